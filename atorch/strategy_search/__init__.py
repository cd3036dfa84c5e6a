"""Fully automatic mode: what the strategy search knows about a model and about the machines.

* ``analyser``: statistics of a model from one sample batch, measured on fake tensors (no real compute).
* ``hardware``: a hardware profile (matmul throughput, collective bandwidth, memory budget), measured by
  short micro-benchmarks on the ranks and cached on disk, or read from a table.
* ``space``: every valid (strategy, micro-batching) candidate, built from the method registry.
* ``candidates``: the space's valid points with the cost model's predictions, as JSON (what a server needs).
* ``ask_tell``: ask/tell over an Optuna study and a candidate table, shared by the planner and the server.
* ``planner``: an Optuna study over the space, seeded by the cost model, judged by dry-runs, cached.
"""

from atorch.strategy_search.analyser import BlockStats, LayerStats, ModelStats, analyse, fingerprint
from atorch.strategy_search.ask_tell import SearchState
from atorch.strategy_search.candidates import CandidateTable
from atorch.strategy_search.hardware import CollectiveStats, HardwareProfile, load_profile, measure_profile
from atorch.strategy_search.planner import Planner, PlanResult, study_key
from atorch.strategy_search.space import Candidate, SearchSpace

__all__ = [
    "BlockStats", "CollectiveStats", "HardwareProfile", "LayerStats", "ModelStats", "analyse", "fingerprint",
    "load_profile", "measure_profile", "Planner", "PlanResult", "study_key", "Candidate", "SearchSpace",
    "CandidateTable", "SearchState",
]
