"""context_parallel: the layout's data × context arithmetic, the zigzag split, the refusals, and training on real
processes (tests/workers/cp_worker.py) against one process, for Llama, Qwen2 and GPT-NeoX at 2 and 4 processes."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from atorch.opt_lib import get_method
from atorch.opt_lib.compatibility import RULES
from atorch.opt_lib.context_parallel import ATTENTION_NAME, context_kv_traffic, zigzag_positions
from atorch.parallel_layout import ParallelLayout
from atorch.strategy import Strategy

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from launcher import run_json  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "cp_worker.py"

# Against one process, context parallel changes (a) the attention's kernel and key order (SDPA with a boolean mask
# over the gathered, zigzag-ordered keys against the causal kernel over the sequence: each softmax's sums in another
# order, a few ulp), (b) the loss as c partial sums over N/c (a few ulp), (c) the order in which the context ranks'
# gradients are summed. Losses (about 5; fp32 ulp 4.8e-7) may differ by a few ulp, weights (ulp 1.2e-7 at 1) by a few
# ulp after 2 SGD steps of lr 0.1 (measured: losses at most 9.5e-7, weights at most 6e-8).
LOSS_ATOL = 1e-5
WEIGHT_ATOL = 1e-6


# ----- pure arithmetic --------------------------------------------------------------------------
def test_context_ranks_read_the_same_batch_and_average_gradients_with_the_data_ranks() -> None:
    layout = ParallelLayout((("context", 2), ("data", 2)))  # context groups [0, 1], [2, 3]
    assert layout.data_size == 2 and layout.replica_size == 4
    assert [layout.data_rank(r) for r in range(4)] == [0, 0, 1, 1]  # a context group shares a data rank's batch
    assert layout.batch_groups(("data", "expert", "context")) == [[0, 1, 2, 3]]
    assert ParallelLayout((("data", 4),)).replica_size == 4  # no context dimension: unchanged


def test_zigzag_gives_every_rank_the_same_causal_work() -> None:
    length, size = 32, 4
    shares = [zigzag_positions(length, size, r) for r in range(size)]
    assert sorted(torch.cat(shares).tolist()) == list(range(length))  # every token once
    assert shares[0].tolist() == [0, 1, 2, 3, 28, 29, 30, 31]
    work = [int((p + 1).sum()) for p in shares]  # keys each query attends to, summed over the rank's queries
    assert len(set(work)) == 1, work


def test_cost_facts_split_activations_and_the_kv_traffic_grows_with_the_context_size() -> None:
    method = get_method("context_parallel")
    facts = method.cost_facts(method.parse_config(None), ParallelLayout((("context", 4), ("data", 2))))
    assert facts.activations == "context"
    assert method.cost_facts(method.parse_config(None), ParallelLayout((("context", 1),))).activations is None
    # Llama 3 405B's long-context stage: 131k tokens over 16 context ranks, 8 KV heads of 128, 126 layers, bf16
    per_sample = context_kv_traffic(131072, 8, 128, 126, 16)
    assert per_sample == pytest.approx(2 * 126 * 2 * 131072 * 8 * 128 * 2 * 15 / 16)
    assert context_kv_traffic(131072, 8, 128, 126, 1) == 0.0


def _problems(strategy: list[Any], world: int = 2) -> list[str]:
    return Strategy.load(strategy).problems(world_size=world)


def test_context_parallel_needs_a_context_dimension() -> None:
    rule = next(r for r in RULES if r.methods == ("context_parallel", "parallel_mode"))
    assert rule.message() in _problems(["context_parallel", ("parallel_mode", {"dims": [["data", 2]]})])
    (alone,) = _problems(["context_parallel"])
    assert "'context' dimension" in alone and "parallel_mode" in alone
    unused = _problems([("parallel_mode", {"dims": [["context", 2]]})])
    assert any("dimension 'context' is not used" in p for p in unused)
    assert _problems([("parallel_mode", {"dims": [["context", 2], ["data", -1]]}), "context_parallel", "fsdp"], 4) == []


@pytest.mark.parametrize("other", ["ds_3d_parallel"])
def test_unsupported_combinations_are_refused_with_a_reason(other: str) -> None:
    problems = _problems([("parallel_mode", {"dims": [["context", 2], ["data", 1]]}), "context_parallel", other])
    assert any(f"'context_parallel' cannot be combined with '{other}'" in p for p in problems), problems


def test_tensor_beside_context_is_allowed_and_sharded_only_over_one_of_data_and_context() -> None:
    """Tensor × context runs (each tensor rank's heads gather their K/V over its context group); FSDP2 joins a
    tensor dimension only over one data-like dimension (torch's DeviceMesh flattens data × context out of rank
    order), so with both above 1 the tensor-parallel replicas are kept by averaging, unsharded."""
    def dims(data: int) -> tuple[str, dict[str, Any]]:
        return ("parallel_mode", {"dims": [["tensor", 2], ["context", 2], ["data", data]]})

    assert _problems([dims(1), "context_parallel", "tensor_parallel", "fsdp"], 4) == []
    assert _problems([dims(2), "context_parallel", "tensor_parallel"], 8) == []
    for sharding in ("fsdp", ("zero2", {"implementation": "fsdp2"}), "zero1"):
        problems = _problems([dims(2), "context_parallel", "tensor_parallel", sharding], 8)
        assert any("'context_parallel' cannot be combined with 'tensor_parallel'" in p and "set data to 1" in p
                   for p in problems), (sharding, problems)


# ----- real processes ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two() -> dict[str, Any]:
    return run_json(WORKER, "two", nproc=2, timeout=600)


@pytest.fixture(scope="module")
def four() -> dict[str, Any]:
    return run_json(WORKER, "four", nproc=4, timeout=600)


@pytest.fixture(scope="module")
def eight() -> dict[str, Any]:
    return run_json(WORKER, "eight", nproc=8, timeout=600)


def _matches_one_process(entry: dict[str, Any], context: int, dp_size: int) -> None:
    assert "error" not in entry and "refused" not in entry, entry
    assert entry["attention"] == ATTENTION_NAME and entry["dp_size"] == dp_size, entry
    assert entry["names_match"], "the accelerated model's parameters carry the user's names"
    assert entry["loss_drop"] > 100 * LOSS_ATOL, "the loss falls far more than the tolerance"
    assert entry["loss_diff"] <= LOSS_ATOL, entry
    assert entry["weight_diff"] <= WEIGHT_ATOL, entry
    # every activation after the embedding holds 1/c of the sequence
    assert entry["local_length"] * context == entry["sequence_length"], entry


@pytest.mark.parametrize("scenario", ["llama_c2", "qwen2_c2", "gpt_neox_c2", "llama_c2_fsdp", "llama_c2_accumulated",
                                      "mistral_window_c2", "gemma2_softcap_c2", "mixtral_c2"])
def test_two_processes_train_like_one(two: dict[str, Any], scenario: str) -> None:
    _matches_one_process(two[scenario], context=2, dp_size=1)


@pytest.mark.parametrize(("scenario", "context", "dp_size"),
                         [("llama_c2_d2", 2, 2), ("qwen2_c2_d2_fsdp", 2, 2), ("llama_c4", 4, 1),
                          ("llama_t2_c2_sp", 2, 1), ("qwen2_t2_c2_fsdp", 2, 1),
                          ("llama_p2_c2", 2, 1), ("qwen2_p2_c2_gpipe_checkpoint_fsdp", 2, 1)])
def test_four_processes_train_like_one(four: dict[str, Any], scenario: str, context: int, dp_size: int) -> None:
    _matches_one_process(four[scenario], context, dp_size)


def test_tensor_pipeline_and_context_with_sequence_parallel_train_like_one(eight: dict[str, Any]) -> None:
    """Llama 3's long-context layout at small scale (tensor 2 × pipeline 2 × context 2, sequence parallel, 8
    processes): every stage splits the micro-batch's sequences, the stages exchange their sequence shards."""
    _matches_one_process(eight["llama_t2_p2_c2_sp"], context=2, dp_size=1)


