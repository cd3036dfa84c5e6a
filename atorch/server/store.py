"""The server's studies: Optuna studies on Optuna's own storage (RDB), the one record of every search.

Every request reads the study from the storage and rebuilds its ``SearchState`` from the trials there, so the
server holds nothing the storage does not (optuna-dashboard and ``atorch search-report`` read the same rows), and a
request whose commit fails leaves no copy behind that disagrees: it answers ``Unavailable`` (503 with Retry-After)
and the retry starts again from what the storage holds. A tell is acknowledged after Optuna's ``tell`` committed
the trial's state, its last write: until then the trial is RUNNING, and a retried tell stores it. Within one
request, what it read is not read again (``RequestMemo``: Optuna reads a told trial six times). Kept between
requests: a study's trials as committed, for the requests that hold its turn (used while the token each writing
request commits in the study is this process's, else read again: ``RequestMemo``; re-reading every trial in flight
on every request doubled its CPU time at 32 clients), the per-study locks (``Turns``: first come, first served),
each study's sampler (what it derives from the trials is updated from those it reads on each ask, not rebuilt) and
the candidate tables, which never change for a study: its name ends with a digest of its space (the table's points
and global batch: ``study_name``), so a job with another space under the same key gets another study. The hardware
is in the key a ``RemotePlanner`` sends (``StudyIdentity``: the model, space, hardware, ... — everything but the
budget); a table sent again for the same space keeps the predictions stored first (a cost model's figures for one
machine vary a little between runs: they must not split the study). The memory budget is the caller's: each request
may carry its own (default: the one the study was created with), and the stored measurements are judged under it,
so jobs with different budgets share measurements and each gets answers under its own budget.

An ask has a time cap: the sampler proposing candidates that are taken (measured, or in flight with another
client) is answered by enqueueing an untaken one, a study whose every candidate is taken answers ``exhausted``
at once with no trial created, and an ask that still runs out of time is a 503 the client retries. An asked
trial carries a lease (unix time in its user attrs); a lease past due is marked FAILED before the study is
asked or listed, so the candidate can be asked again (until then a late result is still taken; after, 409).
A RUNNING trial with no lease is an ask that died before it answered, or one that another writer of the storage
(a local search, a server that should not be there) has just created and not yet leased: it is marked FAILED
only once it is older than the ask's time cap plus ``ORPHAN_GRACE_S``, never while it may still be answered.

One server process per database: on a SQLite file an exclusive lock on ``<database>.lock``, taken before
anything is served (``sqlite_lock``: a second server refuses to start, naming the first); on PostgreSQL a
session advisory lock per study, taken when it is first touched (a second server asking for it gets
``StudyBusy``, 409). A storage error answers ``Unavailable`` with the database's own message, and drops the
pooled connections (``heal_pool``): a SQLite connection opened while the file was read-only stays read-only, so
new ones are opened once it is writable again.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import math
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any

import optuna
from optuna.trial import TrialState

from atorch.server.memo import RequestMemo
from atorch.server.sqlite_lock import ServerLock
from atorch.strategy_search.search.ask_tell import SearchState, make_sampler
from atorch.strategy_search.search.candidates import CandidateTable, family_key, is_baseline, point_key

TABLE_ATTR, CONFIG_ATTR, CONFIRM_ATTR = "atorch_table", "atorch_config", "confirmations"
EXHAUSTED = "exhausted: every candidate is measured, ruled out or being measured by another client"
_OUT_OF_TIME = "\0out of time"
RULED_OUT = ("predicted_oom", "skipped")
DIRECT_FRACTION = 4  # once at most 1/4 of the table is untaken, an ask takes the best-ranked untaken one
# A RUNNING trial with no lease is failed only once older than the ask's cap plus this: an ask creates the trial
# and writes its lease in later commits (each may wait up to the busy timeout on a locked file), and another
# writer's fresh trial must never be taken for a dead one.
ORPHAN_GRACE_S = 60.0


class UnknownStudy(KeyError):
    pass


class UnknownTrial(KeyError):
    pass


class UnknownCandidate(KeyError):
    pass


class LeaseExpired(RuntimeError):
    pass


class StudyBusy(RuntimeError):
    pass


class Unavailable(RuntimeError):
    """The storage failed (locked, connection dropped) or the study is busy: nothing was acknowledged; retry."""


def study_name(key: str, table: dict[str, Any]) -> str:
    """The stored study of ``key`` for this space: the key plus a digest of the table's points and global
    batch."""
    space = {"points": table["points"], "global_batch": table["global_batch"]}
    digest = hashlib.sha256(json.dumps(space, sort_keys=True).encode()).hexdigest()[:12]
    return f"{key}:{digest}"


def check_table(table: CandidateTable) -> None:
    """Refuse (ValueError naming the point) a table the sampler cannot walk, before anything is stored: every
    point must be reached by walking the table's tree (the same dimensions in the same order after the same
    prefix), and be judged by the memory-family and baseline rules."""
    for i, point in enumerate(table.points):
        try:
            walked = table._walk(lambda name, _choices, p=point: p[name.split("|", 1)[0]])
            family_key(point)
            is_baseline(point)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"point {i} ({point_key(point)}) does not fit the table's dimensions: {exc!r}") from exc
        if walked != point:
            raise ValueError(f"point {i} ({point_key(point)}) has dimensions in another order or set than the "
                             f"points before it (walked {point_key(walked)}): give every point the same dimensions")


def open_storage(url: str, busy_timeout_s: float = 5.0) -> Any:
    """Optuna's RDB storage of a URL. SQLite: WAL (readers never wait for the writer) and a busy timeout after
    which a request is a 503 rather than a hang. PostgreSQL: the sessions' commits do not wait for the disk
    (``synchronous_commit`` off: a request's dozen commits waited for a dozen WAL flushes, one after the other, in
    the study's turn); a request that holds a study's turn ends with one commit that does (``Studies._durable``),
    which flushes the WAL up to it: what it answers (an acknowledged tell) is on disk before the answer, and a
    crash of the database keeps a prefix of the commits, as a server stopped mid-request would leave."""
    from sqlalchemy import event, make_url

    if url.startswith("sqlite"):
        rdb = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": busy_timeout_s}})

        @event.listens_for(rdb.engine, "connect")
        def _pragmas(conn: Any, _record: Any) -> None:
            cursor = conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()

        rdb.engine.dispose()  # connections opened before the listener reconnect with the pragmas
        return rdb
    if url.startswith("postgresql"):
        options = " ".join(filter(None, [make_url(url).query.get("options"), "-c synchronous_commit=off"]))
        return optuna.storages.RDBStorage(url, engine_kwargs={"pool_pre_ping": True,
                                                              "connect_args": {"options": options}})
    return optuna.storages.RDBStorage(url)


def storage_error_text(exc: BaseException) -> str:
    """The database's own message of a storage error (Optuna wraps every commit's failure in one text about
    "invalid data ... exceeding max length", whatever it was: the cause underneath says what happened)."""
    import sqlalchemy.exc

    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, sqlalchemy.exc.SQLAlchemyError):
        seen = seen.__cause__ or seen.__context__
    root: BaseException = exc if seen is None else getattr(seen, "orig", None) or seen
    module = type(root).__module__
    kind = type(root).__name__ if module == "builtins" else f"{module}.{type(root).__name__}"
    text = str(root).splitlines()[0][:300] if str(root) else ""
    return f"{kind}: {text}"


@contextlib.contextmanager
def _storage_errors(on_error: Any = None) -> Iterator[None]:
    """A database error (locked, read-only, full, connection lost) as ``Unavailable`` naming it: the request
    changed nothing it answered. ``on_error()`` is called first (``Studies.heal_pool``)."""
    import sqlalchemy.exc

    try:
        yield
    except (optuna.exceptions.StorageInternalError, sqlalchemy.exc.SQLAlchemyError) as exc:
        if on_error is not None:
            on_error()
        raise Unavailable(f"the storage failed ({storage_error_text(exc)})") from exc


class Turns:
    """A lock whose waiters get it in the order they came (``threading.Lock`` wakes any one of them: under 32
    clients a request could wait many times the median while later ones went first)."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._queue: collections.deque[threading.Event] = collections.deque()
        self._held = False

    def acquire(self, timeout: float) -> bool:
        with self._mutex:
            if not self._held:
                self._held = True
                return True
            turn = threading.Event()
            self._queue.append(turn)
        if turn.wait(timeout):
            return True
        with self._mutex:
            if turn.is_set():  # handed over as the wait ran out
                return True
            self._queue.remove(turn)
            return False

    def release(self) -> None:
        with self._mutex:
            if self._queue:
                self._queue.popleft().set()  # handed over: still held
            else:
                self._held = False


