"""The search space from the registry: size, validity by the compatibility rules, filters, round trips."""

from __future__ import annotations

import optuna
import pytest
import toy_models
from space_optuna import optuna_distributions, point_from_params, suggest, to_params

from atorch.errors import SetupError
from atorch.opt_lib.compatibility import conflicts_in
from atorch.strategy import Strategy
from atorch.strategy_search.search.space import SearchSpace

WORLD = 2
GLOBAL_BATCH = 8  # 4 samples per rank: micro-batch sizes 1, 2, 4


@pytest.fixture(scope="module")
def gpt2():
    return toy_models.tiny_gpt2()


@pytest.fixture(scope="module")
def space(gpt2) -> SearchSpace:
    """The whole space: the user opted in to atorch.train_step and to 16-bit weights."""
    return SearchSpace(gpt2, WORLD, GLOBAL_BATCH, loop="train_step", precision="low")


def test_default_space_keeps_the_users_loop_and_fp32_master_weights(gpt2) -> None:
    """By default no candidate needs atorch.train_step or drops the fp32 master weights; each opt-in adds
    exactly its methods, and a method included by name is an opt-in of its own."""
    def methods(**options: object) -> set[str]:
        space = SearchSpace(gpt2, WORLD, GLOBAL_BATCH, **options)  # type: ignore[arg-type]
        return {item.name for cand in space.enumerate() for item in cand.strategy.methods}

    default = methods()
    assert default.isdisjoint({"pipeline_parallel", "mixed_parallel", "ds_3d_parallel", "half"}), default
    assert {"amp_native", "tensor_parallel", "fsdp", "zero1", "zero2", "checkpoint"} <= default
    assert "pipeline_parallel" in methods(loop="train_step") - default
    assert methods(precision="low") - default == {"half"}
    exact = methods(precision="exact")
    assert "amp_native" not in exact and "half" not in exact
    assert "half" in methods(included=["half"])
    with pytest.raises(SetupError, match="loop must be"):
        SearchSpace(gpt2, WORLD, GLOBAL_BATCH, loop="mine")


def test_gpt2_space_has_at_least_50_valid_candidates_and_none_breaks_a_rule(space: SearchSpace) -> None:
    cands = space.enumerate()
    assert len(cands) >= 50, len(cands)
    for cand in cands:
        assert cand.strategy.problems(WORLD) == []
        Strategy.load(cand.strategy.to_json(), world_size=WORLD)  # what a user could load back
        point = dict(cand.point)
        dp = space.data_size(point)
        assert dp * point.get("tensor", 1) * point.get("pipeline", 1) == WORLD
        assert cand.micro_batch_size * cand.micro_batches * dp == GLOBAL_BATCH
        if point.get("pipeline", 1) > 1:  # one batch per step, split by the schedule into micro-batches
            schedule = (cand.strategy.get("pipeline_parallel") or cand.strategy.get("mixed_parallel").pipeline)
            assert schedule.micro_batches * point["micro_batch_size"] == cand.micro_batch_size
            assert schedule.micro_batches >= point["pipeline"]
            assert schedule.schedule == point["pipeline_parallel.schedule"]
    assert len({c.key for c in cands}) == len(cands)
    # Every family of the issue is there: each sharding method and implementation, offload, reshard,
    # checkpointing, each precision, module_replace, and every micro-batch size.
    points = [dict(c.point) for c in cands]
    assert {p["sharding"] for p in points} == {"ddp", "zero1", "zero2", "fsdp"}
    assert {p.get("zero1.implementation") for p in points} >= {"torch", "deepspeed"}
    assert {p.get("zero2.implementation") for p in points} >= {"fsdp2", "deepspeed"}
    assert {p.get("fsdp.cpu_offload") for p in points} >= {True, False}
    assert {p.get("fsdp.reshard_after_forward") for p in points} >= {True, False}
    assert {p["precision"] for p in points} == {"fp32", "amp_bf16", "amp_fp16", "half_bf16"}
    assert {p["checkpoint"] for p in points} == {p["module_replace"] for p in points if "module_replace" in p} == {
        False, True}
    assert {p["micro_batch_size"] for p in points if space.data_size(p) == WORLD} == {1, 2, 4}
    assert {p["micro_batch_size"] for p in points if space.data_size(p) == 1} == {1, 2, 4, 8}  # 8 samples a rank
    # the model-parallel layouts join (#7): tensor 2 (GPT-2's Conv1D swapped by module_replace), pipeline 2
    assert {p.get("tensor", 1) for p in points} == {p.get("pipeline", 1) for p in points} == {1, 2}
    assert all(c.strategy.get("module_replace") is not None for c in cands if dict(c.point).get("tensor", 1) > 1)
    interleaved = {"interleaved_1f1b"} if space.pipeline_blocks >= 4 else set()  # two blocks per stage
    assert {p.get("pipeline_parallel.schedule") for p in points} == {None, "1f1b", "gpipe", *interleaved}


