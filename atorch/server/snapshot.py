"""A trial as JSON and back: what the event log stores, and how a study is rebuilt from it."""

from __future__ import annotations

import datetime
from typing import Any

from optuna.distributions import distribution_to_json, json_to_distribution
from optuna.trial import FrozenTrial, TrialState


def _time(value: datetime.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _parse(value: str | None) -> datetime.datetime | None:
    return datetime.datetime.fromisoformat(value) if value is not None else None


def trial_json(t: FrozenTrial) -> dict[str, Any]:
    # Copies: an in-memory storage changes a trial's dicts in place (a snapshot must not follow them).
    return {"number": t.number, "state": t.state.name, "values": list(t.values) if t.values is not None else None,
            "params": dict(t.params), "distributions": {k: distribution_to_json(d) for k, d in t.distributions.items()},
            "user_attrs": dict(t.user_attrs), "system_attrs": dict(t.system_attrs),
            "start": _time(t.datetime_start), "complete": _time(t.datetime_complete)}


def trial_from_json(data: dict[str, Any]) -> FrozenTrial:
    return FrozenTrial(
        number=data["number"], trial_id=-1, state=TrialState[data["state"]], value=None, values=data["values"],
        datetime_start=_parse(data["start"]), datetime_complete=_parse(data["complete"]), params=data["params"],
        distributions={k: json_to_distribution(d) for k, d in data["distributions"].items()},
        user_attrs=data["user_attrs"], system_attrs=data["system_attrs"], intermediate_values={})


def placeholder(number: int, reason: str) -> FrozenTrial:
    """A FAILED trial holding a number that no event recorded (keeps later numbers where they were)."""
    now = datetime.datetime.now()
    return FrozenTrial(number=number, trial_id=-1, state=TrialState.FAIL, value=None, values=None,
                       datetime_start=now, datetime_complete=now, params={}, distributions={},
                       user_attrs={"status": "discarded", "reason": reason}, system_attrs={},
                       intermediate_values={})
