"""One candidate's two figures: what the cost model predicts (``Predicted``) and what its dry-run measured
(``Measured``). Each is one value from where it is made to the JSON boundary (the candidate table, an Optuna
trial's user attributes, the strategy server's request bodies, which are these types with wire limits added:
atorch.server.models); ``to_json`` / ``from_json`` cross it."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Predicted(BaseModel):
    """The cost model's answer for one candidate (peak bytes per rank, seconds per optimizer step over the global
    batch and the samples/s that makes), or why it could not predict (``error``: the candidate is then measured)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    peak_memory_bytes: float | None = Field(None, ge=0)
    step_time_s: float | None = Field(None, ge=0)
    samples_per_s: float | None = Field(None, ge=0)
    # the relative error of peak_memory_bytes the cost model is known to make (measured against dry-runs): a
    # candidate is ruled out for memory only when even the low end of that band is over the budget, so a close
    # call is settled by a measurement, never by the estimate alone
    memory_band: float = Field(0.0, ge=0, lt=1)
    error: str | None = None

    @model_validator(mode="after")
    def _one_of(self) -> Predicted:
        numbers = (self.peak_memory_bytes, self.step_time_s, self.samples_per_s)
        if self.error is None and any(v is None for v in numbers):
            raise ValueError("give peak_memory_bytes, step_time_s and samples_per_s, or error")
        return self

    @classmethod
    def of(cls, peak_memory_bytes: float, step_time_s: float, global_batch: int,
           memory_band: float = 0.0) -> Predicted:
        step = float(step_time_s)
        return cls(peak_memory_bytes=float(peak_memory_bytes), step_time_s=step,
                   samples_per_s=global_batch / step if step > 0 else 0.0, memory_band=memory_band)

    @classmethod
    def estimate(cls, raw: Any, global_batch: int) -> Predicted:
        """From a cost model's answer: a ``Predicted`` as it is, else anything with ``.peak_memory_bytes`` and
        ``.step_time_s`` (a Planner's ``predict`` contract)."""
        if isinstance(raw, Predicted):
            return raw
        return cls.of(raw.peak_memory_bytes, raw.step_time_s, global_batch)

    @classmethod
    def failed(cls, reason: str) -> Predicted:
        return cls(error=reason)

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return {"error": self.error} if self.error is not None else self.model_dump(exclude={"error"})

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Predicted:
        return cls.model_validate(data)


class Measured(BaseModel):
    """A dry-run's outcome: status (ok, oom, failed, timeout, numerics, ...), samples/s, peak bytes per rank, step
    time, the reason of one that did not run, and the numerics check's figures (atorch.dryrun.numerics: the first
    step's loss and the user's model's on the same samples; a non-finite one is kept as its text, JSON has no NaN).
    A stored outcome may carry more (``runs``, from a confirmation's merge): ``from_json`` leaves it out."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    status: str
    samples_per_s: float = 0.0
    peak_memory_bytes: float = 0.0
    step_time_s: float = 0.0
    reason: str = ""
    loss: float | str | None = None
    reference_loss: float | str | None = None
    # every measured step's time on the slowest rank: their spread is the machine's noise, which tells whether
    # two candidates' confirmation runs differ (ask_tell.decided)
    step_times_s: list[float] = []
    # its timed steps stopped once they showed it slower than the search's best by the early-stop margin: measured
    # slower, its figure the median of the steps it ran (atorch.dryrun.runner: ``stop_above_s``)
    stopped_early: bool = False

    @classmethod
    def of(cls, result: Any) -> Measured:
        """From a dry-run's result: a ``Measured`` as it is, a ``TrialResult`` (atorch.dryrun.runner), or anything
        with ``.status``, ``.samples_per_s``, ``.peak_memory_bytes`` and ``.reason`` (a Planner's ``measure``)."""
        if isinstance(result, Measured):
            return result
        peak = getattr(result, "peak_memory_bytes", None)
        if peak is None:
            peak = getattr(result, "peak_bytes", None)  # a TrialResult: max over ranks
        return cls(status=str(result.status).lower(), samples_per_s=float(result.samples_per_s or 0.0),
                   peak_memory_bytes=float(peak or 0.0), step_time_s=float(getattr(result, "step_time_s", 0.0) or 0.0),
                   reason=str(getattr(result, "reason", "") or ""), loss=getattr(result, "loss", None),
                   reference_loss=getattr(result, "reference_loss", None), step_times_s=_slowest_steps(result),
                   stopped_early=bool(getattr(result, "stopped_early", False)))

    @classmethod
    def failure(cls, exc: BaseException) -> Measured:
        """A measure call that raised: a failed trial with its reason (the search goes on)."""
        return cls(status="failed", reason=f"{type(exc).__name__}: {exc}")

    def to_json(self) -> dict[str, Any]:
        out = self.model_dump(exclude={"loss", "reference_loss"})
        for name in ("loss", "reference_loss"):
            value = getattr(self, name)
            if isinstance(value, str):
                out[name] = value
            elif value is not None:
                out[name] = float(value) if math.isfinite(value) else str(value)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Measured:
        return cls.model_validate(data)


def _slowest_steps(result: Any) -> list[float]:
    """The measured step times of the rank with the slowest median (a TrialResult's ``ranks``), or the result's
    own ``step_times_s``; none where it has neither."""
    import statistics

    own = getattr(result, "step_times_s", None)
    if own:
        return [float(t) for t in own]
    ranks = [list(r.step_times_s) for r in getattr(result, "ranks", None) or [] if r is not None and r.step_times_s]
    return [float(t) for t in max(ranks, key=statistics.median)] if ranks else []
