"""``/healthz``'s storage check: can the storage be read and written now? Probed at most every few seconds.

A probe is one transaction on a new connection (the storage as it is now, not as it was when a pooled connection was
opened: one opened on a read-only SQLite file stays read-only, one opened before stays writable): a read of Optuna's
``studies`` table and a write, committed: on SQLite an upsert of one row in ``atorch_server_health`` (a table of its
own: Optuna's are left alone), on PostgreSQL a transaction id (``txid_current()``: its commit writes the WAL; no
table, the server's role may not be allowed to create one); on a SQLite file also the free space of its file system
(a commit can fit in pages the database already has while a growing one fails). A failed probe, and the first good
one after it, drop the pooled connections (``Studies.heal_pool``): the requests meet the storage's state, and
connections opened while it failed are not used once it is back. The answer is cached: ``/healthz`` is polled hard
(the load bench: every 20 ms beside 32 clients), so a fresh enough answer is given at once while the next probe runs
in the background, on a thread of its own (never the event loop, never the request workers); an answer older than
twice the interval (an idle server, a health check every 30 s) waits for the probe, at most ``wait_s``. A request's
storage error makes the next check probe again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from pathlib import Path
from typing import Any

from atorch.log import get_logger
from atorch.server.store import storage_error_text

logger = get_logger(__name__)
TABLE = "atorch_server_health"
MIN_FREE_BYTES = 256 * 2**10  # below this on a SQLite file's file system, writes are about to fail


class StorageHealth:
    def __init__(self, engine: Any, database: Path | None, heal: Any, every_s: float = 2.0,
                 wait_s: float = 1.0) -> None:
        import sqlalchemy as sa

        # The server's URL, without a pool: each probe opens a connection of its own, and none waits for long (a
        # probe that hangs is answered as such by ``problem``; bounded, its thread is free for the next one).
        connect: dict[str, Any] = {}
        if engine.dialect.name == "sqlite":
            connect = {"timeout": wait_s}
        elif engine.dialect.name == "postgresql":  # the URL's own options (a search_path) kept
            options = " ".join(filter(None, [engine.url.query.get("options"), "-c statement_timeout=5000"]))
            connect = {"connect_timeout": 5, "options": options}
        self.engine = sa.create_engine(engine.url, poolclass=sa.pool.NullPool, connect_args=connect)
        self.database, self.heal = database, heal
        self.every_s, self.wait_s = every_s, wait_s
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="atorch-health")
        self._running: asyncio.Future[Any] | None = None
        self._problem: str | None = None
        self._at = -float("inf")  # monotonic time of the last probe's answer
        self._table_made = False

    def invalidate(self) -> None:
        """A request's storage failed: the next check probes again before it answers."""
        self._at = -float("inf")

    async def problem(self) -> str | None:
        """Why the storage cannot be used now (None: it can)."""
        age = time.monotonic() - self._at
        if age > self.every_s and (self._running is None or self._running.done()):
            self._running = asyncio.get_running_loop().run_in_executor(self._pool, self.probe)
        if age <= 2 * self.every_s or self._running is None:
            return self._problem
        try:
            await asyncio.wait_for(asyncio.shield(self._running), self.wait_s)
        except TimeoutError:
            return f"the storage did not answer a read and a write within {self.wait_s:g} s (locked or hung)"
        return self._problem

    def probe(self) -> None:
        """One read and one committed write (and the free space of a SQLite file); sets the answer."""
        import sqlalchemy as sa

        try:
            with self.engine.begin() as conn:
                conn.execute(sa.text("select count(*) from studies")).scalar()
                if self.engine.dialect.name == "postgresql":  # a transaction id: its commit writes the WAL (no
                    conn.execute(sa.text("select txid_current()"))  # table of ours: the role may not create one)
                else:
                    if not self._table_made:
                        conn.execute(sa.text(f"create table if not exists {TABLE} "
                                             "(id integer primary key, probed_at float not null)"))
                    conn.execute(sa.text(f"insert into {TABLE} (id, probed_at) values (1, :t) on conflict (id) "
                                         "do update set probed_at = excluded.probed_at"), {"t": time.time()})
            self._table_made = True
            problem = self._space()
        except Exception as exc:  # any failure is the answer, never an error of /healthz
            problem = f"the storage cannot be written ({storage_error_text(exc)})"
        if problem is not None or self._problem is not None:  # failing, or back: new connections for the requests
            self.heal()
        if problem != self._problem:
            (logger.warning if problem else logger.info)("storage health: %s", problem or "writable again")
        self._problem, self._at = problem, time.monotonic()

    def _space(self) -> str | None:
        if self.database is None:
            return None
        stat = os.statvfs(self.database.parent)
        free = stat.f_bavail * stat.f_frsize
        if free < MIN_FREE_BYTES:
            return f"the storage's disk is full: {free} bytes free in {self.database.parent}"
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self.engine.dispose()
