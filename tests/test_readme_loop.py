"""The README's training loop (accumulation, clipping, epochs), copied literally, trains correctly
under every strategy: replicas stay equal and the weights match a single-process reference."""

from __future__ import annotations

from typing import Any

import pytest
from launcher import HERE, run_json
from workers.readme_loop_worker import STRATEGIES

WORKER = HERE / "workers" / "readme_loop_worker.py"
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

# fp32: the strategies only reorder fp32 sums. A gradient element then differs by about
# n·2^-24·|g| (n ≤ 64 summed terms, |g| ≤ 1 after clipping to norm 1), and each of the 8 SGD steps
# (lr 0.1) moves a weight by lr·g, so weights may differ by 8·0.1·64·2^-24 ≈ 3e-6 plus the small
# feedback of that difference through later gradients: 2e-5 leaves a margin of about 6.
FP32_ATOL = 2e-5
# fp16 autocast: matmuls round to fp16 (2^-11 relative) before the fp32 update: 8·0.1·2^-11 ≈ 4e-4,
# with the same margin.
FP16_ATOL = 3e-3


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return run_json(WORKER, timeout=540)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_readme_loop_trains_like_one_process(report: dict[str, Any], strategy: str) -> None:
    entry = report["strategies"][strategy]
    assert "error" not in entry, entry["error"]
    assert entry["replica_gap"] == 0.0, f"ranks hold different weights: {entry['replica_gap']}"
    assert report["moved"] > 100 * FP32_ATOL, "training must move the weights for the comparison to mean much"
    tolerance = FP16_ATOL if "fp16" in strategy else FP32_ATOL
    assert entry["max_diff"] <= tolerance, entry["max_diff"]
