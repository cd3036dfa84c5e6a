"""Gradient accumulation on 2 real processes: DDP, zero1, zero2, fsdp and DeepSpeed ZeRO-1/2.

Two half-size micro-batches per step must train exactly like one full batch whether the boundary
is declared before the forward or before the backward of the boundary training pass, the replicas
must stay equal, and the gradient reduction must really be left out before the boundary.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from launcher import HERE, run_json
from workers.grad_accum_worker import LR, ORDERS, PROBED, STEPS, STRATEGIES

WORKER = HERE / "workers" / "grad_accum_worker.py"
LAUNCH_TIMEOUT_S = 420
# Accumulation only changes the order of fp32 sums (per-sample contributions summed over the batch
# or over two halves, then over ranks). Each gradient element is a chain of dot products of length
# <= 32 through <= 5 layers, forward and backward: fewer than K = 1024 roundings of relative size
# u = 2**-24 on magnitudes no larger than G, the largest gradient element seen. So one step's gradients
# differ by at most K*u*G per element, and plain SGD (w -= LR * g) turns that into at most
# LR*K*u*G per step, STEPS steps adding up (the second-order effect of the weights having moved
# apart, through the Hessian, is orders smaller). AdamW would not do: it divides by sqrt(v)+eps and
# so amplifies rounding without bound where gradients are near zero.
ROUNDINGS = 1024
FP32_UNIT_ROUNDOFF = 2.0**-24
# Losses: the mean over 8 samples vs the sum of two means over 4, from the same (or nearly the same)
# weights: a few roundings on values of order 1; rtol 1e-5 is ~170 u.
LOSS_TOL = (1e-5, 1e-6)  # (rtol, atol)
# Ranks saw different samples: un-reduced gradients differ by far more than rounding.
MIN_UNSYNCED_DIFF = 1e-3
SHARDED_GRADIENTS = {"zero2", "fsdp"}  # FSDP2-based: gradients are reduce-scattered into shards


def weight_tolerance(max_grad: float) -> float:
    return STEPS * LR * ROUNDINGS * FP32_UNIT_ROUNDOFF * max_grad


pytestmark = [pytest.mark.distributed, pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)]


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return run_json(WORKER, timeout=LAUNCH_TIMEOUT_S)


def _entry(report: dict[str, Any], strategy: str) -> dict[str, Any]:
    entry = report["strategies"][strategy]
    assert "error" not in entry, f"{strategy} failed: {entry['error']}"
    return entry


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_two_micro_batches_train_like_one_batch(report: dict[str, Any], strategy: str, order: str) -> None:
    entry = _entry(report, strategy)
    accumulated = entry["orders"][order]
    rtol, atol = LOSS_TOL
    torch.testing.assert_close(
        torch.tensor(accumulated["losses"]), torch.tensor(entry["full_losses"]), rtol=rtol, atol=atol
    )
    # The gradients are the same model's on the same data under every strategy: DDP's bound them.
    tolerance = weight_tolerance(_entry(report, "ddp")["max_grad"])
    assert entry["max_weight_change"] > 1000 * tolerance, "training must move the weights for this to mean much"
    assert accumulated["max_weight_diff"] <= tolerance, (accumulated["max_weight_diff"], tolerance)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_replicas_stay_equal_whatever_the_order(report: dict[str, Any], strategy: str) -> None:
    """Every rank applies the same optimizer to the same reduced gradient (an all-reduce leaves the
    same values on every rank), so replicas are bitwise equal; a missed reduction shows at once."""
    gaps = _entry(report, strategy)["replica_gap"]
    assert gaps == {"full": 0.0, **{order: 0.0 for order in ORDERS}}, gaps


@pytest.mark.parametrize("strategy", PROBED)
def test_no_gradient_sync_before_the_boundary(report: dict[str, Any], strategy: str) -> None:
    entry = _entry(report, strategy)
    first, boundary = entry["after_first"], entry["after_boundary"]
    assert boundary["sharded"] == (strategy in SHARDED_GRADIENTS), boundary
    if strategy in SHARDED_GRADIENTS:
        # FSDP2 keeps un-synced gradients unsharded inside its parameter groups: no reduce-scatter
        # ran, so no parameter holds a (sharded) gradient yet; the boundary reduces them all.
        assert first["with_grad"] == 0, first
        assert boundary["with_grad"] == boundary["params"], boundary
    else:
        # DDP: after the first micro-batch each rank holds the gradient of its own samples.
        assert first["with_grad"] == first["params"], first
        assert first["max_diff_across_ranks"] > MIN_UNSYNCED_DIFF, first
        assert boundary["max_diff_across_ranks"] == 0.0, boundary
    # Whatever the strategy, the reduced gradient is DDP's (sharded ones gathered to compare), up to
    # the order of the sums: K*u*G per element, as above.
    bound = ROUNDINGS * FP32_UNIT_ROUNDOFF * _entry(report, "ddp")["max_grad"]
    assert entry["max_grad_diff_vs_ddp"] <= bound, (entry["max_grad_diff_vs_ddp"], bound)
