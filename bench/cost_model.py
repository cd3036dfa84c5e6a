"""Cost model against the dry-run: predicted vs measured peak memory and step time per candidate (2 ranks).

    torchrun --nproc_per_node 2 bench/cost_model.py [--models gpt2,mlp,cnn] [--every 1] [--json out.json]
    python bench/cost_model.py --replay out.json      # predict again from saved measurements (no run)

For a small GPT-2 (bench/search.py's ``small``), the MLP of tests/toy_models.py and a small ResNet
(bench/search.py's ``cnn``), every candidate of the search space (sharding with each implementation, CPU
offload where the device has a host memory, checkpoint, precision fp32 / amp bf16 / amp fp16, micro-batch
size; ``--every K`` keeps every K-th from ``--first``) is measured with the dry-run the search itself uses
(``atorch.dryrun.runner.DryRunSession``):

* peak memory = ``TrialResult.peak_bytes``: the peak increase of live tensor bytes over the baseline taken
  before the candidate is built, over build and warm-up, the maximum over ranks (``PeakMemory``);
* step time = ``TrialResult.step_time_s``: the median of barrier-synchronised steps after warm-up (the
  slowest rank's);
* the prediction is ``atorch.strategy_search.costing.cost_model.predict`` with the analyser's statistics (fake
  tensors) and the hardware profile measured on the same ranks,

so the cost model is held to exactly what the search and bench/search.py compare it with. Prints a
table per model, the median / max relative memory error and Spearman's rank correlation of predicted vs
measured step time (per model and over all). ``--json`` saves the statistics, the profile and every
measurement, so ``--replay`` re-predicts them after a change to the cost model without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
from common import spearman  # noqa: E402
from torch import nn  # noqa: E402

from atorch.strategy import Strategy  # noqa: E402
from atorch.strategy_search.costing.analyser import ModelStats  # noqa: E402
from atorch.strategy_search.costing.cost_model import predict  # noqa: E402
from atorch.strategy_search.costing.hardware import HardwareProfile  # noqa: E402

EXCLUDED = ["half", "module_replace", "tensor_parallel", "pipeline_parallel", "mixed_parallel"]


def mlp() -> dict[str, Any]:
    from toy_models import MLP, mlp_dataset, mlp_loss

    torch.manual_seed(0)
    return {"model": MLP(dim=512, depth=4), "dataset": mlp_dataset(samples=64), "loss_func": mlp_loss,
            "model_input_format": "unpack_sequence"}


# Models no constant of the cost model was fitted on (held out): transformers families from small configs with
# random weights (no download), and two non-transformers models unlike the MLP / ResNet above.
FITTED = ("gpt2", "mlp", "cnn")
SEQ, VOCAB = 64, 1024


def _causal_lm(config: Any, cls: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = cls(config)
    tokens = torch.randint(0, VOCAB, (64, SEQ), generator=torch.Generator().manual_seed(1))
    return {"model": model, "dataset": [{"input_ids": t, "labels": t} for t in tokens],
            "loss_func": lambda data, output: output.loss.float(), "model_input_format": "unpack_dict"}


def llama() -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    return _causal_lm(LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                  use_cache=False), LlamaForCausalLM)


def qwen2() -> dict[str, Any]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _causal_lm(Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                  use_cache=False), Qwen2ForCausalLM)


def phi3() -> dict[str, Any]:
    from transformers import Phi3Config, Phi3ForCausalLM

    return _causal_lm(Phi3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                 num_attention_heads=4, max_position_embeddings=SEQ, pad_token_id=0, bos_token_id=1,
                                 eos_token_id=2, use_cache=False), Phi3ForCausalLM)


def gemma() -> dict[str, Any]:
    from transformers import GemmaConfig, GemmaForCausalLM

    return _causal_lm(GemmaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                  max_position_embeddings=SEQ, use_cache=False), GemmaForCausalLM)


def neox() -> dict[str, Any]:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return _causal_lm(GPTNeoXConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                                    num_attention_heads=4, max_position_embeddings=SEQ, use_cache=False),
                      GPTNeoXForCausalLM)


def opt() -> dict[str, Any]:
    from transformers import OPTConfig, OPTForCausalLM

    return _causal_lm(OPTConfig(vocab_size=VOCAB, hidden_size=128, ffn_dim=512, num_hidden_layers=4,
                                num_attention_heads=4, max_position_embeddings=SEQ, word_embed_proj_dim=128,
                                dropout=0.0, use_cache=False), OPTForCausalLM)


def bert() -> dict[str, Any]:
    from transformers import BertConfig, BertForMaskedLM

    return _causal_lm(BertConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                                 num_attention_heads=4, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0), BertForMaskedLM)


def vgg() -> dict[str, Any]:
    from toy_models import SmallVGG

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    images, labels = torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
    return {"model": SmallVGG(), "dataset": list(zip(images, labels, strict=True)),
            "loss_func": lambda data, output: nn.functional.cross_entropy(output, data[1]),
            "model_input_format": "unpack_sequence"}


class LSTMTagger(nn.Module):
    """Embedding, a 2-layer LSTM and a per-token classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 128)
        self.lstm = nn.LSTM(128, 256, num_layers=2, batch_first=True)
        self.head = nn.Linear(256, 32)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.lstm(self.embed(x))[0])


