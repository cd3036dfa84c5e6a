"""The server's studies: each one's search state in memory, every change one row of the event log.

A study lives in this process as an Optuna study on an in-memory storage with its ``SearchState``; an ask
or tell is an in-memory operation plus one durable row (``atorch.server.events``: the trials it changed,
as snapshots), and is answered once that row is committed. The first touch of a study after a start
rebuilds it by replaying its rows (a study only in the Optuna storage, from an earlier server version, is
imported once), so a restart loses nothing. A confirmation (a second run of a measured candidate,
``SearchState.confirm``) is one "confirm" row, replayed into the study's ``confirmations`` attribute.
An asked trial carries a lease (unix time in its user attrs); a lease past due is marked FAILED before the
study is asked or listed, so the candidate can be asked again (until then a late result is still taken;
after, it is a 409).

The sampler works ahead: after each ask or tell a thread prepares the next suggestion (an Optuna trial
with its point), and the next ask takes it, falling back to sampling inline when none is ready. The
prepared trial is not recorded until an ask takes it, and the ask judges it as an inline one (a known
candidate is told as a duplicate, one in flight is failed), so nothing is measured twice at once.

The Optuna storage holds a copy for optuna-dashboard and ``atorch search-report`` (``atorch.server.mirror``,
written off the request path). One server process per database: the state is in this process, so two
servers on one PostgreSQL would each hold their own copy of a study. On PostgreSQL a study is guarded by a
session advisory lock taken when it is loaded; a second server asking for it gets ``StudyBusy`` (409).
"""

from __future__ import annotations

import math
import queue
import threading
import time
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import optuna

from atorch.server.events import EventLog, connect_args, tune_sqlite
from atorch.server.mirror import Mirror, rdb_trials
from atorch.server.snapshot import placeholder, trial_from_json, trial_json
from atorch.settings import settings
from atorch.strategy_search.ask_tell import SearchState, make_sampler
from atorch.strategy_search.candidates import CandidateTable

TABLE_ATTR, CONFIG_ATTR, CONFIRM_ATTR = "atorch_table", "atorch_config", "confirmations"


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


def open_storage(url: str) -> Any:
    """The Optuna storage of a URL (the copy for the dashboards), tuned as the event log is."""
    if url.startswith("sqlite"):
        rdb = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": connect_args(url)})
        tune_sqlite(rdb.engine)
        rdb.engine.dispose()  # connections opened before the listener reconnect with the pragmas
        return rdb
    if url.startswith("postgresql"):
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": connect_args(url)})
    return optuna.storages.get_storage(url)


def _done() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f


class _Proposer:
    """The study as SearchState sees it, whose ``ask()`` hands out the prepared trial first and notes
    every trial it hands out (the ones this request changes)."""

    def __init__(self, study: Any) -> None:
        self._study = study
        self.ready: Any = None
        self.asked: list[int] = []

    def ask(self) -> Any:
        trial, self.ready = self.ready, None
        trial = trial if trial is not None else self._study.ask()
        self.asked.append(trial.number)
        return trial

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)


@dataclass
class Live:
    key: str
    study: Any  # on ``storage``
    storage: Any  # an InMemoryStorage
    study_id: int  # the study's id in it
    config: dict[str, Any]
    table: CandidateTable
    proposer: _Proposer
    state: SearchState
    logged: dict[int, dict[str, Any]]  # trial number -> its last recorded snapshot (what a replay gives)
    running: dict[int, tuple[str, float | None]] = field(default_factory=dict)  # number -> (key, lease due)
    lock: threading.RLock = field(default_factory=threading.RLock)
    deleted: bool = False

    def trial(self, number: int) -> Any:
        return self.storage.get_trial(self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number))


