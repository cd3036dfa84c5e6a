"""A request's memo over Optuna's storage: what one request has read, it does not read again.

Optuna reads the trial being asked or told several times per call (``optuna.trial.Trial(study, id)``, each
``set_constraint``, ``study.tell`` before and after it writes the state: six reads of a running trial per tell,
six SQL statements each on an RDB storage), the sampler reads every trial again after ``study.ask`` created one,
and the server opens a study by its name three times per request. Inside ``RequestMemo.request()`` the first
read of a study's trials, of a running trial, of a study's id by name and of its attributes goes to the storage;
later reads in the same request are answered from that copy, kept up to date by the request's own writes as the
storage commits them (a param, a user or system attribute; a trial created is read once and added). A write
whose result the storage decides (a trial's state and values, with its completion time; an intermediate value)
drops the copies, so the next read is the storage's. Outside a request every call goes to the storage as is.

Nothing outlives the request: the next request reads the storage again, so the storage stays the one record
(another server process, a restart after ``kill -9``, optuna-dashboard all see what the memo saw). Within a
request the server holds the study's lock, so no other request of this process writes the study meanwhile.
Finished trials come from the storage's own copies (Optuna's ``_CachedStorage`` keeps them once read).
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import threading
from collections.abc import Container, Iterator, Sequence
from typing import Any

from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState


class _Memo:
    """One request's copies. ``trials``: running and waiting trials by id (the objects in ``lists`` too, so a
    write updates both)."""

    def __init__(self) -> None:
        self.study_ids: dict[str, int] = {}
        self.user_attrs: dict[int, dict[str, Any]] = {}
        self.system_attrs: dict[int, dict[str, Any]] = {}
        self.trials: dict[int, FrozenTrial] = {}
        self.lists: dict[int, list[FrozenTrial]] = {}  # study id -> its trials by number
        self.created: dict[int, list[int]] = {}  # study id -> trials created since its list was read

    def drop_lists(self) -> None:
        self.lists.clear()
        self.created.clear()
        self.trials.clear()


class RequestMemo(BaseStorage):
    """Optuna's ``BaseStorage`` over another storage (``backend``), with a memo per request and thread."""

    def __init__(self, backend: BaseStorage) -> None:
        self.backend = backend
        self._local = threading.local()

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Memoize this thread's reads until the block ends (nested blocks share the outer one's memo)."""
        if self._memo() is not None:
            yield
            return
        self._local.memo = _Memo()
        try:
            yield
        finally:
            self._local.memo = None

    def _memo(self) -> _Memo | None:
        return getattr(self._local, "memo", None)

    # ----- studies -----------------------------------------------------------------------------
    def create_new_study(self, directions: Sequence[StudyDirection], study_name: str | None = None) -> int:
        return self.backend.create_new_study(directions, study_name)

    def delete_study(self, study_id: int) -> None:
        if self._memo() is not None:
            self._local.memo = _Memo()
        self.backend.delete_study(study_id)

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        self.backend.set_study_user_attr(study_id, key, value)
        if (memo := self._memo()) is not None and study_id in memo.user_attrs:
            memo.user_attrs[study_id] = {**memo.user_attrs[study_id], key: copy.deepcopy(value)}

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        self.backend.set_study_system_attr(study_id, key, value)
        if (memo := self._memo()) is not None and study_id in memo.system_attrs:
            memo.system_attrs[study_id] = {**memo.system_attrs[study_id], key: copy.deepcopy(value)}

    def get_study_id_from_name(self, study_name: str) -> int:
        memo = self._memo()
        if memo is None:
            return self.backend.get_study_id_from_name(study_name)
        if study_name not in memo.study_ids:
            memo.study_ids[study_name] = self.backend.get_study_id_from_name(study_name)
        return memo.study_ids[study_name]

    def get_study_name_from_id(self, study_id: int) -> str:
        return self.backend.get_study_name_from_id(study_id)

    def get_study_directions(self, study_id: int) -> list[StudyDirection]:
        return self.backend.get_study_directions(study_id)

    def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
        memo = self._memo()
        if memo is None:
            return self.backend.get_study_user_attrs(study_id)
        if study_id not in memo.user_attrs:
            memo.user_attrs[study_id] = self.backend.get_study_user_attrs(study_id)
        return copy.deepcopy(memo.user_attrs[study_id])

    def get_study_system_attrs(self, study_id: int) -> dict[str, Any]:
        memo = self._memo()
        if memo is None:
            return self.backend.get_study_system_attrs(study_id)
        if study_id not in memo.system_attrs:
            memo.system_attrs[study_id] = self.backend.get_study_system_attrs(study_id)
        return copy.deepcopy(memo.system_attrs[study_id])

    def get_all_studies(self) -> list[Any]:
        return self.backend.get_all_studies()

    # ----- trials: writes ----------------------------------------------------------------------
    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        trial_id = self.backend.create_new_trial(study_id, template_trial)
        if (memo := self._memo()) is not None and study_id in memo.lists:
            memo.created.setdefault(study_id, []).append(trial_id)  # read when the list is next read
        return trial_id

    def set_trial_param(self, trial_id: int, param_name: str, param_value_internal: float,
                        distribution: BaseDistribution) -> None:
        self.backend.set_trial_param(trial_id, param_name, param_value_internal, distribution)
        if (t := self._memoized(trial_id)) is not None:
            t.distributions = {**t.distributions, param_name: distribution}
            t.params = {**t.params, param_name: distribution.to_external_repr(param_value_internal)}

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Sequence[float] | None = None) -> bool:
        self._drop()  # the storage sets the start or completion time: read it back from there
        return self.backend.set_trial_state_values(trial_id, state, values)

    def set_trial_intermediate_value(self, trial_id: int, step: int, intermediate_value: float) -> None:
        self._drop()
        self.backend.set_trial_intermediate_value(trial_id, step, intermediate_value)

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        self.backend.set_trial_user_attr(trial_id, key, value)
        if (t := self._memoized(trial_id)) is not None:
            t.user_attrs = {**t.user_attrs, key: copy.deepcopy(value)}

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        self.backend.set_trial_system_attr(trial_id, key, value)
        if (t := self._memoized(trial_id)) is not None:
            t.system_attrs = {**t.system_attrs, key: copy.deepcopy(value)}

    # ----- trials: reads -----------------------------------------------------------------------
    def get_trial_id_from_study_id_trial_number(self, study_id: int, trial_number: int) -> int:
        return self.backend.get_trial_id_from_study_id_trial_number(study_id, trial_number)

    def get_trial(self, trial_id: int) -> FrozenTrial:
        memo = self._memo()
        if memo is None:
            return self.backend.get_trial(trial_id)
        if trial_id not in memo.trials:
            trial = self.backend.get_trial(trial_id)
            if trial.state.is_finished():  # written no more: the storage's copy is the one
                return trial
            memo.trials[trial_id] = copy.deepcopy(trial)
        return copy.deepcopy(memo.trials[trial_id])  # a caller updates its copy as it writes (optuna's Trial)

    def get_all_trials(self, study_id: int, deepcopy: bool = True,
                       states: Container[TrialState] | None = None) -> list[FrozenTrial]:
        """A study's trials: read once per request (its running and waiting ones kept up to date by the
        request's writes), the trials created since read one by one, and read whole again after a trial's state
        changed."""
        memo = self._memo()
        if memo is None:
            return self.backend.get_all_trials(study_id, deepcopy=deepcopy, states=states)
        if study_id not in memo.lists:
            trials = list(self.backend.get_all_trials(study_id, deepcopy=False))
            for i, t in enumerate(trials):
                if not t.state.is_finished():
                    trial_id = self.backend.get_trial_id_from_study_id_trial_number(study_id, t.number)
                    trials[i] = memo.trials.setdefault(trial_id, copy.deepcopy(t))
            memo.lists[study_id] = trials
        trials = memo.lists[study_id]
        for trial_id in memo.created.pop(study_id, []):
            read = self.get_trial(trial_id)
            new = memo.trials.get(trial_id, read)  # memoized unless it was created finished
            trials.insert(bisect.bisect([t.number for t in trials], new.number), new)
        found = [t for t in trials if states is None or t.state in states]
        return copy.deepcopy(found) if deepcopy else found

    def _memoized(self, trial_id: int) -> FrozenTrial | None:
        memo = self._memo()
        return None if memo is None else memo.trials.get(trial_id)

    def _drop(self) -> None:
        if (memo := self._memo()) is not None:
            memo.drop_lists()