def lstm() -> dict[str, Any]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    tokens, tags = torch.randint(0, VOCAB, (64, 32), generator=g), torch.randint(0, 32, (64, 32), generator=g)
    return {"model": LSTMTagger(), "dataset": list(zip(tokens, tags, strict=True)),
            "loss_func": lambda data, output: nn.functional.cross_entropy(output.flatten(0, 1), data[1].flatten()),
            "model_input_format": "unpack_sequence"}


def builders() -> dict[str, Any]:
    import search

    return {"gpt2": search.MODELS["gpt2"], "mlp": mlp, "cnn": search.cnn, "llama": llama,
            "qwen2": qwen2, "phi3": phi3, "gemma": gemma, "neox": neox, "opt": opt, "bert": bert, "vgg": vgg,
            "lstm": lstm}


# ----- measuring ---------------------------------------------------------------------------------------

def measure(name: str, args: argparse.Namespace, env: Any, profile: HardwareProfile) -> dict[str, Any]:
    import search

    from atorch.dryrun.runner import DryRunSession
    from atorch.strategy_search.costing.analyser import analyse
    from atorch.strategy_search.search.automatic import optimizer_state_factor, sample_batch
    from atorch.strategy_search.search.describe import describe_candidate
    from atorch.strategy_search.search.space import SearchSpace

    parts = builders()[name]()
    setup = search.user_setup(parts, args.global_batch)
    stats = analyse(parts["model"], sample_batch(setup, env, args.global_batch // env.world_size),
                    parts["model_input_format"], parts["loss_func"])
    excluded = [m for m in EXCLUDED if not (args.tensor_parallel and m == "tensor_parallel")]
    cands = SearchSpace(parts["model"], env.world_size, args.global_batch, excluded=excluded,
                        host_offload=env.device.type != "cpu").enumerate()
    cands = cands[args.first:: args.every]
    traced: dict[str, Any] = {}
    if env.rank == 0 and not args.no_trace:  # as the search does: rank 0 traces while the others wait
        from atorch.strategy_search.costing.tracing import MemoryTracer

        tracer = MemoryTracer(setup, sample_batch(setup, env, args.global_batch // env.world_size),
                              env.world_size, env.device)
        traced = tracer.trace_candidates(cands)
    session = DryRunSession(setup, env, warmup=args.warmup, steps=args.steps, rejoin_timeout_s=1200)

    def run(cand: Any) -> Any:
        dp = cand.strategy.layout(env.world_size).data_size
        return session.run(cand.strategy, timeout_s=600, micro_batches=cand.micro_batches,
                           batch_size=cand.micro_batch_size * dp)

    rows = []
    for cand in cands:
        trial = run(cand)
        rows.append({"candidate": describe_candidate(cand.strategy, cand.micro_batch_size, cand.micro_batches,
                                                     env.world_size), "strategy": cand.strategy.to_list(),
                     "micro_batches": cand.micro_batches, "micro_batch_size": cand.micro_batch_size,
                     "status": trial.status, "reason": trial.reason, "peak": trial.peak_bytes,
                     "step_s": trial.step_time_s, "step_s_passes": [trial.step_time_s],
                     **_traced_fields(traced.get(cand.key))})
    # Further passes, alternately in reverse order, so that a burst of load on a shared machine or a slow drift
    # hits different candidates in each pass; each keeps its fastest pass (the least disturbed).
    for repeat in range(1, args.repeats):
        order = list(zip(cands, rows, strict=True))
        for cand, row in (reversed(order) if repeat % 2 else order):
            if row["status"] == "ok" and row["step_s"]:
                again = run(cand)
                if again.status == "ok" and again.step_time_s:
                    row["step_s_passes"].append(again.step_time_s)
                    row["step_s"] = min(row["step_s_passes"])
    session.close()
    return {"stats": stats.model_dump(mode="json"), "optimizer_state_factor": optimizer_state_factor(setup),
            "rows": rows}


def _traced_fields(found: Any) -> dict[str, Any]:
    if found is None:
        return {}
    if isinstance(found, str):
        return {"traced": None, "trace_reason": found}
    return {"traced": found.peak, "trace_s": found.seconds, "trace_breakdown": found.to_json()}


# ----- predicting and reporting ------------------------------------------------------------------------

def evaluate(report: dict[str, Any]) -> dict[str, Any]:
    """Predict every measured candidate of ``report`` and summarise the errors (also used by --replay).

    The memory prediction is the search's: the traced peak where the candidate was traced (rank 0 traced it
    before the dry-runs, saved in the row), else the analytical one; the analytical error is shown beside it.
    """
    profile = HardwareProfile.model_validate(report["profile"])
    world, global_batch = report["world_size"], report["global_batch"]
    summary: dict[str, Any] = {}
    groups: dict[str, dict[str, list[float]]] = {}
    all_pred, all_meas = [], []
    for name, model in report["models"].items():
        stats = ModelStats.model_validate(model["stats"])
        lines = []
        errors, analytical, pred_s, meas_s, trace_s = [], [], [], [], []
        for row in model["rows"]:
            if row["status"] != "ok" or not row["step_s"]:
                continue
            strategy = Strategy.load(row["strategy"])
            pred = predict(stats, strategy, strategy.layout(world), profile, global_batch,
                           row["micro_batches"], optimizer_state_factor=model["optimizer_state_factor"])
            memory = row.get("traced") or pred.memory.peak
            err = (memory - row["peak"]) / row["peak"]
            errors.append(abs(err))
            analytical.append(abs(pred.memory.peak - row["peak"]) / row["peak"])
            if row.get("trace_s"):
                trace_s.append(row["trace_s"])
            pred_s.append(pred.time.step)
            meas_s.append(row["step_s"])
            how = "traced" if row.get("traced") else "analytical"
            lines.append(f"{row['candidate'][:44]:<45}{row['micro_batch_size']:>4}{memory / 2**20:>9.2f}"
                         f"{row['peak'] / 2**20:>9.2f}{100 * err:>7.1f}%{100 * analytical[-1]:>7.1f}%"
                         f"{pred.time.step:>9.4f}{row['step_s']:>9.4f}  {how}")
        if not errors:
            print(f"\n{name}: no candidate ran")
            continue
        rho = spearman(pred_s, meas_s) if len(pred_s) > 1 else float("nan")
        group = "fitted" if name in FITTED else "held-out"
        summary[name] = {"group": group, "candidates": len(errors), "mem_err_median": statistics.median(errors),
                         "mem_err_max": max(errors), "analytical_err_median": statistics.median(analytical),
                         "analytical_err_max": max(analytical), "time_spearman": rho,
                         "trace_s_median": statistics.median(trace_s) if trace_s else None}
        print(f"\n{name} ({group}): {len(errors)} candidates, global batch {global_batch}, {world} ranks")
        print(f"{'candidate':<45}{'mbs':>4}{'pred MiB':>9}{'meas MiB':>9}{'err':>8}{'analyt':>8}{'pred s':>9}"
              f"{'meas s':>9}  memory")
        print("\n".join(lines))
        s = summary[name]
        print(f"memory error median {100 * s['mem_err_median']:.1f}% max {100 * s['mem_err_max']:.1f}% "
              f"(analytical alone: {100 * s['analytical_err_median']:.1f}% / {100 * s['analytical_err_max']:.1f}%); "
              f"Spearman(step time) {rho:.3f}"
              + (f"; trace {s['trace_s_median']:.2f} s per candidate (median)" if trace_s else ""))
        g = groups.setdefault(group, {"err": [], "analytical": [], "pred_s": [], "meas_s": []})
        g["err"] += errors
        g["analytical"] += analytical
        g["pred_s"] += pred_s
        g["meas_s"] += meas_s
        all_pred += pred_s
        all_meas += meas_s
    print()
    for group, g in groups.items():
        summary[group] = {"mem_err_median": statistics.median(g["err"]), "mem_err_max": max(g["err"]),
                          "analytical_err_median": statistics.median(g["analytical"]),
                          "analytical_err_max": max(g["analytical"]), "candidates": len(g["err"]),
                          "time_spearman": spearman(g["pred_s"], g["meas_s"]) if len(g["pred_s"]) > 1 else None}
        print(f"{group} models: {len(g['err'])} candidates, memory error median "
              f"{100 * statistics.median(g['err']):.1f}% max {100 * max(g['err']):.1f}% (analytical alone: "
              f"{100 * statistics.median(g['analytical']):.1f}% / {100 * max(g['analytical']):.1f}%); "
              f"Spearman(step time) {summary[group]['time_spearman'] or float('nan'):.3f}")
    if len(all_pred) > 1:
        summary["all"] = {"time_spearman": spearman(all_pred, all_meas)}
        print(f"Spearman(step time, all models) {summary['all']['time_spearman']:.3f}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,mlp,cnn,llama,qwen2,phi3,gemma,neox,opt,bert,vgg,lstm")
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--every", type=int, default=1, help="measure every K-th candidate of the space")
    parser.add_argument("--first", type=int, default=0, help="with --every: the index of the first candidate measured")
    parser.add_argument("--warmup", type=int, default=2, help="as the search: step 2 is the first with optimizer state")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3,
                        help="time every candidate this many times (alternating order), keep its fastest")
    parser.add_argument("--json", default="", help="save statistics, profile and measurements here")
    parser.add_argument("--replay", default="", help="predict the measurements saved by --json (no run)")
    parser.add_argument("--no-trace", action="store_true", help="analytical memory only (no fake-tensor trace)")
    parser.add_argument("--tensor-parallel", action="store_true",
                        help="keep tensor parallel in the space (its DTensor dispatch is priced from the profile)")
    args = parser.parse_args()
    if args.replay:
        evaluate(json.loads(Path(args.replay).read_text()))
        return


    from atorch.distributed import init_distributed, shutdown
    from atorch.strategy_search.costing.hardware import measure_profile

    env = init_distributed()
    profile = measure_profile()
    report: dict[str, Any] = {"world_size": env.world_size, "global_batch": args.global_batch,
                              "profile": profile.model_dump(mode="json"), "models": {}}
    for name in args.models.split(","):
        report["models"][name] = measure(name, args, env, profile)
        if env.rank == 0 and args.json:  # after each model: a later failure keeps what was measured
            Path(args.json).write_text(json.dumps(report, indent=1))
    if env.rank == 0:
        evaluate(report)
    shutdown()  # ranks meet before gloo closes its connections (a lone teardown can abort a peer)


if __name__ == "__main__":
    main()
