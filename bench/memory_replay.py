"""The cost model's peak memory against the peaks a sweep measured, predicted again with no run (one process).

    PYTHONPATH=. python bench/memory_replay.py --sweeps bench/data/sweeps_2026-11-30-held-out-3.json \
        [--models dinov2,gpt_bigcode] [--tensor-parallel] [--rows] [--correction-transfer]

Each model of the sweep file (bench/search.py's sweeps: ``model/global batch`` -> candidate key -> measured) is
built as bench/search.py builds it and analysed on fake tensors as the search analyses it; every swept candidate that
measured a peak is predicted again (``cost_model.predict``, 2 ranks, the profile given) and its error is
``predicted / measured - 1``. Printed per model, checkpoint rows apart: the count, the median, the worst over and
under, and the mean |error|. Pipeline and expert-parallel rows are left out (their peaks are per stage / per expert
rank); tensor-parallel rows with ``--tensor-parallel``. A change to the memory model is judged here in seconds
before a bench run judges the search. ``--correction-transfer``: whether a family's measured memory error, taken from
another precision, stands for a row's as well as its own precision's does (``correction_transfer``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

WORLD = 2
LEFT_OUT = ("pipeline_parallel", "expert_parallel")


PRECISION_METHODS = ("amp_native", "half", "fp8")


def precision_of(items: list[Any]) -> str:
    """A candidate's compute precision as the search names it: fp32, or the precision method and its dtype."""
    for name, config in items:
        if name in PRECISION_METHODS:
            return f"{name}:{(config or {}).get('dtype', 'fp16' if name == 'amp_native' else 'bf16')}"
    return "fp32"


