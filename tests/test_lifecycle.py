"""Jobs end cleanly: no abort while tearing down gloo at exit, and a crash on one rank ends the job."""

from __future__ import annotations

import time

import pytest
from launcher import HERE, _launch

WORKER = HERE / "workers" / "lifecycle_worker.py"
CLEAN_RUNS = 4  # without atorch's exit barrier about a third of such runs aborted at exit


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_processes_exit_cleanly_after_sharded_training() -> None:
    for _ in range(CLEAN_RUNS):  # launched directly: a retry must not hide an abort at exit
        proc = _launch(WORKER, ("clean",), nproc=2, timeout=120)
        assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
        assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_crash_on_one_rank_ends_the_job_with_its_error() -> None:
    start = time.monotonic()
    proc = _launch(WORKER, ("crash",), nproc=2, timeout=240)
    assert proc.returncode != 0
    assert "deliberate failure on rank 1" in proc.stderr
    assert time.monotonic() - start < 120, "the surviving rank must not wait out a collective time-out"
