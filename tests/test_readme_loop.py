"""The README's training loop (accumulation, clipping, epochs), copied literally, trains correctly under every
family of the default search space: replicas stay equal and the weights match a single-process reference.

The families come from the space itself (tests/workers/readme_loop_worker.py): a method or layout the search
can pick is in this test without editing it.
"""

from __future__ import annotations

from typing import Any

import pytest
from launcher import HERE, run_json
from workers.readme_loop_worker import CASES

WORKER = HERE / "workers" / "readme_loop_worker.py"
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

# fp32: the strategies only reorder fp32 sums. A gradient element then differs by about
# n·2^-24·|g| (n ≤ 64 summed terms, |g| ≤ 1 after clipping to norm 1), and each of the 8 SGD steps
# (lr 0.1) moves a weight by lr·g, so weights may differ by 8·0.1·64·2^-24 ≈ 3e-6 plus the small
# feedback of that difference through later gradients: 2e-5 leaves a margin of about 6.
FP32_ATOL = 2e-5
# 16-bit autocast: matmuls round to fp16 (2^-11 relative) or bf16 (2^-8) before the fp32 update:
# 8·0.1·2^-11 ≈ 4e-4 and 8·0.1·2^-8 ≈ 3e-3, each with a margin of about 8.
FP16_ATOL, BF16_ATOL = 3e-3, 2.5e-2


@pytest.fixture(scope="module", params=list(CASES))
def report(request: pytest.FixtureRequest) -> dict[str, Any]:
    return {"case": request.param, **run_json(WORKER, request.param, nproc=CASES[request.param], timeout=840)}


def test_readme_loop_trains_like_one_process_under_every_family(report: dict[str, Any]) -> None:
    entries = report["strategies"]
    errors = {name: e["error"] for name, e in entries.items() if "error" in e}
    assert not errors, errors
    assert report["moved"] > 100 * FP32_ATOL, "training must move the weights for the comparison to mean much"
    for name, entry in entries.items():
        assert entry["replica_gap"] == 0.0, f"{name}: ranks hold different weights: {entry['replica_gap']}"
        tolerance = FP16_ATOL if "fp16" in name else BF16_ATOL if "bf16" in name else FP32_ATOL
        assert entry["max_diff"] <= tolerance, (name, entry["max_diff"])


def test_the_families_cover_the_space(report: dict[str, Any]) -> None:
    names = list(report["strategies"])
    text = " ".join(names)
    assert all(s in text for s in ('"ddp"', '"zero2"', '"fsdp"', '"amp_bf16"', '"checkpoint": true')), names
    if report["case"] == "mlp":
        assert '"zero1"' in text and '"deepspeed"' in text and '"amp_fp16"' in text
    else:  # tensor parallel beside and under sharding: the layout that once broke clipping (two meshes)
        assert '"tensor": 2' in text and '"tensor": 4' in text
        assert any('"tensor": 2' in n and '"fsdp"' in n for n in names)
        assert '"context": 2' in text and '"context": 4' in text  # long sequences: context parallel too
        assert any('"context": 2' in n and '"fsdp"' in n for n in names)
        assert any('"tensor": 2' in n and '"context": 2' in n for n in names)  # tensor × context
