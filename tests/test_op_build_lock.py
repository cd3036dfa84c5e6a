"""A compiled op's build lock: a live build is waited for, a killed build's lock is removed (torch would wait on
it for ever, and every DeepSpeed candidate with it)."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest

from atorch.opt_lib.op_build_lock import build_directory, wait_for_build_lock


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_lock_left_by_a_killed_build_is_removed_with_a_warning_naming_it(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "shm.o").write_bytes(b"half")
    (tmp_path / "lock").touch()
    for entry in tmp_path.iterdir():
        _age(entry, 3600)
    with caplog.at_level(logging.WARNING):
        wait_for_build_lock(tmp_path, stale_after_s=600)
    assert not (tmp_path / "lock").exists()
    assert str(tmp_path / "lock") in caplog.text and "killed" in caplog.text


def test_a_live_build_is_waited_for_and_its_lock_left_alone(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    released = threading.Timer(0.6, lock.unlink)  # the building process finishes
    released.start()
    start = time.monotonic()
    wait_for_build_lock(tmp_path, stale_after_s=600, poll_s=0.05)
    released.join()
    assert time.monotonic() - start >= 0.5  # it waited for the build rather than removing its lock


def test_a_recent_write_keeps_an_old_lock_alive(tmp_path: Path) -> None:
    """The build's outputs, not the lock's own age, tell a running build from a dead one."""
    lock = tmp_path / "lock"
    lock.touch()
    _age(lock, 3600)
    (tmp_path / "shm.o").write_bytes(b"compiling")  # written just now
    released = threading.Timer(0.4, lock.unlink)
    released.start()
    start = time.monotonic()
    wait_for_build_lock(tmp_path, stale_after_s=600, poll_s=0.05)
    released.join()
    assert time.monotonic() - start >= 0.3  # waited: not removed for the lock's own age


def test_the_build_directory_is_torch_s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build_directory("deepspeed_shm_comm") == tmp_path / "deepspeed_shm_comm"