def test_beside_pipeline_stages_eval_logits_are_whole_on_the_last_stage(four: dict[str, Any]) -> None:
    """atorch.training.eval_logits under pipeline 2 × context 2: the last stage's two context ranks return the whole
    sequence's logits in order (as one process), the first stage's None (-1 here)."""
    entry = four["llama_p2_c2_eval_logits"]
    assert "error" not in entry and entry["shape_match"], entry
    last = [d for d in entry["logits_diffs"] if d >= 0]
    assert len(last) == 2 and all(d <= LOSS_ATOL for d in last), entry


def test_beside_pipeline_stages_a_batch_is_refused_before_the_schedule_runs(four: dict[str, Any]) -> None:
    """Every rank refuses (the job does not hang on a stage waiting for its activations), naming the fix."""
    (padded,) = four["pipeline_padded_refused"]["refused"]
    assert "beside pipeline_parallel takes unpadded sequences" in padded and "-100 labels" in padded, padded
    (uneven,) = four["pipeline_uneven_refused"]["refused"]
    assert "sequence length is 14" in uneven and "multiple of 4" in uneven, uneven


def test_without_labels_the_logits_come_back_whole(two: dict[str, Any]) -> None:
    entry = two["llama_whole_logits"]
    assert entry["shape_match"] and entry["logits_diff"] <= LOSS_ATOL, entry


