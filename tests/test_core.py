"""Core behaviour on 2 real ranks: agreement on errors, the global loss, the user's parameter
names, rank order with checkpoints, closing and dropping results, mesh reuse, the user's RNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from launcher import HERE, run_json
from toy_models import mlp, mlp_dataset, mlp_loss
from workers.core_worker import STRATEGIES

import atorch
from atorch.parallel_layout import ParallelLayout

WORKER = HERE / "workers" / "core_worker.py"
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_json(WORKER, str(tmp_path_factory.mktemp("core")), timeout=540)


def _entry(report: dict[str, Any], name: str) -> dict[str, Any]:
    entry = report[name]
    assert "failed" not in entry, entry.get("failed")
    return entry


def test_a_problem_on_one_rank_is_raised_on_every_rank(report: dict[str, Any]) -> None:
    error = _entry(report, "agreement")["error"]
    assert error is not None, "rank 0 (which has the file) must raise too, not enter a collective"
    assert "on rank(s) 1 only" in error and "nor a path to an existing file" in error, error


def test_a_build_that_fails_on_one_rank_is_raised_on_every_rank(report: dict[str, Any]) -> None:
    """The optimizer cannot be made on rank 1: rank 0, whose build worked, raises the same error instead of
    returning a result and waiting in its first training collective."""
    error = _entry(report, "build_failure")["error"]
    assert error is not None, "rank 0 must raise too"
    assert "on rank(s) 1 only: building the strategy failed: RuntimeError: this optimizer cannot be made on rank 1" \
        in error, error


def test_train_step_returns_the_global_mean_loss_on_every_rank(report: dict[str, Any]) -> None:
    returned = _entry(report, "global_loss")["returned"]
    assert returned[0] == returned[1], returned


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_optim_param_func_sees_the_users_module(report: dict[str, Any], strategy: str) -> None:
    entry = _entry(report, "param_names")
    seen = entry[strategy]["seen"]
    assert seen == entry["user_names"], seen
    biases = sum(name.endswith("bias") for name in seen)
    assert entry[strategy]["group_sizes"] == [biases, len(seen) - biases]
    assert entry[strategy]["decays"] == [0.0, 0.1]


def test_a_permuted_rank_order_checkpoints_correctly_and_is_refused_with_fsdp(report: dict[str, Any]) -> None:
    entry = _entry(report, "rank_order")
    assert entry["data_rank"] == 1, "rank 0 sits at mesh position 1"
    assert entry["reloaded_equal"]
    assert "rank_order permutes a data-parallel group" in entry["fsdp_refused"]
    # The 2-rank checkpoint reloads in one process with the same weights.
    weights = torch.load(entry["weights"], weights_only=True)
    _, result, _ = atorch.auto_accelerate(
        mlp(seed=7), torch.optim.AdamW, mlp_dataset(), mlp_loss, model_input_format="unpack_sequence",
        dataloader_args={"batch_size": 8}, load_strategy=["parallel_mode"],
    )
    atorch.load_checkpoint(entry["checkpoint"], result)
    for key, value in result.model.state_dict().items():
        assert torch.equal(value, weights[key]), key


def test_closing_frees_every_tensor_each_cycle(report: dict[str, Any]) -> None:
    entry = _entry(report, "close_cycles")
    assert all(built > entry["baseline"] for built in entry["built"])
    assert entry["after_close"] == [entry["baseline"]] * len(entry["after_close"]), entry


def test_a_dropped_result_is_freed_without_the_cycle_collector(report: dict[str, Any]) -> None:
    entry = _entry(report, "dropped")
    # A leaked result would keep its model copy (kilobytes and more each time). A scalar or two may still
    # be held for a moment by gloo's work object of the loss all-reduce, freed by its own thread (seen
    # under load: +4 bytes): allow 64 bytes.
    assert all(abs(after - entry["baseline"]) <= 64 for after in entry["after_drop"]), entry


def test_meshes_and_groups_are_reused(report: dict[str, Any]) -> None:
    groups = _entry(report, "meshes")["groups"]
    assert groups[0] == groups[1] == groups[2], groups


def test_building_draws_nothing_from_the_users_random_generator(report: dict[str, Any]) -> None:
    entry = _entry(report, "rng")
    assert entry["drawn"] == entry["expected"]


def test_a_collective_can_be_bounded_by_the_caller() -> None:
    entry = _entry(run_json(WORKER, "timeout", timeout=240), "timeout")
    assert entry["raised"] is not None, "the step waited for a peer that never came"
    assert entry["seconds"] < 7.0, entry


# ----- in one process -----------------------------------------------------------------------
def test_layout_is_one_validated_value() -> None:
    layout = ParallelLayout((("tensor", 2), ("data", 2), ("pipeline", 2)))  # the first listed varies fastest
    assert layout.world_size == 8 and layout.data_size == 2 and layout.size("tensor") == 2
    assert layout.coordinate(5) == {"tensor": 1, "data": 0, "pipeline": 1}
    assert [layout.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert layout.groups_follow_coordinates("data")
    permuted = ParallelLayout((("data", 2),), rank_order=(1, 0))
    assert permuted.data_rank(0) == 1 and not permuted.groups_follow_coordinates("data")
    with pytest.raises(atorch.StrategyError, match="rank_order must be a permutation"):
        ParallelLayout((("data", 2),), rank_order=(0, 0))
    with pytest.raises(atorch.StrategyError, match="at least 1"):
        ParallelLayout((("data", 0),))


def test_layout_of_a_strategy_fits_the_data_size() -> None:
    strategy = atorch.Strategy.load([("parallel_mode", ([("data", -1)], None))])
    assert strategy.layout(4).dims == (("data", 4),)
    assert atorch.Strategy.load(["fsdp"]).layout(3).dims == (("data", 3),)


def test_args_read_as_atorchs_dict_and_result_closes(tmp_path: Path) -> None:
    with atorch.auto_accelerate(
        mlp(), torch.optim.AdamW, mlp_dataset(), mlp_loss, model_input_format="unpack_sequence",
        dataloader_args={"batch_size": 8}, load_strategy=["parallel_mode"],
    )[1] as result:
        args = result.args
        assert args["use_optim_backward"] is False and args.get("data_parallel_size") == 1
        assert "local_batch_size" in args and dict(args.items())["global_batch_size"] == 8
        with pytest.raises(KeyError):
            args["no_such_key"]
        model = result.model
    assert list(model.parameters()) == [] and result.optim.param_groups == []
