"""A request's memo over Optuna's storage: what one request has read, it does not read again; and a study's trials
kept between the requests that hold its turn, checked against the storage on each.

Optuna reads the trial being asked or told several times per call (``optuna.trial.Trial(study, id)``, each
``set_constraint``, ``study.tell`` before and after it writes the state: six reads of a running trial per tell,
six SQL statements each on an RDB storage), the sampler reads every trial again after ``study.ask`` created one,
and the server opens a study by its name three times per request. Inside ``RequestMemo.request()`` the first
read of a study's trials, of a running trial, of a study's id by name and of its attributes goes to the storage;
later reads in the same request are answered from that copy, kept up to date by the request's own writes as the
storage commits them (a param, a user or system attribute; a trial created is read once and added). A write
whose result the storage decides (a trial's state and values, with its completion time; an intermediate value)
drops the copies, so the next read is the storage's. Outside a request every call goes to the storage as is.

``request(keep=True)`` (a request holding the study's turn, so no other request of this process writes it
meanwhile): the study's trials are also kept after the request, as committed, and the next such request uses
them instead of reading every unfinished trial again (Optuna's cache re-reads each of them, every attribute, on
every read: with 31 trials in flight that doubled a request's CPU time). They stay the storage's: each request
that writes a study's trials first commits a new token in the study's user attributes (``WRITTEN_ATTR``), and a
request uses the kept trials only while the token it reads there is the one this process wrote last; another
process's write (a second server on the same SQLite file) changes the token, and the trials are read again. A
request that wrote reads the token once more as it ends: if another process set one meanwhile (two servers'
requests at once), it sets a new one, so that both read the storage again. A trial whose state the storage set
is read back from the storage; a request that fails forgets what it kept of its studies (a write whose commit
failed may or may not be stored), so the next one reads them again. Nothing is kept that the storage does not
hold: a restart after ``kill -9`` and optuna-dashboard see what the memo saw (a write to a running trial that
does not set the token, such as one from the dashboard, is seen after the next failed request).
Finished trials come from the storage's own copies (Optuna's ``_CachedStorage`` keeps them once read).
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import threading
import uuid
from collections.abc import Container, Iterator, Sequence
from typing import Any

from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

WRITTEN_ATTR = "atorch_written"  # a study user attribute: the token of the last request that wrote its trials


class _Kept:
    """A study's trials (by number) as this process last committed or read them; ``numbers``: trial id -> number
    of each trial that was unfinished when kept (the ones a request writes); ``token``: the study's
    ``WRITTEN_ATTR`` they are current for."""

    def __init__(self, trials: list[FrozenTrial], numbers: dict[int, int], token: Any) -> None:
        self.trials, self.numbers, self.token = trials, numbers, token
        self.ids = {number: trial_id for trial_id, number in numbers.items()}


class _Memo:
    """One request's copies. ``trials``: running and waiting trials by id (the objects in ``lists`` too, so a
    write updates both). With ``keep``: ``checked``, the studies whose kept trials this request checked against
    the storage's token; ``written``, those whose token it set."""

    def __init__(self, keep: bool = False) -> None:
        self.keep = keep
        self.checked: set[int] = set()
        self.written: set[int] = set()
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
        self._kept: dict[int, _Kept] = {}  # study id -> its trials, between the requests that hold its turn
        self._owner: dict[int, int] = {}  # trial id -> study id, of the kept trials

    @contextlib.contextmanager
    def request(self, keep: bool = False) -> Iterator[None]:
        """Memoize this thread's reads until the block ends (nested blocks share the outer one's memo). ``keep``:
        the caller holds the turn of every study it touches; their trials are kept after the block."""
        if self._memo() is not None:
            yield
            return
        memo = self._local.memo = _Memo(keep)
        try:
            yield
            for study_id in memo.written:
                self._still_mine(study_id)
        except BaseException:
            for study_id in memo.checked | memo.written:  # a failed commit may or may not be stored
                self._forget(study_id)
            raise
        finally:
            self._local.memo = None

    # ----- kept trials -------------------------------------------------------------------------
    def _forget(self, study_id: int) -> None:
        kept = self._kept.pop(study_id, None)
        for trial_id in list(kept.numbers) if kept is not None else ():  # another thread may be adding to it
            self._owner.pop(trial_id, None)

    def _still_mine(self, study_id: int) -> None:
        """After a request wrote a study's trials: the token it set is still the storage's, or another process set
        one meanwhile (its writes may be missing here, and it may hold ours as missing): a new token then sends
        every process back to the storage, this one included."""
        kept = self._kept.get(study_id)
        if kept is None or self.backend.get_study_user_attrs(study_id).get(WRITTEN_ATTR) != kept.token:
            self._forget(study_id)
            self.backend.set_study_user_attr(study_id, WRITTEN_ATTR, uuid.uuid4().hex)

    def _kept_trials(self, memo: _Memo, study_id: int) -> _Kept:
        """The study's kept trials, checked once per request: read again when the storage's token is not the one
        they are current for (another process wrote; none kept yet; forgotten)."""
        kept = self._kept.get(study_id)
        if study_id not in memo.checked or kept is None:
            token = self.get_study_user_attrs(study_id).get(WRITTEN_ATTR)
            if kept is None or token is None or kept.token != token:
                self._forget(study_id)
                trials = list(self.backend.get_all_trials(study_id, deepcopy=False))
                numbers = {}
                for i, t in enumerate(trials):
                    if not t.state.is_finished():
                        trial_id = self.backend.get_trial_id_from_study_id_trial_number(study_id, t.number)
                        trials[i], numbers[trial_id] = copy.deepcopy(t), t.number
                        self._owner[trial_id] = study_id
                kept = self._kept[study_id] = _Kept(trials, numbers, token)
            memo.checked.add(study_id)
        return kept

    def _kept_trial(self, memo: _Memo | None, trial_id: int) -> tuple[_Kept, int] | None:
        """The kept study and number of a trial, in a keeping request (None: not kept)."""
        if memo is None or not memo.keep or (study_id := self._owner.get(trial_id)) is None:
            return None
        kept = self._kept_trials(memo, study_id)
        number = kept.numbers.get(trial_id)
        return None if number is None else (kept, number)

    def _writing(self, memo: _Memo | None, study_id: int | None, trial_id: int | None = None) -> _Kept | None:
        """Before a write to a study's trials: in a keeping request, the study's new token is committed first (once
        per request), so another process reads them again; outside one, what this process kept of it is forgotten.
        Returns the kept trials to update after the write (None: none)."""
        if study_id is None and trial_id is not None:
            study_id = self._owner.get(trial_id)
        if study_id is None:
            if memo is not None and memo.keep:  # a trial read outside the kept ones: keep nothing unchecked
                for other in list(self._kept):
                    self._forget(other)
            return None
        if memo is None or not memo.keep:
            self._forget(study_id)
            return None
        kept = self._kept_trials(memo, study_id)
        if study_id not in memo.written:
            token = uuid.uuid4().hex
            memo.written.add(study_id)
            self.set_study_user_attr(study_id, WRITTEN_ATTR, token)
            kept.token = token
        return kept

    def _memo(self) -> _Memo | None:
        return getattr(self._local, "memo", None)

    # ----- studies -----------------------------------------------------------------------------
    def create_new_study(self, directions: Sequence[StudyDirection], study_name: str | None = None) -> int:
        return self.backend.create_new_study(directions, study_name)

    def delete_study(self, study_id: int) -> None:
        if (memo := self._memo()) is not None:
            self._local.memo = _Memo(memo.keep)
        self._forget(study_id)
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
        memo = self._memo()
        kept = self._writing(memo, study_id)
        trial_id = self.backend.create_new_trial(study_id, template_trial)
        if kept is not None:
            t = self.backend.get_trial(trial_id)
            if t.number != len(kept.trials):  # another process created one meanwhile: read them again
                self._forget(study_id)
                return trial_id
            kept.trials.append(t if t.state.is_finished() else copy.deepcopy(t))
            kept.numbers[trial_id], kept.ids[t.number] = t.number, trial_id
            self._owner[trial_id] = study_id
            return trial_id
        if memo is not None and study_id in memo.lists:
            memo.created.setdefault(study_id, []).append(trial_id)  # read when the list is next read
        return trial_id

    def set_trial_param(self, trial_id: int, param_name: str, param_value_internal: float,
                        distribution: BaseDistribution) -> None:
        kept = self._writing(self._memo(), None, trial_id)
        self.backend.set_trial_param(trial_id, param_name, param_value_internal, distribution)
        for t in self._copies(kept, trial_id):
            t.distributions = {**t.distributions, param_name: distribution}
            t.params = {**t.params, param_name: distribution.to_external_repr(param_value_internal)}

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Sequence[float] | None = None) -> bool:
        kept = self._writing(self._memo(), None, trial_id)
        self._drop()  # the storage sets the start or completion time: read it back from there
        changed = self.backend.set_trial_state_values(trial_id, state, values)
        self._read_back(kept, trial_id)
        return changed

    def set_trial_intermediate_value(self, trial_id: int, step: int, intermediate_value: float) -> None:
        kept = self._writing(self._memo(), None, trial_id)
        self._drop()
        self.backend.set_trial_intermediate_value(trial_id, step, intermediate_value)
        self._read_back(kept, trial_id)

    def _read_back(self, kept: _Kept | None, trial_id: int) -> None:
        if kept is not None and (number := kept.numbers.get(trial_id)) is not None:
            t = self.backend.get_trial(trial_id)
            kept.trials[number] = t if t.state.is_finished() else copy.deepcopy(t)

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        kept = self._writing(self._memo(), None, trial_id)
        self.backend.set_trial_user_attr(trial_id, key, value)
        for t in self._copies(kept, trial_id):
            t.user_attrs = {**t.user_attrs, key: copy.deepcopy(value)}

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        kept = self._writing(self._memo(), None, trial_id)
        self.backend.set_trial_system_attr(trial_id, key, value)
        for t in self._copies(kept, trial_id):
            t.system_attrs = {**t.system_attrs, key: copy.deepcopy(value)}

    # ----- trials: reads -----------------------------------------------------------------------
    def get_trial_id_from_study_id_trial_number(self, study_id: int, trial_number: int) -> int:
        memo = self._memo()
        if memo is not None and memo.keep and study_id in self._kept:
            kept = self._kept_trials(memo, study_id)
            if (trial_id := kept.ids.get(trial_number)) is not None:
                return trial_id
        return self.backend.get_trial_id_from_study_id_trial_number(study_id, trial_number)

    def get_trial(self, trial_id: int) -> FrozenTrial:
        memo = self._memo()
        if memo is None:
            return self.backend.get_trial(trial_id)
        if (found := self._kept_trial(memo, trial_id)) is not None:
            t = found[0].trials[found[1]]
            return t if t.state.is_finished() else copy.deepcopy(t)  # a caller updates its copy as it writes
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
        if memo.keep:
            found = [t for t in self._kept_trials(memo, study_id).trials if states is None or t.state in states]
            return copy.deepcopy(found) if deepcopy else found
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

    def _copies(self, kept: _Kept | None, trial_id: int) -> list[FrozenTrial]:
        """The copies of a trial to update with what a write committed: the kept one, the request's one."""
        found = []
        if kept is not None and (number := kept.numbers.get(trial_id)) is not None:
            found.append(kept.trials[number])
        if (memo := self._memo()) is not None and (t := memo.trials.get(trial_id)) is not None:
            found.append(t)
        return found

    def _drop(self) -> None:
        if (memo := self._memo()) is not None:
            memo.drop_lists()
