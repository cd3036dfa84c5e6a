"""The hardware profile: measured on 2 real ranks (gloo), the same on both, cached; tables round-trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from launcher import HERE, run_json

from atorch.strategy_search.costing import hardware
from atorch.strategy_search.costing.hardware import (
    ALL_TO_ALL,
    ALL_TO_ALL_FALLBACK,
    COLLECTIVES,
    PROFILES_DIR,
    HardwareProfile,
    cache_path,
    load_profile,
    measure_profile,
    profile_names,
)

WORKER = HERE / "workers" / "hardware_worker.py"


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_profile_on_two_ranks(tmp_path: Path) -> None:
    result = run_json(WORKER, str(tmp_path), nproc=2, timeout=240)
    ranks = result["ranks"]
    assert ranks[0]["profiles"] == ranks[1]["profiles"], "every rank must plan with the same numbers"
    profiles = ranks[0]["profiles"]
    first = HardwareProfile.model_validate(profiles["first"])
    assert first.source == "measured" and first.world_size == 2 and first.backend == "gloo"
    assert first.device_type == "cpu" and first.memory_source == "ram"
    # Plausible for any CPU: more than a GFLOP/s, less than 10 TFLOP/s (a large server's fp32 peak).
    assert set(first.matmul_tflops) == {"float32", "bfloat16", "float16"}
    assert 1e-3 < first.matmul_tflops["float32"] < 10, first.matmul_tflops
    assert all(v > 0 for v in first.matmul_tflops.values())
    # Each dtype's rate at every size measured; the best of them is the headline figure.
    for dtype, best in first.matmul_tflops.items():
        sizes = first.matmul_tflops_by_size[dtype]
        assert 128 in sizes and max(sizes.values()) == best
    # Loopback gloo: between 1 MB/s and 1 TB/s bus bandwidth, latency between 100 ns and 1 s.
    assert set(first.collectives) == set(COLLECTIVES)
    assert first.collective(ALL_TO_ALL) == first.collectives[ALL_TO_ALL]  # measured: its own figures
    print(f"all_to_all at 2 gloo ranks: {first.collectives[ALL_TO_ALL]}")
    for stats in first.collectives.values():
        assert 1e6 < stats.bus_bandwidth < 1e12 and 1e-7 < stats.latency_s < 1 and stats.size_bytes > 0, stats
    assert first.memory_per_rank > 0
    # One small operation dispatched from Python: between 100 ns and 10 ms on any machine; elementwise
    # bandwidth between 100 MB/s and 10 TB/s.
    assert 1e-7 < first.op_latency_s < 1e-2 and 1e8 < first.memory_bytes_per_s < 1e13, (
        first.op_latency_s, first.memory_bytes_per_s)
    # DTensor's dispatch under tensor parallel: a split linear costs many plain operations per micro-batch (its
    # forward a part of that), a DTensor parameter's update more than one; all well under a second.
    dispatch = (first.op_latency_s, first.tensor_parallel_linear_s, first.tensor_parallel_linear_forward_s,
                first.dtensor_param_step_s)
    assert 10 * first.op_latency_s < first.tensor_parallel_linear_s < 0.5, dispatch
    assert 0 <= first.tensor_parallel_linear_forward_s < first.tensor_parallel_linear_s, dispatch
    assert first.op_latency_s < first.dtensor_param_step_s < 0.1, dispatch
    assert first.measure_s < 15, f"the micro-benchmarks must stay short: {first.measure_s:.1f} s"

    # The second call reads the cache: the same profile, no measuring (available RAM, the budget, moves).
    cached = HardwareProfile.model_validate(profiles["cached"])
    assert cached.model_copy(update={"memory_per_rank": first.memory_per_rank}) == first
    times = ranks[0]["times"]
    assert times["cached"] < times["first"] / 10, times
    assert len(result["cache_files"]) == 1 and result["cache_files"][0].endswith(".json")

    limited = HardwareProfile.model_validate(profiles["limited"])
    assert limited.memory_per_rank == 2**30 and limited.memory_source == "memory_limit"
    assert limited.model_copy(update={"memory_per_rank": first.memory_per_rank, "memory_source": "ram"}) == first


def test_table_profile_round_trips(tmp_path: Path) -> None:
    table = load_profile("a100_80gb_8x_nvlink")
    assert table == load_profile(PROFILES_DIR / "a100_80gb_8x_nvlink.json")
    # the shipped tables have no sourced all-to-all figure: all-gather's stands in for it
    assert table.source == "table" and table.world_size == 8 and set(table.collectives) == set(COLLECTIVES) - {
        ALL_TO_ALL}
    assert table.collective(ALL_TO_ALL) == table.collectives[ALL_TO_ALL_FALLBACK]
    assert table.matmul_tflops["bfloat16"] > table.matmul_tflops["float32"]
    path = tmp_path / "copy.json"
    table.save(path)
    assert load_profile(path) == table
    assert HardwareProfile.from_table(table.model_dump(mode="json")) == table


@pytest.mark.parametrize("name", profile_names())
def test_every_shipped_table_loads_and_names_its_sources(name: str) -> None:
    table = load_profile(name)
    assert table.source == "table" and table.device_type == "cuda" and table.memory_per_rank > 0
    assert table.matmul_tflops["bfloat16"] > table.matmul_tflops["float32"] > 0
    assert table.memory_bytes_per_s > 0 and table.collectives, name
    # a table says where its figures come from (its note, or one line per figure in its sources)
    raw = json.loads((PROFILES_DIR / f"{name}.json").read_text())
    said = (raw.get("note", "") + " ".join(raw.get("sources", []))).lower()
    figures = {"matmul": ("matmul",), "memory": ("memory",), "collective": ("collective", "bandwidth")}
    for figure, words in figures.items():
        assert any(word in said for word in words), f"{name}: no source for its {figure} figures"


def test_one_process_without_a_process_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATORCH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    profile = measure_profile(memory_limit=12345)
    # Another test of this process may have made a one-process group: then gloo, still no collectives.
    backend = dist.get_backend() if dist.is_initialized() else "none"
    assert profile.world_size == 1 and profile.backend == backend and profile.collectives == {}
    assert profile.memory_per_rank == 12345 and profile.memory_source == "memory_limit"
    (cached,) = (tmp_path / "profiles").glob("*.json")
    assert load_profile(cached).model_copy(update={"memory_per_rank": 12345, "memory_source": "memory_limit"}) \
        == profile
    assert measure_profile(memory_limit=12345) == profile  # from the cache
    assert measure_profile().memory_source == "ram"
    assert profile.op_latency_s > 0 and profile.memory_bytes_per_s > 0
    # Each 16-bit dtype's block step over fp32's, by matmul size: measured on a CPU, positive
    assert {"bfloat16", "bfloat16:half"} <= set(profile.dtype_step_ratio)
    assert all(r > 0 for sizes in profile.dtype_step_ratio.values() for r in sizes.values())


def test_a_cached_profile_from_before_the_dtype_ratio_loads_and_gains_it(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache written before ``dtype_step_ratio`` (the field absent: same format) still loads; on a CPU the ratio is
    measured then and the cache rewritten with it; a table has none (no effect on its predictions)."""
    monkeypatch.setenv("ATORCH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    backend = dist.get_backend() if dist.is_initialized() else "none"
    path = cache_path(hardware._device_name(hardware._device()), 1, backend)
    old = load_profile("a100_80gb_8x_nvlink").model_copy(update={
        "source": "measured", "world_size": 1, "backend": backend, "collectives": {}, "op_latency_s": 1.5e-6})
    data = old.model_dump(mode="json")
    del data["dtype_step_ratio"]
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(data))
    profile = measure_profile(memory_limit=1)
    assert profile.op_latency_s == 1.5e-6  # the cache, not a new measurement
    assert profile.dtype_step_ratio["bfloat16"] and load_profile(path).dtype_step_ratio == profile.dtype_step_ratio
    assert load_profile("a100_80gb_8x_nvlink").dtype_step_ratio == {}


