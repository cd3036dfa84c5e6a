"""The planner's cost model on this machine's processes: does it rank the bench's small models as the dry-runs do?

    PYTHONPATH=. python bench/plan_local.py [--sweeps bench/data/sweeps_2026-11-25b.json] \
        [--profile bench/data/profile_cpu_2ranks_2026-11-25b.json] [--json out.json]

``bench/search.py --sweeps`` measured every candidate of each scenario's space once with the search's dry-run
(2 CPU processes, gloo) and saved the hardware profile measured with it (bench/data/). Here every candidate that
ran is predicted from that profile, and Spearman's rank correlation of predicted against measured step time
(global batch / samples per second) is reported, two ways:

* ``search path``: the search's space (``SearchSpace``) and ``cost_model.predict`` from the analyser's statistics
  of the model: what the automatic search ranks its favourites by, and the one cost model ``atorch plan`` calls;
* ``atorch plan`` with a measured profile (GPT-2 only: its config): the model built from its config on the meta
  device and analysed (``model_shapes.analysed_stats``), then the search's ``cost_model.predict``: what
  ``atorch plan CONFIG.json --hardware MEASURED.json`` ranks layouts with;
* ``plan's transformer terms`` (GPT-2 only: a shape): ``plan_terms.predict_transformer``, what ``atorch plan``
  evaluates a layout with for a profile table (a cluster that is not here) or a model it cannot build.

In sample: the cost model's calibrated time constants (FSDP's per-parameter operations, DeepSpeed's) were fitted on
bench/cost_model.py's GPT-2 on this machine, so the GPT-2 figure is not a held-out one; the ResNet's is closer to
one. Nothing here runs a process group: the measurements are the saved ones.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import search  # noqa: E402
from common import spearman  # noqa: E402
from search_replay import WORLD_SIZE, Replay, _current_keys  # noqa: E402

from atorch.strategy import Strategy  # noqa: E402
from atorch.strategy_search.cluster.model_shapes import shape_from_config, stats_of  # noqa: E402
from atorch.strategy_search.cluster.plan_terms import predict_transformer  # noqa: E402
from atorch.strategy_search.costing.cost_model import predict  # noqa: E402
from atorch.strategy_search.costing.hardware import HardwareProfile  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
SCENARIOS = ("small", "cnn")  # GPT-2 (global batch 2) and the ResNet (global batch 4): one sweep each


def search_path(name: str, sweeps: dict[str, Any], profile: HardwareProfile) -> dict[str, Any]:
    spec = search.SCENARIOS[name]
    replay = Replay(name, sweeps[f"{spec['model']}/{spec['global_batch']}"], profile)
    ran = [c for c in replay.cands if replay.rows[c.key]["status"] == "ok"]
    predicted = [replay.predictions[c.key].step_time_s for c in ran]
    measured = [replay.global_batch / replay.rows[c.key]["samples_per_s"] for c in ran]
    return {"model": spec["model"], "global_batch": replay.global_batch, "candidates": len(ran),
            "spearman": spearman(predicted, measured)}


def _gpt2_sweep(sweeps: dict[str, Any], step_s: Callable[[Strategy, int], float]) -> dict[str, Any]:
    """Spearman of ``step_s(strategy, micro_batches)`` against the GPT-2 sweep's measured step times."""
    predicted, measured = [], []
    for key, row in _current_keys(sweeps["gpt2/2"]).items():
        if row["status"] != "ok":
            continue
        methods, _, micro_batches = json.loads(key)
        predicted.append(step_s(Strategy.load([tuple(m) if isinstance(m, list) else m for m in methods]),
                                micro_batches))
        measured.append(2 / row["samples_per_s"])
    return {"model": "gpt2", "candidates": len(predicted), "spearman": spearman(predicted, measured)}


def transformer_path(sweeps: dict[str, Any], profile: HardwareProfile) -> dict[str, Any]:
    """The GPT-2's sweep predicted with the transformer terms of its shape (``atorch plan`` with a profile table)."""
    config = search.MODELS["gpt2"]()["model"].config
    shape = shape_from_config(config.to_dict(), config.n_positions)
    stats = stats_of(shape)
    return _gpt2_sweep(sweeps, lambda strategy, micro_batches: predict_transformer(
        shape, stats, strategy, strategy.layout(WORLD_SIZE), profile, 2, micro_batches).time.step)


def plan_path(sweeps: dict[str, Any], profile: HardwareProfile) -> dict[str, Any]:
    """The GPT-2's sweep predicted as ``atorch plan CONFIG.json --hardware MEASURED.json`` predicts: the model built
    from its config on the meta device and analysed (``analysed_stats``), the search's terms."""
    import tempfile

    from atorch.strategy_search.cluster.model_shapes import analysed_stats

    config = search.MODELS["gpt2"]()["model"].config
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "config.json"
        path.write_text(config.to_json_string())
        stats = analysed_stats(str(path), config.n_positions)
    assert stats is not None
    return _gpt2_sweep(sweeps, lambda strategy, micro_batches: predict(
        stats, strategy, strategy.layout(WORLD_SIZE), profile, 2, micro_batches).time.step)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweeps", default=str(DATA / "sweeps_2026-11-25b.json"))
    parser.add_argument("--profile", default=str(DATA / "profile_cpu_2ranks_2026-11-25b.json"))
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    import logging

    logging.getLogger("atorch").setLevel(logging.WARNING)
    sweeps = json.loads(Path(args.sweeps).read_text())
    profile = HardwareProfile.model_validate_json(Path(args.profile).read_text())
    kept = [n for n in SCENARIOS if f"{search.SCENARIOS[n]['model']}/{search.SCENARIOS[n]['global_batch']}" in sweeps]
    out = {"search_path": [search_path(name, sweeps, profile) for name in kept],
           "plan_measured_profile": plan_path(sweeps, profile),
           "transformer_terms": transformer_path(sweeps, profile)}
    for row in out["search_path"]:
        print(f"search path, {row['model']} (global batch {row['global_batch']}): {row['candidates']} candidates, "
              f"Spearman {row['spearman']:.3f}")
    row = out["plan_measured_profile"]
    print(f"atorch plan CONFIG --hardware MEASURED (the search's terms), gpt2: {row['candidates']} candidates, "
          f"Spearman {row['spearman']:.3f}")
    row = out["transformer_terms"]
    print(f"transformer terms, gpt2: {row['candidates']} candidates, Spearman {row['spearman']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
