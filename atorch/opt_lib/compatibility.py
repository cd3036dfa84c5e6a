"""Which methods cannot be combined, and why: a table, not code paths."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations

from atorch.opt_lib.base import MethodConfig


@dataclass(frozen=True)
class Conflict:
    first: str
    second: str
    reason: str
    fix: str
    # Only a conflict when this holds for (first's config, second's config); None means always.
    when: Callable[[MethodConfig, MethodConfig], bool] | None = None
    condition: str = ""  # human-readable form of ``when``

    def message(self) -> str:
        cond = f" ({self.condition})" if self.condition else ""
        return f"'{self.first}' cannot be combined with '{self.second}'{cond}: {self.reason}; {self.fix}"


def _ds(config: MethodConfig, _: MethodConfig) -> bool:
    return bool(getattr(config, "use_ds_zero", False))


CONFLICTS: tuple[Conflict, ...] = (
    Conflict("zero1", "zero2", "both shard optimizer state", "keep one ZeRO stage"),
    Conflict("zero1", "fsdp", "fsdp already shards optimizer state", "drop 'zero1'"),
    Conflict("zero2", "fsdp", "fsdp already shards gradients and optimizer state", "drop 'zero2'"),
    Conflict(
        "half", "amp_native", "'half' casts the whole model while 'amp_native' autocasts fp32 weights",
        "keep one of them",
    ),
    *(
        Conflict(
            zero, precision, "DeepSpeed manages precision inside its engine",
            f"set use_ds_zero=False or drop '{precision}'", when=_ds, condition="use_ds_zero=True",
        )
        for zero in ("zero1", "zero2")
        for precision in ("amp_native", "half")
    ),
)


def conflicts_in(configs: dict[str, MethodConfig]) -> list[str]:
    """Messages for every conflicting pair among the given methods."""
    problems = []
    for rule in CONFLICTS:
        both = rule.first in configs and rule.second in configs
        if both and (rule.when is None or rule.when(configs[rule.first], configs[rule.second])):
            problems.append(rule.message())
    return problems


def forbidden_pairs() -> set[frozenset[str]]:
    """Pairs that conflict whatever their configs."""
    return {frozenset((r.first, r.second)) for r in CONFLICTS if r.when is None}


def allowed_pairs(names: list[str]) -> list[tuple[str, str]]:
    """Every pair of the given methods that the table allows with default configs."""
    forbidden = forbidden_pairs()
    return [(a, b) for a, b in combinations(names, 2) if frozenset((a, b)) not in forbidden]
