"""The demo and the benchmark keep working: each runs end to end on 2 real processes (small sizes)."""

from __future__ import annotations

import json

import pytest
from launcher import HERE, run_json

import atorch

ROOT = HERE.parent
SMALL_GPT2 = ["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "256", "--seq-len", "32"]


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "strategy",
    [
        ["parallel_mode", "module_replace", "checkpoint", "fsdp"],  # the demo's default
        ["parallel_mode", ["amp_native", {"dtype": "bf16"}], "zero2"],
    ],
    ids=["default", "amp_bf16_zero2"],
)
def test_demo_trains_gpt2_and_saves_its_strategy(tmp_path, strategy) -> None:
    saved = tmp_path / "strategy.json"
    summary = run_json(
        ROOT / "examples" / "train_gpt2.py", *SMALL_GPT2, "--steps", "80", "--batch-size", "8", "--lr", "1e-2",
        "--no-progress", "--strategy", json.dumps(strategy), "--save-strategy", str(saved),
    )
    assert summary["world_size"] == 2 and summary["steps"] == 80
    # The demo itself exits non-zero unless the loss halves; check the figure it reports too.
    assert summary["tail_mean_loss"] < 0.5 * summary["first_loss"], summary
    assert atorch.Strategy.load(saved) == atorch.Strategy.load(strategy).adjusted(2)


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_demo_searches_its_strategy_when_given_none(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ATORCH_CACHE_DIR", str(tmp_path))  # a fresh search, its study kept in tmp_path
    saved = tmp_path / "strategy.json"
    summary = run_json(
        ROOT / "examples" / "train_gpt2.py", *SMALL_GPT2, "--steps", "80", "--batch-size", "8", "--lr", "1e-2",
        "--no-progress", "--max-trials", "4", "--save-strategy", str(saved), timeout=400,
    )
    assert summary["tail_mean_loss"] < 0.5 * summary["first_loss"], summary
    assert atorch.Strategy.load(saved) == atorch.Strategy.load(json.loads(summary["strategy_json"]))
    assert summary["search"]["source"] == "search" and 1 <= summary["search"]["dry_runs"] <= 4
    assert (tmp_path / "search.db").exists()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_overhead_benchmark_runs_and_both_loops_agree() -> None:
    report = run_json(ROOT / "bench" / "overhead.py", *SMALL_GPT2, "--repeats", "4", "--warmup", "1")
    assert report["losses"]["identical"] is True, report
