"""The server's studies: SearchState rebuilt from the Optuna storage on every request.

Nothing lives only in memory, so a restarted server (or a second server on the same PostgreSQL) continues
every search where it stood. A per-study lock serialises ask/tell inside one process (SQLite allows one
writer; the in-flight check must see the trial just asked). An asked trial carries a lease (unix time in
its user attrs); a lease past due is marked FAILED before the study is asked or listed, so the candidate
can be asked again and the search continues.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

import optuna
from optuna.trial import TrialState

from atorch.strategy_search.ask_tell import SearchState, cached_best, make_sampler, trial_record
from atorch.strategy_search.candidates import CandidateTable

TABLE_ATTR, CONFIG_ATTR = "atorch_table", "atorch_config"


class UnknownStudy(KeyError):
    pass


class UnknownTrial(KeyError):
    pass


class LeaseExpired(RuntimeError):
    pass


class Studies:
    def __init__(self, storage: str, clock: Any = time.time) -> None:
        self.storage = optuna.storages.get_storage(storage)
        self.clock = clock
        self._locks: dict[str, threading.Lock] = defaultdict(threading.Lock)
        self._guard = threading.Lock()
        self._tables: dict[tuple[str, int], CandidateTable] = {}  # parsed once per study id

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
            if study.user_attrs.get(TABLE_ATTR) != table:
                study.set_user_attr(TABLE_ATTR, table)
                self._tables.pop((key, study._study_id), None)
            study.set_user_attr(CONFIG_ATTR, config)
            state = self._state(study)
            state.seed(config["top_k"])
            return self._info(study, config["memory_budget"])

    def info(self, key: str, memory_budget: float | None = None) -> dict[str, Any]:
        study = self._load(key)
        return self._info(study, memory_budget if memory_budget is not None else self._config(study)["memory_budget"])

    def _info(self, study: Any, budget: float) -> dict[str, Any]:
        return {"study_key": study.study_name, "n_trials": len(study.get_trials(deepcopy=False)),
                "memory_budget": budget, "cached": cached_best(study, budget)}

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

    def _config(self, study: Any) -> dict[str, Any]:
        config = study.user_attrs.get(CONFIG_ATTR)
        if config is None:
            raise UnknownStudy(study.study_name)  # a study this server did not create (a local search's)
        return config

    def _state(self, study: Any, on_trial: Any = None) -> SearchState:
        config = self._config(study)
        ident = (study.study_name, study._study_id)
        if ident not in self._tables:
            self._tables[ident] = CandidateTable.from_json(study.user_attrs[TABLE_ATTR])
        # A new sampler per request: seeded by the trial count, so a rebuilt sampler does not repeat itself.
        n = len(study.get_trials(deepcopy=False))
        study.sampler = make_sampler(config["sampler"], config["max_trials"], config["seed"] + n)
        return SearchState(study, self._tables[ident], config["memory_budget"], on_trial=on_trial,
                           max_asks=max(50, 10 * config["max_trials"]))

    # ----- leases ----------------------------------------------------------------------------
    def _expire(self, study: Any, state: SearchState) -> None:
        now = self.clock()
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            due = t.user_attrs.get("lease_expires")
            if due is not None and due < now:
                state.fail(t.number, f"lease expired at {due:.0f} (unix time) with no result told")

    def _in_flight(self, study: Any) -> set[str]:
        return {t.user_attrs["key"] for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                if "key" in t.user_attrs}

    # ----- ask / tell ------------------------------------------------------------------------
    def ask(self, key: str, lease_s: float | None) -> dict[str, Any]:
        with self.lock(key):
            study = self._load(key)
            told: list[dict[str, Any]] = []
            state = self._state(study, on_trial=told.append)
            self._expire(study, state)
            told.clear()  # expired leases are not this ask's news
            lease = lease_s if lease_s is not None else self._config(study)["lease_s"]
            expires = self.clock() + lease
            proposal = state.ask(in_flight=lambda: self._in_flight(study), lease_attrs={"lease_expires": expires})
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
            record = self._state(study).tell(number, measured)
            improved = record.pop("improved")
            already = bool(record.pop("already_told", False))
            return {"record": record, "improved": improved, "already_told": already}

    def store_best(self, key: str, extra: dict[str, Any] | None) -> dict[str, Any] | None:
        with self.lock(key):
            study = self._load(key)
            best = self._state(study).store_best(extra)
            return study.user_attrs.get("best") if best is not None else None

    def best(self, key: str, memory_budget: float | None) -> dict[str, Any] | None:
        study = self._load(key)
        return cached_best(study, memory_budget if memory_budget is not None else self._config(study)["memory_budget"])

    def trials(self, key: str) -> list[dict[str, Any]]:
        with self.lock(key):
            study = self._load(key)
            if CONFIG_ATTR in study.user_attrs:
                self._expire(study, self._state(study))
            return [{"number": t.number, "state": t.state.name, "value": t.value,
                     "constraints": dict(t.constraints), "user_attrs": dict(t.user_attrs)}
                    for t in study.get_trials(deepcopy=False)]

    def records(self, key: str) -> list[dict[str, Any]]:
        return [trial_record(t) for t in self._load(key).get_trials(deepcopy=False)]
