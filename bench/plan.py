"""`atorch plan` against Megatron-LM's weak-scaling table (Narayanan et al., SC 2021, arXiv 2104.04473, Table 1).

For each published row: the prediction for the published layout (tensor × pipeline × data, data-parallel
DDP, full activation recompute as the paper ran it, no sequence parallel: it came a year later; the schedule
and micro-batch size of the paper's scripts, Megatron-LM examples/sc21/run_table_1.sh) against the published
TFLOP/s per GPU,
whether it is predicted to fit in 80 GB, and atorch's own top pick's predicted step time against it.

Nothing here is fitted: the model and the A100 profile (atorch/strategy_search/costing/profiles/a100-80gb.json,
figures from data sheets, nccl-tests and the MAMF matmul ceiling) are used as shipped.

    PYTHONPATH=. python bench/plan.py [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from atorch.strategy_search.cluster.cluster_plan import Layout, Plan, evaluate, layouts, plan_job
from atorch.strategy_search.cluster.plan_terms import TransformerShape
from atorch.strategy_search.costing.hardware import HardwareProfile, load_profile

# params (B), heads, hidden, layers, tensor, pipeline, GPUs, batch, published TFLOP/s per GPU (the paper's Table 1);
# micro-batch size and virtual pipeline stages per rank as the paper's scripts ran each row (Megatron-LM,
# examples/sc21/run_table_1.sh: MBS, and layers / (pipeline x --num-layers-per-virtual-pipeline-stage))
TABLE_1 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1),
)
SEQ, VOCAB = 2048, 51200

# Other published large runs (not in the reference table; each with its source), predicted with the layout as
# published and the planner's best completion of what the source leaves open (schedule, virtual stages, micro-batch).
# "in_sample": a run looked at while the terms were shaped (its error says how well they were fitted, not how they
# generalise); the others are held out: the terms were not changed after seeing them.
# unit "tflops": the source's TFLOP/s per GPU; "tokens": its tokens/s per GPU (compared as is; TFLOP/s then follow
# from the planner's FLOP count). published_gib: the source's measured peak memory per GPU, where it gives one.
OTHER_RUNS: tuple[dict, ...] = (
    # Dubey et al. 2024, "The Llama 3 Herd of Models", arXiv 2407.21783, Table 4: BF16, 16M tokens per batch, TP 8,
    # CP 1, PP 16, sequence parallel (Megatron), FSDP that does not reshard after forward (zero2); no activation
    # recompute is named for these rows. atorch cannot run sequence parallel across a pipeline yet: evaluated by
    # the cost model only (runnable: false).
    {"run": "Llama 3 405B, 8,192 H100", "model": "llama3-405b", "hardware": "h100-80gb", "gpus": 8192,
     "batch": 2048, "seq": 8192, "published": 430, "unit": "tflops", "in_sample": True,
     "layout": "tensor=8,pipeline=16,sharding=zero2,sequence_parallel=true,recompute=none,micro_batch_size=1"},
    {"run": "Llama 3 405B, 16,384 H100", "model": "llama3-405b", "hardware": "h100-80gb", "gpus": 16384,
     "batch": 2048, "seq": 8192, "published": 400, "unit": "tflops", "in_sample": True,
     "layout": "tensor=8,pipeline=16,sharding=zero2,sequence_parallel=true,recompute=none,micro_batch_size=1"},
    # DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv 2412.19437: 2,048 H800 (section 3.1), PP 16 with
    # DualPipe, EP 64 over 8 nodes, ZeRO-1 data parallel, no tensor parallel (3.2), FP8 GEMMs with bf16 moments
    # (3.3), sequence 4,096 and batch 15,360 sequences (4.2), 180K H800 GPU-hours per trillion tokens (section 1,
    # Table 1): 1,543 tokens/s per GPU. The multi-token-prediction module is not modelled (about 2% of the FLOPs).
    {"run": "DeepSeek-V3, 2,048 H800", "model": "deepseek-v3", "hardware": "h800-80gb", "gpus": 2048,
     "batch": 15360, "seq": 4096, "published": 1e12 / (180e3 * 3600), "unit": "tokens", "in_sample": True,
     "precision": "deepseek_fp8",
     "layout": "pipeline=16,expert=64,sharding=zero1,recompute=none,fp8=true,schedule=dualpipe,micro_batch_size=1"},
    # Megatron-Bridge's performance summary (NVIDIA-NeMo/Megatron-Bridge, docs/performance-summary.md, 25.11 container,
    # DGX-H100, FP8 current scaling): Megatron-LM's mixed precision and distributed optimizer (ZeRO-1), sequence
    # parallel with tensor parallel; no recompute named. Llama 3 70B: 64 GPUs, GBS 128, MBS 1, sequence 8,192, TP 4,
    # PP 8, VP 5, 1,602 tokens/s per GPU; Llama 3 8B: 8 GPUs, Megatron's FSDP, GBS 128, MBS 1, 14,451; Qwen3-30B-A3B:
    # 16 GPUs, GBS 512, MBS 2, sequence 4,096, PP 2, VP 24 (one layer per virtual stage), EP 8, 5,275. (Its 405B row
    # uses context parallel: added on 2026-11-29 with the row below it.)
    {"run": "Megatron-Bridge Llama 3 70B, 64 H100 (FP8)", "model": "llama3-70b", "hardware": "h100-80gb",
     "gpus": 64, "batch": 128, "seq": 8192, "published": 1602, "unit": "tokens", "in_sample": False,
     "precision": "megatron",
     "layout": "tensor=4,pipeline=8,virtual_stages=5,sharding=zero1,sequence_parallel=true,recompute=none,fp8=true,"
               "micro_batch_size=1"},
    {"run": "Megatron-Bridge Llama 3 8B, 8 H100 (FP8)", "model": "llama3-8b", "hardware": "h100-80gb",
     "gpus": 8, "batch": 128, "seq": 8192, "published": 14451, "unit": "tokens", "in_sample": False,
     "precision": "megatron", "layout": "tensor=1,pipeline=1,sharding=fsdp,recompute=none,fp8=true,micro_batch_size=1"},
    {"run": "Megatron-Bridge Qwen3-30B-A3B, 16 H100 (FP8)", "model": "qwen3-30b-a3b", "hardware": "h100-80gb",
     "gpus": 16, "batch": 512, "seq": 4096, "published": 5275, "unit": "tokens", "in_sample": False,
     "precision": "megatron",
     "layout": "tensor=1,pipeline=2,virtual_stages=24,expert=8,sharding=zero1,recompute=none,fp8=true,"
               "micro_batch_size=2"},
    # Added 2026-11-29, run once and held out (no term changed after): the context-parallel runs. Dubey et al. 2024,
    # Table 4, third row: the long-context stage, 16,384 H100, TP 8, CP 16, PP 16, DP 8, sequence 131,072, 16
    # sequences per data rank (16M tokens per batch), 380 TFLOP/s per GPU (the planner's context terms were written
    # with this layout in view, its fit is a test of test_context_parallel.py, never its TFLOP/s). Megatron-Bridge
    # (same summary, 25.11): Llama 3.1 405B on 1,024 H100, FP8 current scaling, GBS 512, sequence 8,192, TP 8, PP 8,
    # CP 2, VP 8, 292 tokens/s per GPU; its MBS is taken as 1, as in its other rows.
    {"run": "Llama 3 405B, 16,384 H100, 131k context", "model": "llama3-405b", "hardware": "h100-80gb",
     "gpus": 16384, "batch": 128, "seq": 131072, "published": 380, "unit": "tflops", "in_sample": False,
     "layout": "tensor=8,context=16,pipeline=16,sharding=zero2,sequence_parallel=true,recompute=none,"
               "micro_batch_size=1"},
    {"run": "Megatron-Bridge Llama 3.1 405B, 1,024 H100 (FP8)", "model": "llama3-405b", "hardware": "h100-80gb",
     "gpus": 1024, "batch": 512, "seq": 8192, "published": 292, "unit": "tokens", "in_sample": False,
     "precision": "megatron",
     "layout": "tensor=8,context=2,pipeline=8,virtual_stages=8,sharding=zero1,sequence_parallel=true,recompute=none,"
               "fp8=true,micro_batch_size=1"},
    # torchtitan's Llama 3.1 benchmarks (pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, Dec 2024),
    # on its own H100s (profile h100-96gb-500w): Table 1 / 3, FSDP, bf16, no compile, local batch 2 (sequence 8,192,
    # torchtitan's default), selective activation checkpointing (predicted without recompute: it recomputes cheap
    # operations only); Table 4, FSDP 32 x TP 8, compile + Float8, full checkpointing, local batch 16; Table 5,
    # FSDP 8 x TP 8 x PP 8, interleaved 1F1B, compile + Float8 + AsyncTP, full checkpointing, local batch 32.
    {"run": "torchtitan Llama 3.1 8B, 8 H100", "model": "llama3-8b", "hardware": "h100-96gb-500w", "gpus": 8,
     "batch": 16, "seq": 8192, "published": 5762, "unit": "tokens", "published_gib": 82.4, "in_sample": False,
     "layout": "tensor=1,pipeline=1,sharding=fsdp,recompute=none,micro_batch_size=2"},
    {"run": "torchtitan Llama 3.1 8B, 128 H100", "model": "llama3-8b", "hardware": "h100-96gb-500w", "gpus": 128,
     "batch": 256, "seq": 8192, "published": 5605, "unit": "tokens", "published_gib": 67.0, "in_sample": False,
     "layout": "tensor=1,pipeline=1,sharding=fsdp,recompute=none,micro_batch_size=2"},
    {"run": "torchtitan Llama 3.1 70B, 256 H100 (Float8)", "model": "llama3-70b", "hardware": "h100-96gb-500w",
     "gpus": 256, "batch": 512, "seq": 8192, "published": 829, "unit": "tokens", "published_gib": 71.9,
     "in_sample": False, "layout": "tensor=8,pipeline=1,sharding=fsdp,recompute=full,fp8=true,micro_batch_size=16"},
    {"run": "torchtitan Llama 3.1 405B, 512 H100 (Float8)", "model": "llama3-405b", "hardware": "h100-96gb-500w",
     "gpus": 512, "batch": 256, "seq": 8192, "published": 128, "unit": "tokens", "published_gib": 72.7,
     "in_sample": False,
     "layout": "tensor=8,pipeline=8,sharding=fsdp,recompute=full,fp8=true,schedule=interleaved_1f1b,"
               "micro_batch_size=1"},
    # Added 2026-11-29, run once and held out (no term changed after seeing them): torchtitan's context-parallel
    # tables (the same benchmark file): Table 2, Llama 3.1 8B on 8 GPUs, FSDP x CP = 8, local batch 1 (one sequence
    # per FSDP rank), compile + Float8, full checkpointing; Table 6, Llama 3.1 405B on 512 GPUs, TP 8, PP 8 (1F1B),
    # FSDP x CP = 8, local batch 8 (taken as 8 micro-batches of 1), compile + Float8 + AsyncTP, full checkpointing.
    *({"run": f"torchtitan Llama 3.1 {size}, {gpus} H100, {seq // 1024}k context (Float8)",
       "model": f"llama3-{size.lower()}", "hardware": "h100-96gb-500w", "gpus": gpus, "seq": seq,
       "batch": 8 // cp * per_rank, "published": tokens, "unit": "tokens", "published_gib": gib, "in_sample": False,
       "layout": f"tensor={tp},pipeline={pp},context={cp},sharding=fsdp,recompute=full,fp8=true,"
                 + ("schedule=1f1b," if pp > 1 else "") + "micro_batch_size=1"}
      for size, gpus, tp, pp, per_rank, rows in (
          ("8B", 8, 1, 1, 1, ((1, 32768, 3890, 83.9), (2, 65536, 2540, 84.2), (4, 131072, 1071, 84.0),
                              (8, 262144, 548, 84.5))),
          ("405B", 512, 8, 8, 8, ((1, 32768, 76, 75.3), (2, 65536, 47, 75.9), (4, 131072, 31, 77.1),
                                  (8, 262144, 16, 84.9))))
      for cp, seq, tokens, gib in rows),
    # Added 2026-11-29, run once and held out (no term changed after seeing them): Megatron-Core's H100 weak-scaling
    # table (NVIDIA/Megatron-LM README, images/model_table.png, read at d98e8a64): GPT, vocabulary 131,072, sequence
    # 4,096, bf16, data 48 throughout, with --overlap-grad-reduce, --overlap-param-gather (the distributed
    # optimizer: ZeRO-1, megatron regime) and --tp-comm-overlap (which needs sequence parallel). What the README
    # leaves open is taken from Megatron-Core's defaults, fixed before the first prediction: a 4h GELU MLP, biases,
    # learned positions, dropout 0.1, untied embeddings (the published parameter counts match only untied ones: 1.7B
    # = 24 x 12 x 2048^2 + 2 x 131,072 x 2048), flash attention (Transformer Engine); schedule, virtual stages,
    # micro-batch and recompute are the planner's best completion.
    *({"run": f"Megatron-Core GPT {size}, {48 * t * p} H100", "hardware": "h100-80gb", "gpus": 48 * t * p,
       "batch": batch, "seq": 4096, "published": published, "unit": "tflops", "in_sample": False,
       "precision": "megatron",
       "shape": {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": heads, "ffn": 4 * hidden,
                 "vocab": 131072, "position_embeddings": 4096, "biases": True, "dropout": True},
       "layout": f"tensor={t},pipeline={p},sharding=zero1,sequence_parallel={str(t > 1).lower()}"}
      for size, heads, hidden, layers, t, p, batch, published in (
          ("1.7B", 16, 2048, 24, 1, 1, 192, 408.8), ("7.1B", 32, 4096, 30, 2, 1, 192, 465.9),
          ("16B", 48, 6144, 32, 4, 1, 192, 489.1), ("32B", 56, 7168, 48, 8, 1, 192, 459.6),
          ("70B", 64, 8192, 84, 8, 2, 384, 419.7), ("119B", 80, 10240, 92, 8, 4, 768, 420.5),
          ("177B", 96, 12288, 96, 8, 6, 1152, 432.8), ("314B", 128, 16384, 96, 8, 8, 1536, 474.4),
          ("462B", 144, 18432, 112, 8, 16, 3072, 459.9))),
)


def megatron_gpt(heads: int, hidden: int, layers: int) -> TransformerShape:
    """The paper's GPT: learned positions, biases, dropout, tied embeddings, attention without fusion (2021),
    fp16 weights, activations and gradients with fp32 master weights (``--fp16``: no autocast), its 2021 layer
    code and stage-to-stage sends scattered over the tensor ranks (``megatron_2021``)."""
    return TransformerShape(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden, vocab=VOCAB,
                            seq=SEQ, position_embeddings=SEQ, tied_embeddings=True, dropout=True,
                            flash_attention=False, biases=True, autocast=False,
                            megatron_2021=True)


def published_layout(shape: TransformerShape, gpus: int, batch: int, t: int, p: int, mbs: int, v: int,
                     profile: HardwareProfile) -> Plan:
    """The published layout as Megatron-LM ran it: data parallel by all-reduce (DDP), full recompute, the
    vocabulary split over the tensor ranks, no sequence parallel, the scripts' micro-batch size and schedule
    (1F1B, interleaved with ``v`` stages per rank). atorch's rules are not applied: atorch itself would need FSDP
    on the data dimension of a tensor × pipeline layout, and keeps the vocabulary whole under a pipeline."""
    schedule = "none" if p == 1 else "interleaved_1f1b" if v > 1 else "1f1b"
    wanted = (t, p, "none", "full", False, schedule, v, mbs)
    plans = [evaluate(shape, replace(lay, vocab_parallel=t > 1), profile, batch, profile.memory_per_rank)
             for lay in layouts(shape, gpus, 8, batch)
             if (lay.tensor, lay.pipeline, lay.sharding, lay.recompute, lay.sequence_parallel, lay.schedule,
                 lay.virtual_stages, lay.micro_batch_size) == wanted]
    if len(plans) != 1:
        raise SystemExit(f"the published layout {wanted} is {len(plans)} layouts of the planner's")
    return plans[0]


def run() -> dict:
    profile = load_profile("a100-80gb")
    rows = []
    for params, heads, hidden, layers, t, p, gpus, batch, published, mbs, v in TABLE_1:
        shape = megatron_gpt(heads, hidden, layers)
        start = time.perf_counter()
        result = plan_job(shape, gpus, batch, profile, gpus_per_node=8)
        ours = published_layout(shape, gpus, batch, t, p, mbs, v, profile)
        seconds = time.perf_counter() - start
        top = next((pl for pl in result.plans if pl.fits), None)
        lay = ours.layout
        rows.append({
            "params_b": params, "model_params_b": round(shape.params() / 1e9, 1), "gpus": gpus, "batch": batch,
            "tensor": t, "pipeline": p, "data": lay.data, "published_tflops": published,
            "predicted_tflops": round(ours.tflops_per_gpu, 1),
            "error": round(ours.tflops_per_gpu / published - 1, 3),
            "schedule": lay.schedule, "virtual_stages": lay.virtual_stages, "micro_batch_size": lay.micro_batch_size,
            "memory_gib": round(ours.prediction.memory.peak / 2**30, 1), "fits_80gb": ours.fits,
            "step_s": round(ours.prediction.time.step, 2),
            "top_pick": top.layout.describe() + f" {top.layout.sharding} mbs {top.layout.micro_batch_size}"
            + f" recompute {top.layout.recompute}" if top else None,
            "top_step_s": round(top.prediction.time.step, 2) if top else None,
            "top_not_slower": bool(top and top.prediction.time.step <= ours.prediction.time.step * (1 + 1e-9)),
            "layouts": result.considered, "plan_s": round(seconds, 2),
        })
    errors = [abs(r["error"]) for r in rows]
    return {"rows": rows, "median_abs_error": round(statistics.median(errors), 3), "worst_abs_error": max(errors),
            "within_20pct": sum(e <= 0.2 for e in errors), "fit": sum(r["fits_80gb"] for r in rows),
            "top_not_slower": sum(r["top_not_slower"] for r in rows)}


def other_runs() -> list[dict]:
    """OTHER_RUNS predicted as ``atorch plan MODEL --layout ... [--precision-regime ...]`` evaluates them."""
    from atorch.strategy_search.cluster.cluster_plan import parse_layout
    from atorch.strategy_search.cluster.model_shapes import resolve_model

    rows = []
    for run in OTHER_RUNS:
        shape = (TransformerShape(**run["shape"], seq=run["seq"]) if "shape" in run
                 else resolve_model(run["model"], run["seq"])[1])
        given = plan_job(shape, run["gpus"], run["batch"], load_profile(run["hardware"]),
                         given=parse_layout(run["layout"]), precision=run.get("precision")).plans[0]
        lay, mem = given.layout, given.prediction.memory
        tokens = given.tokens_per_s / run["gpus"]
        predicted = tokens if run["unit"] == "tokens" else given.tflops_per_gpu
        row = {"run": run["run"], "layout": run["layout"], "in_sample": run["in_sample"], "unit": run["unit"],
               "published": round(run["published"], 1), "predicted": round(predicted, 1),
               "error": round(predicted / run["published"] - 1, 3), "tflops_per_gpu": round(given.tflops_per_gpu, 1),
               "tokens_per_gpu": round(tokens, 1), "mfu": round(given.mfu, 3), "precision": given.precision,
               "schedule": lay.schedule, "virtual_stages": lay.virtual_stages,
               "micro_batch_size": lay.micro_batch_size, "memory_gib": round(mem.peak / 2**30, 1),
               "memory_limit_gib": round(given.memory_limit / 2**30, 1), "fits": given.fits,
               "above_mfu_ceiling": given.above_ceiling, "runnable_by_atorch": not given.problems}
        if run.get("published_gib"):
            row["published_gib"] = run["published_gib"]
            row["memory_error"] = round(mem.peak / 2**30 / run["published_gib"] - 1, 3)
        rows.append(row)
    return rows


def gpu_check(path: str) -> list[dict]:
    """Predicted vs measured one-GPU training steps (bench/plan_gpu_check.py's JSON), under the shipped table of the
    device it measured (its ``dev``: the H200's table for an H200, else the H100's)."""
    measured = json.loads(Path(path).read_text())
    profile = load_profile("h200-141gb" if "H200" in measured.get("dev", "") else "h100-80gb")
    rows = []
    for run in measured["runs"]:
        shape = TransformerShape(layers=run["L"], hidden=run["h"], heads=run["a"], kv_heads=run["a"],
                                 ffn=4 * run["h"], vocab=51200, seq=2048, position_embeddings=2048,
                                 tied_embeddings=True, biases=True)
        lay = Layout(1, 1, 1, "none", "none", "none", 1, False, run["b"], 1)
        plan = evaluate(shape, lay, profile, run["b"], profile.memory_per_rank)
        rows.append({"layers": run["L"], "hidden": run["h"], "micro_batch": run["b"],
                     "params_m": round(shape.params() / 1e6), "step_s": run["step_s"],
                     "predicted_step_s": plan.prediction.time.step,
                     "step_error": plan.prediction.time.step / run["step_s"] - 1,
                     "peak_gib": run["peak"] / 2**30, "predicted_peak_gib": plan.prediction.memory.peak / 2**30,
                     "memory_error": plan.prediction.memory.peak / run["peak"] - 1})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--gpu-check", help="also compare bench/plan_gpu_check.py's measurements (its JSON)")
    args = parser.parse_args(argv)
    if args.gpu_check:
        for row in gpu_check(args.gpu_check):
            print(f"{row['layers']} layers, hidden {row['hidden']}, micro-batch {row['micro_batch']} "
                  f"({row['params_m']}M): step {row['step_s']:.4f} s measured, {row['predicted_step_s']:.4f} "
                  f"predicted ({row['step_error']:+.1%}); peak {row['peak_gib']:.1f} GiB measured, "
                  f"{row['predicted_peak_gib']:.1f} predicted ({row['memory_error']:+.1%})")
    out = run()
    head = ("params", "GPUs", "t", "p", "d", "published", "predicted", "error", "schedule", "mbs", "GiB", "fits",
            "top pick", "top s", "published s")
    print(" | ".join(head))
    for r in out["rows"]:
        sched = r["schedule"] + (f"x{r['virtual_stages']}" if r["virtual_stages"] > 1 else "")
        print(" | ".join(str(v) for v in (r["params_b"], r["gpus"], r["tensor"], r["pipeline"], r["data"],
                                          r["published_tflops"], r["predicted_tflops"], f"{r['error']:+.1%}", sched,
                                          r["micro_batch_size"], r["memory_gib"], r["fits_80gb"], r["top_pick"],
                                          r["top_step_s"], r["step_s"])))
    print(f"median |error| {out['median_abs_error']:.1%}, worst {out['worst_abs_error']:.1%}, within 20%: "
          f"{out['within_20pct']}/{len(out['rows'])}, fit: {out['fit']}, top pick not slower: {out['top_not_slower']}")
    out["other_runs"] = other_runs()
    for sample in (True, False):
        print("in sample (looked at while shaping the terms):" if sample else "held out (not used to shape them):")
        for r in (r for r in out["other_runs"] if r["in_sample"] == sample):
            unit = "tokens/s per GPU" if r["unit"] == "tokens" else "TFLOP/s per GPU"
            memory = (f" (published {r['published_gib']} GiB, {r['memory_error']:+.1%})" if "published_gib" in r
                      else "")
            ceiling = ", ABOVE CEILING" if r["above_mfu_ceiling"] else ""
            print(f"  {r['run']}: {r['layout']} -> {r['schedule']}x{r['virtual_stages']} mbs {r['micro_batch_size']}, "
                  f"{r['precision']}; published {r['published']}, predicted {r['predicted']} {unit} "
                  f"({r['error']:+.1%}; {r['tflops_per_gpu']} TFLOP/s, MFU {r['mfu']:.1%}{ceiling}), "
                  f"{r['memory_gib']} GiB{memory} of {r['memory_limit_gib']}, fits {r['fits']}, runnable by atorch "
                  f"{r['runnable_by_atorch']}")
        errors = [abs(r["error"]) for r in out["other_runs"] if r["in_sample"] == sample]
        if errors:
            print(f"  median |error| {statistics.median(errors):.1%}, within 20%: {sum(e <= 0.2 for e in errors)}/"
                  f"{len(errors)}, fit: {sum(r['fits'] for r in out['other_runs'] if r['in_sample'] == sample)}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
