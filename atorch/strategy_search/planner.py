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
   runner-up measured within that fraction of the best, both are measured once more, the runner-up first,
   and each keeps its faster run (``merge_runs``). One dry-run each cannot separate two candidates that close
   on a shared machine: on the bench, a 5% lead in the search was a 20% deficit when re-measured. The two
   runs come out of ``max_trials`` (exploration stops two early), so the dry-run budget holds.

Constraints (Trial.set_constraint, feasible when <= 0): ``memory_over`` = (peak - budget) / budget,
predicted or measured; ``failed`` = 1 for a failed or timed-out run, else 0.

The study lives in an Optuna storage (default: SQLite in the cache directory; any SQLAlchemy URL),
named by ``study_key``. A finished search stores its best as a study attribute; a later planner with
the same storage and key returns it with no dry-run (``force=True`` searches again, reusing every
stored trial). Everything stored is JSON (user attributes), never pickle.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atorch.log import RepeatedWarnings, get_logger
from atorch.strategy_search.analyser import StepError
from atorch.strategy_search.ask_tell import (  # noqa: F401  (OK_STATUSES, DEFAULT_TOP_K: re-exported)
    CONFIRM_RUNS,
    DEFAULT_TOP_K,
    HOPELESS_FACTOR,
    OK_STATUSES,
    SearchState,
    StopRules,
    cached_best,
    make_sampler,
    measure_safely,
    trial_record,
)
from atorch.strategy_search.candidates import CandidateTable
from atorch.strategy_search.describe import describe_candidate
from atorch.strategy_search.space import Candidate, SearchSpace

logger = get_logger(__name__)
COST_MODEL_ONLY_MARGIN = 0.05  # a pick that no dry-run checks stays this far under the memory budget


def cache_dir() -> Path:
    return Path(os.environ.get("ATORCH_CACHE_DIR") or Path.home() / ".cache" / "atorch")


def default_storage() -> str:
    path = cache_dir() / "search.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def hardware_key(profile: Any) -> str:
    """The parts of a hardware profile that identify the machines (a HardwareProfile, or a string as is).

    The memory budget is not part of it (free RAM differs from run to run): stored outcomes are judged
    again under each search's budget, and a cached best is used only if it fits."""
    if isinstance(profile, str):
        return profile
    parts = [getattr(profile, k, None) for k in (
        "device_type", "device_name", "world_size", "local_world_size", "backend", "torch_version",
    )]
    return json.dumps(parts)


def study_key(model_fingerprint: str, world_size: int, hardware: Any, global_batch: int, space_signature: str) -> str:
    """The study name: a hash of everything a plan depends on."""
    payload = json.dumps([model_fingerprint, world_size, hardware_key(hardware), global_batch, space_signature])
    return "atorch-search-" + hashlib.sha256(payload.encode()).hexdigest()[:24]


_study_key = study_key  # Planner's argument of the same name shadows it


