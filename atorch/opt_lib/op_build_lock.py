"""Waiting for a compiled op's build lock without hanging on one a killed build left behind.

torch builds an extension (DeepSpeed's shm_comm among them) under a lock file in its build directory and
waits, without end and without a word, while that file exists. A build that was killed leaves the file,
and every later process then hangs in its first DeepSpeed engine. Here a process waits for a live build
(saying so) and removes a lock that nothing has touched for far longer than a build takes.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from atorch.log import get_logger

logger = get_logger(__name__)

# A CPU build of shm_comm takes 30-70 s (3 min on a loaded 2-core machine); a lock whose directory nothing
# has written to for 10 minutes belongs to no running build.
STALE_LOCK_S = 600.0
_NOTE_EVERY_S = 30.0


def build_directory(name: str) -> Path:
    """Where torch builds the extension ``name`` (TORCH_EXTENSIONS_DIR, else its cache), as torch resolves it."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def _last_write(directory: Path) -> float:
    stamps = [entry.stat().st_mtime for entry in directory.iterdir() if entry.is_file()]
    return max(stamps, default=0.0)


def wait_for_build_lock(directory: Path, stale_after_s: float = STALE_LOCK_S, poll_s: float = 1.0) -> None:
    """Return once ``directory`` holds no build lock: wait for a build in progress, remove a stale lock."""
    lock = directory / "lock"
    started = time.monotonic()
    noted = started - _NOTE_EVERY_S
    while lock.exists():
        try:
            idle_s = time.time() - _last_write(directory)
        except FileNotFoundError:  # the build finished and cleaned up between the two looks
            continue
        if idle_s > stale_after_s:
            logger.warning(
                "removing the build lock %s: nothing in its directory changed for %.0f s (a build takes about a "
                "minute), so a build that was killed left it; torch would otherwise wait on it for ever", lock, idle_s,
            )
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
            return
        if time.monotonic() - noted >= _NOTE_EVERY_S:
            noted = time.monotonic()
            logger.info("waiting for %s: another process is building this op (%.0f s so far; a lock untouched for "
                        "%.0f s is treated as left by a killed build and removed)", lock, noted - started,
                        stale_after_s)
        time.sleep(poll_s)
