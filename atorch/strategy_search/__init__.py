"""Fully automatic mode and ``atorch plan``: three packages, each importing only the ones below it.

* ``search`` (the strategy search): ``space`` (every valid (strategy, micro-batching) candidate, built from the
  method registry), ``candidates`` (the space's valid points with the cost model's predictions, as JSON: what a
  server needs), ``ask_tell`` (ask/tell over an Optuna study and a candidate table, shared by the planner and the
  server), ``planner`` (an Optuna study over the space, seeded by the cost model, judged by dry-runs, cached),
  ``automatic`` / ``entry`` (what ``auto_accelerate`` runs), ``remote`` (the same search over a strategy server's
  study: ``RemotePlanner``, the server's client) and the progress, report and description of a search.
* ``cluster`` (the cluster planner, ``atorch plan``): ``cluster_plan`` (layouts of a transformer on a cluster that
  is not here, ranked by the cost model), ``plan_terms`` (the cost model's transformer terms), ``model_shapes``
  (the shape planned for) and ``precision`` (the precision regimes' bytes per parameter).
* ``costing`` (what both plan with): ``analyser`` (statistics of a model from one sample batch, measured on fake
  tensors: no real compute), ``diagnosis`` (the user's mistakes found by the same fake step, which semi-automatic
  mode checks too), ``hardware`` (a hardware profile, measured by short micro-benchmarks on the ranks and cached on
  disk, or read from a table in ``costing/profiles/``), ``cost_model`` (predicted step time and peak memory) and
  ``tracing`` (memory traced on fake tensors).

The names below are loaded on first use, so importing ``costing`` (as semi-automatic mode does) loads no search
(no Optuna).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BlockStats": "costing.analyser", "LayerStats": "costing.analyser", "ModelStats": "costing.analyser",
    "analyse": "costing.analyser", "fingerprint": "costing.analyser",
    "CollectiveStats": "costing.hardware", "HardwareProfile": "costing.hardware", "load_profile": "costing.hardware",
    "measure_profile": "costing.hardware",
    "SearchState": "search.ask_tell", "CandidateTable": "search.candidates",
    "Planner": "search.planner", "PlanResult": "search.planner", "study_key": "search.planner",
    "Candidate": "search.space", "SearchSpace": "search.space",
}

__all__ = [
    "BlockStats", "CollectiveStats", "HardwareProfile", "LayerStats", "ModelStats", "analyse", "fingerprint",
    "load_profile", "measure_profile", "Planner", "PlanResult", "study_key", "Candidate", "SearchSpace",
    "CandidateTable", "SearchState",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
