"""`atorch plan`: layouts predicted by the cost model's transformer terms, its outputs and its errors.

Pure computation (no processes): the command runs in-process through ``atorch.cli.main``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from atorch.cli import main
from atorch.strategy import Strategy
from atorch.strategy_search.cluster.cluster_plan import evaluate, layouts, parse_layout, plan_job
from atorch.strategy_search.cluster.model_shapes import resolve_model
from atorch.strategy_search.cluster.plan_terms import TransformerShape, _group_link
from atorch.strategy_search.costing.hardware import load_profile

PLAN_FIELDS = {"layout", "sharding", "recompute", "micro_batch_size", "fits", "memory_per_gpu_bytes", "step_time_s",
               "tflops_per_gpu", "model_tflops_per_gpu", "mfu", "given", "strategy"}


def _gpt(layers: int = 24, hidden: int = 2304, heads: int = 24) -> TransformerShape:
    return TransformerShape(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden, vocab=51200,
                            seq=2048, position_embeddings=2048, tied_embeddings=True, dropout=True,
                            flash_attention=False, biases=True)


def test_flops_and_activations_follow_megatron() -> None:
    shape, batch = _gpt(), 512
    s, h, ell, vocab, a = shape.seq, shape.hidden, shape.layers, shape.vocab, shape.heads
    with_recompute = 96 * batch * s * ell * h * h * (1 + s / (6 * h) + vocab / (16 * ell * h))
    without = 72 * batch * s * ell * h * h * (1 + s / (6 * h) + vocab / (12 * ell * h))
    ours = (shape.model_flops_per_token() + shape.recompute_flops_per_token("full")) * batch * s
    assert ours == pytest.approx(with_recompute, rel=1e-12)
    assert shape.model_flops_per_token() * batch * s == pytest.approx(without, rel=1e-12)
    # Korthikanti et al. 2022: sbh(34 + 5as/h); tensor parallel t: sbh(10 + 24/t + 5as/(ht)); with sequence
    # parallel sbh(34/t + 5as/(ht)); selective recompute drops the 5as/h term
    assert shape.layer_activation_bytes(1, False, True) == pytest.approx(34 * h + 5 * a * s)
    assert shape.layer_activation_bytes(8, False, True) == pytest.approx(10 * h + 24 * h / 8 + 5 * a * s / 8)
    assert shape.layer_activation_bytes(8, True, True) == pytest.approx(34 * h / 8 + 5 * a * s / 8)
    assert shape.layer_activation_bytes(8, True, False) == pytest.approx(34 * h / 8)


def _one_gpu(shape: TransformerShape, batch: int, mbs: int, **kw: object) -> tuple[float, float]:
    """(compute, communication) seconds of a layout with full recompute off, DDP, on the A100 profile."""
    from atorch.strategy_search.cluster.cluster_plan import Layout

    t, p = int(kw.get("t", 1)), int(kw.get("p", 1))
    gpus = int(kw.get("gpus", t * p))
    schedule = "1f1b" if p > 1 else "none"
    lay = Layout(t, p, gpus // (t * p), "none", "none", schedule, 1, False, mbs, batch // (gpus // (t * p)) // mbs)
    pred = evaluate(shape, lay, load_profile("a100-80gb"), batch, 80 * 2**30).prediction
    return pred.time.compute, pred.time.communication


def test_unfused_attention_on_the_roofline_and_gradient_accumulation() -> None:
    from atorch.strategy_search.cluster.plan_terms import ELEMENTWISE_PASSES, VOCAB_LOSS_BYTES

    profile = load_profile("a100-80gb")
    flops_s = profile.matmul_tflops["bfloat16"] * 1e12 * profile.matmul_efficiency["bfloat16"]
    bw = profile.memory_bytes_per_s
    shape = _gpt(layers=2, hidden=1024, heads=16).model_copy(update={"dropout": False, "autocast": False})
    tokens, s, h, ell = 2048, shape.seq, shape.hidden, shape.layers
    score_s = max(4 * s * h / flops_s, shape.attention_matmul_bytes(1) / bw)
    assert shape.attention_matmul_bytes(1) / bw > 2 * 4 * s * h / flops_s  # head size 64: memory-bound
    expected = (tokens * (ell * (shape.layer_fwd_flops() - 4 * s * h) * 3 + 3 * shape.vocab_fwd_flops()) / flops_s
                + tokens * ell * 3 * score_s
                + tokens * (ell * shape.layer_elementwise_bytes(1, False) * (ELEMENTWISE_PASSES - 1)
                            + VOCAB_LOSS_BYTES * shape.vocab) / bw)
    one, _ = _one_gpu(shape, 1, 1)
    assert one == pytest.approx(expected, rel=1e-9)
    fused, _ = _one_gpu(shape.model_copy(update={"flash_attention": True}), 1, 1)
    assert fused < one
    # four micro-batches accumulate three gradients into the first one's (read two, write one): Megatron-LM's fp32
    # gradient buffer (the regime of a shape without autocast), 16 bits under 2021's --fp16
    four, _ = _one_gpu(shape, 4, 1)
    assert four - 4 * one == pytest.approx(3 * 3 * 4.0 * shape.params() / bw, rel=1e-6)
    old = shape.model_copy(update={"megatron_2021": True})
    four, one = _one_gpu(old, 4, 1)[0], _one_gpu(old, 1, 1)[0]
    assert four - 4 * one == pytest.approx(3 * 3 * 2.0 * shape.params() / bw, rel=1e-6)


def test_megatron_2021_layer_and_scattered_pipeline_sends() -> None:
    shape = _gpt(layers=8, hidden=4096, heads=32).model_copy(update={"autocast": False})
    old = shape.model_copy(update={"megatron_2021": True})
    h = shape.hidden
    # the QKV bias pass and the attention output's copy: 4·3h + 4h bytes per token, split over tensor ranks
    assert old.layer_elementwise_bytes(8, False) - shape.layer_elementwise_bytes(8, False) == pytest.approx(16 * h / 8)
    # tensor 8 x pipeline 2 over two nodes: each stage boundary crosses them; scattered, each rank sends 1/8
    _, whole = _one_gpu(shape, 32, 1, t=8, p=2)
    _, scattered = _one_gpu(old, 32, 1, t=8, p=2)
    assert scattered < whole


def test_megatron_table_1_published_layouts_within_20_percent() -> None:
    """bench/plan.py's check (Narayanan et al. 2021, Table 1): every published layout, as its scripts ran it, is
    predicted within ±20% of the published TFLOP/s per GPU and to fit in 80 GB."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_plan", Path(__file__).parent.parent / "bench" / "plan.py")
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    profile = load_profile("a100-80gb")
    for _, heads, hidden, layers, t, p, gpus, batch, published, mbs, v in bench.TABLE_1:
        plan = bench.published_layout(bench.megatron_gpt(heads, hidden, layers), gpus, batch, t, p, mbs, v, profile)
        assert plan.fits and abs(plan.tflops_per_gpu / published - 1) <= 0.2, (hidden, plan.tflops_per_gpu)


