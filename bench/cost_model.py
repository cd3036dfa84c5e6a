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
* the prediction is ``atorch.strategy_search.cost_model.predict`` with the analyser's statistics (fake
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

from atorch.parallel_layout import ParallelLayout  # noqa: E402
from atorch.strategy import Strategy  # noqa: E402
from atorch.strategy_search.analyser import ModelStats  # noqa: E402
from atorch.strategy_search.cost_model import predict  # noqa: E402
from atorch.strategy_search.hardware import HardwareProfile  # noqa: E402

EXCLUDED = ["half", "module_replace", "tensor_parallel", "pipeline_parallel", "mixed_parallel"]


def mlp() -> dict[str, Any]:
    from toy_models import MLP, mlp_dataset, mlp_loss

    torch.manual_seed(0)
    return {"model": MLP(dim=512, depth=4), "dataset": mlp_dataset(samples=64), "loss_func": mlp_loss,
            "model_input_format": "unpack_sequence"}


def builders() -> dict[str, Any]:
    import search

    return {"gpt2": search.SCENARIOS["small"]["build"], "mlp": mlp, "cnn": search.cnn}


# ----- measuring ---------------------------------------------------------------------------------------

def measure(name: str, args: argparse.Namespace, env: Any, profile: HardwareProfile) -> dict[str, Any]:
    import search

    from atorch.dryrun.runner import DryRunSession
    from atorch.strategy_search.analyser import analyse
    from atorch.strategy_search.automatic import _sample_batch, optimizer_state_factor
    from atorch.strategy_search.describe import describe_candidate
    from atorch.strategy_search.space import SearchSpace

    parts = builders()[name]()
    setup = search.user_setup(parts, args.global_batch)
    stats = analyse(parts["model"], _sample_batch(setup, env, args.global_batch // env.world_size),
                    parts["model_input_format"], parts["loss_func"])
    cands = SearchSpace(parts["model"], env.world_size, args.global_batch, excluded=EXCLUDED,
                        host_offload=env.device.type != "cpu").enumerate()
    cands = cands[args.first:: args.every]
    session = DryRunSession(setup, env, warmup=args.warmup, steps=args.steps, rejoin_timeout_s=1200)
    rows = []
    for cand in cands:
        dp = ParallelLayout.of(cand.strategy, env.world_size).data_size
        trial = session.run(cand.strategy, timeout_s=600, micro_batches=cand.micro_batches,
                            batch_size=cand.micro_batch_size * dp)
        rows.append({"candidate": describe_candidate(cand.strategy, cand.micro_batch_size, cand.micro_batches,
                                                     env.world_size), "strategy": cand.strategy.to_list(),
                     "micro_batches": cand.micro_batches, "micro_batch_size": cand.micro_batch_size,
                     "status": trial.status, "reason": trial.reason, "peak": trial.peak_bytes,
                     "step_s": trial.step_time_s})
    session.close()
    return {"stats": stats.model_dump(mode="json"), "optimizer_state_factor": optimizer_state_factor(setup),
            "rows": rows}


# ----- predicting and reporting ------------------------------------------------------------------------

def evaluate(report: dict[str, Any]) -> dict[str, Any]:
    """Predict every measured candidate of ``report`` and summarise the errors (also used by --replay)."""
    profile = HardwareProfile.model_validate(report["profile"])
    world, global_batch = report["world_size"], report["global_batch"]
    summary: dict[str, Any] = {}
    all_err, all_pred, all_meas = [], [], []
    for name, model in report["models"].items():
        stats = ModelStats.model_validate(model["stats"])
        lines = []
        errors, pred_s, meas_s = [], [], []
        for row in model["rows"]:
            if row["status"] != "ok" or not row["step_s"]:
                continue
            strategy = Strategy.load(row["strategy"])
            pred = predict(stats, strategy, ParallelLayout.of(strategy, world), profile, global_batch,
                           row["micro_batches"], optimizer_state_factor=model["optimizer_state_factor"])
            err = (pred.memory.peak - row["peak"]) / row["peak"]
            errors.append(abs(err))
            pred_s.append(pred.time.step)
            meas_s.append(row["step_s"])
            lines.append(f"{row['candidate'][:44]:<45}{row['micro_batch_size']:>4}{pred.memory.peak / 2**20:>9.2f}"
                         f"{row['peak'] / 2**20:>9.2f}{100 * err:>7.1f}%{pred.time.step:>9.4f}{row['step_s']:>9.4f}"
                         f"  {pred.memory.peak_phase}")
        if not errors:
            print(f"\n{name}: no candidate ran")
            continue
        rho = spearman(pred_s, meas_s)
        ratio = [p / m for p, m in zip(pred_s, meas_s, strict=True)]
        summary[name] = {"candidates": len(errors), "mem_err_median": statistics.median(errors),
                         "mem_err_max": max(errors), "time_spearman": rho,
                         "time_ratio_median": statistics.median(ratio), "time_ratio_min": min(ratio),
                         "time_ratio_max": max(ratio)}
        print(f"\n{name}: {len(errors)} candidates, global batch {global_batch}, {world} ranks")
        print(f"{'candidate':<45}{'mbs':>4}{'pred MiB':>9}{'meas MiB':>9}{'err':>8}{'pred s':>9}{'meas s':>9}  phase")
        print("\n".join(lines))
        s = summary[name]
        print(f"memory error median {100 * s['mem_err_median']:.1f}% max {100 * s['mem_err_max']:.1f}%; "
              f"Spearman(step time) {rho:.3f}; predicted / measured step time median {s['time_ratio_median']:.2f} "
              f"(min {s['time_ratio_min']:.2f}, max {s['time_ratio_max']:.2f})")
        all_err += errors
        all_pred += pred_s
        all_meas += meas_s
    summary["all"] = {"mem_err_median": statistics.median(all_err), "mem_err_max": max(all_err),
                      "time_spearman": spearman(all_pred, all_meas)}
    print(f"\nall: memory error median {100 * statistics.median(all_err):.1f}% max {100 * max(all_err):.1f}%; "
          f"Spearman(step time, all models) {summary['all']['time_spearman']:.3f}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,mlp,cnn")
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--every", type=int, default=1, help="measure every K-th candidate of the space")
    parser.add_argument("--first", type=int, default=0, help="with --every: the index of the first candidate measured")
    parser.add_argument("--warmup", type=int, default=2, help="as the search: step 2 is the first with optimizer state")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default="", help="save statistics, profile and measurements here")
    parser.add_argument("--replay", default="", help="predict the measurements saved by --json (no run)")
    args = parser.parse_args()
    if args.replay:
        evaluate(json.loads(Path(args.replay).read_text()))
        return

    import torch.distributed as dist

    from atorch.distributed import init_distributed
    from atorch.strategy_search.hardware import measure_profile

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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
