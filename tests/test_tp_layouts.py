"""tensor_parallel on decoder layouts: per-head query/key norms, fused q|k|v with parallel attention, multi-query.

Families (transformers, tiny random configs in tests/workers/tp_worker.py): Qwen3 (one q/k norm weight over
head_dim), Cohere with use_qk_norm (one norm row per head), StableLM with qk_layernorm (one norm module per head,
parallel residual), Falcon (fused per-head q|k|v, parallel attention and MLP, biases), GPT-BigCode with
multi_query (one key/value head in a fused c_attn), OLMo2 without its own plan (norms over the whole projection),
Apertus (learned scalars in the MLP), Jamba (attention and Mamba layers: the Mamba mixer, which computes with
dt_proj's weight itself, kept whole). Three launches: tensor 2 (2 processes; also under sequence_parallel, with the
checkpoints loaded under data 2 and the build check's messages on wrong plans), tensor 4 (with tensor 2 × data 2
under fsdp) and tensor 2 × pipeline 2 (4 processes each).
Each must train like one fp32 process on the same global batches: losses and the first gradient norm within
test_tensor_parallel.FP32_TOL (the same sums in another order: ~1e-6 relative over 4 SGD steps).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from launcher import HERE, run_json
from test_tensor_parallel import FP32_TOL
from workers.tp_worker import LAYOUTS, PIPELINED

from atorch.opt_lib.tensor_parallel import TensorParallelConfig, derive_plan

WORKER = HERE / "workers" / "tp_worker.py"
# What each family's plan must say in the log (rank 0), and a parameter it must split / keep whole.
LOGGED = {"qwen3": "query/key norms on the rank's heads (head_norm)",
          "olmo2_split": "query/key norms on the rank's heads (width_norm_split)",
          "apertus": "learned scalars on the rank's shard (gradient summed over the group): 2 modules",
          "cohere_qk": "query/key norms on the rank's heads (head_norm_split)",
          "stablelm_qk": "query/key norms on the rank's heads (head_norm_list)"}
SPLIT = {"qwen3": "self_attn.q_proj.weight", "cohere_qk": "self_attn.q_norm.weight",
         "falcon": "self_attention.query_key_value.bias", "stablelm_qk": "self_attn.q_proj.weight",
         "bigcode_mqa": "attn.c_proj.weight", "olmo2_split": "self_attn.q_norm.weight",
         "apertus": "mlp.up_proj.weight", "jamba": "feed_forward.down_proj.weight"}
WHOLE = {"qwen3": "self_attn.q_norm.weight",  # replicated (its gradient summed): not split
         "bigcode_mqa": "attn.c_attn.weight", "stablelm_qk": "q_layernorm.norms.0.weight",
         "jamba": "mamba.dt_proj.weight"}  # its mixer computes with the weight itself


def _assert_trains_like_reference(name: str, entry: dict[str, Any], report: dict[str, Any], model: str) -> None:
    assert "error" not in entry and "refused" not in entry, (name, entry)
    reference = report["reference"][model][:len(entry["losses"])]
    rtol, atol = FP32_TOL
    # The comparison can fail: training moves the loss by far more than the tolerance.
    assert abs(reference[0] - reference[-1]) > 5 * (atol + rtol * max(map(abs, reference))), reference
    torch.testing.assert_close(torch.tensor(entry["losses"]), torch.tensor(reference), rtol=rtol, atol=atol,
                               msg=lambda m: f"{name}: {entry['losses']} vs {reference}: {m}")
    if "grad_norm" in entry:  # (measured without a data dimension)
        torch.testing.assert_close(entry["grad_norm"], report["reference_grad_norm"][model], rtol=rtol, atol=atol,
                                   msg=lambda m: f"{name} first gradient norm: {m}")


@pytest.mark.distributed
@pytest.mark.timeout(480)
@pytest.mark.parametrize("group", ["layouts_tp2", "layouts_tp4"])
def test_layouts_train_like_one_process(group: str) -> None:
    nproc = 2 if group == "layouts_tp2" else 4
    report = run_json(WORKER, group, nproc=nproc, timeout=420)
    for name, (model, _) in LAYOUTS[group].items():
        entry = report["scenarios"][name]
        if name.startswith(("refused/", "checkpoint/")):
            continue
        _assert_trains_like_reference(name, entry, report, model)
        log = "\n".join(entry["log"])
        assert LOGGED.get(model, "") in log, (name, log)
        assert ("build checked on one sample" in log) != ("sequence_parallel" in name), (name, log)  # not under sp
        assert any(n.endswith(SPLIT[model]) for n in entry["split"]), (name, entry["split"])
        if model in WHOLE:
            assert not any(n.endswith(WHOLE[model]) for n in entry["split"]), (name, entry["split"])
        memory = entry["memory"]  # the split layers hold 1/t of their parameters per rank (1/(t·d) under fsdp)
        # (fsdp shards a tensor-parallel shard's dim 0 again: Cohere's one key-norm row per rank goes to one data
        # rank, so a rank holds up to a few rows more than its share)
        slack = 0.01 * memory["split_global"] if "fsdp" in name else 0
        assert abs(memory["split_local"] * nproc - memory["split_global"]) <= slack, memory
        assert memory["split_global"] > 0, memory
        assert entry["dp_size"] == (2 if "xdp2" in name else 1), entry["dp_size"]
    if group != "layouts_tp2":
        return
    # A checkpoint saved under tensor 2 loads under data 2 with fsdp (from other weights) to the same weights, and
    # into the plain model in one process.
    for name in (n for n in LAYOUTS[group] if n.startswith("checkpoint/")):
        entry = report["scenarios"][name]
        assert entry["same_keys"] and entry["differ"] == [] and entry["strict_load"], (name, entry)
        assert entry["moved"] == entry["keys"] > 0, (name, entry)  # trained: every tensor moved from its start
    # The build check names the first cause: where a wrong split fails (module, the model's line, the operation's
    # error), or the first sub-module whose output differs.
    failed = report["scenarios"]["refused/multi-query c_attn split column-wise"]["refused"]
    assert any("the split transformer.h.0 fails on one sample in transformer.h.0.attn (GPTBigCodeAttention) forward, "
               "at modeling_gpt_bigcode.py:" in p and "split_with_sizes expects split_sizes to sum exactly to 24" in p
               for p in failed), failed
    scalars = report["scenarios"]["refused/learned scalars kept whole"]["refused"]
    assert any("computes the unsplit output on one sample but not its gradients: gradient of mlp.act_fn.alpha_" in p
               and "give model.layers.0.mlp.act_fn the style 'replicated_with_grad_allreduce'" in p
               for p in scalars), scalars
    differs = report["scenarios"]["refused/fused layer split column-wise[first difference]"]["refused"]
    assert any("computes other numbers than the unsplit one on one sample" in p
               and "first at blocks.0.down (Linear): its output differs by" in p for p in differs), differs


@pytest.mark.distributed
@pytest.mark.timeout(480)
def test_layouts_under_tensor_by_pipeline() -> None:
    """Tensor 2 × pipeline 2 (1f1b) on 4 processes: each stage's copy split by the same layout rules, each stage's
    build checked."""
    report = run_json(WORKER, "layouts_tp2xpp2", nproc=4, timeout=420)
    for name, (model, _) in PIPELINED["layouts_tp2xpp2"].items():
        entry = report["scenarios"][name]
        _assert_trains_like_reference(name, entry, report, model)
        assert entry["checked"] == [1.0] * 4, (name, entry["checked"])


# ----- plans, in this process -------------------------------------------------------------------------
def _make(name: str) -> torch.nn.Module:
    from workers.tp_worker import make

    return make(name)


def _hf(family: str, **extra: Any) -> torch.nn.Module:
    from workers.tp_worker import _hf as make

    return make(family, **extra)


def test_norm_styles_follow_the_norm_weights() -> None:
    qwen3 = derive_plan(_make("qwen3"), TensorParallelConfig(), 2)
    assert not qwen3.problems and qwen3.styles["model.layers.0.self_attn.q_norm"] == "head_norm", qwen3
    cohere = derive_plan(_make("cohere_qk"), TensorParallelConfig(), 2)
    assert cohere.styles["model.layers.1.self_attn.k_norm"] == "head_norm_split", cohere.styles
    stablelm = derive_plan(_make("stablelm_qk"), TensorParallelConfig(), 2)
    assert stablelm.styles["model.layers.0.self_attn.q_layernorm"] == "head_norm_list", stablelm.styles
    # OLMo2 normalises over the whole projection: its own plan gathers q/k/v (the norm sees everything, no style);
    # without that plan the projections are split plainly and the norm by width (mean reduced over the group).
    olmo2 = _hf("Olmo2", num_attention_heads=4, num_key_value_heads=2)
    assert not any(s.endswith("_norm") for s in derive_plan(olmo2, TensorParallelConfig(), 2).styles)
    split = derive_plan(_make("olmo2_split"), TensorParallelConfig(), 2)
    assert split.styles["model.layers.0.self_attn.q_norm"] == "width_norm_split" and not split.problems, split
    # Replicated key/value heads (2 over tensor 4): a shared head_dim weight follows the rank's head; a norm with a
    # row per head or over the width stays whole, the rank's head taken from its output.
    assert derive_plan(_make("qwen3"), TensorParallelConfig(), 4).styles["model.layers.0.self_attn.k_norm"] == \
        "head_norm"
    for name, style in (("cohere_qk", "head_norm_split"), ("olmo2_split", "width_norm_split")):
        plan = derive_plan(_make(name), TensorParallelConfig(), 4)
        assert not plan.problems and plan.whole_k_norms["model.layers.0.self_attn"] == ("k_norm", style), plan
        assert "model.layers.0.self_attn.k_norm" not in plan.styles and plan.styles[
            "model.layers.0.self_attn.q_norm"] == style, plan.styles


def _local_split(attention: torch.nn.Module, split: Any, fused: torch.Tensor, columns: list[int],
                 attrs: dict[str, int]) -> Any:
    saved = {a: getattr(attention, a) for a in attrs}
    for attr, value in attrs.items():
        setattr(attention, attr, value)
    try:
        return split(fused[..., columns])
    finally:
        for attr, value in saved.items():
            setattr(attention, attr, value)


@pytest.mark.parametrize(("config", "t"), [
    ({"multi_query": True}, 2), ({"multi_query": True}, 4),
    ({"new_decoder_architecture": True, "num_kv_heads": 1}, 4), ({"new_decoder_architecture": True,
                                                                  "num_kv_heads": 2}, 4),
    ({"new_decoder_architecture": True, "num_kv_heads": 2, "num_attention_heads": 8}, 4)])
def test_falcon_columns_give_each_rank_its_heads_and_their_key_value_head(config: dict[str, Any], t: int) -> None:
    """The columns a rank keeps of a whole fused Falcon projection, run through Falcon's own head split with the
    rank's counts, give exactly the rank's query heads and the key/value head they read (at sizes no launch uses)."""
    from atorch.opt_lib.tp_layouts import match_layout

    heads = config.pop("num_attention_heads", 4)
    model = _hf("Falcon", num_attention_heads=heads, parallel_attn=True, ffn_hidden_size=64, **config)
    attention = model.transformer.h[0].self_attention
    match = match_layout("attn", attention, t)
    assert not match.problems and "attn" in match.own_columns, match
    spec = match.own_columns["attn"]
    fused = torch.arange(attention.query_key_value.out_features, dtype=torch.float32).expand(1, 1, -1)
    query, key, value = attention._split_heads(fused)  # [1, 1, heads, head_dim] each (keys broadcast per query head)
    per_rank = heads // t
    for rank in range(t):
        q, k, v = _local_split(attention, attention._split_heads, fused, spec.columns(rank), spec.attrs)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        assert torch.equal(q, query[:, :, mine]), rank
        # Falcon's multi-query split keeps one key head (broadcast later); the grouped one broadcasts it here.
        assert torch.equal(k.expand_as(q), key.expand_as(query)[:, :, mine]), rank
        assert torch.equal(v.expand_as(q), value.expand_as(query)[:, :, mine]), rank


def test_bigcode_multi_query_columns_and_per_head_blocks() -> None:
    from atorch.opt_lib.tp_layouts import match_layout

    model = _make("bigcode_mqa")
    attention = model.transformer.h[0].attn
    spec = match_layout("attn", attention, 2).own_columns["attn"]
    embed, d = attention.embed_dim, attention.head_dim
    assert spec.columns(1) == list(range(embed // 2, embed)) + list(range(embed, embed + 2 * d))
    assert spec.attrs == {"num_heads": 2, "embed_dim": embed // 2, "num_key_value_groups": 2}
    # The cost model counts the kept-whole c_attn whole on every rank, at any tensor size.
    from atorch.opt_lib.tensor_parallel import replicated_kv_bytes

    whole = sum(p.numel() * 4 for n, p in model.named_parameters() if ".attn.c_attn." in n)
    assert replicated_kv_bytes(model, 2) == replicated_kv_bytes(model, 4) == whole > 0
    # Without multi-query c_attn holds [q_i k_i v_i] per head: a plain column split, no reordering (GPT-2's is
    # [q | k | v]), and its checkpoint rows stay in the user's order.
    mha = _hf("GPTBigCode", num_attention_heads=4, multi_query=False, n_inner=64)
    plan = derive_plan(mha, TensorParallelConfig(), 2)
    assert plan.styles["transformer.h.0.attn.c_attn"] == "colwise" and not plan.fused_qkv and not plan.own_columns
    assert derive_plan(model, TensorParallelConfig(), 2).fused_qkv == []
    problems = derive_plan(model, TensorParallelConfig(), 3).problems
    assert any("4 attention heads do not divide over tensor size 3" in p for p in problems), problems


def test_falcon_with_alibi_keeps_its_attention_whole() -> None:
    plan = derive_plan(_hf("Falcon", num_attention_heads=4, alibi=True, ffn_hidden_size=64), TensorParallelConfig(), 2)
    assert not plan.problems and not any("query_key_value" in n or "self_attention.dense" in n for n in plan.styles)
    assert plan.styles["transformer.h.0.mlp.dense_h_to_4h"] == "colwise"
    assert any("ALiBi" in note for note in plan.notes), plan.notes
