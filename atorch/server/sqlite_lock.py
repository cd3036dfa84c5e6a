"""One strategy server per SQLite file: an exclusive ``flock`` on ``<database>.lock``, taken before serving.

Two servers on one SQLite file lose acknowledged tells: each sees the other's fresh ask (a RUNNING trial whose
lease is not written yet) and may take it for a dead one. The lock makes the second server refuse to start,
naming the first (its pid, host, address and start time are written in the lock file). The kernel drops a
``flock`` with the process that held it, so a lock left by a killed server (``kill -9``) is free: no stale-lock
cleanup. PostgreSQL has its own rule (a session advisory lock per study: ``Studies._claim``); other databases
are not locked here.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
from pathlib import Path
from urllib.parse import unquote

from atorch.errors import SetupError
from atorch.log import get_logger

logger = get_logger(__name__)


def sqlite_path(url: str) -> Path | None:
    """The database file of a SQLite URL, resolved (None: not SQLite). An in-memory database is refused: it
    is one per connection (each of the server's worker threads would see another, empty one) and dies with the
    process."""
    from sqlalchemy import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return None
    database = parsed.database or ""
    if database.startswith("file:"):  # a SQLite URI (``?uri=true``): its path part; mode=memory is in the query
        database = unquote(database[len("file:"):].split("?", 1)[0])
        if parsed.query.get("mode") == "memory":
            database = ""
    if database in ("", ":memory:"):
        raise SetupError(
            f"storage {url!r} is an in-memory SQLite database: each connection gets its own, empty one, and it is "
            "gone when the server stops. Give a file (--storage sqlite:////path/to/atorch-server.db) or a "
            "PostgreSQL URL.")
    return Path(os.path.realpath(database))  # realpath: two spellings of one file take one lock


class ServerLock:
    """The held lock (``take``); ``release`` (or the process's exit) frees it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def take(cls, url: str, address: str | None = None) -> ServerLock | None:
        """Hold ``<database>.lock`` for this process, or raise ``SetupError`` naming the server holding it.
        None for a storage that is not a SQLite file."""
        database = sqlite_path(url)
        if database is None:
            return None
        path = database.with_name(database.name + ".lock")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError as exc:
            raise SetupError(f"storage {url!r}: the folder {database.parent} does not exist: create it, or give "
                             "another --storage") from exc
        except PermissionError:  # a read-only folder: lock an existing file, else say what is needed
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise SetupError(f"storage {url!r}: cannot create the server's lock file {path} ({exc}): the "
                                 "server needs to write in the database's folder (SQLite writes its -wal and -shm "
                                 "files there too); fix the folder's permissions") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise SetupError(
                f"the SQLite storage {database} is already served by another atorch server ({holder}; lock file "
                f"{path}): two servers on one SQLite file fail each other's trials. Send the requests to that "
                "server, stop it first, or give this one another --storage (or use PostgreSQL).") from None
        with contextlib.suppress(OSError):  # a read-only lock file still locks; it just names no holder
            record = {"pid": os.getpid(), "host": socket.gethostname(), "address": address,
                      "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
        logger.info("serving the SQLite storage %s alone (lock file %s)", database, path)
        return cls(path, fd)

    def release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)  # closing the descriptor drops the flock

    def __del__(self) -> None:
        self.release()


def _holder(fd: int) -> str:
    """Who holds the lock, from what it wrote in the file."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
        parts = [f"pid {record['pid']} on {record['host']}"]
    except (OSError, ValueError, KeyError, TypeError):
        return "its pid is not recorded in the lock file"
    if record.get("address"):
        parts.append(f"at {record['address']}")
    if record.get("since"):
        parts.append(f"since {record['since']}")
    return ", ".join(parts)