def correction_transfer(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """How well one precision's measured memory error stands for another's in the same memory family (the methods
    without the precision one), as the search applies it (``SearchState.correction``: a row's figure times the
    largest measured / predicted of the family's other measured rows, at least 1). Per source: another precision of
    the other width (fp32 for 16-bit and back), another precision of the same width, the same precision at another
    micro-batch size; each value is the corrected figure over the row's measured peak, minus 1 (over 0: the row is
    judged bigger than it is)."""
    def source(row: dict[str, Any], other: dict[str, Any]) -> str:
        mine, theirs = row["precision"], other["precision"]
        if mine == theirs:
            return "same precision"
        return "same width" if (mine == "fp32") == (theirs == "fp32") else "other width"

    families: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        family = json.dumps([m for m in row["methods"] if m not in PRECISION_METHODS])
        families.setdefault(family, []).append(row)
    out: dict[str, list[float]] = {"other width": [], "same width": [], "same precision": []}
    for members in families.values():
        for i, row in enumerate(members):
            ratio = 1.0 / (1.0 + row["error"])  # measured / predicted
            for kind, values in out.items():
                ratios = [1.0 / (1.0 + r["error"]) for j, r in enumerate(members) if j != i and source(row, r) == kind]
                if ratios:
                    values.append(max(1.0, *ratios) / ratio - 1.0)
    return out


TUNED_MODELS = ("gpt2", "cnn")  # bench/search.py's tuned families: every other model of the sweeps is held out


def close_call_outcomes(errors: list[float], band: float = 0.08) -> tuple[float, float]:
    """How a close call's dry-run ends, from the memory model's errors (figure / measured - 1) over a model's swept
    peaks, its distance from the budget spread evenly over the band: the share of those predicted over the budget by
    under ``band`` that run out of memory, and of those predicted under it by under ``band`` that run out too (the
    chances behind ``automatic.TRACE_PER_STOPPED_RUN``). A figure over the budget by ``o`` fits where the model was
    ``o`` or more too high; one under it by ``u`` does not where the model was more than ``u`` too low."""
    grid = [band * (i + 0.5) / 80 for i in range(80)]
    over = statistics.mean(sum(e < o for e in errors) / len(errors) for o in grid)
    under = statistics.mean(sum(e < -u for e in errors) / len(errors) for u in grid)
    return over, under


def replay(key: str, sweep: dict[str, Any], profile: Any, tensor_parallel: bool) -> list[dict[str, Any]]:
    """One model's swept candidates, predicted again: their methods, micro-batching and error."""
    import search

    from atorch.distributed import DistEnv
    from atorch.strategy import Strategy
    from atorch.strategy_search.costing.analyser import analyse
    from atorch.strategy_search.costing.cost_model import predict
    from atorch.strategy_search.search.automatic import optimizer_state_factor, sample_batch

    name, global_batch = key.split("/")[0], int(key.split("/")[1])
    parts = search.MODELS[name]()
    setup = search.user_setup(parts, global_batch)
    env = DistEnv(rank=0, world_size=WORLD, local_rank=0, device=torch.device("cpu"), backend="gloo")
    stats = analyse(parts["model"], sample_batch(setup, env, global_batch // WORLD), parts["model_input_format"],
                    parts["loss_func"])
    rows = []
    for candidate, measured in sweep.items():
        items, micro_batch_size, micro_batches = json.loads(candidate)
        names = [n for n, _ in items]
        if not measured.get("peak") or any(n in names for n in LEFT_OUT) or (
                "tensor_parallel" in names and not tensor_parallel):
            continue
        strategy = Strategy.load(items)
        pred = predict(stats, strategy, strategy.layout(WORLD), profile, global_batch, micro_batches,
                       optimizer_state_factor=optimizer_state_factor(setup))
        methods = [n + ("(deepspeed)" if (config or {}).get("implementation") == "deepspeed" else "")
                   for n, config in items[1:]]
        rows.append({"methods": methods, "micro_batch_size": micro_batch_size, "micro_batches": micro_batches,
                     "checkpoint": "checkpoint" in names, "error": pred.memory.peak / measured["peak"] - 1,
                     "precision": precision_of(items)})
    return rows


def main() -> None:
    from atorch.strategy_search.costing.hardware import HardwareProfile

    parser = argparse.ArgumentParser()
    parser.add_argument("--sweeps", type=Path, nargs="+", required=True, help="bench/search.py sweep files")
    parser.add_argument("--models", help="comma-separated model names (default: every model in the files)")
    parser.add_argument("--profile", type=Path, default=HERE / "data" / "profile_cpu_2ranks_2026-11-25b.json")
    parser.add_argument("--tensor-parallel", action="store_true", help="include the tensor-parallel rows")
    parser.add_argument("--rows", action="store_true", help="print every row, worst under first")
    parser.add_argument("--close-calls", action="store_true",
                        help="how often a close call's dry-run runs out of memory (close_call_outcomes)")
    parser.add_argument("--correction-transfer", action="store_true",
                        help="how one precision's measured error corrects another's (correction_transfer)")
    args = parser.parse_args()
    profile = HardwareProfile.model_validate(json.loads(args.profile.read_text()))
    sweeps: dict[str, Any] = {}
    for path in args.sweeps:
        sweeps.update(json.loads(path.read_text()))
    wanted = set(args.models.split(",")) if args.models else None
    transfer: dict[str, list[float]] = {}
    model_errors: dict[str, list[float]] = {}
    for key, sweep in sweeps.items():
        if wanted is not None and key.split("/")[0] not in wanted:
            continue
        rows = replay(key, sweep, profile, args.tensor_parallel)
        model_errors[key.split("/")[0]] = [r["error"] for r in rows]
        for recompute in (False, True):
            errors = [r["error"] for r in rows if r["checkpoint"] == recompute]
            if errors:
                print(f"{key:16s} checkpoint={recompute!s:5s} rows {len(errors):3d}  median "
                      f"{statistics.median(errors):+.3f}  worst over {max(errors):+.3f}  worst under "
                      f"{min(errors):+.3f}  mean |error| {statistics.mean(map(abs, errors)):.3f}")
        for source, values in (correction_transfer(rows) if args.correction_transfer else {}).items():
            transfer.setdefault(source, []).extend(values)
        if args.rows:
            for row in sorted(rows, key=lambda r: r["error"]):
                print(f"    {row['error']:+.3f}  {', '.join(row['methods']) or 'ddp'}  "
                      f"mbs {row['micro_batch_size']} x {row['micro_batches']}")

    if args.close_calls:
        print("a close call's dry-run runs out of memory (within 8% of the budget, by the figure's side):")
        for label, models in (("tuned: gpt2, cnn", [m for m in model_errors if m in TUNED_MODELS]),
                              ("held out", [m for m in model_errors if m not in TUNED_MODELS]),
                              *((m, [m]) for m in model_errors)):
            pooled = [e for m in models for e in model_errors[m]]
            if pooled:
                over, under = close_call_outcomes(pooled)
                print(f"  {label:16s} rows {len(pooled):4d}  predicted over: {over:.2f}  predicted under: {under:.2f}")
    if args.correction_transfer:
        print("a family's memory correction taken from (corrected figure / measured peak - 1, every row):")
        for source, values in transfer.items():
            if values:
                values = sorted(values)
                print(f"  {source:15s} rows {len(values):4d}  median {statistics.median(values):+.3f}  90th percentile "
                      f"{values[int(0.9 * len(values))]:+.3f}  worst over {values[-1]:+.3f}  worst under "
                      f"{values[0]:+.3f}  over +5%: {sum(v > 0.05 for v in values) / len(values):.0%}")


if __name__ == "__main__":
    main()
