"""The search's decisions replayed against a saved exhaustive sweep: no dry-run, no timing noise (one process).

    python bench/search_replay.py --sweeps sweeps.json [--scenarios small,cnn] [--budgets 0.5,0.6,...] \
        [--seeds 5] [--noise 0.1] [--json out.json]

``bench/search.py --sweeps FILE`` measures every candidate of a scenario's space once (the same dry-run as the
search) and keeps the measurements. This script runs the real search loop (``Planner`` over an Optuna study in
memory, with the cost model's predictions from the analyser's statistics and a hardware profile measured here)
but answers each dry-run from that file, so the search's *policy* (its favourites, the per-family corrections,
the skip rule, the sampler, the confirmation) is judged over many budgets and sampler seeds in seconds, apart
from the machine's noise:

* budgets: fractions of plain DDP's measured peak (``--budgets``; ``none`` = no limit). Under each, the sweep's
  best is the fastest candidate that ran and fits;
* per budget and seed: the pick's measured samples/s over the sweep's best (``pick / best``: 0 when the search
  found nothing that fits), the dry-runs it used and how many were wasted (over the budget or failed), and the
  sweep wall time those dry-runs cost against the whole sweep's (``search / sweep``; tracing and set-up are
  not in it: the real search adds ~30 s of tracing, see bench/README.md);
* ``--noise S`` multiplies every replayed samples/s by a log-normal factor (sigma S, per dry-run) to show how
  the policy copes with a noisy machine; the pick is still scored on the sweep's own figures;
* ``--patience``: the search's patience (4, as bench/search.py; ``none``: the search's default, off);
* each policy side by side: ``corrected`` (the search as shipped: per-family time corrections) and ``plain``
  (``correct_time=False``: the cost model's predictions as they are).

Candidates that run one program (zero2 over FSDP2 is fsdp without resharding after forward) are one
candidate in the space; their sweep rows are merged (the faster run, the higher peak). Memory is predicted
analytically here (the search traces its favourites' memory; tracing is left out to keep
the replay fast), so a few more candidates may be predicted to fit than in a real search.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import optuna  # noqa: E402
import search  # noqa: E402

from atorch.strategy_search.costing.analyser import analyse  # noqa: E402
from atorch.strategy_search.costing.cost_model import predict  # noqa: E402
from atorch.strategy_search.costing.hardware import HardwareProfile, measure_profile  # noqa: E402
from atorch.strategy_search.search.automatic import SearchOptions, optimizer_state_factor  # noqa: E402
from atorch.strategy_search.search.outcome import Measured, Predicted  # noqa: E402
from atorch.strategy_search.search.planner import Planner  # noqa: E402
from atorch.strategy_search.search.space import SearchSpace  # noqa: E402

WORLD_SIZE = 2  # the sweeps are measured at 2 ranks
DEFAULT_BUDGETS = "none,0.9,0.8,0.75,0.7,0.65,0.6,0.55,0.5"


class Replay:
    """One scenario's space, predictions and sweep; ``search(budget, seed, ...)`` runs one replayed search."""

    def __init__(self, name: str, rows: dict[str, dict[str, Any]], profile: HardwareProfile) -> None:
        spec = search.SCENARIOS[name]
        parts = search.MODELS[spec["model"]]()
        self.global_batch = spec["global_batch"]
        self.space = SearchSpace(parts["model"], WORLD_SIZE, self.global_batch, loop=spec.get("loop", "user"),
                                 host_offload=False)  # as bench/search.py on a CPU device
        rows = _current_keys(rows)
        self.cands = [c for c in self.space.enumerate() if search.sweep_id(c) in rows]
        if len(self.cands) < len(self.space.enumerate()):
            raise SystemExit(f"{name}: the sweep file lacks {len(self.space.enumerate()) - len(self.cands)} of the "
                             f"space's candidates: run bench/search.py --scenarios {name} --sweeps FILE first")
        self.rows = {c.key: dict(rows[search.sweep_id(c)]) for c in self.cands}
        # A candidate the space leaves out as the same program as a kept one (zero2 over FSDP2 = fsdp without
        # resharding) was swept too: two runs of one program, of which the faster is its time (as the sweep's
        # two passes), and the higher peak its memory.
        for twin, kept in self.space.duplicates():
            other = rows.get(search.sweep_id(twin))
            row = self.rows.get(kept)
            if other is None or row is None or other["status"] != "ok" or row["status"] != "ok":
                continue
            row.update(samples_per_s=max(row["samples_per_s"], other["samples_per_s"]),
                       peak=max(row["peak"], other["peak"]), wall_s=row["wall_s"])
        setup = search.user_setup(parts, self.global_batch)
        batch = _first_batch(parts["dataset"], self.global_batch // WORLD_SIZE)
        stats = analyse(parts["model"], batch, parts["model_input_format"], parts["loss_func"])
        factor = optimizer_state_factor(setup)
        self.predictions = {}
        for c in self.cands:
            pred = predict(stats, c.strategy, c.strategy.layout(WORLD_SIZE), profile, self.global_batch,
                           c.micro_batches, optimizer_state_factor=factor)
            self.predictions[c.key] = Predicted.of(pred.memory.peak, pred.time.step, self.global_batch)
        self.ddp_peak = max(self.rows[c.key]["peak"] for c in self.cands
                            if search.point_of(c)["sharding"] == "ddp" and search.point_of(c)["precision"] == "fp32"
                            and not search.point_of(c)["checkpoint"] and search.data_parallel_only(c))

    def budget(self, fraction: float | None) -> int:
        return int(fraction * self.ddp_peak) if fraction is not None else 2**62

    def best(self, budget: int) -> float:
        return max((r["samples_per_s"] for r in self.rows.values() if r["status"] == "ok" and r["peak"] <= budget),
                   default=0.0)

    def search(self, budget: int, seed: int, noise: float, correct_time: bool, patience: int | None = 4
               ) -> dict[str, Any]:
        rng = random.Random(seed)
        clock = [0.0]
        ran: list[Any] = []

        def measure(cand: Any) -> Measured:
            row = self.rows[cand.key]
            ran.append(cand)
            clock[0] += row["wall_s"]
            sps = row["samples_per_s"] * (math.exp(rng.gauss(0.0, noise)) if noise else 1.0)
            return Measured(status=row["status"], samples_per_s=sps, peak_memory_bytes=float(row["peak"]),
                            step_time_s=self.global_batch / sps if sps else 0.0, reason=row.get("reason") or "")

        options = SearchOptions()
        planner = Planner(self.space, predict=lambda c: self.predictions[c.key], measure=measure,
                          memory_budget=budget, storage=optuna.storages.InMemoryStorage(), study_key="replay",
                          max_trials=options.max_trials, patience=patience, top_k=options.top_k, seed=seed,
                          clock=lambda: clock[0], confirm_within=options.confirm_within,
                          skip_slower_than=options.skip_slower_than, correct_time=correct_time)
        result = planner.search()
        best = self.best(budget)
        pick = result.candidate.key if result.candidate is not None else None
        row = self.rows.get(pick) if pick else None
        picked = row["samples_per_s"] if row and row["status"] == "ok" and row["peak"] <= budget else 0.0
        wasted = sum(self.rows[c.key]["status"] != "ok" or self.rows[c.key]["peak"] > budget for c in ran)
        sweep_s = sum(r["wall_s"] for r in self.rows.values())
        # what ran, in order: description, measured / predicted samples/s, measured peak / budget
        order = [f"{planner.describe(c)}: {self.rows[c.key]['samples_per_s']:.1f} / "
                 f"{self.predictions[c.key].samples_per_s:.1f}, peak {self.rows[c.key]['peak'] / budget:.2f}"
                 for c in ran]
        return {"pick_over_best": picked / best if best else None, "dry_runs": len(ran), "wasted": wasted,
                "search_over_sweep": clock[0] / sweep_s, "ran": order,
                "pick": planner.describe(result.candidate) if result.candidate is not None else None}


def _current_keys(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The sweep's rows keyed as this version of atorch writes a candidate (a strategy saved before a method
    gained an option is read with that option's default), so a sweep outlives such additions."""
    from atorch.strategy import Strategy

    out = {}
    for key, row in rows.items():
        methods, micro_batch_size, micro_batches = json.loads(key)
        strategy = Strategy.load([tuple(m) if isinstance(m, list) else m for m in methods])
        out[json.dumps([strategy.to_list(), micro_batch_size, micro_batches], default=str)] = row
    return out


def _first_batch(dataset: Any, size: int) -> Any:
    import torch.utils.data

    return next(iter(torch.utils.data.DataLoader(dataset, batch_size=size, shuffle=False)))


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [r["pick_over_best"] for r in runs if r["pick_over_best"] is not None]
    return {"median": statistics.median(ratios), "min": min(ratios),
            "at_least_0_95": sum(r >= 0.95 for r in ratios) / len(ratios),
            "dry_runs": statistics.median(r["dry_runs"] for r in runs),
            "wasted_max": max(r["wasted"] for r in runs),
            "search_over_sweep": statistics.median(r["search_over_sweep"] for r in runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweeps", required=True, help="bench/search.py's --sweeps file")
    parser.add_argument("--scenarios", default="small,cnn", help="bench/search.py scenarios (their model and space)")
    parser.add_argument("--budgets", default=DEFAULT_BUDGETS, help="fractions of DDP's measured peak; none = no limit")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--noise", type=float, default=0.0, help="log-normal sigma on each replayed samples/s")
    parser.add_argument("--profile", help="a hardware profile JSON (default: measured here)")
    parser.add_argument("--patience", default="4", help="the search's patience (bench/search.py: 4); none = off")
    parser.add_argument("--json", help="write every run here")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    import logging

    logging.getLogger("atorch").setLevel(logging.WARNING)
    sweeps = json.loads(Path(args.sweeps).read_text())
    profile = (HardwareProfile.model_validate_json(Path(args.profile).read_text()) if args.profile
               else measure_profile())
    budgets = [None if b == "none" else float(b) for b in args.budgets.split(",")]
    patience = None if args.patience == "none" else int(args.patience)
    report: dict[str, Any] = {}
    print("| scenario | budget | policy | pick / best (median, min, share ≥ 0.95) | dry-runs (median) | wasted (max) "
          "| search / sweep (median) |")
    print("|---|---|---|---|---:|---:|---:|")
    for name in args.scenarios.split(","):
        spec = search.SCENARIOS[name]
        replay = Replay(name, sweeps[f"{spec['model']}/{spec['global_batch']}"], profile)
        for fraction in budgets:
            budget = replay.budget(fraction)
            if not replay.best(budget):
                continue  # nothing in the sweep fits: no search can succeed
            label = "none" if fraction is None else f"{fraction:.0%} of DDP"
            for policy, correct in (("plain", False), ("corrected", True)):
                runs = [replay.search(budget, seed, args.noise, correct, patience) for seed in range(args.seeds)]
                s = summarise(runs)
                report[f"{name}/{label}/{policy}"] = {"summary": s, "runs": runs}
                print(f"| {name} | {label} | {policy} | {s['median']:.2f}, {s['min']:.2f}, {s['at_least_0_95']:.0%} "
                      f"| {s['dry_runs']:g} | {s['wasted_max']} | {s['search_over_sweep']:.3f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
