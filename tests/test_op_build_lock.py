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


def test_every_deepspeed_engine_start_clears_a_killed_build_s_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    # the lock torch's loader would wait on for ever, where it looks (TORCH_EXTENSIONS_DIR), left by a killed build
    pytest.importorskip("deepspeed")
    from atorch.opt_lib.deepspeed_zero import wait_for_deepspeed_ops

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builder = wait_for_deepspeed_ops()  # the builder of the op DeepSpeed's engine loads here (shm_comm on CPU)
    assert builder is not None, "DeepSpeed loads shm_comm on the CPU accelerator"
    directory = build_directory(builder.name)
    assert directory.parent == tmp_path
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "lock").touch()
    _age(directory / "lock", 3600)
    begin = time.monotonic()
    with caplog.at_level(logging.WARNING):
        wait_for_deepspeed_ops()
    assert time.monotonic() - begin < 30 and not (directory / "lock").exists()
    assert "removing the build lock" in caplog.text


def test_the_engines_wait_for_the_lock_before_deepspeed_initialize() -> None:
    # both engine starts (ZeRO, the 3D pipeline) and the dry-run's preparation of both go through the wait
    import inspect

    pytest.importorskip("deepspeed")
    from atorch.opt_lib import deepspeed_zero, ds_3d_parallel
    from atorch.opt_lib.ds_3d_parallel import Ds3dParallelConfig
    from atorch.opt_lib.sharding import Zero2Config
    from atorch.opt_lib.zero1 import Zero1Config

    for start in (deepspeed_zero.start_deepspeed, ds_3d_parallel.start_ds_pipeline):
        source = inspect.getsource(start)
        assert source.index("wait_for_deepspeed_ops()") < source.index("deepspeed.initialize("), start.__name__
    for config in (Ds3dParallelConfig(), Zero1Config.model_validate({"use_ds_zero": True}),
                   Zero2Config.model_validate({"use_ds_zero": True})):
        prep = config.preparation()
        assert prep is not None and prep.run is deepspeed_zero.prepare_deepspeed, type(config).__name__
