"""Stand-ins for the cost model's prediction and the dry-run's result, as the planner reads them (by
attribute), for planner tests that script both."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Pred:
    peak_memory_bytes: float
    step_time_s: float


@dataclass
class Run:
    status: str
    samples_per_s: float
    peak_memory_bytes: float
    reason: str = ""
