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
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atorch.log import get_logger
from atorch.strategy_search.space import Candidate, SearchSpace

logger = get_logger(__name__)

OK_STATUSES = frozenset({"ok", "success", "succeeded", "complete", "completed"})
DEFAULT_TOP_K = 3


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
        self._predictions: dict[str, Predicted | str] | None = None

    # ----- the cost model ----------------------------------------------------------------------
    def _predict(self, cand: Candidate) -> Predicted | str:
        """The prediction, or the reason the cost model could not predict (then it is measured)."""
        try:
            raw = self.predict_fn(cand)
            step = float(raw.step_time_s)
            return Predicted(float(raw.peak_memory_bytes), step, self.space.global_batch / step if step > 0 else 0.0)
        except Exception as exc:  # a cost model gap must not stop the search
            logger.warning("cost model could not predict %s: %s", cand, exc)
            return f"{type(exc).__name__}: {exc}"

    def predictions(self) -> dict[str, Predicted | str]:
        if self._predictions is None:
            self._predictions = {c.key: self._predict(c) for c in self.space.enumerate()}
        return self._predictions

    def _fits(self, pred: Predicted | str) -> bool:
        return isinstance(pred, Predicted) and pred.peak_memory_bytes <= self.memory_budget

    def ranked_by_cost_model(self) -> list[Candidate]:
        """Predicted-feasible candidates, highest predicted samples/s first."""
        preds = self.predictions()
        feasible = [c for c in self.space.enumerate() if self._fits(preds[c.key])]
        return sorted(feasible, key=lambda c: -preds[c.key].samples_per_s)  # type: ignore[union-attr]

    def plan_without_dryrun(self) -> PlanResult:
        """The cost model's pick: no study, no dry-run."""
        ranked = self.ranked_by_cost_model()
        if not ranked:
            return PlanResult(None, None, "cost_model", self.study_name, stop_reason="no candidate is predicted to fit")
        best = ranked[0]
        pred = self.predictions()[best.key]
        return PlanResult(best, pred.samples_per_s, "cost_model", self.study_name,  # type: ignore[union-attr]
                          stop_reason="picked by the cost model")

    def baseline(self) -> Candidate | None:
        """Plain DDP (fp32, no checkpointing, no replacement) at the micro-batch the cost model likes best."""
        ddp = [c for c in self.space.enumerate() if dict(c.point).get("sharding") == "ddp"
               and dict(c.point).get("precision") == "fp32" and not dict(c.point).get("checkpoint")
               and not dict(c.point).get("module_replace")]
        if not ddp:
            return None
        preds = self.predictions()
        fitting = [c for c in ddp if self._fits(preds[c.key])]
        if fitting:
            return max(fitting, key=lambda c: preds[c.key].samples_per_s)  # type: ignore[union-attr]
        return min(ddp, key=lambda c: c.micro_batch_size)

    # ----- the study ---------------------------------------------------------------------------
    def _make_sampler(self) -> Any:
        import optuna

        if not isinstance(self.sampler, str):
            return self.sampler
        startup = max(1, self.max_trials // 2)
        if self.sampler == "tpe":
            return optuna.samplers.TPESampler(seed=self.seed, n_startup_trials=startup)
        if self.sampler == "gp":
            return optuna.samplers.GPSampler(seed=self.seed, n_startup_trials=startup)
        raise ValueError(f"sampler must be 'tpe', 'gp' or an Optuna sampler, got {self.sampler!r}")

    def study(self) -> Any:
        import optuna

        return optuna.create_study(
            direction="maximize", storage=self.storage, study_name=self.study_name,
            load_if_exists=True, sampler=self._make_sampler(),
        )

    def cached(self) -> PlanResult | None:
        """The stored best of a finished search with this key, if it fits the memory budget."""
        study = self.study()
        best = study.user_attrs.get("best")
        if not best or best.get("peak_memory_bytes", math.inf) > self.memory_budget:
            return None
        cand = self.space.from_point(best["point"])
        return PlanResult(cand, best["samples_per_s"], "cache", self.study_name, stop_reason="cached",
                          trials=_trial_records(study))

    def search(self, force: bool = False) -> PlanResult:
        start = self.clock()
        if not force and (hit := self.cached()) is not None:
            logger.info("strategy search: cached best %s (%.3g samples/s)", hit.candidate, hit.samples_per_s)
            return hit
        from optuna.trial import TrialState

        study = self.study()
        preds = self.predictions()
        seeds = self.ranked_by_cost_model()[: self.top_k]
        base = self.baseline()
        order = seeds
        if base is not None and base not in seeds:
            # A baseline predicted not to fit goes first: it costs no dry-run and shows the sampler
            # where the infeasible region is; one that fits is measured after the cost model's picks.
            order = [base, *seeds] if not self._fits(preds[base.key]) else [*seeds, base]
        for cand in order:
            study.enqueue_trial(self.space.to_params(dict(cand.point)), skip_if_exists=True)

        # Measured outcomes already in the study (an earlier or interrupted search): never measured again,
        # judged under this budget. Predicted OOMs are not reused: the budget may have changed.
        done: dict[str, tuple[float, dict[str, float], dict[str, Any]]] = {}
        for old in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if "measured" in old.user_attrs and old.user_attrs.get("status") != "duplicate":
                key = old.user_attrs["key"]
                verdict: dict[str, Any] = {"number": old.number, "measured": old.user_attrs["measured"]}
                value, constraints = self._judge(old.user_attrs["measured"], preds.get(key, ""), verdict)
                done[key] = (value, constraints, verdict)
        best_value, best_key = None, None
        for key, (value, _, verdict) in done.items():
            if verdict["status"] == "ok" and (best_value is None or value > best_value):
                best_value, best_key = value, key
        dry_runs, since_best, asks = 0, 0, 0
        max_asks = max(50, 10 * self.max_trials)
        stop = ""
        while True:
            elapsed = self.clock() - start
            if self.time_limit_s is not None and elapsed >= self.time_limit_s:
                stop = f"time limit {self.time_limit_s:g}s reached ({elapsed:.1f}s)"
            elif dry_runs >= self.max_trials:
                stop = f"{dry_runs} dry-runs (max_trials)"
            elif self.patience is not None and since_best >= self.patience:
                stop = f"no improvement in {since_best} dry-runs (patience)"
            elif asks >= max_asks or len(done) >= len(self.space.enumerate()):
                stop = "every candidate the sampler proposes is already known"
            if stop:
                break
            asks += 1
            trial = study.ask()
            cand = self.space.suggest(trial)
            pred = preds[cand.key]
            attrs: dict[str, Any] = {"key": cand.key, "candidate": cand.to_json(), "predicted": _pred_json(pred)}
            if cand.key in done:  # asked again: reuse the stored outcome, no dry-run
                value, constraints, verdict = done[cand.key]
                attrs.update(status="duplicate", duplicate_of=verdict["number"], outcome=verdict["status"])
                self._tell(study, trial, value, constraints, attrs)
                continue
            if isinstance(pred, Predicted) and not self._fits(pred):
                attrs.update(status="predicted_oom", reason=(
                    f"predicted peak {pred.peak_memory_bytes / 2**20:.1f} MiB > budget "
                    f"{self.memory_budget / 2**20:.1f} MiB"
                ))
                over = (pred.peak_memory_bytes - self.memory_budget) / self.memory_budget
                constraints = {"memory_over": over, "failed": 0.0}
                self._tell(study, trial, pred.samples_per_s, constraints, attrs)
                done[cand.key] = (pred.samples_per_s, constraints, {"number": trial.number, **attrs})
                continue
            dry_runs += 1
            value, constraints = self._measure(cand, pred, attrs)
            self._tell(study, trial, value, constraints, attrs)
            done[cand.key] = (value, constraints, {"number": trial.number, **attrs})
            logger.info("trial %d: %s -> %s %s", trial.number, cand, attrs["status"], attrs.get("reason", ""))
            if attrs["status"] == "ok" and (best_value is None or value > best_value):
                best_value, best_key, since_best = value, cand.key, 0
            else:
                since_best += 1

        best_cand = None
        if best_key is not None:
            _, _, verdict = done[best_key]
            best_cand = self.space.from_point(json.loads(best_key))
            study.set_user_attr("best", {
                "point": dict(best_cand.point), "samples_per_s": best_value, "trial": verdict["number"],
                "peak_memory_bytes": verdict["measured"]["peak_memory_bytes"],
                "strategy": json.loads(best_cand.strategy.to_json(indent=None)),
            })
        logger.info("strategy search: %s; best %s", stop, best_cand)
        return PlanResult(best_cand, best_value, "search", self.study_name, dry_runs, stop, _trial_records(study))

    def _measure(self, cand: Candidate, pred: Predicted | str, attrs: dict[str, Any]) -> tuple[float, dict[str, float]]:
        try:
            res = self.measure_fn(cand)
            measured = {"status": str(res.status).lower(), "samples_per_s": float(res.samples_per_s or 0.0),
                        "peak_memory_bytes": float(res.peak_memory_bytes or 0.0),
                        "step_time_s": float(getattr(res, "step_time_s", 0.0) or 0.0),
                        "reason": str(getattr(res, "reason", "") or "")}
        except Exception as exc:  # a dry-run that raises is a failed trial; the search goes on
            measured = {"status": "failed", "samples_per_s": 0.0, "peak_memory_bytes": 0.0,
                        "reason": f"{type(exc).__name__}: {exc}"}
        attrs["measured"] = measured
        return self._judge(measured, pred, attrs)

    def _judge(
        self, measured: dict[str, Any], pred: Predicted | str, attrs: dict[str, Any]
    ) -> tuple[float, dict[str, float]]:
        """Value and constraints of a measured outcome under this planner's budget (stored outcomes too:
        a budget that changed since they were measured re-judges them)."""
        fallback = pred.samples_per_s if isinstance(pred, Predicted) else 0.0
        status, peak, sps, reason = (measured[k] for k in ("status", "peak_memory_bytes", "samples_per_s", "reason"))
        over = (peak - self.memory_budget) / self.memory_budget
        if status in OK_STATUSES and over > 0:
            status = "oom"
            reason = f"measured peak {peak / 2**20:.1f} MiB > budget {self.memory_budget / 2**20:.1f} MiB"
        if status in OK_STATUSES and sps > 0:
            attrs["status"] = "ok"
            return sps, {"memory_over": over, "failed": 0.0}
        attrs.update(status=status if status not in OK_STATUSES else "failed", reason=reason or status)
        if status == "oom":  # over budget by the measured amount (by the whole budget when not measured)
            return fallback, {"memory_over": over if over > 0 else 1.0, "failed": 0.0}
        return fallback, {"memory_over": over if peak > 0 else 0.0, "failed": 1.0}

    @staticmethod
    def _tell(study: Any, trial: Any, value: float, constraints: dict[str, float], attrs: dict[str, Any]) -> Any:
        for k, v in constraints.items():
            trial.set_constraint(k, float(v))
        for k, v in attrs.items():
            trial.set_user_attr(k, v)
        return study.tell(trial, float(value))


def _pred_json(pred: Predicted | str) -> dict[str, Any]:
    if isinstance(pred, str):
        return {"error": pred}
    return {"peak_memory_bytes": pred.peak_memory_bytes, "step_time_s": pred.step_time_s,
            "samples_per_s": pred.samples_per_s}


def _trial_records(study: Any) -> list[dict[str, Any]]:
    return [{"number": t.number, "value": t.value, "constraints": dict(t.constraints), **t.user_attrs}
            for t in study.get_trials(deepcopy=False)]
