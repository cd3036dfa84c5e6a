"""The planner: an Optuna study over the search space, seeded by the cost model, judged by dry-runs.

1. Every candidate of the space is predicted by the cost model (cheap, no run).
2. The cost model's top-k predicted-feasible candidates and a plain DDP baseline are enqueued.
3. Ask/tell loop. A candidate predicted above the memory budget is told as a COMPLETED trial with a
   violated constraint and is never measured; otherwise it is measured (a dry-run). A measured OOM,
   failure or timeout is also a completed trial with a violated constraint, its reason kept as a user
   attribute: samplers ignore FAILED trials, so this is how they learn where the infeasible region is
   (a failure is never told as "throughput 0"). An infeasible trial's value is the cost model's
   predicted samples/s: the constraint ranks it below every feasible trial whatever its value.
4. It stops on ``time_limit_s`` (checked before each trial), ``max_trials`` dry-runs, or ``patience``
   dry-runs without improvement. The best is the highest *measured* samples/s among feasible trials.
5. Confirmation (``confirm_within``, off by default here; ``auto_accelerate`` turns it on): when the
   runner-up measured within that fraction of the best, both are re-measured interleaved (the runner-up first:
   A B, A B, ...) in rounds, at most ``confirm_rounds``, while their runs stay within the machine's noise of
   each other (``decided``: the spread of their measured steps; without step times, CONFIRM_TIE), and those
   runs decide (``merge_runs`` pools the rounds): they ran under the same load. One dry-run each cannot
   separate two candidates that close on a shared machine: on the bench, a 5% lead in the search was a 20%
   deficit when re-measured. Still within noise after the last round, the simpler strategy is kept
   (``best_of``). The first round's two runs come out of ``max_trials`` (exploration stops two early); later
   rounds run only while undecided, from what exploration left of ``max_trials`` (the budget of dry-runs holds).

The loop (``Planner.search``: stop rules, dry-runs, confirmation) is one for every study: it drives a
``SearchStudy``, either ``LocalStudy`` (below) or a strategy server's (``remote.RemoteStudy``, over HTTP; the
server runs the same ``SearchState``).

Constraints (Trial.set_constraint, feasible when <= 0): ``memory_over`` = (peak - budget) / budget,
predicted or measured; ``failed`` = 1 for a failed or timed-out run, else 0.

The study lives in an Optuna storage (default: SQLite in the cache directory; any SQLAlchemy URL),
named by ``study_key(StudyIdentity)``: a hash of everything that changes the answer except the memory
budget. Every search stores how it ended (``SearchRecord``: finished or not, why it stopped, its budget).
A later planner with the same key serves the study only if that search finished, re-selecting the best
among the measured candidates under *its* budget (``cached_best``); otherwise (a time limit, an interruption,
a budget the old best does not fit or that admits candidates the old budget ruled out) it resumes the
search, reusing every stored trial (``force=True`` searches again in any case). Everything stored is JSON
(user attributes), never pickle.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from atorch.class_ref import class_path
from atorch.errors import RankLost
from atorch.log import RepeatedWarnings, get_logger
from atorch.opt_lib.parallel_mode import ParallelMode
from atorch.settings import cache_dir
from atorch.strategy_search.costing.analyser import identity_json
from atorch.strategy_search.costing.diagnosis import StepError
from atorch.strategy_search.search.ask_tell import (  # noqa: F401  (OK_STATUSES, DEFAULT_TOP_K: re-exported)
    CONFIRM_ROUNDS,
    CONFIRM_RUNS,
    CONFIRM_TIE,
    DEFAULT_TOP_K,
    EARLY_STOP_FACTOR,
    FINISHING_STOPS,
    HOPELESS_FACTOR,
    MAX_MEMORY_CORRECTION,
    OK_STATUSES,
    Proposal,
    SearchRecord,
    SearchState,
    StopRules,
    cached_best,
    decided,
    disputed_band,
    make_sampler,
    measure_safely,
    merge_runs,
    trial_record,
)
from atorch.strategy_search.search.candidates import CandidateTable
from atorch.strategy_search.search.describe import describe_candidate
from atorch.strategy_search.search.outcome import Measured, Predicted
from atorch.strategy_search.search.space import Candidate, SearchSpace

logger = get_logger(__name__)
COST_MODEL_ONLY_MARGIN = 0.05  # a pick that no dry-run checks stays this far under the memory budget


def default_storage() -> str:
    path = cache_dir() / "search.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def hardware_key(profile: Any) -> str:
    """The parts of a hardware profile that identify the machines (a HardwareProfile, or a string as is).

    The memory budget is not part of it (free RAM differs from run to run): stored outcomes are judged
    again under each search's budget (``cached_best``)."""
    if isinstance(profile, str):
        return profile
    parts = [getattr(profile, k, None) for k in (
        "device_type", "device_name", "world_size", "local_world_size", "backend", "torch_version",
    )]
    return json.dumps(parts)