def test_rules_refuse_points_and_those_never_become_candidates(space: SearchSpace) -> None:
    invalid = space.invalid_points()
    assert invalid, "DeepSpeed ZeRO with amp/half must be refused by the rules"
    keys = {c.key for c in space.enumerate()}
    for point, problems in invalid:
        assert problems and conflicts_in(space.strategy_of(point).adjusted(WORLD).configs())
        assert "deepspeed" in (point.get("zero1.implementation"), point.get("zero2.implementation")) or (
            point.get("pipeline", 1) > 1 or point.get("tensor", 1) > 1)  # e.g. fp16 under a pipeline schedule
        with pytest.raises(SetupError, match="not a valid strategy"):
            space.from_point(point)
        assert Strategy(methods=()).to_json() not in keys


def test_sharding_over_one_data_rank_is_no_candidate(space: SearchSpace) -> None:
    """Tensor 2 x pipeline 1 on 2 ranks leaves one data rank: zero1/zero2/fsdp there shard nothing (twins)."""
    sharded_alone = [c for c in space.enumerate()
                     if space.data_size(dict(c.point)) == 1 and dict(c.point)["sharding"] != "ddp"]
    assert sharded_alone == []
    degenerate = space.degenerate_points()
    assert degenerate and all(space.data_size(p) == 1 and p["sharding"] != "ddp" for p, _ in degenerate)
    assert all("dimension of one rank changes nothing" in why[0] for _, why in degenerate)
    with pytest.raises(SetupError, match="changes nothing"):
        space.from_point(degenerate[0][0])
    # with data ranks left, sharding is still searched beside the layout
    assert any(space.data_size(dict(c.point)) == WORLD and dict(c.point)["sharding"] == "fsdp"
               for c in space.enumerate())


def test_points_round_trip_and_optuna_view_covers_every_param(space: SearchSpace) -> None:
    dists = optuna_distributions(space)
    for cand in space.enumerate():
        point = space.to_point(cand)
        assert space.from_point(point) == cand
        params = to_params(space, point)
        assert point_from_params(params) == point
        for name, value in params.items():
            assert value in dists[name].choices
    # A narrowed dimension gets its own name (DeepSpeed leaves only fp32 precision).
    assert dists["precision|fp32"].choices == ("fp32",)
    with pytest.raises(SetupError, match="needs exactly the keys"):
        space.from_point({"sharding": "ddp"})


def test_suggest_from_a_real_trial_gives_only_valid_candidates(space: SearchSpace) -> None:
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    keys = {c.key for c in space.enumerate()}
    for _ in range(40):
        trial = study.ask()
        cand = suggest(space, trial)
        assert cand.key in keys
        study.tell(trial, 1.0)


def test_excluded_and_included(gpt2) -> None:
    excl = SearchSpace(gpt2, WORLD, GLOBAL_BATCH, excluded=["fsdp", "half", "module_replace"])
    for cand in excl.enumerate():
        assert not {"fsdp", "half", "module_replace"} & set(cand.strategy.names())
    incl = SearchSpace(gpt2, WORLD, GLOBAL_BATCH, included=["zero2", "checkpoint", "amp_native"])
    assert incl.enumerate()
    for cand in incl.enumerate():
        assert {"zero2", "checkpoint", "amp_native"} <= set(cand.strategy.names())
    with pytest.raises(SetupError, match="both excluded and included"):
        SearchSpace(gpt2, WORLD, GLOBAL_BATCH, excluded=["fsdp"], included=["fsdp"])
    with pytest.raises(SetupError, match="unknown method"):
        SearchSpace(gpt2, WORLD, GLOBAL_BATCH, excluded=["fdsp"])
    with pytest.raises(SetupError, match="no valid strategy"):  # two ZeRO stages: every point breaks a rule
        SearchSpace(gpt2, WORLD, GLOBAL_BATCH, included=["zero1", "zero2"]).enumerate()


