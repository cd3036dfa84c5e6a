"""Replacing a checkpoint directory so that a crash at any point leaves a loadable one at its path.

A save writes into a staging directory beside the target (``.<name>.tmp-<id>``, same parent, so renames
stay on one file system) and, once every rank's files are written and synced, one process swaps it in:
the old checkpoint is renamed aside (``.<name>.old-<id>``), the new one into place, then the old is
removed. Until the first rename the old checkpoint is untouched; between the two renames it is the one
``.old-`` directory, which ``resolve`` reads and the next save renames back. These functions touch the
file system only; the caller runs them on one process and makes the others wait.
"""

from __future__ import annotations

import errno
import glob
import os
import shutil
import uuid
from pathlib import Path

from atorch.log import get_logger

logger = get_logger(__name__)

_STAGING, _OLD = ".tmp-", ".old-"


def _beside(target: Path, kind: str) -> list[Path]:
    """``.<name><kind>*`` directories beside ``target``, oldest first."""
    found = glob.glob(os.path.join(glob.escape(os.fspath(target.parent)), f".{glob.escape(target.name)}{kind}*"))
    return sorted((Path(p) for p in found if os.path.isdir(p)), key=lambda p: p.stat().st_mtime)


def _new_name(target: Path, kind: str) -> Path:
    return target.parent / f".{target.name}{kind}{uuid.uuid4().hex[:12]}"


def real_target(path: str | os.PathLike) -> Path:
    """The directory a save replaces: a symbolic link's target (the link stays), else ``path``."""
    path = Path(path)
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def replace_problems(target: Path, markers: tuple[str, ...]) -> list[str]:
    """Why ``target`` cannot be replaced by a new checkpoint: it is a file, or a directory holding other
    things than a checkpoint (one with any of ``markers`` in it), which a save would remove."""
    if target.is_dir():
        if any(True for _ in target.iterdir()) and not any((target / m).exists() for m in markers):
            return [f"{target} is a directory that is not a checkpoint (it has none of {', '.join(markers)}); a save "
                    "replaces the whole directory: give a new path or one a previous save wrote"]
    elif target.exists():
        return [f"{target} is a file; give a directory path (a checkpoint is a directory)"]
    return []


def resolve(target: Path) -> Path:
    """``target``, or, when it is missing because a save stopped between its two renames, the previous
    checkpoint that save moved aside."""
    if target.exists():
        return target
    old = _beside(target, _OLD)
    if not old:
        return target
    logger.warning("%s is missing: a save of it was interrupted; reading the previous checkpoint from %s (the next "
                   "save to %s moves it back)", target, old[-1], target)
    return old[-1]


def prepare(target: Path) -> Path:
    """On one process: restore what an interrupted save left, then make an empty staging directory."""
    target.parent.mkdir(parents=True, exist_ok=True)
    old = _beside(target, _OLD)
    if not target.exists() and old:
        os.rename(old.pop(), target)  # interrupted between the two renames: the previous checkpoint returns
        fsync_dir(target.parent)
        logger.warning("restored the previous checkpoint at %s (a save of it was interrupted)", target)
    for stale in old + _beside(target, _STAGING):  # a finished swap's old copy, an interrupted save's files
        shutil.rmtree(stale, ignore_errors=True)
    staging = _new_name(target, _STAGING)
    staging.mkdir()
    return staging


def commit(staging: Path, target: Path) -> Path | None:
    """On one process, after every process wrote and synced its files: put ``staging`` in place of
    ``target`` without a moment when neither exists. Returns where the replaced checkpoint went (if any),
    for ``remove_replaced``."""
    fsync_dir(staging)
    old = None
    if target.exists():
        old = _new_name(target, _OLD)
        os.rename(target, old)
    os.rename(staging, target)
    fsync_dir(target.parent)
    return old


def remove_replaced(old: Path | None) -> None:
    """Remove the checkpoint ``commit`` replaced; one that stays (an error) is removed by the next save."""
    if old is None:
        return
    shutil.rmtree(old, ignore_errors=True)
    if old.exists():
        logger.warning("could not remove the replaced checkpoint %s; the next save beside it removes it", old)


def write_durably(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all: a temporary file, synced, renamed into place, the directory synced."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (files created, renamed) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems cannot sync a directory; their renames are as durable as they get
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)