class StudyIdentity(BaseModel):
    """Everything a search's answer depends on, except the memory budget (stored measurements are judged again
    under each call's budget). Hashed into the study's name and stored as its ``identity`` attribute, so
    ``atorch cache list`` can say what a study is for. Build it with ``StudyIdentity.of``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str  # analyser.fingerprint: module tree and settings, parameter shapes/dtypes, transformers config
    model_class: str
    sample: Any = None  # the per-rank sample batch: structure, shapes and dtypes (never values of tensors)
    optimizer: Any = None  # class, arguments, parameter-group function
    loss: Any = None  # qualified name (a loss module: class and settings)
    model_input_format: str | None = None
    global_batch: int
    world_size: int
    hardware: str  # hardware_key
    space: str  # SearchSpace.signature(): its valid points
    options: dict[str, Any] = Field(default_factory=dict)  # what built the space (excluded, included, ...)
    versions: dict[str, str] = Field(default_factory=dict)  # atorch and torch

    @classmethod
    def of(cls, space: SearchSpace, *, model: Any = None, hardware: Any = "", sample: Any = None,
           optimizer: Any = None, loss: Any = None, model_input_format: str | None = None,
           options: dict[str, Any] | None = None) -> StudyIdentity:
        """The identity of a search over ``space`` (its model, batch, world size, points and the options that
        built it); the other parts as the caller has them, reduced to stable JSON (tensors by shape and dtype,
        functions and classes by qualified name). ``options``: further search options that change the answer."""
        import torch

        built = {"excluded": sorted(space.excluded), "included": sorted(space.included),
                 "supported_dtypes": list(space.supported_dtypes), "half_dtypes": list(space.half_dtypes),
                 "host_offload": space.host_offload, "max_micro_batch_size": space.max_micro_batch_size,
                 "finetune": space.finetune.to_list() if space.finetune is not None else None}
        return cls(model=space.model_fingerprint, model_class=class_path(type(model)) if model is not None else "",
                   sample=identity_json(sample), optimizer=identity_json(optimizer), loss=identity_json(loss),
                   model_input_format=model_input_format, global_batch=space.global_batch,
                   world_size=space.world_size, hardware=hardware_key(hardware), space=space.signature(),
                   options=identity_json({**built, **(options or {})}),
                   versions={"atorch": _atorch_version(), "torch": torch.__version__})


def _atorch_version() -> str:
    """The installed distribution's version (setup.cfg reads it from ``atorch.__version__``: the two are one),
    asked of the package metadata so the search does not import the package facade above it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("atorch")
    except PackageNotFoundError:  # a source checkout on PYTHONPATH, never installed
        return "unknown"