def test_supported_dtypes_limit_precision(gpt2) -> None:
    fp32_only = SearchSpace(gpt2, WORLD, GLOBAL_BATCH, supported_dtypes=())
    assert {dict(c.point)["precision"] for c in fp32_only.enumerate()} == {"fp32"}
    bf16 = SearchSpace(gpt2, WORLD, GLOBAL_BATCH, supported_dtypes=("bf16",), precision="low")
    assert {dict(c.point)["precision"] for c in bf16.enumerate()} == {"fp32", "amp_bf16", "half_bf16"}


def test_cpu_offload_is_searched_only_where_the_device_has_a_host_memory(gpt2) -> None:
    """On a CPU device offloading moves nothing (the same RAM, the same program): no twin candidates."""
    with_host = SearchSpace(gpt2, WORLD, GLOBAL_BATCH, excluded=["tensor_parallel", "pipeline_parallel"])
    cpu = SearchSpace(gpt2, WORLD, GLOBAL_BATCH, excluded=["tensor_parallel", "pipeline_parallel"], host_offload=False)
    assert {p.get("fsdp.cpu_offload") for p in with_host.valid_points()} == {None, False, True}
    assert all("fsdp.cpu_offload" not in p for p in cpu.valid_points())
    fsdp = [c for c in with_host.enumerate() if dict(c.point)["sharding"] == "fsdp"]
    offloaded = [c for c in fsdp if c.strategy.get("fsdp").cpu_offload]
    assert offloaded and len(cpu) == len(with_host) - len(offloaded)  # the offloaded FSDP candidates are gone
    assert all(c.strategy.get("fsdp") is None or not c.strategy.get("fsdp").cpu_offload for c in cpu.enumerate())


def test_finetune_fixes_methods_and_varies_only_tunable_configs(gpt2) -> None:
    loaded = [("parallel_mode", None), ("amp_native", {"dtype": "bf16"}),
              ("fsdp", {"cpu_offload": False}, True)]
    space = SearchSpace(gpt2, WORLD, GLOBAL_BATCH, finetune_strategy=loaded)
    cands = space.enumerate()
    assert len(cands) == 2 * 2 * 3  # fsdp: reshard_after_forward x cpu_offload; 3 micro-batch sizes
    for cand in cands:
        assert cand.strategy.names() == ["parallel_mode", "amp_native", "fsdp"]
        assert cand.strategy.get("amp_native").dtype == "bf16"  # not tunable: kept
    assert {(c.strategy.get("fsdp").cpu_offload, c.strategy.get("fsdp").reshard_after_forward)
            for c in cands} == {(False, False), (False, True), (True, False), (True, True)}
    fixed = SearchSpace(gpt2, WORLD, GLOBAL_BATCH, finetune_strategy=["parallel_mode", "zero2"])
    assert [c.micro_batch_size for c in fixed.enumerate()] == [1, 2, 4]  # only micro-batching varies


def test_model_without_blocks_or_replaceable_modules_has_no_such_dims() -> None:
    from torch import nn

    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    space = SearchSpace(plain, WORLD, GLOBAL_BATCH)
    assert all("checkpoint" not in c.point and "module_replace" not in dict(c.point) for c in space.enumerate())
    with pytest.raises(SetupError, match="not divisible"):
        SearchSpace(plain, WORLD, 7)


def test_signature_follows_the_space(gpt2) -> None:
    a = SearchSpace(gpt2, WORLD, GLOBAL_BATCH)
    assert a.signature() == SearchSpace(gpt2, WORLD, GLOBAL_BATCH).signature()
    assert a.signature() != SearchSpace(gpt2, WORLD, 16).signature()
    assert a.signature() != SearchSpace(gpt2, WORLD, GLOBAL_BATCH, excluded=["fsdp"]).signature()


