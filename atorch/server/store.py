"""The server's studies: SearchState rebuilt from the Optuna storage on every request.

Nothing lives only in memory, so a restarted server (or a second server on the same PostgreSQL) continues
every search where it stood. A per-study lock serialises ask/tell inside one process (SQLite allows one
writer; the in-flight check must see the trial just asked). An asked trial carries a lease (unix time in
its user attrs); a lease past due is marked FAILED before the study is asked or listed, so the candidate
can be asked again and the search continues (until then a late result is still taken; after, it is a 409).
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict
from typing import Any

import optuna
from optuna.trial import TrialState

from atorch.strategy_search.ask_tell import SearchState, make_sampler, trial_record
from atorch.strategy_search.candidates import CandidateTable

TABLE_ATTR, CONFIG_ATTR = "atorch_table", "atorch_config"


class UnknownStudy(KeyError):
    pass


class UnknownTrial(KeyError):
    pass


class LeaseExpired(RuntimeError):
    pass


def open_storage(url: str) -> Any:
    """The Optuna storage of a URL, tuned for a server that commits on every ask and tell.

    SQLite: WAL journal with synchronous=NORMAL and a 30 s busy timeout; PostgreSQL: synchronous_commit=off.
    Either way a crash of the server process loses nothing and the database stays consistent; a crash of
    the machine itself may lose the last moments of tells (those trials are then re-asked when their
    leases expire). Without this every commit waits for the disk (about 10 ms each here, ~30 per trial).
    """
    from sqlalchemy import event

    if url.startswith("sqlite"):
        rdb = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 30}})

        @event.listens_for(rdb.engine, "connect")
        def _pragmas(conn: Any, _record: Any) -> None:
            cursor = conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()

        rdb.engine.dispose()  # connections opened before the listener reconnect with the pragmas
        return rdb
    if url.startswith("postgresql"):
        return optuna.storages.RDBStorage(
            url, engine_kwargs={"connect_args": {"options": "-c synchronous_commit=off"}})
    return optuna.storages.get_storage(url)


class Studies:
    def __init__(self, storage: str, clock: Any = time.time) -> None:
        self.storage = open_storage(storage)
        self.clock = clock
        self._locks: dict[str, threading.Lock] = defaultdict(threading.Lock)
        self._guard = threading.Lock()
        # (name, study id) -> (config, table): read from the study once per process (the table can be large;
        # reading it on every request dominated a request's time). A create in this process refreshes it.
        self._meta: dict[tuple[str, int], tuple[dict[str, Any], CandidateTable]] = {}

    def lock(self, key: str) -> threading.Lock:
        with self._guard:
            return self._locks[key]

    # ----- studies ---------------------------------------------------------------------------
    def create(self, key: str, table: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
        """Create-or-get: the table and config are (re)stored, the cost model's seeds enqueued once."""
        CandidateTable.from_json(table)  # a table that cannot be walked is refused before it is stored
        with self.lock(key):
            study = optuna.create_study(storage=self.storage, study_name=key, direction="maximize",
                                        load_if_exists=True)
            attrs = self._attrs(study)
            if attrs.get(TABLE_ATTR) != table:
                study.set_user_attr(TABLE_ATTR, table)
            if attrs.get(CONFIG_ATTR) != config:
                study.set_user_attr(CONFIG_ATTR, config)
            self._meta[(key, study._study_id)] = (config, CandidateTable.from_json(table))
            state = self._state(study)
            state.seed(config["top_k"])
            return self._info(study, config["memory_budget"])

    def info(self, key: str, memory_budget: float | None = None) -> dict[str, Any]:
        study = self._load(key)
        return self._info(study, memory_budget if memory_budget is not None else self._config(study)["memory_budget"])

    def _info(self, study: Any, budget: float) -> dict[str, Any]:
        best = self._attrs(study).get("best")
        return {"study_key": study.study_name, "n_trials": len(study.get_trials(deepcopy=False)),
                "memory_budget": budget, "cached": best if best and best["peak_memory_bytes"] <= budget else None}

    def names(self) -> list[str]:
        return [s.study_name for s in optuna.get_all_study_summaries(self.storage, include_best_trial=False)]

    def delete(self, key: str) -> None:
        with self.lock(key):
            self._load(key)
            optuna.delete_study(study_name=key, storage=self.storage)

    def _load(self, key: str) -> Any:
        try:
            return optuna.load_study(study_name=key, storage=self.storage)
        except KeyError as exc:
            raise UnknownStudy(key) from exc

    @staticmethod
    def _attrs(study: Any) -> dict[str, Any]:
        return study._storage.get_study_user_attrs(study._study_id)  # Study.user_attrs deep-copies them

    def _known(self, study: Any) -> tuple[dict[str, Any], CandidateTable]:
        ident = (study.study_name, study._study_id)
        if ident not in self._meta:
            attrs = self._attrs(study)
            if CONFIG_ATTR not in attrs:
                raise UnknownStudy(study.study_name)  # a study this server did not create (a local search's)
            self._meta[ident] = (attrs[CONFIG_ATTR], CandidateTable.from_json(attrs[TABLE_ATTR]))
        return self._meta[ident]

    def _config(self, study: Any) -> dict[str, Any]:
        return self._known(study)[0]

    def _state(self, study: Any, on_trial: Any = None, trials: list[Any] | None = None) -> SearchState:
        config, table = self._known(study)
        trials = trials if trials is not None else study.get_trials(deepcopy=False)
        # A new sampler per request: seeded by the trial count, so a rebuilt sampler does not repeat itself.
        study.sampler = make_sampler(config["sampler"], config["max_trials"], config["seed"] + len(trials))
        return SearchState(study, table, config["memory_budget"], on_trial=on_trial,
                           max_asks=max(50, 10 * config["max_trials"]), trials=trials)

    # ----- leases ----------------------------------------------------------------------------
    def _expire(self, state: SearchState, trials: list[Any]) -> set[str]:
        """Mark running trials past their lease failed; returns the keys still in flight."""
        now, in_flight = self.clock(), set()
        for t in trials:
            if t.state != TrialState.RUNNING:
                continue
            due = t.user_attrs.get("lease_expires")
            if due is not None and due < now:
                state.fail(t.number, f"lease expired at {due:.0f} (unix time) with no result told")
            elif "key" in t.user_attrs:
                in_flight.add(t.user_attrs["key"])
        return in_flight

    # ----- ask / tell ------------------------------------------------------------------------
    def ask(self, key: str, lease_s: float | None) -> dict[str, Any]:
        with self.lock(key):
            study = self._load(key)
            told: list[dict[str, Any]] = []
            trials = study.get_trials(deepcopy=False)
            state = self._state(study, on_trial=told.append, trials=trials)
            in_flight = self._expire(state, trials)
            told.clear()  # expired leases are not this ask's news
            lease = lease_s if lease_s is not None else self._config(study)["lease_s"]
            expires = self.clock() + lease
            proposal = state.ask(in_flight=lambda: in_flight, lease_attrs={"lease_expires": expires})
            return {"number": proposal.number, "point": proposal.point, "key": proposal.key,
                    "predicted": proposal.predicted, "stop": proposal.stop, "told": told,
                    "lease_expires": expires if proposal.number is not None else None}

    def tell(self, key: str, number: int, measured: dict[str, Any]) -> dict[str, Any]:
        with self.lock(key):
            study = self._load(key)
            trials = study.get_trials(deepcopy=False)
            if not 0 <= number < len(trials) or trials[number].number != number:
                raise UnknownTrial(number)
            frozen = trials[number]
            if frozen.state == TrialState.FAIL and frozen.user_attrs.get("status") == "expired":
                raise LeaseExpired(frozen.user_attrs.get("reason", "lease expired"))
            if frozen.state == TrialState.WAITING:
                raise UnknownTrial(number)  # enqueued, never asked
            record = self._state(study, trials=trials).tell(number, measured)
            improved = record.pop("improved")
            already = bool(record.pop("already_told", False))
            return {"record": record, "improved": improved, "already_told": already}

    def store_best(self, key: str, extra: dict[str, Any] | None) -> dict[str, Any] | None:
        with self.lock(key):
            study = self._load(key)
            best = self._state(study).store_best(extra)
            return self._attrs(study).get("best") if best is not None else None

    def best(self, key: str, memory_budget: float | None) -> dict[str, Any] | None:
        study = self._load(key)
        budget = memory_budget if memory_budget is not None else self._config(study)["memory_budget"]
        best = self._attrs(study).get("best")
        return best if best and best.get("peak_memory_bytes", math.inf) <= budget else None

    def trials(self, key: str) -> list[dict[str, Any]]:
        with self.lock(key):
            study = self._load(key)
            try:
                self._expire(self._state(study), study.get_trials(deepcopy=False))
            except UnknownStudy:
                pass  # a local search's study: listed as it is
            return [{"number": t.number, "state": t.state.name, "value": t.value,
                     "constraints": dict(t.constraints), "user_attrs": dict(t.user_attrs)}
                    for t in study.get_trials(deepcopy=False)]

    def records(self, key: str) -> list[dict[str, Any]]:
        return [trial_record(t) for t in self._load(key).get_trials(deepcopy=False)]