class Studies:
    def __init__(self, storage: str, clock: Any = time.time, mirror_interval_s: float | None = None) -> None:
        if mirror_interval_s is None:  # how often the Optuna copy is written (seconds)
            mirror_interval_s = settings().server_mirror_s
        self.storage = open_storage(storage)
        self.log = EventLog(storage)
        self.mirror = Mirror(self.storage, mirror_interval_s, self.log.write_lock)
        self.clock = clock
        self._live: dict[str, Live] = {}
        self._guard = threading.RLock()
        self._advisory = self.log.engine.connect() if self.log.engine.dialect.name == "postgresql" else None
        self._todo: queue.Queue[str | None] = queue.Queue()
        self._sampler = threading.Thread(target=self._prepare_loop, name="atorch-sampler", daemon=True)
        self._sampler.start()

    def close(self) -> None:
        self._todo.put(None)
        self._sampler.join(timeout=30)
        self.mirror.close()
        self.log.close()
        if self._advisory is not None:
            self._advisory.close()

    # ----- loading ---------------------------------------------------------------------------
    def _get(self, key: str) -> Live:
        live = self._live.get(key)
        if live is not None:
            return live
        with self._guard:
            if key not in self._live:
                self._live[key] = self._load(key)
            return self._live[key]

    def _claim(self, key: str, release: bool = False) -> None:
        """PostgreSQL: this process serves ``key`` alone (a session advisory lock, held until it exits or
        deletes the study)."""
        if self._advisory is None:
            return
        import sqlalchemy as sa

        ident = zlib.crc32(key.encode()) - 2**31
        call = "pg_advisory_unlock" if release else "pg_try_advisory_lock"
        got = self._advisory.execute(sa.text(f"select {call}(7431, :k)"), {"k": ident}).scalar()
        self._advisory.commit()
        if not got and not release:
            raise StudyBusy(f"study {key!r} is served by another atorch server on this database; "
                            "send every request for a study to one server")

    def _load(self, key: str) -> Live:
        events = self.log.read(key)
        if not events:
            return self._import(key)
        self._claim(key)
        attrs: dict[str, Any] = {}
        snaps: dict[int, dict[str, Any]] = {}
        for kind, body in events:
            if kind == "study":
                attrs.update({TABLE_ATTR: body["table"], CONFIG_ATTR: body["config"]})
            elif kind == "best":
                attrs["best"] = body
            elif kind == "confirm":
                attrs.setdefault(CONFIRM_ATTR, []).append(body)
            elif kind == "trials":
                snaps.update({t["number"]: t for t in body})
        live = self._build(key, attrs, snaps)
        self.mirror.push(key, attrs, list(live.logged.values()))  # brings the copy up to date
        return live

    def _import(self, key: str) -> Live:
        """A study in the Optuna storage with no event (an earlier server's): recorded once, then served."""
        found = rdb_trials(self.storage, key)
        if found is None or CONFIG_ATTR not in found[0]:
            raise UnknownStudy(key)  # none, or a local search's study
        self._claim(key)
        attrs, trials = found
        snaps = {t.number: trial_json(t) for t in trials}
        live = self._build(key, dict(attrs), snaps)
        self.log.append(key, "study", {"table": attrs[TABLE_ATTR], "config": attrs[CONFIG_ATTR]})
        if "best" in attrs:
            self.log.append(key, "best", attrs["best"])
        for record in attrs.get(CONFIRM_ATTR, []):
            self.log.append(key, "confirm", record)
        self.log.append(key, "trials", list(live.logged.values())).result()
        return live

    def _build(self, key: str, attrs: dict[str, Any], snaps: dict[int, dict[str, Any]],
               seed_top_k: int | None = None) -> Live:
        config = attrs[CONFIG_ATTR]
        table = CandidateTable.from_json(attrs[TABLE_ATTR])
        storage = optuna.storages.InMemoryStorage()
        study = optuna.create_study(storage=storage, study_name=key, direction="maximize")
        for k, v in attrs.items():
            study.set_user_attr(k, v)
        gaps = []
        for number in range(max(snaps, default=-1) + 1):
            if number not in snaps:  # no row holds it: kept failed so later numbers stay where they were
                snaps[number] = trial_json(placeholder(number, "a trial number with no record (server restart)"))
                gaps.append(snaps[number])
            study.add_trial(trial_from_json(snaps[number]))
        if gaps:
            self.log.append(key, "trials", gaps)
        proposer = _Proposer(study)
        state = self._state(proposer, storage, config, table)
        live = Live(key, study, storage, state.study_id, config, table, proposer, state, dict(snaps))
        for number, snap in snaps.items():
            if snap["state"] == "RUNNING" and "key" in snap["user_attrs"]:
                live.running[number] = (snap["user_attrs"]["key"], snap["user_attrs"].get("lease_expires"))
        return live

    @staticmethod
    def _state(proposer: _Proposer, storage: Any, config: dict[str, Any], table: CandidateTable) -> SearchState:
        study = proposer._study
        trials = study.get_trials(deepcopy=False)
        # Seeded by the trial count, so a sampler rebuilt after a restart does not repeat itself.
        study.sampler = make_sampler(config["sampler"], config["max_trials"], config["seed"] + len(trials))
        return SearchState(proposer, table, config["memory_budget"], storage=storage,
                           max_asks=max(50, 10 * config["max_trials"]), trials=trials)

    # ----- recording -------------------------------------------------------------------------
    def _record(self, live: Live, numbers: list[int]) -> Future:
        """One row with the snapshots of the trials this request changed (under the study's lock)."""
        if not numbers:
            return _done()
        snaps = [trial_json(live.trial(n)) for n in sorted(set(numbers))]
        for s in snaps:
            live.logged[s["number"]] = s
            if s["state"] != "RUNNING":
                live.running.pop(s["number"], None)
        done = self.log.append(live.key, "trials", snaps)
        self.mirror.push(live.key, trials=snaps)
        return done

    # ----- the sampler thread ----------------------------------------------------------------
    def _prepare_loop(self) -> None:
        while (key := self._todo.get()) is not None:
            live = self._live.get(key)
            if live is None:
                continue
            with live.lock:
                if live.deleted or live.proposer.ready is not None or live.state.exhausted():
                    continue
                try:
                    trial = live.study.ask()
                    live.table.suggest(trial)
                except Exception:  # the next ask samples inline and meets the error there
                    continue
                live.proposer.ready = trial

    def _prepare(self, key: str) -> None:
        self._todo.put(key)

    # ----- studies ---------------------------------------------------------------------------
    def create(self, key: str, table: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
        """Create-or-get: the table and config are (re)stored, the cost model's seeds enqueued once."""
        CandidateTable.from_json(table)  # a table that cannot be walked is refused before it is stored
        with self._guard:
            try:
                live = self._get(key)
            except UnknownStudy:
                self._claim(key)
                live = self._build(key, {TABLE_ATTR: table, CONFIG_ATTR: config}, {})
                self._live[key] = live
                self.log.append(key, "study", {"table": table, "config": config})
                self.mirror.push(key, {TABLE_ATTR: table, CONFIG_ATTR: config})
            else:
                known = self._attrs(live)
                if known.get(TABLE_ATTR) != table or known.get(CONFIG_ATTR) != config:
                    with live.lock:
                        live.config, live.table = config, CandidateTable.from_json(table)
                        attrs = {TABLE_ATTR: table, CONFIG_ATTR: config}
                        for k, v in attrs.items():
                            live.study.set_user_attr(k, v)
                        live.state = self._state(live.proposer, live.storage, config, live.table)
                        self.log.append(key, "study", {"table": table, "config": config})
                        self.mirror.push(key, attrs)
            with live.lock:
                before = len(live.study.get_trials(deepcopy=False))
                live.state.seed(config["top_k"])
                done = self._record(live, list(range(before, len(live.study.get_trials(deepcopy=False)))))
        done.result()
        return self._info(live, config["memory_budget"])

    def info(self, key: str, memory_budget: float | None = None) -> dict[str, Any]:
        live = self._get(key)
        return self._info(live, memory_budget if memory_budget is not None else live.config["memory_budget"])

    def _info(self, live: Live, budget: float) -> dict[str, Any]:
        best = self._attrs(live).get("best")
        return {"study_key": live.key, "n_trials": len(live.logged), "memory_budget": budget,
                "cached": best if best and best["peak_memory_bytes"] <= budget else None}

    def names(self) -> list[str]:
        rdb = [s.study_name for s in optuna.get_all_study_summaries(self.storage, include_best_trial=False)]
        return sorted(set(rdb) | set(self.log.studies()) | {k for k, v in self._live.items() if not v.deleted})

    def delete(self, key: str) -> None:
        with self._guard:
            live = self._get(key)
            with live.lock:
                live.deleted = True
                del self._live[key]
                done = self.log.delete(key)
                self.mirror.delete(key)
            done.result()
            self._claim(key, release=True)

    @staticmethod
    def _attrs(live: Live) -> dict[str, Any]:
        return live.storage.get_study_user_attrs(live.study_id)  # Study.user_attrs deep-copies

    # ----- leases ----------------------------------------------------------------------------
    def _expire(self, live: Live) -> list[int]:
        """Mark running trials past their lease failed (the numbers changed)."""
        now = self.clock()
        overdue = [n for n, (_, due) in live.running.items() if due is not None and due < now]
        for n in overdue:
            live.state.fail(n, f"lease expired at {live.running[n][1]:.0f} (unix time) with no result told")
            live.running.pop(n)
        return overdue

    # ----- ask / tell: in memory, then one row --------------------------------------------------
    def ask(self, key: str, lease_s: float | None) -> tuple[dict[str, Any], Future]:
        live = self._get(key)
        with live.lock:
            if live.deleted:
                raise UnknownStudy(key)
            live.proposer.asked = []
            changed = self._expire(live)
            in_flight = {k for k, _ in live.running.values()}
            told: list[dict[str, Any]] = []
            live.state.on_trial, live.state.asks = told.append, 0  # expired leases are not this ask's news
            lease = lease_s if lease_s is not None else live.config["lease_s"]
            expires = self.clock() + lease
            try:
                proposal = live.state.ask(in_flight=lambda: in_flight, lease_attrs={"lease_expires": expires})
            finally:
                live.state.on_trial = None
            if proposal.number is not None:
                live.running[proposal.number] = (proposal.key, expires)
            done = self._record(live, changed + live.proposer.asked)
        self._prepare(key)
        return ({"number": proposal.number, "point": proposal.point, "key": proposal.key,
                 "predicted": proposal.predicted, "stop": proposal.stop, "told": told,
                 "lease_expires": expires if proposal.number is not None else None}, done)

    def tell(self, key: str, number: int, measured: dict[str, Any]) -> tuple[dict[str, Any], Future]:
        live = self._get(key)
        with live.lock:
            snap = live.logged.get(number)
            if snap is None or live.deleted or snap["state"] == "WAITING":  # never asked (or only enqueued)
                raise UnknownTrial(number)
            if snap["state"] == "FAIL" and snap["user_attrs"].get("status") == "expired":
                raise LeaseExpired(snap["user_attrs"].get("reason", "lease expired"))
            record = live.state.tell(number, measured)
            improved = record.pop("improved")
            already = bool(record.pop("already_told", False))
            done = _done() if already else self._record(live, [number])
        if not already:
            self._prepare(key)
        return {"record": record, "improved": improved, "already_told": already}, done

    def contenders(self, key: str, within: float) -> dict[str, Any]:
        """The best and the runner-up when it measured within ``within`` of the best (SearchState.contenders)."""
        live = self._get(key)
        with live.lock:
            found, measured_ok = live.state.contenders(within)
            return {"contenders": found, "measured_ok": measured_ok}

    def confirm(self, key: str, candidate: str, measured: dict[str, Any]) -> tuple[dict[str, Any], Future]:
        """A re-measurement of a measured candidate (SearchState.confirm): one "confirm" row."""
        live = self._get(key)
        with live.lock:
            if live.deleted:
                raise UnknownStudy(key)
            known = live.state.done.get(candidate)
            if known is None or "measured" not in known[2]:
                raise UnknownCandidate(candidate)
            record = live.state.confirm(candidate, measured)
            best = live.state.best()
            done = self.log.append(key, "confirm", record)
            self.mirror.push(key, {CONFIRM_ATTR: self._attrs(live)[CONFIRM_ATTR]})
        return {"record": record, "best": best}, done

    def store_best(self, key: str, extra: dict[str, Any] | None) -> dict[str, Any] | None:
        live = self._get(key)
        with live.lock:
            if live.state.store_best(extra) is None:
                return None
            best = self._attrs(live)["best"]
            done = self.log.append(key, "best", best)
            self.mirror.push(key, {"best": best})
        done.result()
        return best

    def best(self, key: str, memory_budget: float | None) -> dict[str, Any] | None:
        live = self._get(key)
        budget = memory_budget if memory_budget is not None else live.config["memory_budget"]
        best = self._attrs(live).get("best")
        return best if best and best.get("peak_memory_bytes", math.inf) <= budget else None

    def trials(self, key: str) -> list[dict[str, Any]]:
        try:
            live = self._get(key)
        except UnknownStudy:  # a local search's study: listed from the Optuna storage as it is
            found = rdb_trials(self.storage, key)
            if found is None:
                raise
            return [_listed(t) for t in found[1]]
        with live.lock:
            done = self._record(live, self._expire(live))
            snaps = [live.logged[n] for n in sorted(live.logged)]
        done.result()
        return [_listed(trial_from_json(s)) for s in snaps]

    def view(self, key: str) -> Any:
        """What the /ui page shows of a study: its attributes and recorded trials (as the storage holds them
        for a study this server does not serve)."""
        try:
            live = self._get(key)
        except UnknownStudy:
            found = rdb_trials(self.storage, key)
            if found is None:
                raise
            return _View(key, self.storage.get_study_id_from_name(key), dict(found[0]), list(found[1]))
        with live.lock:
            snaps = [live.logged[n] for n in sorted(live.logged)]
            attrs = dict(self._attrs(live))
        try:
            sid = self.storage.get_study_id_from_name(key)
        except KeyError:
            sid = 0  # not copied yet
        trials = [trial_from_json(s) for s in snaps]
        return _View(key, sid, attrs, trials)


@dataclass
class _View:
    study_name: str
    study_id: int  # in the Optuna storage (optuna-dashboard's link); 0 until copied
    user_attrs: dict[str, Any]
    trials: list[Any]

    def get_trials(self, deepcopy: bool = False) -> list[Any]:
        return self.trials


def _listed(t: Any) -> dict[str, Any]:
    return {"number": t.number, "state": t.state.name, "value": t.value,
            "constraints": dict(t.constraints), "user_attrs": dict(t.user_attrs)}