def test_refusals_name_the_problem_and_the_fix(two: dict[str, Any]) -> None:
    mlp = two["mlp_refused"]["refused"]
    assert any("transformers decoder" in p and "not a FlatMLP" in p for p in mlp), mlp
    (bart,) = two["bart_refused"]["refused"]
    assert "attention interface" in bart and "drop context_parallel" in bart
    (uneven,) = two["uneven_refused"]["refused"]
    assert "sequence length is 14" in uneven and "multiple of 4" in uneven
    (mask,) = two["mask_4d_refused"]["refused"]
    assert "(batch, sequence) = (1, 16)" in mask and "(1, 1, 16, 16)" in mask and "2-D attention_mask" in mask


@pytest.mark.parametrize(("launch", "scenario"), [("two", "llama_c2_padded_right"), ("two", "qwen2_c2_padded_left"),
                                                  ("two", "qwen3_moe_c2_padded_right"),
                                                  ("four", "llama_c2_d2_padded_left")])
def test_padded_batches_train_like_one_process_with_its_mask(launch: str, scenario: str,
                                                             request: pytest.FixtureRequest) -> None:
    """Padding (attention_mask 0, labels -100), right or left (leading padded queries see no real key, and the
    last of them predicts the first real token): the mask is applied to the gathered keys as transformers' own SDPA
    mask applies it in one process."""
    entry = request.getfixturevalue(launch)[scenario]
    assert "error" not in entry and "refused" not in entry, entry
    assert entry["padded"] > 0 and entry["finite"], entry
    assert entry["loss_drop"] > 100 * LOSS_ATOL, "the loss falls far more than the tolerance"
    assert entry["loss_diff"] <= LOSS_ATOL and entry["weight_diff"] <= WEIGHT_ATOL, entry


# ----- the cluster planner ----------------------------------------------------------------------
def _planned(layout: str, seq: int = 131072, gpus: int = 16384, batch: int = 2048) -> Any:
    from atorch.strategy_search.cluster.cluster_plan import parse_layout, plan_job
    from atorch.strategy_search.cluster.model_shapes import resolve_model
    from atorch.strategy_search.costing.hardware import load_profile

    shape = resolve_model("llama3-405b", seq)[1]
    return plan_job(shape, gpus, batch, load_profile("h100-80gb"), given=parse_layout(layout))


def test_the_planner_splits_long_sequences_over_context_ranks() -> None:
    """Llama 3 405B's long-context stage (Dubey et al. 2024, Table 4: 131k tokens, TP 8, CP 16, PP 16 on 16,384
    H100s): without a context dimension a 131k sequence's activations do not fit; with CP 16 they are 1/16."""
    common = "tp=8,pp=16,sp=true,sharding=zero1,mbs=1,recompute=full"
    alone, split = _planned(f"{common},cp=1").plans[0], _planned(f"{common},cp=16").plans[0]
    assert alone.layout.context == 1 and split.layout.context == 16
    assert split.layout.describe().startswith("t8·c16·p16·d8"), split.layout.describe()
    assert not alone.fits and split.fits, (alone.prediction.memory, split.prediction.memory)
    assert split.prediction.memory.activations < alone.prediction.memory.activations / 8
    assert "context 16" in split.prediction.notes[0]
    # atorch runs it (tests/workers/cp_worker.py: tensor 2 × pipeline 2 × context 2 with sequence parallel)
    assert not split.problems, split.problems
    dims = split.strategy.to_list()[0][1]["dims"]
    assert [d[0] for d in dims] == ["tensor", "context", "pipeline", "data"]