def study_key(identity: StudyIdentity) -> str:
    """The study name: a hash of the identity's JSON."""
    payload = json.dumps(identity.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return "atorch-search-" + hashlib.sha256(payload.encode()).hexdigest()[:24]


_study_key = study_key  # Planner's argument of the same name shadows it


@dataclass
class PlanResult:
    candidate: Candidate | None
    samples_per_s: float | None  # measured (or, for plan_without_dryrun, predicted)
    source: str  # "search", "cache" or "cost_model"
    study_name: str = ""
    dry_runs: int = 0  # measure calls made by this call
    stop_reason: str = ""
    trials: list[dict[str, Any]] = field(default_factory=list)  # user attrs of this study's trials


class Planner:
    """Plans a strategy for one job. ``predict(candidate)`` returns a ``Predicted`` or something with
    ``.peak_memory_bytes`` and ``.step_time_s`` (one optimizer step over the global batch);
    ``measure(candidate)`` returns a ``Measured`` or something with ``.status``, ``.samples_per_s``,
    ``.peak_memory_bytes`` and ``.reason`` (atorch.strategy_search.search.outcome)."""

    def __init__(
        self,
        space: SearchSpace,
        *,
        predict: Callable[[Candidate], Any],
        measure: Callable[[Candidate], Any],
        memory_budget: int,
        storage: Any = None,
        study_key: str | None = None,
        sampler: Any = "tpe",
        time_limit_s: float | None = None,
        max_trials: int = 8,
        patience: int | None = None,
        top_k: int = DEFAULT_TOP_K,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
        on_trial: Callable[[dict[str, Any]], None] | None = None,
        confirm_within: float | None = None,
        skip_slower_than: float | None = HOPELESS_FACTOR,
        identity: StudyIdentity | None = None,
        correct_time: bool = True,
        check: Callable[[], None] | None = None,
        prepare: Callable[[list[Candidate]], dict[tuple[str, str], str] | None] | None = None,
        confirm_rounds: int = CONFIRM_ROUNDS,
        time_spent_s: float = 0.0,
        stop_when_nothing_left: bool = True,
        phases: dict[str, float] | None = None,
    ) -> None:
        if memory_budget <= 0:
            raise ValueError(f"memory_budget must be positive bytes, got {memory_budget}")
        self.space = space
        self.predict_fn = predict
        self.measure_fn = measure
        self.memory_budget = int(memory_budget)
        self.storage = storage if storage is not None else default_storage()
        # ``identity``: what the study is for (named by its hash unless ``study_key`` names it; stored with it)
        self.identity = identity
        self.study_name = study_key or _study_key(identity or StudyIdentity.of(space))
        self.sampler = sampler
        self.time_limit_s = time_limit_s
        self.time_spent_s = time_spent_s  # of time_limit_s, before this planner (the analysis): counted against it
        self.max_trials = max_trials
        self.patience = patience
        self.top_k = top_k
        self.seed = seed
        self.clock = clock
        self.on_trial = on_trial  # called after every told trial with its record (_trial_records' shape)
        self.confirm_within = confirm_within
        self.confirm_rounds = confirm_rounds  # interleaved rounds at most, while the two stay within noise
        self.skip_slower_than = skip_slower_than
        # exploration stops once no candidate left is predicted within NOTHING_LEFT_MARGIN of the best measured one
        # (SearchState.nothing_left; off with skip_slower_than=None: the sampler's proposals are all dry-run)
        self.stop_when_nothing_left = stop_when_nothing_left
        # seconds by phase, added to ``phases`` (a caller's dict: automatic.py adds the analysis and the trace):
        # build_check_s (``prepare``), dry_runs_s (exploration's), confirmation_s; stored in the study (the report)
        self.phases: dict[str, float] = phases if phases is not None else {}
        self.correct_time = correct_time  # per-family time corrections (SearchState); False: bench/search_replay.py
        # Called before each ask, each confirmation run and before the search's end is stored; it raises to stop the
        # search unfinished (the automatic search: a rank that never came back from a trial it overran).
        self.check = check or (lambda: None)
        # What a search does once before its first dry-run (never for a cached answer), in the search's wall time:
        # the build check of the space's method families (atorch.strategy_search.search.buildable: it returns the
        # (method, layout) pairs that do not build, and why) and the methods' one-time preparations
        # (``MethodConfig.preparation``: DeepSpeed's op build), so no trial's time holds them.
        self.prepare = prepare
        self.unbuildable: dict[tuple[str, str], str] | None = None  # set by ``before_dry_runs``
        self._predictions: dict[str, Predicted] | None = None
        self._table: CandidateTable | None = None
        self.best_step_s: float | None = None  # the best measured candidate's median step in this search (seconds)
        self.confirming = False  # confirmation runs are timed in full (they decide between two close candidates)

    # ----- the cost model ----------------------------------------------------------------------
    def _predict(self, cand: Candidate, warn: RepeatedWarnings) -> Predicted:
        """The prediction, or the reason the cost model could not predict (``error``: then it is measured)."""
        try:
            return Predicted.estimate(self.predict_fn(cand), self.space.global_batch)
        except StepError:  # the user's model / loss_func cannot run a step: measuring would fail the same way
            raise
        except Exception as exc:  # a cost model gap must not stop the search
            reason = f"{type(exc).__name__}: {exc}"
            warn(reason, f"cost model could not predict {cand}: {exc}")  # once, with the count, not per candidate
            return Predicted.failed(reason)

    def predictions(self) -> dict[str, Predicted]:
        if self._predictions is None:
            with RepeatedWarnings(logger, "candidates") as warn:
                self._predictions = {c.key: self._predict(c, warn) for c in self.space.enumerate()}
        return self._predictions

    def table(self) -> CandidateTable:
        """The space's valid points with the cost model's predictions (what ask/tell works from)."""
        if self._table is None:
            preds = self.predictions()
            self._table = CandidateTable.from_space(self.space, lambda c: preds[c.key].to_json())
        return self._table

    def describe(self, cand: Candidate) -> str:
        """The one description of a candidate (atorch.strategy_search.search.describe), at this space's world size."""
        return describe_candidate(cand.strategy, cand.micro_batch_size, cand.micro_batches, self.space.world_size)

    def early_stop_above_s(self) -> float | None:
        """The bar a dry-run's timed steps stop at (EARLY_STOP_FACTOR x the best measured median step of this
        search), for ``measure`` to pass to the dry-run (atorch.dryrun.runner: ``stop_above_s``); None before a
        candidate ran and during the confirmation."""
        if self.confirming or self.best_step_s is None:
            return None
        return EARLY_STOP_FACTOR * self.best_step_s

    def _candidate(self, key: str) -> Candidate:
        return self.space.enumerate()[self.table().by_key[key]]

    def ranked_by_cost_model(self, memory_budget: float | None = None, banded: bool = True) -> list[Candidate]:
        """Candidates predicted to fit ``memory_budget`` (default: the planner's), highest predicted samples/s
        first; ``banded``: within the cost model's known memory error of it (a dry-run settles those)."""
        budget = self.memory_budget if memory_budget is None else memory_budget
        return [self._candidate(k) for k in self.table().ranked(budget, banded=banded)]

    def plan_without_dryrun(self) -> PlanResult:
        """The cost model's pick: no study, no dry-run. Nothing measures it, so it must be predicted to fit with
        COST_MODEL_ONLY_MARGIN to spare (the memory model's error reaches ~8% on the bench: bench/README.md)."""
        safe = self.memory_budget * (1.0 - COST_MODEL_ONLY_MARGIN)
        ranked = self.ranked_by_cost_model(safe, banded=False)
        if not ranked:
            return PlanResult(None, None, "cost_model", self.study_name, stop_reason=(
                f"no candidate is predicted to fit {100 * (1 - COST_MODEL_ONLY_MARGIN):.0f}% of the memory budget"))
        best = ranked[0]
        pred = self.predictions()[best.key]
        return PlanResult(best, pred.samples_per_s, "cost_model", self.study_name,
                          stop_reason="picked by the cost model")

    def baseline(self) -> Candidate | None:
        """Plain DDP (fp32, no checkpointing, no replacement) at the micro-batch the cost model likes best."""
        key = self.table().baseline(self.memory_budget)
        return self._candidate(key) if key is not None else None

    # ----- the study ---------------------------------------------------------------------------
    def _make_sampler(self) -> Any:
        return make_sampler(self.sampler, self.max_trials, self.seed)

    def study(self) -> Any:
        return self._open()[0]

    def _open(self) -> tuple[Any, Any]:
        """The study and its Optuna storage object (SearchState finds trials by number through it)."""
        import optuna

        storage = optuna.storages.get_storage(self.storage)  # a URL's storage; a storage object as it is
        with _optuna_quiet():  # Optuna's own "A new study created ..." line: atorch's log says what the study is
            study = optuna.create_study(
                direction="maximize", storage=storage, study_name=self.study_name,
                load_if_exists=True, sampler=self._make_sampler(),
            )
        if "created" not in study.user_attrs:  # a new study: say when, and what it is for (atorch cache list)
            study.set_user_attr("created", _now())
            if self.identity is not None:
                study.set_user_attr("identity", self.identity.model_dump(mode="json"))
        return study, storage

    def cached(self) -> PlanResult | None:
        """This study's answer under this budget, if its search finished and the answer holds (``cached_best``)."""
        return self._reuse(self.study())[0]

    def _reuse(self, study: Any) -> tuple[PlanResult | None, str]:
        verdict = cached_best(study, self.memory_budget)
        if verdict.best is None:
            return None, verdict.reason
        cand = self.space.from_point(verdict.best["point"])
        reason = f"reused: {verdict.reason}"
        return PlanResult(cand, verdict.best["samples_per_s"], "cache", self.study_name, stop_reason=reason,
                          trials=_trial_records(study)), reason

    def search(self, force: bool = False) -> PlanResult:
        """The search loop, over this planner's study (``search_study``: a local Optuna study here, a strategy
        server's in RemotePlanner). A study whose search finished and whose answer holds under this budget is
        served with no dry-run; any other is resumed: explore, then confirm a close runner-up."""
        # confirmation's dry-runs are kept out of exploration where at least four are left to it
        reserve = CONFIRM_RUNS if self.confirm_within and self.max_trials >= 4 + CONFIRM_RUNS else 0
        rules = StopRules(self.time_limit_s, self.max_trials, self.patience, self.clock, reserved=reserve,
                          spent=self.time_spent_s)
        study = self.search_study()
        self.best_step_s, self.confirming = None, False
        if (hit := study.start(force)) is not None:
            return hit
        try:
            self.before_dry_runs()  # a strategy server's study: here (a local one did it before seeding)
            stop, kind = self._explore(study, rules)
            self.phases["dry_runs_s"] = sum(rules.walls)
            confirmation = self._confirm(study, rules) if reserve else self._no_confirmation()
            self.phases["confirmation_s"] = sum(rules.walls) - self.phases["dry_runs_s"]
            if confirmation.startswith("confirmation cut short"):
                kind = "time_limit"
            stop = rules.ended(stop, confirmation)
            self.check()  # every rank back: only then is the end stored (finished or not)
        except BaseException as exc:  # an interrupted or failed search is stored as unfinished, then raised
            kind = "error" if isinstance(exc, Exception) else "interrupted"
            study.abort("rank_lost" if isinstance(exc, RankLost) else kind, f"{type(exc).__name__}: {exc}")
            raise
        best, ended = study.finish(kind, stop, lambda point: json.loads(
            self.space.from_point(point).strategy.to_json(indent=None)))
        best_cand = self.space.from_point(best["point"]) if best is not None else None
        logger.info("strategy search: %s (%s); best %s", stop, ended, self.describe(best_cand) if best_cand else None)
        return PlanResult(best_cand, best["samples_per_s"] if best is not None else None, "search", self.study_name,
                          rules.dry_runs, stop, study.trials())

    def before_dry_runs(self) -> dict[tuple[str, str], str]:
        """Run ``prepare`` once: the (method, layout) pairs that do not build, and why."""
        if self.unbuildable is None:
            begin = self.clock()
            self.unbuildable = dict((self.prepare(self.space.enumerate()) if self.prepare is not None else None) or {})
            self.phases["build_check_s"] = self.clock() - begin
        return self.unbuildable

    def search_study(self) -> SearchStudy:
        """The study ``search`` drives: this planner's Optuna study (RemotePlanner: a strategy server's)."""
        return LocalStudy(self)

    def _no_confirmation(self) -> str:
        if not self.confirm_within:
            return "no confirmation (off)"
        return f"no confirmation (max_trials {self.max_trials} leaves no room: it needs {4 + CONFIRM_RUNS})"

    def _explore(self, study: SearchStudy, rules: StopRules) -> tuple[str, str]:
        """Ask, measure, tell until a stop rule or the sampler stops it: (the stop reason, its kind)."""
        same = SameFailure()
        while True:
            self.check()
            proposal = study.ask(stop=rules.reason)
            if proposal.number is None:
                return proposal.stop, rules.stopped or "exhausted"
            cand = self.space.from_point(proposal.point)
            record = study.tell(proposal.number, self._timed(cand, rules))
            if record is None:  # the study refused the result (a server's lease expired): the dry-run counts
                rules.record(False)
                continue
            logger.info("trial %d: %s -> %s %s", proposal.number, self.describe(cand), record.get("status"),
                        record.get("reason", ""))
            rules.record(record["improved"])
            measured = record.get("measured") or {}
            if record.get("status") == "ok" and measured.get("step_time_s") and not measured.get("stopped_early"):
                step = float(measured["step_time_s"])
                self.best_step_s = step if self.best_step_s is None else min(self.best_step_s, step)
            same.check(record, cand)  # raises where every dry-run failed the same way: the user's setup

    def _timed(self, cand: Candidate, rules: StopRules) -> Measured:
        """One dry-run, its wall time kept by ``rules`` (the next one's prediction against the time left)."""
        begin = self.clock()
        try:
            return measure_safely(self.measure_fn, cand)
        finally:
            rules.timed(self.clock() - begin)

    def _confirm(self, study: SearchStudy, rules: StopRules) -> str:
        """Re-measure the best and a close runner-up interleaved (the runner-up first: A B, A B, ...) in rounds,
        while their runs stay within the noise of each other (``decided``; at most ``confirm_rounds``), then choose
        again (``best_of``: the faster where the runs tell them apart, else the simpler); says what it did and
        which rule decided (for the stop message, and the study's ``confirmation_verdict``)."""
        self.confirming = True
        contenders, measured = study.contenders(self.confirm_within or 0.0)
        if not contenders:
            why = "fewer than two candidates ran" if measured < 2 else (
                f"the runner-up was not within {self.confirm_within:.0%} of the best "
                f"({disputed_band(self.confirm_within):.0%} for a runner-up that the cost model ranked first)")
            return f"no confirmation: {why}"
        # each contender's confirmation runs merged as the study merges them (merge_runs), to judge the rounds
        merged = {c["key"]: {"status": "ok", "samples_per_s": c["samples_per_s"], "peak_memory_bytes": 0.0}
                  for c in contenders}
        done, rounds, best, rule = 0, 0, None, ""
        while rounds < max(1, self.confirm_rounds) and not rule:
            if rounds and rules.dry_runs + len(contenders) > self.max_trials:
                # a further round only from what exploration left of max_trials: the user's budget of dry-runs holds
                rule = self._verdict(study, contenders, merged, rounds, best, final=True)
                break
            for contender in reversed(contenders):
                if late := rules.out_of_time():
                    logger.info("strategy search: confirmation cut short: %s", late)
                    said = f"confirmation cut short after {done} dry-runs ({rounds} full rounds): {late}"
                    if rounds:  # what the full rounds measured still decides
                        said += "; " + self._verdict(study, contenders, merged, rounds, best, final=True)
                    return said
                self.check()
                cand = self.space.from_point(contender["point"])
                run = self._timed(cand, rules)
                record, best = study.confirm(contender["key"], run)
                merged[contender["key"]] = merge_runs(merged[contender["key"]], run.to_json())
                rules.record(False)
                done += 1
                logger.info("confirmation round %d: %s -> %s, %.3g samples/s (first run %.3g)", rounds + 1,
                            self.describe(cand), record["status"], run.samples_per_s, contender["samples_per_s"])
            rounds += 1
            rule = self._verdict(study, contenders, merged, rounds, best, final=rounds >= self.confirm_rounds)
        logger.info("confirmation: best %s (%s)", self.describe(self.space.from_point(best["point"])) if best else None,
                    rule)
        return (f"confirmation: the best and the runner-up re-measured interleaved, {rounds} round"
                f"{'' if rounds == 1 else 's'} ({done} dry-runs); {rule}")

    def _verdict(self, study: SearchStudy, contenders: list[dict[str, Any]], merged: dict[str, dict[str, Any]],
                 rounds: int, best: dict[str, Any] | None, final: bool) -> str:
        """Which rule decides after ``rounds`` rounds ("" while the two are within noise and rounds are left); the
        verdict is kept in the study."""
        runs = [merged[c["key"]] for c in contenders]
        failed = [r for r in runs if str(r["status"]).lower() not in OK_STATUSES]
        if failed:
            rule = "a contender failed when re-measured: the other is kept"
        elif decided(*runs):
            rule = f"measured faster over {rounds} round{'' if rounds == 1 else 's'}"
        elif final:
            rule = f"tie within noise over {rounds} round{'' if rounds == 1 else 's'}: the simpler strategy wins"
        else:
            return ""
        study.note_verdict({"rule": rule, "rounds": rounds, "keys": [c["key"] for c in contenders],
                            "best": best["key"] if best else None})
        return rule

def failure_signature(reason: str) -> str:
    """A failure's reason as compared across candidates: the first rank's error, without rank numbers, figures
    or addresses (shapes and sizes differ with the micro-batch and the layout)."""
    first = re.sub(r"^rank \d+: ", "", reason.split("; ")[0])
    return re.sub(r"0x[0-9a-fA-F]+|\d+(\.\d+)?", "#", first)[:300]


class SameFailure:
    """The search's stop for a mistake in the user's own setup: when every dry-run so far failed (none ran, none
    ran out of memory) with the same error, on candidates that share no method but the layout, the error is not a
    strategy's: measuring more candidates would fail the same way, and "raise memory_limit" would mislead. The
    search stops at once and raises that error as the user's (every rank hears it)."""

    RUNS = 2

    def __init__(self) -> None:
        self.failures: list[tuple[str, frozenset[str], str]] = []  # (signature, methods, reason)
        self.other = False  # some dry-run ran, ran out of memory or timed out: the setup can run

    def check(self, record: dict[str, Any], cand: Candidate) -> None:
        if record.get("status") != "failed":
            self.other = self.other or record.get("status") in ("ok", "oom", "timeout")
            return
        methods = frozenset(cand.strategy.names()) - {ParallelMode.name}
        reason = str(record.get("reason") or "")
        self.failures.append((failure_signature(reason), methods, reason))
        if self.other or len(self.failures) < self.RUNS or len({f[0] for f in self.failures}) > 1:
            return
        if frozenset.intersection(*(f[1] for f in self.failures)):
            return  # a method they share may be the cause
        raise StepError(
            f"every candidate the search ran failed with the same error ({len(self.failures)} dry-runs of "
            f"strategies that share no method), so the cause is in the training setup (the model, loss_func, the "
            f"data or optim_args), not in a strategy: {reason}. Fix it and run again; one process with "
            "load_strategy=['parallel_mode'] shows the whole traceback")


class SearchStudy(ABC):
    """A study as ``Planner.search`` drives it: where the trials are kept and the next candidate is decided.
    ``LocalStudy``: an Optuna study in this process (``SearchState``); ``remote.RemoteStudy``: a strategy
    server's, over HTTP. The loop (stop rules, dry-runs, confirmation) is the planner's, the same for
    both."""

    @abstractmethod
    def start(self, force: bool) -> PlanResult | None:
        """The stored answer when the study serves this search (never with ``force``); else None, and the study
        is ready to be asked (the cost model's favourites enqueued)."""

    @abstractmethod
    def ask(self, stop: Callable[[], str]) -> Proposal:
        """The next candidate to measure, or (``number`` None) why to stop; ``stop()``: the search's stop rules."""

    @abstractmethod
    def tell(self, number: int, measured: Measured) -> dict[str, Any] | None:
        """Tell a measured outcome: the trial's record plus ``improved``; None when the study refused it (a
        server's lease expired: the trial is failed there and the search goes on)."""

    @abstractmethod
    def contenders(self, within: float) -> tuple[list[dict[str, Any]], int]:
        """The best and the runner-up (``key``, ``point``, ``samples_per_s``) when the runner-up measured within
        ``within`` of the best (``SearchState.contenders``), else none; and how many candidates ran ok."""

    @abstractmethod
    def confirm(self, key: str, measured: Measured) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Record a re-measurement (``SearchState.confirm``): its record and the best chosen again."""

    def note_verdict(self, verdict: dict[str, Any]) -> None:  # noqa: B027  (optional: a server keeps none)
        """Keep which rule decided the confirmation (the report shows it)."""

    @abstractmethod
    def finish(self, kind: str, stop: str, strategy_of: Callable[[Any], dict[str, Any]]
               ) -> tuple[dict[str, Any] | None, str]:
        """Store the best (with its strategy, ``strategy_of(point)``) and how the search ended (``kind``: the
        stop rule's); returns the best (``point``, ``samples_per_s``) or None, and what the log says of it."""

    @abstractmethod
    def abort(self, kind: str, reason: str) -> None:
        """The search ended by an error or an interruption (``kind``) before ``finish``."""

    @abstractmethod
    def trials(self) -> list[dict[str, Any]]:
        """Every trial's record (``trial_record``'s shape)."""


class LocalStudy(SearchStudy):
    """The planner's Optuna study (its storage: SQLite by default) with ``SearchState``; every search stores how it
    ended (``SearchRecord``), so a later one serves it (``cached_best``) or resumes it."""

    def __init__(self, planner: Planner) -> None:
        self.planner = planner
        self.study, self.storage = planner._open()
        self.state: SearchState | None = None
        self.asked: int | None = None  # the trial asked and not yet told

    def start(self, force: bool) -> PlanResult | None:
        p, study = self.planner, self.study
        if not force:
            hit, why = p._reuse(study)
            if hit is not None:
                logger.info("strategy search: %s from study %s: %s (%.3g samples/s); %s", hit.candidate,
                            p.study_name, hit.source, hit.samples_per_s, why)
                return hit
            measured = sum(1 for t in _trial_records(study) if "measured" in t and t.get("status") != "duplicate")
            if measured:
                logger.info("strategy search: resuming study %s, reusing its %d measured trials: %s",
                            p.study_name, measured, why)
        self._record(False, "running", "started; not finished (a search killed before its end stays so)")
        unbuildable = p.before_dry_runs()  # before seeding: a family that cannot build is never enqueued
        if unbuildable:  # the report lists them with their reasons
            study.set_user_attr("unbuildable", [{"method": m, "layout": at, "reason": why}
                                                for (m, at), why in unbuildable.items()])
        self.state = SearchState(study, p.table(), p.memory_budget, storage=self.storage, on_trial=p.on_trial,
                                 max_asks=max(50, 10 * p.max_trials), skip_slower_than=p.skip_slower_than,
                                 correct_time=p.correct_time, unbuildable=unbuildable,
                                 stop_when_nothing_left=p.stop_when_nothing_left)
        self.state.seed(p.top_k)
        return None

    def _state(self) -> SearchState:
        if self.state is None:
            raise RuntimeError("LocalStudy.start() first")
        return self.state

    def ask(self, stop: Callable[[], str]) -> Proposal:
        proposal = self._state().ask(stop=stop)
        self.asked = proposal.number
        return proposal

    def tell(self, number: int, measured: Measured) -> dict[str, Any] | None:
        self.asked = None
        return self._state().tell(number, measured)

    def contenders(self, within: float) -> tuple[list[dict[str, Any]], int]:
        return self._state().contenders(within)

    def confirm(self, key: str, measured: Measured) -> tuple[dict[str, Any], dict[str, Any] | None]:
        state = self._state()
        return state.confirm(key, measured), state.best()

    def note_verdict(self, verdict: dict[str, Any]) -> None:
        self.study.set_user_attr("confirmation_verdict", verdict)

    def finish(self, kind: str, stop: str, strategy_of: Callable[[Any], dict[str, Any]]
               ) -> tuple[dict[str, Any] | None, str]:
        state = self._state()
        if (best := state.best()) is not None:
            state.store_best({"strategy": strategy_of(best["point"])})
        self.study.set_user_attr("phases", {k: round(v, 3) for k, v in self.planner.phases.items()})
        finished = kind in FINISHING_STOPS and best is not None and not (kind == "patience" and _untried(self.study))
        self._record(finished, kind, stop)
        ended = "finished" if finished else "not finished: the next search resumes it"
        return best, f"{ended} in study {self.planner.study_name}"

    def abort(self, kind: str, reason: str) -> None:
        if self.asked is not None and self.state is not None:  # asked, never measured: not a result of it
            self.state.fail(self.asked, f"not run: the search stopped first ({reason})", status="not_run")
            # queued again, so the next search asks for it first (a FAILED trial's point is never enqueued again)
            (never,) = [t for t in self.study.get_trials(deepcopy=False) if t.number == self.asked]
            self.study.enqueue_trial(never.params)
            self.asked = None
        self._record(False, kind, reason)

    def trials(self) -> list[dict[str, Any]]:
        return _trial_records(self.study)

    def _record(self, finished: bool, stop: str, reason: str) -> None:
        p, state = self.planner, self.state
        best = state.best() if state is not None else None
        measured = sum(1 for v in state.done.values() if "measured" in v[2]) if state is not None else 0
        SearchRecord(finished=finished, stop=stop, stop_reason=reason, memory_budget=p.memory_budget,
                     fits_below=self._fits_below(state) if state is not None else None, max_trials=p.max_trials,
                     best_key=best["key"] if best else None, measured=measured, at=_now()).store(self.study)

    def _fits_below(self, state: SearchState) -> float | None:
        """The smallest peak of a candidate this budget ruled out: measured over it, or predicted over it (scaled
        by its family's memory correction) and never measured. None when the budget ruled nothing out."""
        budget, table = self.planner.memory_budget, self.planner.table()
        peaks = [v[2]["measured"]["peak_memory_bytes"] for v in state.done.values()
                 if v[2].get("status") == "oom" and "measured" in v[2]]
        for key, pred in zip(table.keys, table.predictions, strict=True):
            if (key in state.done and "measured" in state.done[key][2]) or "error" in pred:
                continue
            peak = pred["peak_memory_bytes"] * (state.correction(key) or 1.0)
            if peak > budget:
                peaks.append(peak)
        return min(peaks) if peaks else None


def _trial_records(study: Any) -> list[dict[str, Any]]:
    return [trial_record(t) for t in study.get_trials(deepcopy=False)]


def _untried(study: Any) -> bool:
    """Enqueued candidates (the cost model's favourites) that no ask has taken yet."""
    from optuna.trial import TrialState

    return bool(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))


@contextlib.contextmanager
def _optuna_quiet() -> Iterator[None]:
    """Optuna's INFO lines held back for the block (its logger's level restored after: the application's)."""
    import optuna

    logger = optuna.logging.get_logger("optuna")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# ----- the cache on disk (atorch cache list / clear) ------------------------------------------------------

def list_studies(storage: str | None = None) -> list[dict[str, Any]]:
    """Every study in ``storage`` (default: the cache's SQLite file): what it is for, how its last search
    ended and its best, as JSON."""
    import optuna

    storage = storage or default_storage()
    rows = []
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        attrs = summary.user_attrs
        identity = attrs.get("identity") or {}
        records = SearchRecord.stored(study)
        last = records[-1] if records else None
        measured = sum(1 for t in study.get_trials(deepcopy=False)
                       if "measured" in t.user_attrs and t.user_attrs.get("status") != "duplicate")
        best = attrs.get("best") or {}
        rows.append({
            "study": summary.study_name,
            "created": attrs.get("created") or (summary.datetime_start.isoformat(timespec="seconds")
                                                if summary.datetime_start else ""),
            "model": identity.get("model_class", ""), "fingerprint": identity.get("model", "")[:12],
            "world_size": identity.get("world_size"), "global_batch": identity.get("global_batch"),
            "trials": summary.n_trials, "measured": measured,
            "finished": [r.memory_budget for r in records if r.finished],  # the budgets it answers for
            "last_stop": f"{last.stop}: {last.stop_reason}" if last else "",
            "best": _strategy_names(best.get("strategy")), "best_samples_per_s": best.get("samples_per_s"),
            "identity": identity,
        })
    return rows


def clear_studies(storage: str | None = None, study: str | None = None) -> list[str]:
    """Delete one study (``study``) or every study in ``storage``; returns the names deleted."""
    import optuna

    storage = storage or default_storage()
    names = [s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)]
    if study is not None:
        if study not in names:
            raise KeyError(f"no study {study!r} in {storage} (atorch cache list shows the studies)")
        names = [study]
    for name in names:
        optuna.delete_study(study_name=name, storage=storage)
    return names


def _strategy_names(strategy: Any) -> str:
    """A stored strategy (Strategy.to_json's form) by its methods' names."""
    if not isinstance(strategy, dict):
        return ""
    return " + ".join(str(m.get("name")) for m in strategy.get("methods", []))
