"""Gradient clipping through the returned optimizer on 2 real processes, under every strategy, and
the non-finite step skip agreed across ranks.

Each case takes one SGD step on the first global batch with ``clip_grad_norm_`` (then, in a fresh
run, with ``clip_grad_value_``) and compares with the same step in one process on the whole batch.
"""

from __future__ import annotations

from typing import Any

import pytest
from launcher import HERE, run_json
from workers.clipping_worker import CLIP_STRATEGIES, LR, SKIP_STRATEGIES

WORKER = HERE / "workers" / "clipping_worker.py"
LAUNCH_TIMEOUT_S = 420
# fp32: the distributed gradient differs from the single-process one only in the order of fp32 sums
# (over the batch halves, then over ranks): at most K = 1024 roundings of u = 2**-24 along any
# chain (dot products of length <= 32 through <= 5 layers, forward and backward), so gradients, the
# norm and the clipping factor agree to a relative K*u, and one SGD step's weights to LR*K*u*G, G the
# largest gradient element.
FP32_RTOL = 1024 * 2.0**-24
# fp16 autocast rounds every matmul output (activations, then gradients) to fp16, relative 2**-11;
# the two ranks round partial sums over half batches where one process rounds the whole sum. A
# gradient element goes through at most 10 such roundings (5 layers, forward and backward).
FP16_RTOL = 10 * 2.0**-11
DEEPSPEED = {name for name in CLIP_STRATEGIES if "use_ds_zero" in name}
SHARDED = {"zero2", "fsdp", "fsdp[ignored head]", "amp_fp16+fsdp"}

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)]


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return run_json(WORKER, timeout=LAUNCH_TIMEOUT_S)


def _entry(section: dict[str, Any], name: str) -> dict[str, Any]:
    entry = section[name]
    assert "error" not in entry, f"{name} failed: {entry['error']}"
    return entry


@pytest.mark.parametrize("strategy", list(CLIP_STRATEGIES))
def test_clip_grad_norm_is_the_single_process_norm_and_step(report: dict[str, Any], strategy: str) -> None:
    entry = _entry(report["clip"], strategy)
    rtol = FP16_RTOL if entry["fp16"] else FP32_RTOL
    assert entry["norm_is_plain_tensor"], "the full norm as a plain tensor, not a DTensor"
    assert abs(entry["norm"] - entry["reference_norm"]) <= rtol * entry["reference_norm"], entry
    # max_norm was half the norm: the clip halves the step; a wrong norm or factor moves the weights
    # by a fraction of the step itself (about LR * G), far above this bound.
    bound = LR * rtol * entry["reference_max_grad"]
    assert entry["weight_change"] > 100 * bound
    assert entry["weight_diff"] <= bound, (entry["weight_diff"], bound)
    assert entry["replica_gap"] == 0.0 and entry["skipped"] == 0, entry


@pytest.mark.parametrize("strategy", [name for name in CLIP_STRATEGIES if name not in DEEPSPEED])
def test_clip_grad_value_is_the_single_process_step(report: dict[str, Any], strategy: str) -> None:
    entry = _entry(report["clip"], strategy)
    rtol = FP16_RTOL if entry["fp16"] else FP32_RTOL
    bound = LR * rtol * entry["reference_max_grad"]
    assert entry["value_weight_diff"] <= bound, (entry["value_weight_diff"], bound)
    assert entry["value_replica_gap"] == 0.0, entry


@pytest.mark.parametrize("strategy", sorted(DEEPSPEED))
def test_clip_grad_value_under_deepspeed_is_refused_with_the_fix(report: dict[str, Any], strategy: str) -> None:
    error = _entry(report["clip"], strategy)["value_error"]
    assert "clip_grad_norm_" in error and "the default implementation" in error, error


def test_what_torch_clipping_would_have_seen(report: dict[str, Any]) -> None:
    """The controls: torch's own norm of this rank's .grad is the scaled one under fp16 loss scaling
    (x 2**16) and a part of the whole under sharding."""
    amp = _entry(report["clip"], "amp_fp16")
    assert amp["naive_norm"] > 1000 * amp["reference_norm"], amp
    fsdp = _entry(report["clip"], "fsdp")
    assert fsdp["naive_norm"] < (1 - 1e-3) * fsdp["reference_norm"], fsdp


@pytest.mark.parametrize("strategy", list(SKIP_STRATEGIES))
def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_all(report: dict[str, Any], strategy: str) -> None:
    entry = _entry(report["skip"], strategy)
    assert entry["skipped_per_rank"] == [1.0, 1.0], entry
    assert entry["max_change"] == 0.0 and entry["replica_gap"] == 0.0, entry
