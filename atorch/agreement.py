"""What every rank must hold equal before a build, and the words for where ranks differ.

Processes given different strategies, options or models do not fail: they wait for each other in different
collectives (one in FSDP's broadcast, the other in DDP's check) and the job hangs with no output. So before
anything is built the ranks compare a digest of each ``Same`` value (``distributed.agreed_problems``); only
where digests differ are the values themselves gathered, to name what differs on which ranks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

SHOWN_KEYS = 3  # differing entries named per value (the first ones, in rank 0's order)


@dataclass(frozen=True)
class Same:
    """A JSON ``value`` every rank must hold equal: ``what`` it is ("strategy", "model"), and the ``fix``.

    A dict value is compared key by key in the message (the first differing keys are named); any other value
    is shown whole, as ``shown`` when given (a shorter form of it). ``value=None``: nothing to compare on this
    rank (a rank that could not read its strategy reports that as a problem of its own).
    """

    what: str
    value: Any
    fix: str
    shown: Any = None

    def digest(self) -> str | None:
        return None if self.value is None else hashlib.sha256(
            json.dumps(self.value, sort_keys=True).encode()).hexdigest()[:32]


def plain(value: Any) -> Any:
    """``value`` as JSON that stands for it: scalars and containers as they are, a class or function by its
    import path, anything else by its type (a tensor-valued option compares by type only)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(str(plain(v)) for v in value)
    name = getattr(value, "__qualname__", None)
    if isinstance(name, str):
        return f"{getattr(value, '__module__', '')}.{name}"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _dtype(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def model_signature(model: Any) -> dict[str, str] | None:
    """Parameter names, shapes, dtypes and whether they train, and buffer shapes and dtypes, in module order:
    what decides the collectives a build runs (FSDP's shards, DDP's buckets). None for a non-module."""
    if not isinstance(model, nn.Module):
        return None
    signature = {f"parameter '{name}'": f"{list(p.shape)} {_dtype(p)}{'' if p.requires_grad else ' (frozen)'}"
                 for name, p in model.named_parameters()}
    signature.update({f"buffer '{name}'": f"{list(b.shape)} {_dtype(b)}" for name, b in model.named_buffers()})
    return signature


def ranks_label(ranks: list[int]) -> str:
    """'rank 1', 'ranks 2, 3', 'ranks 1-7, 9, 10' ('no rank' for none)."""
    if not ranks:
        return "no rank"
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def differing(digests: list[list[str | None]], count: int) -> list[int]:
    """Which of ``count`` values (by index) some ranks hold differently; ``digests``: each rank's list."""
    found = []
    for i in range(count):
        held = {d[i] for d in digests if i < len(d) and d[i] is not None}
        if len(held) > 1:
            found.append(i)
    return found


def difference_problems(item: Same, held: list[Any], digests: list[str | None]) -> list[str]:
    """One sentence per group of ranks whose value differs from the reference's (rank 0's, or the lowest rank
    with a value): what differs and the fix. ``held``: each rank's ``[shown, value]``; ``digests``: its digest."""
    ranked = [r for r, d in enumerate(digests) if d is not None]
    if not ranked:
        return []
    ref = ranked[0]
    groups: dict[str, list[int]] = {}
    for r in ranked:
        if digests[r] != digests[ref]:
            groups.setdefault(str(digests[r]), []).append(r)
    problems = []
    for ranks in groups.values():
        label, (ref_shown, ref_value), (shown, value) = ranks_label(ranks), held[ref], held[ranks[0]]
        if ref_shown is None or ref_shown == shown:  # the short forms hide the difference: the values show it
            ref_shown, shown = ref_value, value
        verb = "differ" if item.what.endswith("s") else "differs"
        problems.append(f"{label}'s {item.what} {verb} from rank {ref}'s: "
                        f"{_difference(ref_shown, shown, ref, label)}; {item.fix}")
    return problems


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _difference(ref_value: Any, other: Any, ref: int, label: str) -> str:
    if not (isinstance(ref_value, dict) and isinstance(other, dict)):
        return f"rank {ref} {_shown(ref_value)}, {label} {_shown(other)}"
    keys = [k for k in ref_value if ref_value[k] != other.get(k, ...)]
    keys += [k for k in other if k not in ref_value]
    parts = [f"{k} {_shown(ref_value[k]) if k in ref_value else 'absent'} on rank {ref}, "
             f"{_shown(other[k]) if k in other else 'absent'} on {label}" for k in keys[:SHOWN_KEYS]]
    more = f" (and {len(keys) - SHOWN_KEYS} more)" if len(keys) > SHOWN_KEYS else ""
    return "; ".join(parts) + more if parts else "the same entries in another form"