def test_published_sizes() -> None:
    for name, billions in (("Llama-2 7B", 6.74), ("llama2-70b", 68.98), ("Llama-3 8B", 8.03),
                           ("llama3-70b", 70.55), ("llama3-405b", 405.85), ("GPT-3 175B", 174.6)):
        assert resolve_model(name, 2048)[1].params() / 1e9 == pytest.approx(billions, rel=0.01), name


def test_hierarchical_collectives() -> None:
    profile = load_profile("a100-80gb")
    intra = profile.collectives["all_reduce"].bus_bandwidth
    inter = profile.inter_node["all_reduce"].bus_bandwidth
    assert _group_link(profile, "all_reduce", 8, 1)[0] == intra  # one node
    assert _group_link(profile, "all_reduce", 16, 8)[0] == inter  # one GPU per node: its own adapter
    assert _group_link(profile, "all_reduce", 32, 2)[0] == min(intra, 4 * inter)  # four per node
    assert _group_link(profile, "all_reduce", 4, 2)[0] == intra  # stride 2, 4 ranks: still one node


def test_plan_cli_json_and_emitted_strategy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, emitted = tmp_path / "plans.json", tmp_path / "strategy.json"
    page = tmp_path / "plans.html"
    rc = main(["plan", "llama2-7b", "--gpus", "16", "--global-batch", "64", "--seq", "2048", "--top", "5",
               "--json", str(out), "--html", str(page), "--emit-strategy", str(emitted)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "tokens/s" in text and "MFU" in text
    plans = json.loads(out.read_text())["plans"]
    assert len(plans) > 20
    assert all(set(p) >= PLAN_FIELDS for p in plans)
    fitting = [p for p in plans if p["fits"]]
    assert plans[0]["fits"] and not plans[0]["given"]
    assert [p["step_time_s"] for p in fitting] == sorted(p["step_time_s"] for p in fitting)
    assert all(p["layout"]["tensor"] * p["layout"]["pipeline"] * p["layout"]["data"] == 16 for p in plans)
    assert {p["sharding"] for p in plans} >= {"none", "fsdp"} and {p["layout"]["pipeline"] for p in plans} > {1}
    best = plans[0]
    assert best["tflops_per_gpu"] >= best["model_tflops_per_gpu"] > 0 and 0 < best["mfu"] < 1
    assert json.loads(emitted.read_text()) == best["strategy"]
    assert Strategy.load(emitted.read_text(), world_size=16) is not None
    assert main(["check", str(emitted), "--world-size", "16"]) == 0
    assert "<svg" in page.read_text()


def test_given_layout_first(tmp_path: Path) -> None:
    out = tmp_path / "plans.json"
    rc = main(["plan", "llama2-13b", "--gpus", "32", "--global-batch", "64", "--seq", "4096",
               "--layout", "tensor=4,pipeline=2,sharding=fsdp", "--json", str(out)])
    assert rc == 0
    plans = json.loads(out.read_text())["plans"]
    first = plans[0]
    assert first["given"] and first["layout"] == {"tensor": 4, "pipeline": 2, "data": 4, "expert": 1}
    assert first["sharding"] == "fsdp" and first["runnable"]
    assert sum(p["given"] for p in plans) == 1
    # the planner's free choices (schedule, recompute, micro-batch) were the best among that layout's
    same = [p for p in plans[1:] if p["layout"] == first["layout"] and p["sharding"] == "fsdp" and p["fits"]]
    assert all(first["step_time_s"] <= p["step_time_s"] for p in same)


def test_the_published_405b_layout_runs_in_atorch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Llama 3 405B as published (Dubey et al. 2024, Table 4: 16,384 H100, TP 8, PP 16, sequence parallel, 400
    TFLOP/s per GPU) with Megatron's distributed optimizer (zero1): runnable in atorch (the stages exchange
    sequence shards; zero1 across the tensor dimension runs as zero2, said in the notes), predicted near the
    published rate; the emitted strategy passes ``atorch check``, and is, at small sizes, the one the tp2xpp2 launch
    trains against one process (tests/test_tensor_parallel.py). Its 126 layers interleave over 16 ranks unevenly."""
    from workers.tp_worker import planner_layout_scaled_down

    out, emitted = tmp_path / "plans.json", tmp_path / "strategy.json"
    assert main(["plan", "llama3-405b", "--gpus", "16384", "--hardware", "h100-80gb", "--global-batch", "2048",
                 "--seq", "8192", "--layout", "tensor=8,pipeline=16,sequence_parallel=true,recompute=none,"
                 "sharding=zero1", "--json", str(out), "--emit-strategy", str(emitted)]) == 0
    assert "does NOT run" not in capsys.readouterr().err
    given, *ranked = json.loads(out.read_text())["plans"]
    assert given["given"] and given["runnable"] and not given["problems"] and given["fits"], given["problems"]
    assert any("zero1 across the tensor dimension runs as zero2" in n for n in given["notes"]), given["notes"]
    assert abs(given["tflops_per_gpu"] / 400 - 1) <= 0.2, given["tflops_per_gpu"]
    assert all(p["runnable"] and not p["given"] for p in ranked)
    # zero1 across a tensor dimension is zero2's twin in atorch: ranked only as the given layout's completions
    assert all((p["layout"]["tensor"], p["layout"]["pipeline"]) == (8, 16) for p in ranked
               if p["sharding"] == "zero1" and p["layout"]["tensor"] > 1)
    assert main(["check", str(emitted), "--world-size", "16384"]) == 0
    big, small = Strategy.load(emitted.read_text()).to_list(), Strategy.load(planner_layout_scaled_down()).to_list()
    assert [m[0] for m in big] == [m[0] for m in small] == ["parallel_mode", "amp_native", "mixed_parallel", "zero1"]
    assert [d[0] for d in big[0][1]["dims"]] == [d[0] for d in small[0][1]["dims"]] == ["tensor", "pipeline", "data"]
    assert big[2][1]["tensor"] == small[2][1]["tensor"] and big[2][1]["tensor"]["sequence_parallel"] is True
    assert big[1:2] == small[1:2] and big[3:] == small[3:]
    shape = resolve_model("llama3-405b", 8192)[1]
    uneven = {lay.virtual_stages for lay in layouts(shape, 16384, 8, 2048)
              if lay.pipeline == 16 and lay.schedule == "interleaved_1f1b"}
    assert uneven == set(range(2, 7 + 1)), uneven  # 126 layers: none of 32..112 virtual stages divides them


def test_a_measured_profile_plans_with_the_search_s_cost_model(tmp_path: Path) -> None:
    """With a profile atorch measured (the local processes), a config's model is analysed on fake tensors and
    every layout is predicted by the automatic search's own cost model (per-operation, DTensor costs); a table
    profile keeps the transformer terms."""
    from atorch.strategy_search.cluster.model_shapes import analysed_stats
    from atorch.strategy_search.costing.cost_model import predict

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256,
                                  "n_positions": 32}))
    measured = Path(__file__).parent.parent / "bench" / "data" / "profile_cpu_2ranks_2026-11-25.json"
    outs = {}
    for label, hardware in (("measured", str(measured)), ("table", "h100-80gb")):
        outs[label] = tmp_path / f"{label}.json"
        assert main(["plan", str(config), "--gpus", "2", "--hardware", hardware, "--global-batch", "4", "--seq", "32",
                     "--json", str(outs[label])]) == 0
    local, table = (json.loads(outs[k].read_text()) for k in ("measured", "table"))
    assert (local["cost_model"], table["cost_model"]) == ("search", "transformer")
    stats = analysed_stats(str(config), 32)
    assert stats is not None and stats.tp_split_layers == 2 * 4  # c_attn, c_proj, c_fc, c_proj per block
    best = local["plans"][0]
    strategy = Strategy.load(json.dumps(best["strategy"]))
    micro = 1 if best["layout"]["pipeline"] > 1 else best["micro_batches"]
    expected = predict(stats, strategy, strategy.layout(2), load_profile(measured), 4, micro).time.step
    assert best["step_time_s"] == pytest.approx(expected)
    assert resolve_model("llama2-7b", 32) and analysed_stats("llama2-7b", 32) is None  # a built-in: shape only


def test_config_json_and_meta_module(tmp_path: Path) -> None:
    config = {"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
              "num_key_value_heads": 4, "intermediate_size": 2816, "vocab_size": 32000, "hidden_act": "silu"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    _, shape = resolve_model(str(path), 1024)
    assert (shape.kv_heads, shape.gated_mlp, shape.ffn) == (4, True, 2816)
    _, meta = resolve_model("test_plan:meta_model", 256)
    assert (meta.layers, meta.hidden, meta.vocab, meta.ffn) == (6, 256, 1000, 1024)
    result = plan_job(meta, 8, 16, load_profile("h100-80gb"))
    assert result.plans and result.plans[0].fits


class _Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(hidden, 4, bias=False)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class _Meta(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 256)
        self.layers = nn.ModuleList(_Block(256) for _ in range(6))

    def forward(self, ids: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return x @ self.embed.weight.T


def meta_model() -> nn.Module:
    with torch.device("meta"):
        return _Meta()


def test_emitted_strategy_runs_under_auto_accelerate(tmp_path: Path) -> None:
    """The plan for one GPU (the model on the meta device) is a strategy auto_accelerate builds and trains."""
    import atorch
    from atorch.training import train_step

    emitted = tmp_path / "strategy.json"
    assert main(["plan", "test_plan:meta_model", "--gpus", "1", "--global-batch", "4", "--seq", "16",
                 "--emit-strategy", str(emitted)]) == 0
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (8, 17))
    dataset = torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])

    def loss_func(data: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output.float().flatten(0, 1), data[1].flatten())

    status, result, strategy = atorch.auto_accelerate(
        _Meta(), torch.optim.AdamW, dataset, loss_func, model_input_format="unpack_sequence",
        dataloader_args={"batch_size": 4}, load_strategy=str(emitted))
    with result:
        assert status and strategy.names() == Strategy.load(emitted.read_text()).names()
        loss = train_step(result, [next(iter(result.dataloader))])
        assert torch.isfinite(torch.as_tensor(loss))


@pytest.mark.parametrize(("argv", "expected"), [
    (["llama2-7b", "--hardware", "b200"], ["no hardware profile 'b200'", "a100-80gb", "h100-80gb"]),
    (["llama-9", "--hardware", "a100-80gb"], ["unknown model 'llama-9'", "llama2-70b", "llama3-405b"]),
    (["llama2-7b", "--gpus", "12"], ["not a whole number of 8-GPU nodes", "16"]),
    (["llama2-7b", "--layout", "tensor=3"], ["no layout of 8 GPUs matches"]),
    (["llama2-7b", "--layout", "sharding=zero9"], ["sharding must be one of"]),
])
def test_bad_input(argv: list[str], expected: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    defaults = ["--gpus", "8", "--global-batch", "64", "--seq", "2048"]
    assert main(["plan", *argv, *defaults[2 * ("--gpus" in argv):]]) == 2
    err = capsys.readouterr().err
    assert all(e in err for e in expected), err


def test_batch_no_layout_divides() -> None:
    from atorch.errors import SetupError

    with pytest.raises(SetupError, match="no layout divides 8 GPUs"):
        plan_job(_gpt(layers=1, hidden=2560, heads=5), 8, 3, load_profile("a100-80gb"))  # tensor 1, data 8


def test_too_large_names_smallest_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "llama3-405b", "--gpus", "16", "--global-batch", "64", "--seq", "2048", "--top", "1"]) == 3
    err = capsys.readouterr().err
    assert "no layout fits" in err and "smallest cluster" in err and "GPUs" in err
    assert parse_layout("tp=8,pp=4,sp=true,mbs=2") == {"tensor": 8, "pipeline": 4, "sequence_parallel": True,
                                                       "micro_batch_size": 2}


def test_70b_on_1024_gpus_is_fast() -> None:
    _, shape = resolve_model("llama2-70b", 4096)
    start = time.perf_counter()
    result = plan_job(shape, 1024, 1024, load_profile("a100-80gb"))
    assert time.perf_counter() - start < 10.0
    assert result.considered > 1000 and result.plans[0].fits
    assert result.plans[0].layout.tensor <= 8
    start = time.perf_counter()
    evaluate(shape, result.plans[-1].layout, load_profile("a100-80gb"), 1024, 80 * 2**30)
    assert time.perf_counter() - start < 0.05  # one configuration


# ----- precision regimes, ZeRO stages, schedules, MoE (issue 33) ------------------------------------------------------
def test_precision_regimes_count_bytes_per_parameter_as_each_stack_keeps_them() -> None:
    """Megatron-LM's distributed optimizer: 2 (bf16 weights) + 4 (fp32 gradient buffer) + 12/d (fp32 master and Adam
    states) bytes per parameter; ZeRO-1 shards only the optimizer, ZeRO-2 also the gradients but keeps the stage's
    weights whole, FSDP shards everything."""
    from atorch.strategy_search.cluster.precision import REGIMES, rank_bytes

    n, d = 1e9, 8
    mega = REGIMES["megatron"]
    z1 = rank_bytes(mega, "zero1", n, n / 10, d)
    assert (z1.parameters, z1.gradients, z1.optimizer_state) == (2 * n, 4 * n, 12 * n / d)
    assert rank_bytes(mega, "none", n, n / 10, d).optimizer_state == 12 * n
    z2 = rank_bytes(mega, "zero2", n, n / 10, d)
    assert (z2.parameters, z2.gradients, z2.optimizer_state) == (2 * n, 4 * n / d, 12 * n / d)
    # FSDP2's mixed precision: fp32 sharded master weights; under ZeRO-2 the bf16 gathered stage stays whole
    mixed = REGIMES["fsdp_mixed"]
    z2 = rank_bytes(mixed, "zero2", n, n / 10, d)
    assert z2.parameters == 2 * n + 4 * n / d and z2.gradients == 4 * n / d and z2.optimizer_state == 8 * n / d
    z3 = rank_bytes(mixed, "fsdp", n, n / 10, d)
    assert z3.parameters == 4 * n / d and z3.temporary == 2 * (n / 10) * 2  # a layer running, the next prefetched
    # atorch's amp_native: fp32 weights and gradients, autocast's bf16 copies through forward and backward
    amp = rank_bytes(REGIMES["amp_native"], "none", n, n / 10, d)
    assert (amp.parameters, amp.gradients, amp.optimizer_state, amp.temporary) == (4 * n, 4 * n, 8 * n, 2 * n)


def _given(tmp_path: Path, argv: list[str]) -> dict:
    out = tmp_path / "plans.json"
    assert main(["plan", *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_regime_default_per_layout_selectable_and_reported(tmp_path: Path) -> None:
    job = ["llama3-70b", "--gpus", "64", "--global-batch", "128", "--seq", "4096", "--hardware", "h100-80gb"]
    plans = _given(tmp_path, job)["plans"]
    by_sharding = {p["sharding"]: p["precision_regime"] for p in plans}
    assert by_sharding["fsdp"] == by_sharding["zero2"] == "fsdp_mixed"  # atorch's FSDP2 mixed-precision policy
    assert all(p["precision_regime"] == "amp_native" for p in plans if p["sharding"] in ("none", "zero1"))
    # ZeRO-1 across a tensor dimension runs as zero2 in atorch (FSDP2): FSDP2's policy by default, said in the notes
    given = _given(tmp_path, [*job, "--layout", "tensor=8,pipeline=4,sharding=zero1"])["plans"][0]
    assert given["precision_regime"] == "fsdp_mixed" and given["runnable"]
    assert any("runs as zero2 in atorch" in note for note in given["notes"]), given["notes"]
    # Megatron-LM's regime on request (its distributed optimizer), said to differ from what the strategy runs
    megatron = _given(tmp_path, [*job, "--layout", "tensor=8,pipeline=4,sharding=zero1", "--precision-regime",
                                 "megatron"])["plans"][0]
    assert megatron["precision_regime"] == "megatron" and "emitted strategy runs fsdp_mixed" in megatron["notes"][0]
    forced = _given(tmp_path, [*job, "--layout", "tensor=8,pipeline=4,sharding=zero1", "--precision-regime",
                               "amp_native"])["plans"][0]
    assert forced["precision_regime"] == "amp_native"
    # fp32 weights against bf16 (and the vocabulary kept whole where Megatron splits it over the tensor ranks)
    assert forced["memory"]["parameters"] >= 2 * megatron["memory"]["parameters"] > 0
    # ZeRO-2 keeps the stage's weights: more parameter bytes than FSDP's shards, fewer gradients than ZeRO-1's
    z2 = _given(tmp_path, [*job, "--layout", "tensor=8,pipeline=1,sharding=zero2,micro_batch_size=1,"
                                 "recompute=full"])["plans"][0]
    z3 = _given(tmp_path, [*job, "--layout", "tensor=8,pipeline=1,sharding=fsdp,micro_batch_size=1,"
                                 "recompute=full"])["plans"][0]
    assert z2["memory"]["parameters"] > 4 * z3["memory"]["parameters"]
    low, high = given["memory_per_gpu_range_bytes"]
    assert low < given["memory_per_gpu_bytes"] < high and given["memory_band"] == pytest.approx(0.15)
    assert given["above_mfu_ceiling"] is False and given["tflops_per_gpu"] < given["ceiling_tflops_per_gpu"]


def test_interleaving_down_to_one_layer_per_virtual_stage(tmp_path: Path) -> None:
    """A 96-layer model on 8 stages with 12 virtual stages per rank (one layer each), ZeRO-1 and sequence parallel
    on 256 H100s, as Megatron-LM runs Nemotron-4 340B's published recipe: evaluated (not refused) and predicted to fit
    in 80 GB in Megatron's regime (the vocabulary split over the tensor ranks, as Megatron-LM always does)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "nemotron", "hidden_size": 18432, "num_hidden_layers": 96,
                                  "num_attention_heads": 96, "num_key_value_heads": 8, "intermediate_size": 73728,
                                  "vocab_size": 256000, "hidden_act": "relu2"}))
    given = _given(tmp_path, [str(config), "--gpus", "256", "--global-batch", "64", "--seq", "4096", "--hardware",
                              "h100-80gb", "--precision-regime", "megatron", "--layout",
                              "tensor=8,pipeline=8,sharding=zero1,virtual_stages=12,"
                              "sequence_parallel=true,recompute=none,micro_batch_size=1"])["plans"][0]
    # (asked for: atorch would run zero1 across the tensor dimension as zero2, under FSDP2's regime; the published
    # recipe is Megatron-LM's distributed optimizer)
    assert given["given"] and given["virtual_stages"] == 12 and given["schedule"] == "interleaved_1f1b"
    assert given["precision_regime"] == "megatron" and given["fits"], given["memory_per_gpu_bytes"] / 2**30
    shape = resolve_model(str(config), 4096)[1]
    eight = {lay.virtual_stages for lay in layouts(shape, 256, 8, 64, virtual_stages=13) if lay.pipeline == 8}
    assert 13 not in eight and max(eight) == 8  # 8 x 13 = 104 stages for 96 layers; 12 only when asked for


