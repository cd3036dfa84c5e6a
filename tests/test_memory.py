"""Sharding methods shrink what each rank holds, counted from local tensor bytes on 2 real processes.

zero1 halves optimizer state; zero2 also halves gradients; fsdp also halves parameters (at rest and
between forward and backward). DDP in the same launch is the unsharded baseline.
"""

from __future__ import annotations

from typing import Any

import pytest
from launcher import HERE, run_json

WORKER = HERE / "workers" / "memory_worker.py"
LAUNCH_TIMEOUT_S = 180
# FSDP2 shards every tensor along dim 0 in equal chunks; all dim-0 sizes of the model are even, so
# halves are exact. The 1% allows for a chunk rounding without hiding a missed shard.
EVEN_SHARD_BOUND = 0.51

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)]


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return run_json(WORKER, timeout=LAUNCH_TIMEOUT_S)


def _assert_sharded(report: dict[str, Any], strategy: str, kind: str, bound: float, add_up: bool = True) -> None:
    """Each rank holds at most ``bound`` of DDP's bytes, and (add_up) the ranks' shards make up the whole."""
    whole = report["strategies"]["ddp"][kind]
    assert len(set(whole)) == 1, f"DDP ranks differ in {kind}: {whole}"
    per_rank = report["strategies"][strategy][kind]
    assert max(per_rank) <= bound * whole[0], f"{strategy} {kind}: {per_rank} bytes per rank vs DDP's {whole[0]}"
    if add_up:
        assert sum(per_rank) == whole[0], f"{strategy} {kind}: shards {per_rank} do not add up to {whole[0]}"


def _assert_whole(report: dict[str, Any], strategy: str, kind: str) -> None:
    whole = report["strategies"]["ddp"][kind]
    assert report["strategies"][strategy][kind] == whole, f"{strategy} should hold all {kind} on each rank"


def test_ddp_baseline_holds_everything(report: dict[str, Any]) -> None:
    params = report["full"]["param_bytes"]
    ddp = report["strategies"]["ddp"]
    assert ddp["params_at_rest"] == ddp["params_between_forward_and_backward"] == [params, params]
    assert ddp["grads"] == [params, params]
    assert ddp["optimizer_state"] == [2 * params, 2 * params]  # AdamW: exp_avg and exp_avg_sq


def test_zero1_halves_optimizer_state(report: dict[str, Any]) -> None:
    # ZeroRedundancyOptimizer assigns whole parameters greedily, so one rank may hold up to one
    # parameter's share more than half.
    _assert_sharded(report, "zero1", "optimizer_state", 0.5 + report["full"]["largest_param_fraction"])
    for kind in ("grads", "params_at_rest", "params_between_forward_and_backward"):
        _assert_whole(report, "zero1", kind)


def test_zero2_halves_gradients_and_optimizer_state(report: dict[str, Any]) -> None:
    for kind in ("optimizer_state", "grads"):
        _assert_sharded(report, "zero2", kind, EVEN_SHARD_BOUND)
    # What sets it apart from fsdp: whole parameters are kept from forward through backward.
    _assert_whole(report, "zero2", "params_between_forward_and_backward")


def test_fsdp_halves_parameters_gradients_and_optimizer_state(report: dict[str, Any]) -> None:
    for kind in ("optimizer_state", "grads", "params_at_rest"):
        _assert_sharded(report, "fsdp", kind, EVEN_SHARD_BOUND)
    # The blocks (about 99% of the parameters) are resharded after forward; whether the small root is too
    # depends on the FSDP2 version, so only the bound is checked.
    _assert_sharded(report, "fsdp", "params_between_forward_and_backward", EVEN_SHARD_BOUND, add_up=False)