def test_a_published_context_size_is_accepted_below_the_length_it_is_enumerated_from() -> None:
    """Megatron-Bridge's Llama 3.1 405B splits 8,192 tokens over 2 context ranks (TP 8, CP 2, PP 8, VP 8 on 1,024
    H100): the planner enumerates context parallel from CONTEXT_MIN_SEQ, but a layout given with one is evaluated."""
    from atorch.strategy_search.cluster.cluster_plan import CONTEXT_MIN_SEQ

    assert CONTEXT_MIN_SEQ > 8192
    plan = _planned("tp=8,cp=2,pp=8,vp=8,sharding=zero1,sp=true,mbs=1,recompute=none", seq=8192, gpus=1024,
                    batch=512).plans[0]
    assert plan.layout.context == 2 and plan.layout.virtual_stages == 8, plan.layout


def test_short_sequences_get_no_context_dimension_and_a_data_context_layout_runs() -> None:
    from atorch.strategy_search.cluster.cluster_plan import Layout, strategy_for

    assert all(plan.layout.context == 1 for plan in _planned("tp=8,pp=16", seq=8192).plans)
    plain = strategy_for(Layout(1, 1, 4, "fsdp", "none", "none", 1, False, 1, 1, context=2))
    assert "context_parallel" in [m[0] if isinstance(m, (list, tuple)) else m for m in plain.to_list()]
    assert plain.problems(8) == []


# ----- the automatic search ---------------------------------------------------------------------
def test_the_space_offers_context_for_a_decoder_s_long_sequences() -> None:
    import shard_models as sm

    from atorch.strategy_search.search.space import CONTEXT_PARALLEL_FROM, SearchSpace

    torch.manual_seed(0)
    model = sm.tiny_llama()
    assert CONTEXT_PARALLEL_FROM == 8192
    assert SearchSpace(model, 2, 4, sequence_length=16).context_sizes == (1,)  # short sequences: not offered
    space = SearchSpace(model, 2, 4, sequence_length=16, context_parallel_from=16)
    assert space.context_sizes == (1, 2)
    split = [c for c in space.enumerate() if dict(c.point).get("context", 1) == 2]
    assert split and len(split) < len(space)
    for cand in split:
        layout = cand.strategy.layout(2)
        assert "context_parallel" in cand.strategy.names() and layout.size("context") == 2
        assert layout.data_size == 1 and layout.size("tensor") == 1  # two ranks: context 2 takes both
        assert cand.micro_batch_size * cand.micro_batches == 4  # one data rank reads the whole global batch
        assert cand.strategy.problems(2) == [], cand.strategy
    # FSDP shards over data × context (the ranks its gradients are averaged over): offered at data 1, context 2
    assert {"fsdp", "zero2"} <= {n for c in split for n in c.strategy.names()}, [c.strategy for c in split]
    # included by name: offered at any length, and every candidate has it
    included = SearchSpace(model, 2, 4, sequence_length=16, included=["context_parallel"])
    assert all(dict(c.point)["context"] == 2 for c in included.enumerate())
    # sequences that do not split into 2 × context chunks, and a model it cannot split, get none
    assert SearchSpace(model, 2, 4, sequence_length=18, context_parallel_from=16).context_sizes == (1,)
    assert SearchSpace(sm.FlatMLP(), 2, 4, sequence_length=16, context_parallel_from=16).context_sizes == (1,)
    # four ranks: context beside tensor (tensor × context) and, where pipeline_parallel is searched, beside pipeline
    # stages (pipeline × context)
    def layouts_of(**kwargs: Any) -> set[tuple[int, int, int]]:
        four = [c.strategy for c in SearchSpace(model, 4, 4, sequence_length=16, context_parallel_from=16,
                                                **kwargs).enumerate()]
        assert all(s.problems(4) == [] for s in four)
        return {(s.layout(4).size("tensor"), s.layout(4).size("context"), s.layout(4).size("pipeline")) for s in four}

    assert {(2, 2, 1), (1, 4, 1)} <= layouts_of()
    assert (1, 2, 2) in layouts_of(included=["pipeline_parallel"])
    # a mixture of experts: context beside experts too (expert × context), the experts' sizes unchanged
    from ep_worker import mixtral

    torch.manual_seed(0)
    moe = [c.strategy.layout(4) for c in SearchSpace(mixtral(), 4, 4, sequence_length=16,
                                                      context_parallel_from=16).enumerate()]
    assert any(lay.size("expert") == 2 and lay.size("context") == 2 for lay in moe)