def test_a_strategy_atorch_cannot_run_is_emitted_and_said_so(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    emitted = tmp_path / "strategy.json"
    assert main(["plan", "llama2-70b", "--gpus", "64", "--global-batch", "128", "--seq", "4096", "--layout",
                 "tensor=8,pipeline=4,sharding=none,sequence_parallel=true", "--emit-strategy", str(emitted)]) == 0
    err = capsys.readouterr().err
    assert emitted.is_file() and "does NOT run in atorch" in err and "add 'fsdp'" in err
    assert main(["check", str(emitted), "--world-size", "64"]) != 0  # the registry's rules refuse it, as said


def test_moe_models_expert_dimension_and_all_to_all() -> None:
    """DeepSeek-V3 (arXiv 2412.19437): 671B parameters, 37B active; experts split over an expert dimension, each
    rank's expert bytes shrinking with it, the all-to-all volume per layer growing towards 4 x tokens x top-k x h x 2
    bytes; without an expert_parallel method in the registry an expert layout is not runnable."""
    from atorch.opt_lib import registry
    from atorch.strategy_search.cluster.cluster_plan import Layout

    shape = resolve_model("deepseek-v3", 4096)[1]
    assert shape.params() / 1e9 == pytest.approx(671, rel=0.01)
    assert shape.active_params() / 1e9 == pytest.approx(37, rel=0.03)
    # FLOPs at the active parameters (top-8 routed + 1 shared expert), not the total
    assert shape.model_flops_per_token() < 8 * shape.active_params()
    profile = load_profile("h800-80gb")
    plans = {}
    for ep in (8, 64):
        lay = Layout(1, 16, 128, "zero1", "none", "1f1b", 1, False, 1, 120, expert=ep)
        plans[ep] = evaluate(shape, lay, profile, 15360, profile.memory_per_rank, precision="megatron")
    assert plans[8].moe["expert_params_per_rank"] == pytest.approx(8 * plans[64].moe["expert_params_per_rank"])
    assert plans[64].prediction.memory.parameters < plans[8].prediction.memory.parameters
    a2a = plans[64].moe["all_to_all_bytes_per_layer"]
    assert a2a == pytest.approx(4 * 4096 * 8 * 7168 * 2 * 63 / 64)
    assert plans[64].prediction.time.communication > 0
    enumerated = {lay.expert for lay in layouts(shape, 256, 8, 256) if lay.pipeline == 16 and lay.tensor == 1}
    assert enumerated == {1, 2, 4, 8, 16}  # divisors of the 16 data ranks that divide the 256 experts
    if "expert_parallel" not in registry.method_names():
        result = plan_job(shape, 2048, 15360, profile, given=parse_layout("pipeline=16,expert=64,sharding=zero1,"
                                                                            "micro_batch_size=1,schedule=1f1b"))
        given = result.plans[0]
        assert given.given and any("expert_parallel" in p for p in given.problems)
        assert all(p.layout.expert == 1 for p in result.plans[1:])  # only runnable layouts are ranked


def test_moe_config_and_mla() -> None:
    from atorch.strategy_search.cluster.model_shapes import shape_from_config

    mixtral = shape_from_config({"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32,
                                 "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                                 "vocab_size": 32000, "hidden_act": "silu", "num_local_experts": 8,
                                 "num_experts_per_tok": 2}, 4096)
    assert (mixtral.experts, mixtral.top_k, mixtral.expert_ffn) == (8, 2, 14336)
    assert mixtral.params() == resolve_model("mixtral-8x7b", 4096)[1].params()
    assert mixtral.params() / 1e9 == pytest.approx(46.7, rel=0.01)
    assert mixtral.active_params() / 1e9 == pytest.approx(12.9, rel=0.01)


def test_prediction_above_the_matmul_ceiling_is_flagged() -> None:
    from dataclasses import replace as dc_replace

    shape = resolve_model("llama2-7b", 2048)[1]
    profile = load_profile("h100-80gb")
    plan = plan_job(shape, 8, 64, profile).plans[0]
    assert not plan.above_ceiling and plan.mfu_ceiling == pytest.approx(0.801)
    assert dc_replace(plan, mfu_ceiling=0.1).above_ceiling  # a run computing faster than the measured matmul rate


def test_published_runs_since_table_1_fit_and_in_sample_ones_within_20_percent() -> None:
    """bench/plan.py's other published runs (Llama 3 405B, DeepSeek-V3, torchtitan's Llama 3.1): every published
    layout is predicted to fit; the in-sample ones (looked at while the terms were shaped) within ±20%. The held-out
    ones' errors are reported by the bench, not asserted (see bench/README.md)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_plan", Path(__file__).parent.parent / "bench" / "plan.py")
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.other_runs()
    assert len(rows) == len(bench.OTHER_RUNS) >= 7
    assert all(r["fits"] for r in rows), [(r["run"], r["memory_gib"]) for r in rows if not r["fits"]]
    assert all(abs(r["error"]) <= 0.2 for r in rows if r["in_sample"]), [(r["run"], r["error"]) for r in rows]


def test_sharding_spans_the_context_ranks_when_the_data_dimension_is_one() -> None:
    """torchtitan's 256k-token rows run FSDP 1 × context 8: the parameters are sharded over the data × context
    ranks, so a layout whose data dimension is 1 still has shardings to choose from (it was enumerated unsharded
    only, and the published layout was refused as 'no layout matches')."""
    _, shape = resolve_model("llama3-8b", 262144)
    found = {(lay.sharding, lay.data) for lay in layouts(shape, 8, 8, 1, context=8) if lay.context == 8}
    assert ("fsdp", 1) in found and ("none", 1) in found, found
    profile = load_profile("h100-96gb-500w")
    given = plan_job(shape, 8, 1, profile, given=parse_layout("context=8,sharding=fsdp,recompute=full")).plans[0]
    whole = plan_job(shape, 8, 1, profile, given=parse_layout("context=8,sharding=none,recompute=full")).plans[0]
    assert given.layout.sharding == "fsdp" and given.prediction.memory.peak < whole.prediction.memory.peak
    _, single = resolve_model("llama3-8b", 4096)  # one rank: nothing to shard over
    assert {lay.sharding for lay in layouts(single, 1, 8, 1)} == {"none"}
