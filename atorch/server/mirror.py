"""A copy of the server's studies in the Optuna storage, for optuna-dashboard and ``atorch search-report``.

Off the request path: requests hand over what they logged (trial snapshots, study attributes) and a
thread applies it to the Optuna RDB study about every ``interval_s`` seconds, coalescing (a trial asked
and told between two rounds is written once). The event log is the record; this copy trails it by up to
an interval plus the time to write, and is brought up to date when a study is loaded after a restart
(what differs from the log is rewritten). Trials are created in number order so their numbers agree.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from optuna.study import StudyDirection
from optuna.trial import TrialState

from atorch.log import get_logger
from atorch.server.snapshot import trial_from_json, trial_json

logger = get_logger(__name__)


class _Pending:
    def __init__(self) -> None:
        self.attrs: dict[str, Any] = {}
        self.trials: dict[int, dict[str, Any]] = {}
        self.deleted = False


class Mirror:
    def __init__(self, storage: Any, interval_s: float = 2.0, write_lock: Any = None) -> None:
        self.storage, self.interval_s = storage, interval_s
        self.write_lock = write_lock if write_lock is not None else contextlib.nullcontext()
        self._pending: dict[str, _Pending] = {}
        # key -> (study id, number -> (trial id, snapshot)); a trial id found by number when first needed (None
        # until then: public storage API, one query for a trial that changes, not one per trial of a study loaded)
        self._known: dict[str, tuple[int, dict[int, tuple[int | None, dict[str, Any]]]]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._idle = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="atorch-optuna-mirror", daemon=True)
        self._thread.start()

    # ----- from the request path (cheap) -----------------------------------------------------
    def push(self, key: str, attrs: dict[str, Any] | None = None, trials: list[dict[str, Any]] | None = None) -> None:
        with self._lock:
            p = self._pending.setdefault(key, _Pending())
            p.attrs.update(attrs or {})
            for t in trials or []:
                p.trials[t["number"]] = t
            self._idle.clear()

    def delete(self, key: str) -> None:
        with self._lock:
            p = self._pending[key] = _Pending()
            p.deleted = True
            self._idle.clear()
        self._wake.set()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Apply everything pushed so far (tests and shutdown); True when done in time."""
        self._wake.set()
        return self._idle.wait(timeout_s)

    def close(self) -> None:
        self.flush()
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    # ----- the writer thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            with self._lock:
                pending, self._pending = self._pending, {}
            for key, p in pending.items():
                try:
                    self._apply(key, p)
                except Exception as exc:  # the log has it all; the copy is redone when the study is reloaded
                    logger.warning("could not copy study %r to the Optuna storage: %s", key, exc)
                    self._known.pop(key, None)
            with self._lock:
                if not self._pending:
                    self._idle.set()

    def _study(self, key: str) -> tuple[int, dict[int, tuple[int | None, dict[str, Any]]]]:
        if key not in self._known:
            try:
                sid = self.storage.get_study_id_from_name(key)
            except KeyError:
                sid = self.storage.create_new_study([StudyDirection.MAXIMIZE], key)
            trials: dict[int, tuple[int | None, dict[str, Any]]] = {
                t.number: (None, trial_json(t)) for t in self.storage.get_all_trials(sid, deepcopy=False)}
            self._known[key] = (sid, trials)
        return self._known[key]

    def _apply(self, key: str, p: _Pending) -> None:
        if p.deleted:
            self._known.pop(key, None)
            try:
                self.storage.delete_study(self.storage.get_study_id_from_name(key))
            except KeyError:
                pass
            return
        with self.write_lock:  # held per trial: the event log's commits wait for one trial at most
            sid, known = self._study(key)
            old_attrs = self.storage.get_study_user_attrs(sid) if p.attrs else {}
            for k, v in p.attrs.items():
                if old_attrs.get(k) != v:
                    self.storage.set_study_user_attr(sid, k, v)
        for number in sorted(p.trials):
            with self.write_lock:
                self._copy(key, sid, known, number, p.trials[number])

    def _copy(self, key: str, sid: int, known: dict[int, tuple[int | None, dict[str, Any]]], number: int,
              snap: dict[str, Any]) -> None:
        if number in known:
            tid, old = known[number]
            if TrialState[old["state"]].is_finished() or old == snap:
                return
            if tid is None:
                tid = self.storage.get_trial_id_from_study_id_trial_number(sid, number)
            self._update(tid, old, snap)
            known[number] = (tid, snap)
        elif number == len(known):
            tid = self.storage.create_new_trial(sid, template_trial=trial_from_json(snap))
            known[number] = (tid, snap)
        else:  # a number before it is not copied yet: keep it for the next round
            self.push(key, trials=[snap])

    def _update(self, tid: int, old: dict[str, Any], new: dict[str, Any]) -> None:
        s = self.storage
        if old["state"] == "WAITING" and new["state"] != "WAITING":
            s.set_trial_state_values(tid, TrialState.RUNNING)
        new_trial = trial_from_json(new)
        for name, value in new_trial.params.items():
            if name not in old["params"]:
                dist = new_trial.distributions[name]
                s.set_trial_param(tid, name, dist.to_internal_repr(value), dist)
        for k, v in new["user_attrs"].items():
            if old["user_attrs"].get(k) != v:
                s.set_trial_user_attr(tid, k, v)
        for k, v in new["system_attrs"].items():
            if old["system_attrs"].get(k) != v:
                s.set_trial_system_attr(tid, k, v)
        state = TrialState[new["state"]]
        if state.is_finished():
            s.set_trial_state_values(tid, state, new["values"])


def rdb_trials(storage: Any, key: str) -> tuple[dict[str, Any], list[Any]] | None:
    """An Optuna study's user attributes and trials (None: no such study)."""
    try:
        sid = storage.get_study_id_from_name(key)
    except KeyError:
        return None
    return storage.get_study_user_attrs(sid), storage.get_all_trials(sid, deepcopy=False)

