"""Colossal-AI scripts that used to stop at ``boost``: fp16 under pipeline parallel, tensor × DDP, an older
Gemini's placement policies.

One launch of tests/workers/pp_fp16_worker.py (2 gloo processes): HybridParallelPlugin(pp_size=2) with its default
precision 'fp16' against one process under fp16 autocast with torch's GradScaler, and an overflow injected on
one stage. The translations run here, in one process.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from launcher import HERE, run_json

from atorch.booster.plugin import GeminiPlugin, HybridParallelPlugin
from atorch.errors import StrategyError
from atorch.strategy import Strategy

WORKER = HERE / "workers" / "pp_fp16_worker.py"

# The pipeline runs the reference's fp16 operations on the same micro-batch shapes; the loss scale and 1/m are
# powers of two (exact). What differs is the order of a few fp32 sums (micro-batch gradients, the loss mean),
# a few ulps, which can flip the rounding of an fp16 activation (2^-11 relative) here and there: measured at most
# 3e-6 relative over 4 SGD steps, so 1e-4; a missing unscale (2^8) or a skipped step is far above it.
FP16_PIPELINE_TOL = 1e-4


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return run_json(WORKER, timeout=400)


def ok(report: dict[str, Any], name: str) -> dict[str, Any]:
    entry = report[name]
    assert "error" not in entry, f"{name} failed: {entry['error']}"
    return entry


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_fp16_pipeline_matches_one_process_with_grad_scaler(report: dict[str, Any]) -> None:
    entry = ok(report, "matches_one_process")
    assert entry["methods"] == ["parallel_mode", "amp_native", "pipeline_parallel"] and entry["dtype"] == "fp16"
    reference = entry["reference"]
    assert entry["losses"] == pytest.approx(reference["losses"], rel=FP16_PIPELINE_TOL, abs=0)
    assert entry["losses"][-1] < entry["losses"][0]  # it trains
    # the scale on both stages follows the reference's (2**8, growing every 2 steps without overflow)
    assert [s[0] for s in entry["scales"]] == reference["scales"] == [256.0, 512.0, 512.0, 1024.0]
    assert all(a == b for a, b in entry["scales"])
    assert entry["skipped"] == [0, 0]


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_an_overflow_on_one_stage_skips_the_step_on_every_stage(report: dict[str, Any]) -> None:
    first_stage, last_stage, clean = ok(report, "overflow")["steps"]
    for step, skipped in ((first_stage, 1), (last_stage, 2)):  # inf injected on rank 0, then on rank 1
        assert step["changed"] == [0.0, 0.0], "no rank may step"
        assert step["scale_ratio"] == [0.5, 0.5], "the scale is halved on every stage"
        assert step["skipped"] == [skipped, skipped]
    assert clean["changed"] == [1.0, 1.0] and clean["scale_ratio"] == [1.0, 1.0] and clean["skipped"] == [2, 2]


def test_fp16_is_accepted_with_pipeline_and_mixed_parallel() -> None:
    pp = ("parallel_mode", {"dims": [["pipeline", 2], ["data", -1]]})
    assert Strategy.load([pp, "pipeline_parallel", ("amp_native", {"dtype": "fp16"})]).problems(2) == []
    three_d = ("parallel_mode", {"dims": [["tensor", 2], ["pipeline", 2], ["data", -1]]})
    assert Strategy.load([three_d, "mixed_parallel", "fsdp", ("amp_native", {"dtype": "fp16"})]).problems(8) == []
    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2)  # Colossal-AI's default fp16
    assert plugin.strategy().get("amp_native").dtype == "fp16"
    assert plugin.layout(4).data_size == 2


def test_tensor_parallel_with_data_ranks_runs_as_tensor_times_ddp() -> None:
    plugin = HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32")  # zero_stage=0: replicas of the shards
    assert plugin.layout(4).data_size == 2
    assert plugin.strategy().names() == ["parallel_mode", "tensor_parallel"]
    # ZeRO-1 next to tensor parallel: zero1, which runs as FSDP2 over the data dimension there (zero1.py)
    zero1 = HybridParallelPlugin(tp_size=2, pp_size=1, zero_stage=1)
    assert zero1.layout(4).data_size == 2 and "zero1" in zero1.strategy().names()
    with pytest.raises(StrategyError, match="replicated tensor-parallel stages are not supported; set zero_stage=2"):
        HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=2).layout(8)
    assert HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=2, zero_stage=2).layout(8).data_size == 2


@pytest.mark.parametrize(("policy", "offload"), [("cpu", True), ("cuda", False)])
def test_an_older_gemini_placement_policy_warns_and_places_as_it_named(policy: str, offload: bool) -> None:
    with pytest.warns(UserWarning, match=f"placement_policy='{policy}'.*older Gemini's name") as caught:
        plugin = GeminiPlugin(placement_policy=policy, precision="bf16")
    assert "offload_param_frac=1.0" in str(caught[0].message) if offload else "at 0.0" in str(caught[0].message)
    sharding = plugin.strategy().get("fsdp")
    assert sharding.cpu_offload is offload
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # today's names say nothing
        GeminiPlugin(placement_policy="static", precision="bf16")
    with pytest.raises(StrategyError, match="placement_policy='gpu'.*use 'static' or 'auto'"):
        GeminiPlugin(placement_policy="gpu")
