"""The benchmark scripts still run against the package as it is (a bench that breaks silently measures nothing):
bench/cost_model.py builds every model it measures, bench/search_replay.py replays the search's policy against the
sweep kept in bench/data, and bench/memory_replay.py predicts a kept sweep's peaks again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def bench_path():
    sys.path.insert(0, str(BENCH))
    yield
    sys.path.remove(str(BENCH))


def test_the_cost_model_bench_builds_every_model_it_measures(bench_path) -> None:
    import cost_model

    builders = cost_model.builders()
    expected = {"gpt2", "mlp", "cnn", "llama", "qwen2", "phi3", "gemma", "neox", "opt", "bert", "vgg", "lstm"}
    assert expected <= set(builders)
    for name, build in builders.items():
        parts = build()
        assert isinstance(parts["model"], nn.Module), name
        assert len(parts["dataset"]) > 0 and callable(parts["loss_func"]), name


def test_the_search_replay_runs_both_policies_against_the_kept_sweep(tmp_path) -> None:
    out = tmp_path / "replay.json"
    run = subprocess.run(
        [sys.executable, str(BENCH / "search_replay.py"), "--sweeps", str(BENCH / "data" / "sweeps_2026-11-24.json"),
         "--profile", str(BENCH / "data" / "profile_cpu_2ranks_2026-11-24.json"), "--scenarios", "cnn",
         "--budgets", "0.8", "--seeds", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    import json

    report = json.loads(out.read_text())
    assert set(report) == {"cnn/80% of DDP/plain", "cnn/80% of DDP/corrected"}
    for result in report.values():
        (one,) = result["runs"]
        # the ResNet's best under this budget is the cost model's pick (bench/README.md): both policies find it
        assert one["pick_over_best"] == pytest.approx(1.0) and 1 <= one["dry_runs"] <= 8 and one["wasted"] == 0


def test_the_memory_replay_predicts_the_kept_sweep_again() -> None:
    # DINOv2's sweep (the third held-out set): checkpoint rows within bench/README.md's run O figures
    run = subprocess.run(
        [sys.executable, str(BENCH / "memory_replay.py"), "--sweeps",
         str(BENCH / "data" / "sweeps_2026-11-30-held-out-3.json"), "--models", "dinov2"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(BENCH.parent)})
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line.split() for line in run.stdout.splitlines() if line.startswith("dinov2/4")]
    assert [line[1] for line in lines] == ["checkpoint=False", "checkpoint=True"], run.stdout
    for line in lines:
        assert int(line[3]) >= 20 and float(line[-1]) < 0.08, line  # rows, mean |error|