class _Open:
    """One request's view of a study: what the storage holds now (its trials, config and SearchState)."""

    def __init__(self, studies: Studies, name: str, budget: float | None = None) -> None:
        storage = studies.memo
        try:
            self.sid = storage.get_study_id_from_name(name)
        except KeyError:
            raise UnknownStudy(name) from None
        self.name = name
        self.attrs = storage.get_study_user_attrs(self.sid)
        if CONFIG_ATTR not in self.attrs:  # a local search's study, or one whose create did not finish
            raise UnknownStudy(name)
        self.config: dict[str, Any] = self.attrs[CONFIG_ATTR]
        self.table = studies.table(name, self.sid, self.attrs)
        self.study = optuna.Study(study_name=name, storage=storage)
        self.trials = self.study.get_trials(deepcopy=False)
        cfg = self.config
        self.study.sampler = studies.sampler(name, self.sid, cfg, len(self.trials))
        self.budget = float(budget if budget is not None else cfg["memory_budget"])
        self.state = SearchState(self.study, self.table, self.budget, storage=storage,
                                 max_asks=10**9, trials=self.trials,  # bounded by time and by the table
                                 stop_when_nothing_left=bool(cfg.get("stop_when_nothing_left", True)))
        # Candidates ruled out without a dry-run stay ruled out while they still would be under this budget
        # (predicted too big, with the family corrections, which only grow; or hopelessly slow next to a best
        # that only improves): a proposal of one again is a duplicate, as it is within one search.
        state, table = self.state, self.table
        for t in self.trials:
            status, key = t.user_attrs.get("status"), t.user_attrs.get("key")
            if t.state != TrialState.COMPLETE or status not in RULED_OUT or key in state.done:
                continue
            if status == "predicted_oom" and table.fits(table.prediction(key), self.budget, state.correction(key)):
                continue
            state.done[key] = (t.value, dict(t.constraints), {"number": t.number, "status": status,
                                                              "reason": t.user_attrs.get("reason", "")})

    def running(self) -> dict[int, tuple[str | None, float | None]]:
        """number -> (key, lease due) of every RUNNING trial."""
        return {t.number: (t.user_attrs.get("key"), t.user_attrs.get("lease_expires"))
                for t in self.trials if t.state == TrialState.RUNNING}

    def expire(self, now: float, orphan_after_s: float) -> None:
        """Mark failed the running trials past their lease, and those with no lease (no ask finished) started more
        than ``orphan_after_s`` ago: a younger one may be an ask still on its way (another writer's)."""
        changed = False
        for t in self.trials:
            if t.state != TrialState.RUNNING:
                continue
            due = t.user_attrs.get("lease_expires")
            if due is None:
                started = t.datetime_start.timestamp() if t.datetime_start is not None else now
                if now - started <= orphan_after_s:
                    continue
                self.state.fail(t.number, f"no lease {now - started:.0f} s after it was created: the ask that "
                                "created it did not finish (server stopped or storage failed)", status="discarded")
            elif due < now:
                self.state.fail(t.number, f"lease expired at {due:.0f} (unix time) with no result told")
            else:
                continue
            changed = True
        if changed:
            self.trials = self.study.get_trials(deepcopy=False)


