"""The benchmark scripts still run against the package as it is (a bench that breaks silently measures nothing):
bench/cost_model.py builds every model it measures, bench/search_replay.py replays the search's policy against the
sweep kept in bench/data, and bench/memory_replay.py predicts a kept sweep's peaks again."""

from __future__ import annotations

import json
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
         str(BENCH / "data" / "sweeps_2026-11-30-held-out-3.json"), "--models", "dinov2", "--close-calls"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(BENCH.parent)})
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line.split() for line in run.stdout.splitlines() if line.startswith("dinov2/4")]
    assert [line[1] for line in lines] == ["checkpoint=False", "checkpoint=True"], run.stdout
    for line in lines:
        assert int(line[3]) >= 20 and float(line[-1]) < 0.08, line  # rows, mean |error|
    # how a close call's dry-run ends (automatic.TRACE_PER_STOPPED_RUN): one predicted over the budget runs out of
    # memory more often than one predicted under it (run W: 0.77 and 0.22 on this sweep)
    (chances,) = [line.split() for line in run.stdout.splitlines() if line.startswith("  held out ")]
    over, under = float(chances[-4]), float(chances[-1])
    assert 0.5 < over <= 1.0 and 0.0 <= under < 0.5, chances


def test_close_call_outcomes_follow_the_sign_and_size_of_the_memory_error() -> None:
    sys.path.insert(0, str(BENCH))
    from memory_replay import close_call_outcomes

    assert close_call_outcomes([0.0] * 10) == (1.0, 0.0)  # exact figures: over the budget stops, under fits
    assert close_call_outcomes([0.1] * 10) == (0.0, 0.0)  # 10% too high: within 8% either side, every run fits
    assert close_call_outcomes([-0.1] * 10) == (1.0, 1.0)  # 10% too low: every close call stops
    over, under = close_call_outcomes([-0.04, 0.04])  # half of the band each way
    assert over == pytest.approx(0.75) and under == pytest.approx(0.25)


def test_the_gpu_check_reports_every_case_skipped_with_its_reason_on_a_cpu_machine() -> None:
    script = BENCH.parent / "scripts" / "gpu_check.py"
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(BENCH.parent)})
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("REPORT "))[7:])
    cases = {k: v for k, v in report.items() if isinstance(v, dict)}
    assert {"ddp", "search", "families_vs_cost_model", "families_search", "expert_parallel"} <= set(cases)
    assert all(v["ok"] is None and v["skipped"] for v in cases.values()), cases


def test_the_gpu_checks_family_cases_run_at_a_cpu_size(monkeypatch) -> None:
    """The held-out family cases, on CPU-sized copies (the GPU's run is the day a GPU is lent): an MoE model against
    the cost model, a conv model through automatic mode and the loop."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(BENCH.parent / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(BENCH.parent / "scripts"))
    monkeypatch.setattr(gpu_check, "FAMILIES", ("olmoe",))
    costs = gpu_check.families_vs_cost_model(scale=0, batch=2)
    assert costs["olmoe"]["experts"] == 4 and costs["olmoe"]["active_param_m"] < costs["olmoe"]["params_m"]
    assert [row["status"] for row in costs["olmoe"]["rows"]] == ["ok"] * 3
    assert all(0.5 < row["predicted_mib"] / row["measured_mib"] < 2 for row in costs["olmoe"]["rows"])
    monkeypatch.setattr(gpu_check, "FAMILIES", ("regnet",))
    found = gpu_check.families_search(scale=0, batch=2, rounds=1, steps=1)["regnet"]
    assert 0 < found["pick_over_best"] <= 1 and found["best"] != str(gpu_check.PLAUSIBLE[3])  # half: beside it
