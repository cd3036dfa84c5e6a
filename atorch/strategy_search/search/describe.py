"""The one description of a search candidate, derived from its Strategy: what a person reads is what ran.

``layout | methods | micro-batching``, e.g. ``tensor 2 × data 2 | tensor_parallel, amp_native(bf16),
checkpoint | mbs 4 × 2``:

- the layout is the strategy's ``parallel_mode`` fitted to the world size (``data 4`` for plain data parallel);
- every other method, model-parallel ones first, with its non-default config (``zero2(deepspeed)``,
  ``fsdp(cpu_offload, no reshard_after_forward)``), plus the fields that always matter: a precision's dtype
  and a pipeline's schedule, default or not; ``ddp`` when the layout is all there is;
- ``mbs S × N``: N micro-batches of S samples per rank make one optimizer step (under pipeline parallel the
  schedule's micro-batches, times any gradient accumulation).

The log lines, the live table, the summary, the HTML report and ``result.args.search`` all use it; the
candidate table stores it with each trial so a server-side study has it too.
"""

from __future__ import annotations

from typing import Any

from atorch.opt_lib.parallel_mode import ParallelMode
from atorch.strategy import Strategy

ALWAYS_SHOWN = frozenset({"dtype", "schedule"})  # shown even at their default: the numerics, the pipeline
BARE = frozenset({"dtype", "implementation", "schedule", "plan"})  # a value that names itself: no "key="
# Pipeline micro-batches: shown in the micro-batching part, not twice.
MICRO_BATCH_FIELDS = frozenset({"micro_batches"})


def describe_candidate(strategy: Any, micro_batch_size: int, micro_batches: int, world_size: int | None) -> str:
    """``layout | methods | mbs S × N`` of a strategy run with ``micro_batches`` micro-batches of
    ``micro_batch_size`` per rank (a Candidate's fields). Without ``world_size`` the data size is ``*``."""
    strategy = Strategy.load(strategy) if not isinstance(strategy, Strategy) else strategy
    # The model-parallel methods first (they go with the layout), the rest in the strategy's order.
    items = sorted((i for i in strategy.methods if i.name != ParallelMode.name),
                   key=lambda i: not _model_parallel(i.name))
    methods = [_method(item.name, item.config) for item in items]
    return " | ".join((_layout(strategy, world_size), ", ".join(methods) or "ddp",
                       _micro_batching(strategy, micro_batch_size, micro_batches)))


def describe_record(candidate: dict[str, Any], world_size: int | None = None) -> str:
    """The description of a stored trial's candidate (``Candidate.to_json`` or a candidate table's details):
    the stored one, else derived from its strategy (a study written before descriptions were stored)."""
    if candidate.get("description"):
        return str(candidate["description"])
    if "strategy" not in candidate:
        return "-"  # a trial never asked (enqueued): no candidate yet
    try:
        return describe_candidate(candidate["strategy"], int(candidate.get("micro_batch_size", 0)),
                                  int(candidate.get("micro_batches", 0)), world_size)
    except Exception as exc:  # noqa: BLE001  (a record from another atorch version: say so, do not fail)
        return f"? ({type(exc).__name__}: {exc})"


def _layout(strategy: Strategy, world_size: int | None) -> str:
    mode = strategy.get(ParallelMode.name)
    if world_size is not None:
        try:
            return str(strategy.layout(world_size))
        except Exception:  # noqa: BLE001  (a layout that does not fit: shown as configured)
            pass
    dims = [tuple(d) for d in mode.dims] if mode is not None else [("data", -1)]  # type: ignore[attr-defined]
    return " × ".join(f"{name} {size if size > 0 else '*'}" for name, size in dims)


def _method(name: str, config: Any) -> str:
    full = config.model_dump(mode="json")
    changed = config.model_dump(mode="json", exclude_defaults=True)
    parts = _fields(full, changed)
    return f"{name}({', '.join(parts)})" if parts else name


def _fields(full: dict[str, Any], changed: dict[str, Any], prefix: str = "") -> list[str]:
    parts: list[str] = []
    for key, value in full.items():
        if key in MICRO_BATCH_FIELDS:
            continue
        if isinstance(value, dict):
            parts += _fields(value, changed.get(key) or {}, f"{prefix}{key}.")
        elif key in changed or (key in ALWAYS_SHOWN and value is not None):
            parts.append(_field(prefix + key, key, value))
    return parts


def _field(path: str, key: str, value: Any) -> str:
    if value is True:
        return path
    if value is False:
        return f"no {path}"
    if key in BARE and isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        value = "[" + ", ".join(str(v) for v in value) + "]"
    return f"{path}={value}"


def _model_parallel(name: str) -> bool:
    """A method that splits the model over a parallel_mode dimension other than data (its registry entry)."""
    from atorch.opt_lib.registry import get_method

    return any(dim != "data" for dim in get_method(name).mesh_dims)


def _pipeline_micro_batches(strategy: Strategy) -> int:
    """The pipeline schedule's micro-batches per step (1 without pipeline parallel or when not set): what the
    strategy's method says (``Method.schedule_micro_batches``)."""
    from atorch.opt_lib.registry import get_method

    for item in strategy.methods:
        if value := get_method(item.name).schedule_micro_batches(item.config):
            return value
    return 1


def _micro_batching(strategy: Strategy, micro_batch_size: int, micro_batches: int) -> str:
    # A pipeline candidate takes one batch per step and the schedule splits it: show the schedule's split.
    split = _pipeline_micro_batches(strategy)
    if split > 1 and micro_batch_size % split == 0:
        return f"mbs {micro_batch_size // split} × {split * micro_batches}"
    return f"mbs {micro_batch_size} × {micro_batches}"


def search_json(outcome: Any, world_size: int) -> dict[str, Any]:
    """``result.args.search``: the outcome's JSON, the pick's description and, on rank 0, one record per trial
    of the study (number, description, status and reason, predicted and measured); duplicates and enqueued
    trials never asked are left out."""
    trials = [{"number": t.get("number"), "description": describe_record(t.get("candidate") or {}, world_size),
               "status": t.get("status", t.get("state", "")), "reason": t.get("reason", ""),
               "predicted": t.get("predicted") or {}, "measured": t.get("measured") or {}}
              for t in outcome.trials if t.get("status") != "duplicate" and t.get("candidate")]
    description = describe_candidate(outcome.strategy, outcome.micro_batch_size, outcome.micro_batches, world_size)
    return {**outcome.to_json(), "description": description, "trials": trials}
