"""The /v1 API's request and response bodies (pydantic: a malformed field is a 422 that names it)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

from atorch.strategy_search.search import outcome
from atorch.strategy_search.search.outcome import Predicted

Scalar = str | bool | int | float
STUDY_KEY = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,239}$"  # a key, or a study name (key:digest)
MAX_KEY = 240 - 13  # a key's name adds ":" and a 12-character digest, and every route takes names up to 240
# NaN / Infinity are refused (422), never stored; strict: a number is a JSON number (true or "5" is a 422, not 1
# or 5), an integer an integer.
STRICT = ConfigDict(allow_inf_nan=False, strict=True)
MAX_POINTS = 100_000


class Prediction(Predicted):
    """The cost model's answer for one point, or why it could not predict (a ``Predicted`` with the wire's
    limits)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, strict=True)
    error: str | None = Field(None, max_length=2000)


class Table(BaseModel):
    """The candidate table: valid points in walk order, one prediction each (and optional details)."""

    model_config = STRICT

    points: list[dict[str, Scalar]] = Field(min_length=1, max_length=MAX_POINTS)
    predictions: list[Prediction] = Field(min_length=1, max_length=MAX_POINTS)
    global_batch: int = Field(gt=0)
    details: list[dict[str, JsonValue]] | None = Field(None, max_length=MAX_POINTS)  # JsonValue: NaN refused too

    @model_validator(mode="after")
    def _aligned(self) -> Table:
        if len(self.predictions) != len(self.points):
            raise ValueError(f"predictions: {len(self.predictions)} given for {len(self.points)} points")
        if self.details is not None and len(self.details) != len(self.points):
            raise ValueError(f"details: {len(self.details)} given for {len(self.points)} points")
        return self

    def as_json(self) -> dict[str, Any]:
        out = {"points": self.points, "predictions": [p.to_json() for p in self.predictions],
               "global_batch": self.global_batch}
        return {**out, "details": self.details} if self.details is not None else out


class CreateStudy(BaseModel):
    model_config = STRICT
    table: Table
    memory_budget: float = Field(gt=0, description="bytes per rank; outcomes are judged under it")
    sampler: Literal["tpe", "gp"] = "tpe"
    max_trials: int = Field(8, ge=1, le=10_000)
    top_k: int = Field(3, ge=0, le=1000)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    lease_s: float = Field(600.0, gt=0, le=7 * 86400, description="how long an asked trial may go untold")
    stop_when_nothing_left: bool = Field(True, description="end exploration once every candidate not yet measured "
                                         "is predicted well slower than the best measured one (as a local search "
                                         "does); false: ask until max_trials or the table runs out")


class StudyInfo(BaseModel):
    study_key: str
    n_trials: int
    memory_budget: float
    cached: dict[str, Any] | None = Field(None, description="the stored best, if it fits this memory budget")


BUDGET_FIELD = Field(None, gt=0, description="bytes per rank this job's outcomes are judged under (default: the "
                                           "study's, from its PUT)")


class AskRequest(BaseModel):
    model_config = STRICT
    memory_budget: float | None = BUDGET_FIELD
    lease_s: float | None = Field(None, gt=0, le=7 * 86400)


class AskResponse(BaseModel):
    number: int | None = Field(None, description="the trial to measure and tell; null: stop")
    point: dict[str, Scalar] | None = None
    key: str = ""
    predicted: dict[str, Any] = Field(default_factory=dict)
    lease_expires: float | None = Field(None, description="unix time after which the trial is marked failed")
    stop: str = ""
    told: list[dict[str, Any]] = Field(default_factory=list, description="trials told on the way (no dry-run)")


class Measured(outcome.Measured):
    """A dry-run's outcome (``atorch.strategy_search.search.outcome.Measured``) with the wire's limits; a
    non-finite loss travels as its text ("nan", "inf")."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, strict=True)
    status: str = Field(min_length=1, max_length=64, description="ok, oom, failed, timeout, ...")
    samples_per_s: float = Field(0.0, ge=0)
    peak_memory_bytes: float = Field(0.0, ge=0)
    step_time_s: float = Field(0.0, ge=0)
    reason: str = Field("", max_length=10_000)
    loss: float | str | None = Field(None, description="first-step loss")
    reference_loss: float | str | None = Field(None, description="the user's model on the same samples")
    step_times_s: list[float] = Field(default_factory=list, max_length=10_000,
                                      description="each measured step's time on the slowest rank")
    stopped_early: bool = Field(False, description="timed steps stopped once slower than the best by the early-stop "
                                                   "margin (measured slower)")


class TellRequest(BaseModel):
    model_config = STRICT
    measured: Measured
    memory_budget: float | None = BUDGET_FIELD


class TellResponse(BaseModel):
    record: dict[str, Any]
    improved: bool
    already_told: bool = False


class Contenders(BaseModel):
    contenders: list[dict[str, Any]] = Field(description=(
        "the best and the runner-up (key, point, samples_per_s) when the runner-up measured within ``within`` of "
        "the best; else empty"))
    measured_ok: int = Field(description="how many candidates measured ok")


class ConfirmRequest(BaseModel):
    model_config = STRICT
    memory_budget: float | None = BUDGET_FIELD
    key: str = Field(min_length=1, max_length=10_000, description="a measured candidate's key (its trial's ``key``)")
    measured: Measured


class ConfirmResponse(BaseModel):
    record: dict[str, Any] = Field(description="the re-measurement as stored in the study's ``confirmations``")
    best: dict[str, Any] | None = Field(description="the best measured candidate, chosen again")


class StoreBest(BaseModel):
    model_config = STRICT
    strategy: dict[str, JsonValue] | None = None
    memory_budget: float | None = BUDGET_FIELD


class Best(BaseModel):
    best: dict[str, Any] | None


class Trial(BaseModel):
    number: int
    state: str
    value: float | None
    constraints: dict[str, float]
    user_attrs: dict[str, Any]