def test_a_method_joins_the_search_by_its_registry_entry_alone() -> None:
    """A method registered with a search role is searched, built into strategies, kept out of the baseline and
    described, with no edit to the space, the candidate table or the descriptions."""
    from atorch.opt_lib import registry
    from atorch.opt_lib.base import Method, SearchRole

    class Toy(Method):
        name = "toy_switch"
        group = "memory"
        summary = "a method that changes nothing (for this test)"
        search_role = SearchRole("switch", "toy_switch", position=35, off=False)

    model = toy_models.mlp()
    before = SearchSpace(model, WORLD, GLOBAL_BATCH).valid_points()
    with registry.scoped():  # the registration is undone after
        registry.register_method(Toy)
        _toy_is_searched(model, before)
    assert not registry.is_registered("toy_switch")


def _toy_is_searched(model: object, before: list) -> None:
    from atorch.strategy_search.search.candidates import CandidateTable, family_key
    from atorch.strategy_search.search.describe import describe_candidate

    space = SearchSpace(model, WORLD, GLOBAL_BATCH)
    points = space.valid_points()
    assert len(points) == 2 * len(before)
    assert list(points[0]) == ["sharding", "checkpoint", "toy_switch", "precision", "micro_batch_size"]
    on = [c for c in space.enumerate() if dict(c.point)["toy_switch"]]
    assert on and all(c.strategy.get("toy_switch") is not None for c in on)
    assert "toy_switch" in describe_candidate(on[0].strategy, on[0].micro_batch_size, on[0].micro_batches, WORLD)
    assert family_key(dict(on[0].point)) != family_key({**dict(on[0].point), "toy_switch": False})
    preds = [{"peak_memory_bytes": 1.0, "step_time_s": 1.0, "samples_per_s": 1.0} for _ in points]
    baseline = CandidateTable(points, preds, GLOBAL_BATCH).baseline(2.0)
    assert baseline is not None and '"toy_switch": false' in baseline


def test_zero1_across_a_tensor_dimension_is_zero2s_program() -> None:
    """zero1 next to a tensor dimension runs as zero2 (FSDP2 over the data dimension, zero1.py): the search counts
    the two as one program; without a tensor dimension zero1 stays its own (ZeroRedundancyOptimizer under DDP)."""
    from atorch.strategy_search.search.space import Candidate, _program_key

    def key(dims: list[list[object]], *methods: object) -> str:
        return _program_key(Candidate(Strategy.load([("parallel_mode", {"dims": dims}), *methods]), 1, 1))

    tensor = [["tensor", 2], ["data", 2]]
    assert key(tensor, "tensor_parallel", "zero1") == key(tensor, "tensor_parallel", "zero2")
    assert key([["data", 4]], "zero1") != key([["data", 4]], "zero2")


def test_a_model_that_skips_layers_at_random_gets_no_candidate_that_communicates_inside_them() -> None:
    """transformers' speech encoders drop whole layers at random in training (``config.layerdrop``), each rank
    drawing its own: under sharding, tensor parallel or DeepSpeed's engine a rank that skips a layer leaves the
    others in that layer's collective (gloo aborted a Wav2Vec2 search so). Plain data parallel and zero1 stay."""
    from atorch.opt_lib.deepspeed_zero import deepspeed_reason

    def methods(model: object) -> tuple[set[str], set[str]]:
        cands = SearchSpace(model, WORLD, GLOBAL_BATCH).enumerate()
        items = [item for c in cands for item in c.strategy.methods]
        return {item.name for item in items}, {str(getattr(item.config, "implementation", "")) for item in items}

    model = toy_models.tiny_gpt2()
    kept, implementations = methods(model)
    assert {"fsdp", "zero2", "tensor_parallel", "zero1"} <= kept  # the same model without layer drop
    assert deepspeed_reason() is not None or "deepspeed" in implementations
    model.config.layerdrop = 0.1  # as Wav2Vec2's config has it
    left, implementations = methods(model)
    assert left.isdisjoint({"fsdp", "zero2", "tensor_parallel", "expert_parallel", "context_parallel"}), left
    assert {"parallel_mode", "zero1", "checkpoint"} <= left and "deepspeed" not in implementations
