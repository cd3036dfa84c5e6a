"""Run a script under torchrun with N real processes (gloo) and collect what rank 0 reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _launch(script: str | Path, args: tuple[str, ...], nproc: int, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]))
    # --standalone: torchrun picks a free rendezvous port itself (no race between probing and binding).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script),
           *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{script} timed out after {timeout}s:\n{exc.stdout}\n{exc.stderr}") from exc


def torchrun(script: str | Path, *args: str, nproc: int = 2, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """Launch ``script`` on nproc local processes; raises with the output on failure or time-out.

    There is no retry: a launch that fails is a failure to fix, not to hide.
    """
    proc = _launch(script, args, nproc, timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def run_json(script: str | Path, *args: str, nproc: int = 2, timeout: float = 300.0) -> dict:
    """Launch and parse the last stdout line that starts with 'RESULT ' as JSON."""
    proc = torchrun(script, *args, nproc=nproc, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise AssertionError(f"{script} printed no RESULT line:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def launch_fixture(script: str | Path, *, timeout: float, groups: dict[str, int] | None = None) -> Any:
    """A module-scoped ``launch`` fixture: the report of one run of ``script`` on 2 processes; with ``groups``
    (group -> processes), one run per group, the group as the script's argument: ``(group, report)``."""
    import pytest

    if groups is None:
        @pytest.fixture(scope="module", name="launch")
        def launch_once() -> dict[str, Any]:
            return run_json(script, timeout=timeout)

        return launch_once

    @pytest.fixture(scope="module", params=list(groups), name="launch")
    def launch_group(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
        group = request.param
        return group, run_json(script, group, nproc=groups[group], timeout=timeout)

    return launch_group
