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


# ----- scripts/demo.sh: pip only when something is missing ------------------------------------------------------
def _install_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("install_check", ROOT / "scripts" / "install_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _checkout_copy(tmp_path, extra_requirement: str | None = None):
    """The parts of this checkout demo.sh uses, atorch linked; setup.cfg with one more demo requirement."""
    import shutil

    copy = tmp_path / "checkout"
    (copy / "examples").mkdir(parents=True)
    shutil.copytree(ROOT / "scripts", copy / "scripts")
    shutil.copy(ROOT / "examples" / "train_gpt2.py", copy / "examples")
    (copy / "atorch").symlink_to(ROOT / "atorch", target_is_directory=True)
    text = (ROOT / "setup.cfg").read_text(encoding="utf-8")
    if extra_requirement:
        text = text.replace("demo =\n", f"demo =\n    {extra_requirement}\n", 1)
        assert extra_requirement in text
    (copy / "setup.cfg").write_text(text, encoding="utf-8")
    return copy


def test_install_check_finds_nothing_to_do_here_and_names_what_is_missing(tmp_path) -> None:
    check = _install_check()
    assert check.problem(ROOT, "demo") is None  # the suite runs on this checkout's install
    changed = _checkout_copy(tmp_path, "atorch-demo-no-such-package>=1")
    assert check.problem(changed, "demo") == "setup.cfg's requirements changed since atorch was installed"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert check.problem(elsewhere, "demo").startswith("atorch imports from ")


def _demo(checkout, tmp_path, pip_exit: int):
    """bash scripts/demo.sh --help (the example's help: no training) with an interpreter that logs pip calls."""
    import os
    import subprocess
    import sys

    log = tmp_path / "pip.log"
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/usr/bin/env bash\n'
                       f'if [[ "$1 $2" == "-m pip" ]]; then echo "$*" >> {log}; exit {pip_exit}; fi\n'
                       f'exec {sys.executable} "$@"\n', encoding="utf-8")
    wrapper.chmod(0o755)
    env = dict(os.environ, PYTHON=str(wrapper), OMP_NUM_THREADS="1", MASTER_PORT=str(_free_port()),
               PYTHONPATH=str(ROOT))
    done = subprocess.run(["bash", str(checkout / "scripts" / "demo.sh"), "--help"], capture_output=True, text=True,
                          env=env, timeout=240)
    return done, (log.read_text() if log.exists() else "")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_demo_script_skips_pip_when_installed(tmp_path) -> None:
    done, pip_calls = _demo(ROOT, tmp_path, pip_exit=3)
    assert done.returncode == 0, done.stdout + done.stderr
    assert pip_calls == "", pip_calls
    assert "==> atorch is installed from this checkout with its dependencies: nothing to install" in done.stdout
    assert "==> searching a strategy for a GPT-2 on 2 processes" in done.stdout
    assert "--max-trials" in done.stdout  # the example's own --help, from the launched processes


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_demo_script_installs_when_setup_cfg_asks_for_more(tmp_path) -> None:
    checkout = _checkout_copy(tmp_path, "atorch-demo-no-such-package>=1")
    done, pip_calls = _demo(checkout, tmp_path, pip_exit=0)  # pip "succeeds" without touching this environment
    assert done.returncode == 0, done.stdout + done.stderr
    pip = "-m pip install --disable-pip-version-check --progress-bar off -e .[demo]"
    assert pip_calls.splitlines() == [pip], pip_calls
    assert ("==> installing atorch and its dependencies (setup.cfg's requirements changed since atorch was installed;"
            " first run: a few minutes)...") in done.stdout
