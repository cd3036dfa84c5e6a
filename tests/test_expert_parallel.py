"""expert_parallel: the layout's data × expert arithmetic, the plan, the refusals, and training on real processes
(tests/workers/ep_worker.py) against one process, for Mixtral and Qwen3-MoE at 2 and 4 processes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from atorch.opt_lib.compatibility import RULES
from atorch.opt_lib.expert_parallel import _own_plan, expert_plan, experts_modules
from atorch.parallel_layout import ParallelLayout
from atorch.strategy import Strategy

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from ep_worker import mixtral, qwen3_moe  # noqa: E402
from launcher import run_json  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "ep_worker.py"

# Tolerances from the arithmetic. Against one process, expert parallel changes only (a) the order in which the
# data × expert ranks' gradients are summed (n <= 4 terms: a few ulp of each gradient), and (b) which rows the
# experts' grouped matmuls see together (each row's dot products are the same sums in the same order: exact).
# So losses (about 5; fp32 ulp 4.8e-7) may differ by a few ulp, weights (at most about 1; ulp 1.2e-7) by a few ulp
# after 4 SGD steps of lr 0.1; the bounds leave 20 and 16 ulp. Routing is top-k, a discontinuous function: a
# rounding difference could flip a choice only at a near-tie, which the fixed seeds here do not hold.
LOSS_ATOL = 1e-5
WEIGHT_ATOL = 2e-6
NORM_RTOL = 1e-5


# ----- pure arithmetic --------------------------------------------------------------------------
def test_layout_splits_the_batch_over_data_and_expert_ranks() -> None:
    layout = ParallelLayout((("expert", 2), ("data", 2)))  # expert listed first: expert groups [0, 1], [2, 3]
    assert layout.data_size == 4
    assert layout.batch_groups() == [[0, 1, 2, 3]]
    assert [layout.data_rank(r) for r in range(4)] == [0, 1, 2, 3]
    with_tensor = ParallelLayout((("tensor", 2), ("expert", 2), ("data", 2)))
    assert with_tensor.data_size == 4
    assert with_tensor.batch_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]  # one per tensor position
    assert [with_tensor.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert ParallelLayout((("data", 4),)).data_size == 4  # no expert dimension: unchanged


@pytest.mark.parametrize("make", [mixtral, qwen3_moe])
def test_plan_splits_every_experts_module_parameters_first(make: Any) -> None:
    torch.manual_seed(0)
    model = make()
    plan = expert_plan(model)
    assert sorted(experts_modules(model)) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for layer in (0, 1):
        keys = list(plan)
        module = f"model.layers.{layer}.mlp.experts"
        # transformers' dispatch reads the local experts count its parameters' split sets: they must come first
        assert keys.index(f"{module}.gate_up_proj") < keys.index(module) > keys.index(f"{module}.down_proj")
        assert plan[module] == "ep_dispatch_experts" and plan[f"{module}.down_proj"] == "grouped_gemm"
    assert "model.layers.0.mlp.gate.weight" not in plan  # the router stays whole


def test_own_plan_for_experts_without_a_shipped_plan() -> None:
    torch.manual_seed(0)
    model = mixtral()
    shipped = expert_plan(model)
    model.ep_plan = {}
    assert _own_plan(model) == expert_plan(model) == shipped  # atorch's own rule finds what transformers ships


def _problems(strategy: list[Any], world: int = 2) -> list[str]:
    return Strategy.load(strategy).problems(world_size=world)


def test_expert_parallel_needs_an_expert_dimension() -> None:
    rule = next(r for r in RULES if r.methods == ("expert_parallel", "parallel_mode"))
    assert rule.message() in _problems(["expert_parallel", ("parallel_mode", {"dims": [["data", 2]]})])
    (alone,) = _problems(["expert_parallel"])
    assert "'expert' dimension" in alone and "parallel_mode" in alone
    assert any("dimension 'expert' is not used" in p for p in _problems([("parallel_mode", {"dims": [["expert", 2]]})]))
    assert _problems([("parallel_mode", {"dims": [["expert", 2], ["data", -1]]}), "expert_parallel", "fsdp"], 4) == []


def test_a_rank_order_that_permutes_an_expert_group_is_refused() -> None:
    # measured before the rule: losses off from the first step (tokens dispatched by group rank to the rank whose
    # DTensor shard, placed by mesh position, holds other experts)
    problems = _problems([("parallel_mode", {"dims": [["expert", 2], ["data", 1]], "rank_order": [1, 0]}),
                          "expert_parallel"])
    assert any("rank_order permutes an expert group" in p for p in problems), problems
    assert _problems([("parallel_mode", {"dims": [["expert", 2], ["data", 2]], "rank_order": [0, 1, 3, 2]}),
                      "expert_parallel"], 4)  # the second expert group [3, 2]
    assert not _problems([("parallel_mode", {"dims": [["expert", 2], ["data", 2]], "rank_order": [2, 3, 0, 1]}),
                          "expert_parallel"], 4)  # groups [2, 3], [0, 1]: each ascending


def test_tensor_and_pipeline_beside_experts_are_allowed() -> None:
    assert _problems([("parallel_mode", {"dims": [["tensor", 2], ["expert", 2]]}), "expert_parallel",
                      "tensor_parallel"], 4) == []
    assert _problems([("parallel_mode", {"dims": [["tensor", 2], ["pipeline", 2], ["expert", 2]]}), "expert_parallel",
                      "mixed_parallel"], 8) == []


# ----- real processes ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_json(WORKER, "two", str(tmp_path_factory.mktemp("ep2")), nproc=2, timeout=600)


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_json(WORKER, "four", str(tmp_path_factory.mktemp("ep4")), nproc=4, timeout=600)


@pytest.fixture(scope="module")
def eight(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_json(WORKER, "eight", str(tmp_path_factory.mktemp("ep8")), nproc=8, timeout=600)


def _matches_one_process(entry: dict[str, Any], local_experts: int, dp_size: int) -> None:
    assert "error" not in entry and "refused" not in entry, entry
    sharded = any(word in entry.get("scenario", "") for word in ("fsdp", "zero"))
    # DDP keeps every non-expert parameter on every rank; fsdp, and zero1 (run as FSDP2 next to experts), shard them
    if sharded:
        assert entry["dense_local_share"] < 1.2 / dp_size, entry
    else:
        assert entry["dense_local_share"] == 1.0, entry
    assert entry["local_experts"] == [local_experts] and entry["dp_size"] == dp_size, entry
    assert entry["names_match"], "the accelerated model's parameters carry the user's names"
    assert entry["loss_drop"] > 100 * LOSS_ATOL, "the loss falls far more than the tolerance"
    assert entry["loss_diff"] <= LOSS_ATOL and entry["aux_diff"] <= LOSS_ATOL, entry
    assert all(a > 0 for a in entry["aux"]), "the router's load-balancing loss is kept"
    assert entry["weight_diff"] <= WEIGHT_ATOL, entry
    assert entry["norm_diff"] <= NORM_RTOL * entry["norm"], entry


@pytest.mark.parametrize(("scenario", "local_experts"),
                         [("mixtral_e2", 2), ("qwen3_e2", 4), ("qwen2_e2", 2), ("mixtral_e2_fsdp", 2),
                          ("mixtral_own_plan_e2", 2), ("qwen3_e2_zero1", 4)])
def test_two_processes_train_like_one(two: dict[str, Any], scenario: str, local_experts: int) -> None:
    _matches_one_process({**two[scenario], "scenario": scenario}, local_experts, dp_size=2)


@pytest.mark.parametrize(("scenario", "local_experts"),
                         [("mixtral_e2_d2", 2), ("qwen3_e2_d2_fsdp", 4), ("mixtral_e4", 1), ("qwen3_e4", 2),
                          ("mixtral_e2_d2_zero1", 2)])
def test_four_processes_train_like_one(four: dict[str, Any], scenario: str, local_experts: int) -> None:
    _matches_one_process({**four[scenario], "scenario": scenario}, local_experts, dp_size=4)


@pytest.mark.parametrize(("scenario", "local_experts"), [("mixtral_e2_c2", 2), ("qwen3_e2_c2_fsdp", 4)])
def test_experts_beside_context_ranks_train_like_one(four: dict[str, Any], scenario: str, local_experts: int) -> None:
    """Expert 2 × context 2: the batch split over the 2 expert ranks, each sequence over 2 context ranks; the
    router's load-balancing loss over the whole sequence (its logits gathered over the context group), the expert
    gradients averaged over data × expert × context."""
    _matches_one_process({**four[scenario], "scenario": scenario}, local_experts, dp_size=2)


@pytest.mark.parametrize(("scenario", "local_experts"),
                         [("mixtral_p2_e2", 2), ("qwen3_p2_e2_fsdp", 4), ("qwen2_p2_e2_zero1", 2)])
def test_experts_beside_pipeline_stages_train_like_one(four: dict[str, Any], scenario: str, local_experts: int) -> None:
    """Pipeline 2 × expert 2 (DeepSeek-V3's layout, small): each stage's MoE layers split over its expert group, the
    expert gradients summed over their replicas after each schedule, the rest averaged over data × expert."""
    entry = four[scenario]
    assert "error" not in entry and "refused" not in entry, entry
    assert entry["local_experts"] == [local_experts] and entry["names_match"], entry
    assert entry["loss_drop"] > 100 * LOSS_ATOL and entry["loss_diff"] <= LOSS_ATOL, entry
    assert entry["weight_diff"] <= WEIGHT_ATOL, entry


@pytest.mark.parametrize(("scenario", "local_experts"),
                         [("mixtral_t2_e2", 2), ("qwen3_t2_e2_fsdp", 4), ("qwen2_t2_e2_zero1", 2)])
def test_experts_beside_tensor_ranks_train_like_one(four: dict[str, Any], scenario: str, local_experts: int) -> None:
    """Tensor 2 × expert 2: the attention (and dense MLPs) split over the tensor ranks, the experts over the expert
    group at each tensor position, which dispatches its tokens (the same on every tensor rank); the experts' gradients
    are averaged over their replicas only, the tensor-parallel replicas' over data × expert."""
    entry = four[scenario]
    assert "error" not in entry and "refused" not in entry, entry
    assert entry["local_experts"] == [local_experts] and entry["names_match"] and entry["dp_size"] == 2, entry
    assert entry["dense_local_share"] < 0.85, entry  # the tensor plan splits the attention (sharded: about half)
    assert entry["loss_drop"] > 100 * LOSS_ATOL, entry
    assert entry["loss_diff"] <= LOSS_ATOL and entry["aux_diff"] <= LOSS_ATOL, entry
    assert entry["weight_diff"] <= WEIGHT_ATOL and entry["norm_diff"] <= NORM_RTOL * entry["norm"], entry


def test_tensor_pipeline_and_experts_train_like_one(eight: dict[str, Any]) -> None:
    """Tensor 2 × pipeline 2 × expert 2 with the router's load-balancing loss: the routing statistics passed on
    between stages on every tensor rank."""
    entry = eight["mixtral_t2_p2_e2"]
    assert "error" not in entry and "refused" not in entry, entry
    assert entry["local_experts"] == [2] and entry["names_match"], entry
    assert entry["loss_drop"] > 100 * LOSS_ATOL and entry["loss_diff"] <= LOSS_ATOL, entry
    assert entry["weight_diff"] <= WEIGHT_ATOL, entry


@pytest.mark.parametrize(("scenario", "sharded"), [("mixtral_t2_e2_sp", False), ("qwen2_t2_e2_sp_fsdp", True)])
def test_sequence_parallel_beside_experts_trains_like_one(four: dict[str, Any], scenario: str, sharded: bool) -> None:
    """Tensor 2 × expert 2 with sequence parallel: the norms run on sequence shards, each MoE layer gathers the
    sequence, computes it whole (experts over the expert group, Qwen2-MoE's shared expert split by the tensor plan)
    and returns this rank's shard; the router's loss is over the whole sequence, as in one process."""
    entry = four[scenario]
    assert "error" not in entry and "refused" not in entry, entry
    assert entry["local_experts"] == [2] and entry["names_match"] and entry["dp_size"] == 2, entry
    assert entry["dense_local_share"] < (0.5 if sharded else 0.85), entry
    assert entry["loss_drop"] > 100 * LOSS_ATOL, entry
    assert entry["loss_diff"] <= LOSS_ATOL and entry["aux_diff"] <= LOSS_ATOL, entry
    assert all(a > 0 for a in entry["aux"]), "the router's load-balancing loss is kept"
    assert entry["weight_diff"] <= WEIGHT_ATOL and entry["norm_diff"] <= NORM_RTOL * entry["norm"], entry


def test_sequence_parallel_on_a_mixture_of_experts_without_experts_split(two: dict[str, Any]) -> None:
    """Tensor 2 with sequence parallel, every expert on every rank (no expert dimension)."""
    entry = two["qwen2_t2_sp"]
    assert "error" not in entry and "refused" not in entry, entry
    assert entry["expert_params"] == 0 and entry["names_match"] and entry["dense_local_share"] < 0.95, entry
    assert entry["loss_drop"] > 100 * LOSS_ATOL, entry
    assert entry["loss_diff"] <= LOSS_ATOL and entry["aux_diff"] <= LOSS_ATOL, entry
    assert entry["weight_diff"] <= WEIGHT_ATOL and entry["norm_diff"] <= NORM_RTOL * entry["norm"], entry


@pytest.mark.parametrize(("launch", "scenario", "local_experts"),
                         [("two", "mixtral_p2_router_loss", None),
                          ("two", "qwen2_dense_first_p2_router_loss_gpipe", None),
                          ("two", "mixtral_p2_checkpoint_router_loss", None),
                          ("four", "mixtral_p2_e2_router_loss", 2), ("four", "qwen3_p2_e2_fsdp_router_loss", 4),
                          ("four", "mixtral_p2_c2_router_loss", None)])
def test_pipeline_stages_carry_the_router_s_load_balancing_loss(launch: str, scenario: str, local_experts: int | None,
                                                                request: pytest.FixtureRequest) -> None:
    """The router's load-balancing loss spans every stage's layers: each stage passes its router logits on beside
    its hidden states, the last stage computes the loss with the family's own function, and its gradient flows back
    to every stage's routers. Losses (the language-model loss plus 0.1 × the router loss, about 0.2 of it) and final
    weights match one process on the schedule's micro-batches, the first stage of Qwen2-MoE (dense first layer)
    having no router; with the router loss left out, the losses differ by 0.2 and the weights by 7e-4. Beside context
    ranks (pipeline 2 × context 2) each stage sums its routing statistics over the group: without that sum the
    weights differ by 2.4e-4, without its backward's scaling by 3.2e-4."""
    entry = request.getfixturevalue(launch)[scenario]
    assert "error" not in entry and "refused" not in entry, entry
    assert entry["names_match"] and entry["local_experts"] == ([] if local_experts is None else [local_experts]), entry
    assert entry["loss_drop"] > 100 * LOSS_ATOL and entry["loss_diff"] <= LOSS_ATOL, entry
    assert entry["weight_diff"] <= WEIGHT_ATOL, entry


@pytest.mark.parametrize("scenario", ["mixtral_e2_accumulated", "qwen3_e2_fsdp_accumulated"])
def test_gradient_accumulation_averages_once_at_the_boundary(two: dict[str, Any], scenario: str) -> None:
    entry = two[scenario]
    assert "error" not in entry, entry
    assert entry["loss_drop"] > 100 * LOSS_ATOL and entry["loss_diff"] <= LOSS_ATOL, entry
    assert entry["weight_diff"] <= WEIGHT_ATOL, entry


def test_refusals_name_the_problem_and_the_fix(two: dict[str, Any]) -> None:
    (uneven,) = two["three_experts_refused"]["refused"]
    assert "'expert' size 2 does not divide the 3 experts" in uneven and "one of [3]" in uneven
    (dense,) = two["dense_model_refused"]["refused"]
    assert "no mixture-of-experts layer" in dense


@pytest.mark.parametrize(("launch", "scenario"), [("two", "checkpoint"), ("four", "checkpoint_e2d2_to_e4")])
def test_checkpoint_reloads_under_another_layout(launch: str, scenario: str, request: pytest.FixtureRequest) -> None:
    entry = request.getfixturevalue(launch)[scenario]
    assert "error" not in entry, entry
    assert entry["step"] == 2 and entry["names_match"], entry
    assert entry["plain_diff"] == 0.0 and entry["ep_diff"] == 0.0, entry  # copies of saved values: exact


def test_an_explicit_plan_is_read_with_patterns() -> None:
    from atorch.opt_lib.expert_parallel import ExpertParallelConfig

    torch.manual_seed(0)
    model = mixtral()
    plan = {"model.layers.1.mlp.experts.*": "grouped_gemm", "model.layers.1.mlp.experts": "ep_dispatch_experts"}
    assert list(expert_plan(model, plan)) == [
        "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts"]
    with pytest.raises(ValueError, match="unknown style"):
        ExpertParallelConfig(plan={"model.layers.*.mlp.experts": "colwise"})