def test_a_new_profile_format_measures_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache written before the profile gained fields (older format) is not read: the new fields are measured."""
    monkeypatch.setenv("ATORCH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    backend = dist.get_backend() if dist.is_initialized() else "none"
    name = hardware._device_name(hardware._device())
    old = load_profile("a100_80gb_8x_nvlink").model_copy(update={
        "source": "measured", "world_size": 1, "backend": backend, "collectives": {}, "op_latency_s": 0.0,
        "memory_bytes_per_s": 0.0})
    monkeypatch.setattr(hardware, "PROFILE_FORMAT", hardware.PROFILE_FORMAT - 1)
    stale = cache_path(name, 1, backend)
    stale.parent.mkdir(parents=True)
    old.save(stale)
    assert measure_profile(memory_limit=1).op_latency_s == 0.0  # the same format reads its cache
    monkeypatch.undo()
    monkeypatch.setenv("ATORCH_CACHE_DIR", str(tmp_path))
    assert cache_path(name, 1, backend) != stale
    fresh = measure_profile(memory_limit=1)
    assert fresh.op_latency_s > 0 and fresh.matmul_tflops != old.matmul_tflops


def test_matmul_rate_is_read_at_the_model_s_own_matmul_size() -> None:
    """A small model's matmuls do not reach the best size's rate: the rate is interpolated in log-size between
    the sizes measured, clamped at both ends; a table (no sizes) gives its one figure for any size."""
    base = load_profile("a100_80gb_8x_nvlink").model_dump()
    profile = HardwareProfile.model_validate({**base, "matmul_tflops": {"float32": 0.1, "bfloat16": 0.2},
                                              "matmul_tflops_by_size": {"bfloat16": {128: 0.1, 512: 0.2}}})
    assert profile.matmul_tflops_at("bfloat16", 64) == 0.1  # below the smallest size: its rate
    assert profile.matmul_tflops_at("bfloat16", 256) == pytest.approx(0.15)  # halfway in log-size
    assert profile.matmul_tflops_at("bfloat16", 4096) == 0.2  # beyond the largest: its rate
    assert profile.matmul_tflops_at("bfloat16") == 0.2  # no size given: the best size's
    assert profile.matmul_tflops_at("float32", 64) == 0.1  # no sizes for the dtype: its one figure
    assert profile.matmul_tflops_at("float16", 64) == 0.1  # no such dtype: float32's


def test_a_profile_saved_without_all_to_all_loads_and_reads_all_gather_for_it(tmp_path: Path) -> None:
    """A profile measured before all-to-all was (format 5) still loads; the cost model times all-to-all at
    all-gather's figures for it, and says so."""
    from test_cost_model import _stats

    from atorch.strategy import Strategy
    from atorch.strategy_search.costing.analyser import ModelStats
    from atorch.strategy_search.costing.cost_model import predict

    table = load_profile("a100_80gb_8x_nvlink").model_dump(mode="json")
    assert ALL_TO_ALL not in table["collectives"]
    path = tmp_path / "old.json"
    HardwareProfile.from_table(table).save(path)
    old = load_profile(path)
    assert old.collective(ALL_TO_ALL) == old.collectives[ALL_TO_ALL_FALLBACK]
    stats = ModelStats.model_validate({**_stats().model_dump(), "experts": 4, "experts_per_token": 2,
                                       "expert_param_count": 1000, "moe_layers": 2})
    strategy = Strategy.load([("parallel_mode", {"dims": [["expert", 2], ["data", -1]]}), "expert_parallel"])
    notes = predict(stats, strategy, strategy.layout(8), old, 8).notes
    assert any("no all-to-all figures" in n for n in notes), notes