def test_the_cost_model_s_context_terms() -> None:
    """At the same tokens per rank as data parallel: the same compute, the K/V all-gathers and their backward on
    top, the attention's whole K/V and one shared mask in memory, the gathers' operations per attention layer."""
    import shard_models as sm

    from atorch.strategy_search.costing import cost_model as cm
    from atorch.strategy_search.costing.analyser import analyse
    from atorch.strategy_search.costing.hardware import load_profile

    torch.manual_seed(0)
    model = sm.tiny_llama()
    data = sm.TokenDataset()
    stats = analyse(model, {k: torch.stack([data[i][k] for i in range(2)]) for k in ("input_ids", "labels")},
                    "unpack_dict")
    profile = load_profile("a100_80gb_8x_nvlink")  # a GPU's: the gradients' backward is a reduce-scatter
    ddp = Strategy.load(["parallel_mode"])
    cp = Strategy.load([("parallel_mode", {"dims": [["context", 2], ["data", -1]]}), "context_parallel"])
    plain = cm.predict(stats, ddp, ddp.layout(2), profile, 4)
    split = cm.predict(stats, cp, cp.layout(2), profile, 4)
    assert stats.kv_bytes_per_token == 2 * 2 * 8 * 4 * 2  # K and V, 2 KV heads of 8, fp32, 2 layers
    assert stats.attention_kv_bytes_per_token == 2 * stats.kv_bytes_per_token  # repeated to the 4 query heads
    assert split.time.compute == pytest.approx(plain.time.compute, rel=1e-9)  # 4 samples / 2 ranks either way
    layers, seq = 2, 16
    assert split.time.ops - plain.time.ops == (cm.CONTEXT_LAYER_OPS[0] + 2 * cm.CONTEXT_LAYER_OPS[1]) * layers
    kv = stats.kv_bytes_per_token * seq * 4
    gathers = cm._collective_s(profile, "all_gather", kv, 2, 2 * layers) + cm._collective_s(
        profile, "reduce_scatter", kv, 2, 2 * layers)
    assert split.time.communication - plain.time.communication == pytest.approx(gathers, rel=1e-9)
    whole = stats.attention_kv_bytes_per_token * seq * 4 * (1 - 1 / 2) + seq ** 2 / 2
    assert split.memory.activations - plain.memory.activations == pytest.approx(whole, abs=2)
    # beside tensor 2 a rank gathers and keeps its half of the heads' K/V (against tensor 2 × data 2: the same
    # tokens per rank, the same gradient sync over 2 replicas)
    tp_dp = Strategy.load([("parallel_mode", {"dims": [["tensor", 2], ["data", -1]]}), "tensor_parallel"])
    tp_cp = Strategy.load([("parallel_mode", {"dims": [["tensor", 2], ["context", 2], ["data", -1]]}),
                           "context_parallel", "tensor_parallel"])
    tensor_data = cm.predict(stats, tp_dp, tp_dp.layout(4), profile, 4)
    tensor_context = cm.predict(stats, tp_cp, tp_cp.layout(4), profile, 4)
    halves = cm._collective_s(profile, "all_gather", kv / 2, 2, 2 * layers) + cm._collective_s(
        profile, "reduce_scatter", kv / 2, 2, 2 * layers)
    assert tensor_context.time.communication - tensor_data.time.communication == pytest.approx(halves, rel=1e-9)
    assert tensor_context.memory.activations - tensor_data.memory.activations == pytest.approx(whole / 2 + seq ** 2
                                                                                               / 4, abs=2)


def test_the_search_dry_runs_and_picks_context_candidates(two: dict[str, Any]) -> None:
    entry = two["search_with_context"]
    assert "error" not in entry, entry
    assert "context_parallel" in entry["names"] and entry["context"] == 2, entry
    assert entry["dry_runs"] >= 1 and all(math.isfinite(x) for x in entry["losses"]), entry
    assert entry["losses"][-1] < entry["losses"][0], entry