class Studies:
    def __init__(self, storage: str, clock: Any = time.time, ask_cap_s: float = 1.0,
                 busy_timeout_s: float = 5.0, address: str | None = None) -> None:
        # First: a second server on this SQLite file refuses to start here, before it reads or writes anything.
        self._server_lock = ServerLock.take(storage, address)
        try:
            self.rdb = open_storage(storage, busy_timeout_s)
        except BaseException:
            if self._server_lock is not None:
                self._server_lock.release()
            raise
        # What optuna.load_study uses: finished trials are read once and kept; the rest is read on each call.
        self.storage = optuna.storages.get_storage(self.rdb)
        self.memo = RequestMemo(self.storage)  # what requests read through (``RequestMemo.request``)
        self.clock, self.ask_cap_s, self.busy_timeout_s = clock, ask_cap_s, busy_timeout_s
        self._locks: dict[str, Turns] = {}
        self._tables: dict[str, CandidateTable] = {}  # by study name (whose digest fixes its table)
        self._samplers: dict[tuple[Any, ...], Any] = {}  # by study name, id and sampler settings
        self._guard = threading.Lock()
        self._postgres = self.rdb.engine.dialect.name == "postgresql"
        self._advisory: Any = None  # the PostgreSQL session holding this process's study locks (``_claim``)
        self._advisory_checked = 0.0
        self._claimed: set[str] = set()
        self.on_storage_error: Any = None  # set by the app: its health probe runs again (``health.StorageHealth``)

    def close(self) -> None:
        if self._advisory is not None:
            self._advisory.close()
        self.rdb.engine.dispose()
        if self._server_lock is not None:
            self._server_lock.release()

    def heal_pool(self) -> None:
        """After a storage error: new connections for the next requests (a SQLite connection opened while the
        file was read-only stays read-only after it is writable again; a dropped one is dead). Connections in
        use by other requests are closed when they are given back. The health probe runs again."""
        self.rdb.engine.dispose()
        if self.on_storage_error is not None:
            self.on_storage_error()

    # ----- locks and claims ------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, name: str, wait_s: float) -> Iterator[None]:
        """This process's one request at a time on a study (waiting at most ``wait_s``; then 503)."""
        with self._guard:
            lock = self._locks.setdefault(name, Turns())
        if not lock.acquire(timeout=wait_s):
            raise Unavailable(f"study {name!r} is busy with other requests")
        try:
            with self._request(keep=True):  # holding the study's turn: its trials are kept between requests
                yield
            with _storage_errors(self.heal_pool):
                self._durable()  # last: after the memo's own end-of-request writes
        finally:
            lock.release()

    def _durable(self) -> None:
        """PostgreSQL: one commit that waits for the disk (``synchronous_commit`` on; ``txid_current()`` gives the
        transaction a commit record), so the WAL is flushed up to it: every commit this request made or read is on
        disk before it answers (the sessions' own commits do not wait: ``open_storage``)."""
        if not self._postgres:
            return
        import sqlalchemy as sa

        with self.rdb.engine.connect() as conn:
            conn.execute(sa.text("set local synchronous_commit to on"))
            conn.execute(sa.text("select txid_current()"))
            conn.commit()

    @contextlib.contextmanager
    def _request(self, keep: bool = False) -> Iterator[None]:
        """One request's storage work: its reads memoized (``RequestMemo``), its database errors ``Unavailable``."""
        with _storage_errors(self.heal_pool), self.memo.request(keep=keep):
            yield

    def _claim(self, name: str, release: bool = False) -> None:
        """PostgreSQL: this process serves ``name`` alone (a session advisory lock, held until it exits or
        deletes the study). The database may drop that session (a restart, ``pg_terminate_backend``): its locks
        go with it, so a session found dropped is opened again and every claim taken again (one another server
        took meanwhile is that server's: ``StudyBusy`` here). A release never fails its request: the study's
        deletion is committed by then, and a dropped session holds no lock left to release."""
        if not self._postgres:
            return
        import sqlalchemy.exc

        with self._guard:
            if release:
                if name in self._claimed and self._advisory is not None:
                    with contextlib.suppress(sqlalchemy.exc.SQLAlchemyError):
                        self._advisory_call("pg_advisory_unlock", name)
                self._claimed.discard(name)
                return
            if name in self._claimed and self._session_alive():
                return
            if self._advisory is None:
                self._reclaim()
            if name in self._claimed:
                return
            if not self._advisory_call("pg_try_advisory_lock", name):
                raise StudyBusy(f"study {name!r} is served by another atorch server on this database; "
                                "send every request for a study to one server")
            self._claimed.add(name)

    def _advisory_call(self, call: str, name: str) -> bool:
        """``select call(7431, <name's id>)`` on the advisory session (opened on first use). A database error
        drops the session (its locks are gone or about to go) and is raised: the request is a 503."""
        import sqlalchemy as sa

        if self._advisory is None:
            self._advisory = self.rdb.engine.connect()
        ident = zlib.crc32(name.encode()) - 2**31
        try:
            got = self._advisory.execute(sa.text(f"select {call}(7431, :k)"), {"k": ident}).scalar()
            self._advisory.commit()
        except sa.exc.SQLAlchemyError:
            self._drop_session()
            raise
        self._advisory_checked = time.monotonic()
        return bool(got)

    def _session_alive(self, every_s: float = 5.0) -> bool:
        """Whether the advisory session still stands (asked of the database at most every ``every_s``)."""
        import sqlalchemy as sa

        if self._advisory is None:
            return False
        if time.monotonic() - self._advisory_checked < every_s:
            return True
        try:
            self._advisory.execute(sa.text("select 1")).scalar()
            self._advisory.commit()
        except sa.exc.SQLAlchemyError:
            self._drop_session()
            return False
        self._advisory_checked = time.monotonic()
        return True

    def _drop_session(self) -> None:
        """Close the advisory session for good (never back into the pool: its locks must not outlive it)."""
        import sqlalchemy.exc

        with contextlib.suppress(sqlalchemy.exc.SQLAlchemyError):
            self._advisory.invalidate()
        with contextlib.suppress(sqlalchemy.exc.SQLAlchemyError):
            self._advisory.close()
        self._advisory = None

    def _reclaim(self) -> None:
        """A new advisory session: take again every study this process held (those another server took
        meanwhile are its: dropped from this process's claims)."""
        held, self._claimed = self._claimed, set()
        for other in sorted(held):
            if self._advisory_call("pg_try_advisory_lock", other):
                self._claimed.add(other)

    def _open(self, name: str, budget: float | None = None) -> _Open:
        self._claim(name)
        return _Open(self, name, budget)

    def sampler(self, name: str, sid: int, config: dict[str, Any], n_trials: int) -> Any:
        """The study's sampler, kept between requests: what it derives from the trials (TPE's intersection search
        space) is then updated with the trials since its last ask instead of rebuilt from all of them each time;
        it reads the trials from the storage on every ask, so it knows nothing the storage does not. A new one
        (a restart, other settings) is seeded by the trial count, so that it does not repeat a former one."""
        key = (name, sid, config["sampler"], config["max_trials"], config["seed"])
        with self._guard:
            if key not in self._samplers:
                self._samplers[key] = make_sampler(config["sampler"], config["max_trials"], config["seed"] + n_trials)
            return self._samplers[key]

    def table(self, name: str, sid: int, attrs: dict[str, Any]) -> CandidateTable:
        table = self._tables.get(name)
        if table is None:
            data = self.storage.get_study_system_attrs(sid).get(TABLE_ATTR) or attrs.get(TABLE_ATTR)
            if data is None:
                raise UnknownStudy(name)
            table = self._tables[name] = CandidateTable.from_json(data)
        return table

    # ----- studies ---------------------------------------------------------------------------
    def create(self, key: str, table: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
        """Create-or-get the study of ``key`` for this table (its name: ``study_name``). The table is checked
        before anything is written and stored once; the settings (the default budget, the sampler's) are
        updated; the cost model's seeds under this budget are enqueued once. Each step is idempotent: a create
        that failed half-way is finished by a retry."""
        parsed = CandidateTable.from_json(table)
        check_table(parsed)
        name = study_name(key, table)
        config = {**config, "global_batch": parsed.global_batch, "key": key}
        with self._locked(name, self.busy_timeout_s + 5):
            self._claim(name)
            try:
                sid = self.storage.get_study_id_from_name(name)
            except KeyError:
                sid = self.storage.create_new_study([optuna.study.StudyDirection.MAXIMIZE], name)
            if TABLE_ATTR not in self.storage.get_study_system_attrs(sid):
                self.storage.set_study_system_attr(sid, TABLE_ATTR, table)  # big: out of the user attrs
            self._tables.setdefault(name, parsed)
            if self.storage.get_study_user_attrs(sid).get(CONFIG_ATTR) != config:
                self.storage.set_study_user_attr(sid, CONFIG_ATTR, config)  # last: the study is complete
            opened = _Open(self, name, config["memory_budget"])
            opened.state.seed(config["top_k"])
            return self._info(opened, config["memory_budget"])

    def info(self, name: str, memory_budget: float | None = None) -> dict[str, Any]:
        with self._request():
            opened = self._open(name)
            return self._info(opened, memory_budget if memory_budget is not None else opened.config["memory_budget"])

    def _info(self, opened: _Open, budget: float) -> dict[str, Any]:
        best = opened.attrs.get("best")
        return {"study_key": opened.name, "n_trials": len(opened.trials), "memory_budget": budget,
                "cached": best if best and best["peak_memory_bytes"] <= budget else None}

    def names(self) -> list[str]:
        with _storage_errors(self.heal_pool):
            return sorted(s.study_name for s in self.storage.get_all_studies())

    def delete(self, name: str) -> None:
        with self._locked(name, self.busy_timeout_s + 5):
            try:
                sid = self.storage.get_study_id_from_name(name)
            except KeyError:
                raise UnknownStudy(name) from None
            self._claim(name)
            self.storage.delete_study(sid)
            self._tables.pop(name, None)
            with self._guard:
                self._samplers = {k: v for k, v in self._samplers.items() if k[0] != name}
            self._claim(name, release=True)

    # ----- ask / tell ------------------------------------------------------------------------
    def ask(self, name: str, lease_s: float | None, budget: float | None = None) -> dict[str, Any]:
        with self._locked(name, self.busy_timeout_s + 5):  # other requests first: each holds it briefly
            deadline = time.monotonic() + self.ask_cap_s
            opened = self._open(name, budget)
            now = self.clock()
            opened.expire(now, self.ask_cap_s + ORPHAN_GRACE_S)
            state, table = opened.state, opened.table
            in_flight = {k for k, _ in opened.running().values() if k is not None}
            untaken = [k for k in table.keys if k not in state.done and k not in in_flight]
            lease = lease_s if lease_s is not None else opened.config["lease_s"]
            expires = now + lease
            if not untaken:
                return _answer(None, EXHAUSTED, [], None)
            if not any(table.fits(pred := table.prediction(k), state.budget, state.correction(k)) or "error" in pred
                       for k in untaken):  # each would be told predicted_oom, one trial at a time: answered at once
                return _answer(None, f"exhausted: none of the {len(untaken)} candidates left is predicted to fit the "
                                     f"memory budget ({state.budget / 2**20:.1f} MiB)", [], None)
            told: list[dict[str, Any]] = []
            state.on_trial = told.append
            direct = len(untaken) * DIRECT_FRACTION <= len(table.keys)
            waiting = [sum(t.state == TrialState.WAITING for t in opened.trials)]  # study.ask takes these first

            def stop() -> str:  # called before each study.ask of this ask
                if time.monotonic() > deadline:
                    return _OUT_OF_TIME
                if direct or (told and told[-1]["status"] in ("duplicate", "in_flight")):
                    # Few left, or the sampler proposed a taken candidate: the next ask takes an untaken one.
                    left = [k for k in untaken if k not in state.done]
                    if not left:
                        return EXHAUSTED
                    if not waiting[0]:
                        chosen = set(left)
                        ranked = [k for k in table.ranked(state.budget, state.correction) if k in chosen]
                        pick = (ranked or left)[0]
                        opened.study.enqueue_trial(table.to_params(table.points[table.by_key[pick]]))
                        waiting[0] += 1
                    told.append({"status": "enqueued"})
                waiting[0] = max(0, waiting[0] - 1)
                return ""

            proposal = state.ask(stop=stop, in_flight=lambda: in_flight, lease_attrs={"lease_expires": expires})
            told = [t for t in told if t["status"] != "enqueued"]
            if proposal.stop == _OUT_OF_TIME:
                raise Unavailable(f"no candidate found within the ask's {self.ask_cap_s:g} s")
            if proposal.number is None:
                return _answer(None, proposal.stop, told, None)
            return {**_answer(proposal.number, "", told, expires), "point": proposal.point, "key": proposal.key,
                    "predicted": proposal.predicted}

    def tell(self, name: str, number: int, measured: dict[str, Any], budget: float | None = None) -> dict[str, Any]:
        with self._locked(name, self.busy_timeout_s + 5):
            opened = self._open(name, budget)
            trial = next((t for t in opened.trials if t.number == number), None)
            if trial is None or trial.state == TrialState.WAITING:  # never asked (or only enqueued)
                raise UnknownTrial(number)
            if trial.state == TrialState.FAIL and trial.user_attrs.get("status") == "expired":
                raise LeaseExpired(trial.user_attrs.get("reason", "lease expired"))
            record = opened.state.tell(number, measured)
            improved = record.pop("improved")
            already = bool(record.pop("already_told", False))
            return {"record": record, "improved": improved, "already_told": already}

    def contenders(self, name: str, within: float, budget: float | None = None) -> dict[str, Any]:
        """The best and the runner-up when it measured within ``within`` of the best (SearchState.contenders)."""
        with self._request():
            found, measured_ok = self._open(name, budget).state.contenders(within)
        return {"contenders": found, "measured_ok": measured_ok}

    def confirm(self, name: str, candidate: str, measured: dict[str, Any],
                budget: float | None = None) -> dict[str, Any]:
        """A re-measurement of a measured candidate (SearchState.confirm: the study's ``confirmations``)."""
        with self._locked(name, self.busy_timeout_s + 5):
            opened = self._open(name, budget)
            known = opened.state.done.get(candidate)
            if known is None or "measured" not in known[2]:
                raise UnknownCandidate(candidate)
            record = opened.state.confirm(candidate, measured)
            return {"record": record, "best": opened.state.best()}

    def store_best(self, name: str, extra: dict[str, Any] | None,
                   budget: float | None = None) -> dict[str, Any] | None:
        """Store the best measured candidate that fits ``budget`` as the study's answer (checked against each
        later caller's budget)."""
        with self._locked(name, self.busy_timeout_s + 5):
            opened = self._open(name, budget)
            if opened.state.store_best(extra) is None:
                return None
            return opened.study.user_attrs["best"]

    def best(self, name: str, memory_budget: float | None) -> dict[str, Any] | None:
        with self._request():
            opened = self._open(name)
        budget = memory_budget if memory_budget is not None else opened.config["memory_budget"]
        best = opened.attrs.get("best")
        return best if best and best.get("peak_memory_bytes", math.inf) <= budget else None

    def trials(self, name: str) -> list[dict[str, Any]]:
        try:
            with self._locked(name, self.busy_timeout_s + 5):
                opened = self._open(name)
                opened.expire(self.clock(), self.ask_cap_s + ORPHAN_GRACE_S)
                return [_listed(t) for t in opened.trials]
        except UnknownStudy:  # a local search's study: listed from the storage as it is
            with _storage_errors(self.heal_pool):
                try:
                    study = optuna.load_study(study_name=name, storage=self.storage)
                except KeyError:
                    raise UnknownStudy(name) from None
                return [_listed(t) for t in study.get_trials(deepcopy=False)]

    def view(self, name: str) -> Any:
        """What the /ui page shows of a study (the Optuna study; its table's global batch in its attrs)."""
        study = optuna.load_study(study_name=name, storage=self.storage)
        attrs = dict(study.user_attrs)
        config = attrs.get(CONFIG_ATTR) or {}
        attrs.setdefault(TABLE_ATTR, {"global_batch": config.get("global_batch")})
        return _View(name, self.storage.get_study_id_from_name(name), attrs, study.get_trials(deepcopy=False))


class _View:
    def __init__(self, study_name: str, study_id: int, user_attrs: dict[str, Any], trials: list[Any]) -> None:
        self.study_name, self.study_id, self.user_attrs, self.trials = study_name, study_id, user_attrs, trials

    def get_trials(self, deepcopy: bool = False) -> list[Any]:
        return self.trials


def _answer(number: int | None, stop: str, told: list[dict[str, Any]], expires: float | None) -> dict[str, Any]:
    return {"number": number, "point": None, "key": "", "predicted": {}, "stop": stop, "told": told,
            "lease_expires": expires}


def _listed(t: Any) -> dict[str, Any]:
    return {"number": t.number, "state": t.state.name, "value": t.value,
            "constraints": dict(t.constraints), "user_attrs": dict(t.user_attrs)}
