"""Shared by the benchmarks: the demo's model and data, timing statistics, and the run's facts."""

from __future__ import annotations

import os
import platform
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# The benchmarks train the same GPT-2 and generated data as examples/train_gpt2.py.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train_gpt2 import SyntheticLanguage, build_gpt2, loss_func  # noqa: E402

__all__ = ["SyntheticLanguage", "Stats", "build_gpt2", "is_main", "loss_func", "machine", "spearman", "stats"]


@dataclass(frozen=True)
class Stats:
    """Summary of repeated timings (seconds)."""

    count: int
    median: float
    mean: float
    minimum: float
    maximum: float
    q1: float
    q3: float

    @property
    def spread(self) -> float:
        """Interquartile range relative to the median."""
        return (self.q3 - self.q1) / self.median if self.median else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "spread": self.spread}


def stats(values: list[float]) -> Stats:
    if not values:
        raise ValueError("no timings to summarise")
    ordered = sorted(values)
    q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else (ordered[0],) * 3
    return Stats(
        count=len(ordered), median=statistics.median(ordered), mean=statistics.fmean(ordered),
        minimum=ordered[0], maximum=ordered[-1], q1=q1, q3=q3,
    )


def _ranks(values: list[float]) -> list[float]:
    """1-based ranks; tied values share the average of their ranks."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties averaged); 0 if either is constant."""
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def machine() -> dict[str, Any]:
    """The facts a reader needs to compare figures between runs."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "omp_threads": torch.get_num_threads(),
    }