@dataclass(frozen=True)
class Predicted:
    peak_memory_bytes: float
    step_time_s: float
    samples_per_s: float


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
    """Plans a strategy for one job. ``predict(candidate)`` returns something with
    ``.peak_memory_bytes`` and ``.step_time_s`` (one optimizer step over the global batch);
    ``measure(candidate)`` returns something with ``.status``, ``.samples_per_s``,
    ``.peak_memory_bytes`` and ``.reason``."""

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
    ) -> None:
        if memory_budget <= 0:
            raise ValueError(f"memory_budget must be positive bytes, got {memory_budget}")
        self.space = space
        self.predict_fn = predict
        self.measure_fn = measure
        self.memory_budget = int(memory_budget)
        self.storage = storage if storage is not None else default_storage()
        self.study_name = study_key or _study_key(
            space.model_fingerprint, space.world_size, "", space.global_batch, space.signature()
        )
        self.sampler = sampler
        self.time_limit_s = time_limit_s
        self.max_trials = max_trials
        self.patience = patience
        self.top_k = top_k
        self.seed = seed
        self.clock = clock
        self.on_trial = on_trial  # called after every told trial with its record (_trial_records' shape)
        self.confirm_within = confirm_within
        self.skip_slower_than = skip_slower_than
        self._predictions: dict[str, Predicted | str] | None = None
        self._table: CandidateTable | None = None

    # ----- the cost model ----------------------------------------------------------------------
    def _predict(self, cand: Candidate, warn: RepeatedWarnings) -> Predicted | str:
        """The prediction, or the reason the cost model could not predict (then it is measured)."""
        try:
            raw = self.predict_fn(cand)
            step = float(raw.step_time_s)
            return Predicted(float(raw.peak_memory_bytes), step, self.space.global_batch / step if step > 0 else 0.0)
        except StepError:  # the user's model / loss_func cannot run a step: measuring would fail the same way
            raise
        except Exception as exc:  # a cost model gap must not stop the search
            reason = f"{type(exc).__name__}: {exc}"
            warn(reason, f"cost model could not predict {cand}: {exc}")  # once, with the count, not per candidate
            return reason

    def predictions(self) -> dict[str, Predicted | str]:
        if self._predictions is None:
            with RepeatedWarnings(logger, "candidates") as warn:
                self._predictions = {c.key: self._predict(c, warn) for c in self.space.enumerate()}
        return self._predictions

    def _fits(self, pred: Predicted | str) -> bool:
        return isinstance(pred, Predicted) and pred.peak_memory_bytes <= self.memory_budget

    def table(self) -> CandidateTable:
        """The space's valid points with the cost model's predictions (what ask/tell works from)."""
        if self._table is None:
            preds = self.predictions()
            self._table = CandidateTable.from_space(self.space, lambda c: _pred_json(preds[c.key]))
        return self._table

    def describe(self, cand: Candidate) -> str:
        """The one description of a candidate (atorch.strategy_search.describe), at this space's world size."""
        return describe_candidate(cand.strategy, cand.micro_batch_size, cand.micro_batches, self.space.world_size)

    def _candidate(self, key: str) -> Candidate:
        return self.space.enumerate()[self.table().by_key[key]]

    def ranked_by_cost_model(self) -> list[Candidate]:
        """Predicted-feasible candidates, highest predicted samples/s first."""
        return [self._candidate(k) for k in self.table().ranked(self.memory_budget)]

    def plan_without_dryrun(self) -> PlanResult:
        """The cost model's pick: no study, no dry-run. Nothing measures it, so it must be predicted to fit with
        COST_MODEL_ONLY_MARGIN to spare (the memory model's error reaches ~8% on the bench: bench/README.md)."""
        safe = self.memory_budget * (1.0 - COST_MODEL_ONLY_MARGIN)
        ranked = [self._candidate(k) for k in self.table().ranked(safe)]
        if not ranked:
            return PlanResult(None, None, "cost_model", self.study_name, stop_reason=(
                f"no candidate is predicted to fit {100 * (1 - COST_MODEL_ONLY_MARGIN):.0f}% of the memory budget"))
        best = ranked[0]
        pred = self.predictions()[best.key]
        return PlanResult(best, pred.samples_per_s, "cost_model", self.study_name,  # type: ignore[union-attr]
                          stop_reason="picked by the cost model")

    def baseline(self) -> Candidate | None:
        """Plain DDP (fp32, no checkpointing, no replacement) at the micro-batch the cost model likes best."""
        key = self.table().baseline(self.memory_budget)
        return self._candidate(key) if key is not None else None

    # ----- the study ---------------------------------------------------------------------------
    def _make_sampler(self) -> Any:
        return make_sampler(self.sampler, self.max_trials, self.seed)

    def study(self) -> Any:
        import optuna

        return optuna.create_study(
            direction="maximize", storage=self.storage, study_name=self.study_name,
            load_if_exists=True, sampler=self._make_sampler(),
        )

    def cached(self) -> PlanResult | None:
        """The stored best of a finished search with this key, if it fits the memory budget."""
        study = self.study()
        best = cached_best(study, self.memory_budget)
        if best is None:
            return None
        cand = self.space.from_point(best["point"])
        return PlanResult(cand, best["samples_per_s"], "cache", self.study_name, stop_reason="cached",
                          trials=_trial_records(study))

    def search(self, force: bool = False) -> PlanResult:
        """The local loop over SearchState (ask/tell shared with the strategy server)."""
        # confirmation's dry-runs are kept out of exploration where at least four are left to it
        reserve = CONFIRM_RUNS if self.confirm_within and self.max_trials >= 4 + CONFIRM_RUNS else 0
        rules = StopRules(self.time_limit_s, self.max_trials, self.patience, self.clock, reserved=reserve)
        if not force and (hit := self.cached()) is not None:
            logger.info("strategy search: cached best %s (%.3g samples/s)", hit.candidate, hit.samples_per_s)
            return hit
        study = self.study()
        state = SearchState(study, self.table(), self.memory_budget, on_trial=self.on_trial,
                            max_asks=max(50, 10 * self.max_trials), skip_slower_than=self.skip_slower_than)
        state.seed(self.top_k)
        while True:
            proposal = state.ask(stop=rules.reason)
            if proposal.number is None:
                stop = proposal.stop
                break
            cand = self.space.from_point(proposal.point)
            record = state.tell(proposal.number, measure_safely(self.measure_fn, cand))
            logger.info("trial %d: %s -> %s %s", proposal.number, self.describe(cand), record["status"],
                        record.get("reason", ""))
            rules.record(record["improved"])
        stop = rules.ended(stop, self._confirm(state, rules) if reserve else self._no_confirmation())
        best_cand = None
        if (best := state.best()) is not None:
            best_cand = self.space.from_point(best["point"])
            state.store_best({"strategy": json.loads(best_cand.strategy.to_json(indent=None))})
        logger.info("strategy search: %s; best %s", stop, self.describe(best_cand) if best_cand else None)
        return PlanResult(best_cand, state.best_value, "search", self.study_name, rules.dry_runs, stop,
                          _trial_records(study))

    def _no_confirmation(self) -> str:
        if not self.confirm_within:
            return "no confirmation (off)"
        return f"no confirmation (max_trials {self.max_trials} leaves no room: it needs {4 + CONFIRM_RUNS})"

    def _confirm(self, state: SearchState, rules: StopRules) -> str:
        """Measure the best and a close runner-up once more (the runner-up first) and choose again; says what
        it did (for the stop message)."""
        contenders = state.contenders(self.confirm_within or 0.0)
        if not contenders:
            measured = sum(v[2]["status"] == "ok" for v in state.done.values())
            why = "fewer than two candidates ran" if measured < 2 else (
                f"the runner-up was not within {self.confirm_within:.0%} of the best")
            return f"no confirmation: {why}"
        done = 0
        for key in reversed(contenders):
            if late := rules.out_of_time():
                logger.info("strategy search: confirmation cut short: %s", late)
                return f"confirmation cut short after {done} of {len(contenders)} dry-runs: {late}"
            cand = self.space.from_point(json.loads(key))
            first = state.done[key][2]["measured"]["samples_per_s"]
            record = state.confirm(key, measure_safely(self.measure_fn, cand))
            rules.record(False)
            done += 1
            logger.info("confirmation: %s -> %s, %.3g samples/s (first run %.3g)", self.describe(cand),
                        record["status"], record["measured"]["samples_per_s"], first)
        logger.info("confirmation: best %s", self.describe(self.space.from_point(json.loads(state.best_key)))
                    if state.best_key else None)
        return f"confirmation: the best and the runner-up ran once more ({done} dry-runs)"


def _pred_json(pred: Predicted | str) -> dict[str, Any]:
    if isinstance(pred, str):
        return {"error": pred}
    return {"peak_memory_bytes": pred.peak_memory_bytes, "step_time_s": pred.step_time_s,
            "samples_per_s": pred.samples_per_s}


def _trial_records(study: Any) -> list[dict[str, Any]]:
    return [trial_record(t) for t in study.get_trials(deepcopy=False)]
