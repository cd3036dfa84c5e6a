"""The server's durable record: an append-only table of events per study, written with group commit.

Each ask, tell, create or stored best is ONE row (JSON): the trials it changed, as snapshots, or the
study's table and config, or its best. The in-memory study is rebuilt by replaying a study's rows in
order (``read``), so a restarted server continues every search where it stood. One writer thread commits
whatever the request threads have queued in one transaction (group commit) and wakes them; a request
answers only after its row is committed. SQLite runs in WAL mode with ``synchronous=NORMAL``,
PostgreSQL with ``synchronous_commit=off``: a crash of the server process loses nothing, a crash of the
machine may lose the last moments (those trials are re-asked when their leases expire).
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
from concurrent.futures import Future
from typing import Any

import sqlalchemy as sa

TABLE = "atorch_server_events"
_meta = sa.MetaData()
events = sa.Table(
    TABLE, _meta,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("study", sa.String(255), nullable=False, index=True),
    sa.Column("kind", sa.String(16), nullable=False),  # study | trials | best | confirm
    sa.Column("body", sa.Text(), nullable=False),
)


def connect_args(url: str) -> dict[str, Any]:
    """The driver's arguments for one short commit per request (see the module's docstring); the Optuna
    copy (store.open_storage) is opened with the same."""
    if url.startswith("sqlite"):
        return {"timeout": 30}
    if url.startswith("postgresql"):
        return {"options": "-c synchronous_commit=off"}
    return {}


def tune_sqlite(engine: sa.Engine) -> None:
    """WAL and synchronous=NORMAL on every connection the engine opens from now on."""

    @sa.event.listens_for(engine, "connect")
    def _pragmas(conn: Any, _record: Any) -> None:
        cursor = conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()


def make_engine(url: str) -> sa.Engine:
    """An engine tuned for one short commit per request (see the module's docstring)."""
    engine = sa.create_engine(url, connect_args=connect_args(url))
    if url.startswith("sqlite"):
        tune_sqlite(engine)
    return engine


class EventLog:
    """Append (asynchronously, group-committed) and read a study's events."""

    def __init__(self, url: str) -> None:
        self.engine = make_engine(url)
        _meta.create_all(self.engine, checkfirst=True)
        # SQLite has one writer: whoever else writes the file in this process (the Optuna copy) takes this
        # lock too, so a commit waits on it rather than in SQLite's busy handler (which sleeps in steps).
        self.write_lock = threading.Lock() if url.startswith("sqlite") else contextlib.nullcontext()
        self._queue: queue.Queue[tuple[str, str, str, Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._write_loop, name="atorch-event-writer", daemon=True)
        self._thread.start()

    # ----- writing ---------------------------------------------------------------------------
    def append(self, study: str, kind: str, body: Any) -> Future:
        """Queue one row; the Future is done once it is committed (or holds the database's error)."""
        done: Future = Future()
        self._queue.put((study, kind, json.dumps(body), done))
        return done

    def delete(self, study: str) -> Future:
        """Queue the removal of every row of ``study`` (in order with the appends before it)."""
        done: Future = Future()
        self._queue.put((study, "", "", done))
        return done

    def _write_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while True:  # everything queued meanwhile goes into the same transaction
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                batch.append(item)
            try:
                with self.write_lock, self.engine.begin() as conn:
                    rows: list[dict[str, str]] = []
                    for study, kind, body, _ in batch:
                        if kind:
                            rows.append({"study": study, "kind": kind, "body": body})
                            continue
                        if rows:  # keep the order: appends before a delete are written first
                            conn.execute(events.insert(), rows)
                            rows = []
                        conn.execute(events.delete().where(events.c.study == study))
                    if rows:
                        conn.execute(events.insert(), rows)
            except Exception as exc:  # every waiting request gets the database's error
                for *_, done in batch:
                    done.set_exception(exc)
                continue
            for *_, done in batch:
                done.set_result(None)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
        self.engine.dispose()

    # ----- reading ---------------------------------------------------------------------------
    def read(self, study: str) -> list[tuple[str, Any]]:
        """A study's events in the order they were written (empty: no such study in the log)."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(events.c.kind, events.c.body).where(events.c.study == study)
                                .order_by(events.c.id)).all()
        return [(kind, json.loads(body)) for kind, body in rows]

    def studies(self) -> list[str]:
        with self.engine.connect() as conn:
            return [r[0] for r in conn.execute(sa.select(events.c.study).distinct().order_by(events.c.study))]
