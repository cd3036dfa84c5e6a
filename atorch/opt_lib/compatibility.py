"""Which methods cannot be combined, and why: a table of rules, not code paths.

A rule names two or more methods and, optionally, a condition on their configs (e.g. DeepSpeed's
implementation of a ZeRO stage, or parallel_mode's rank order). Each rule carries an ``example``:
a strategy it refuses, which the tests use to show that every rule really refuses before building.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations
from typing import Any

from atorch.opt_lib.base import MethodConfig

Configs = dict[str, MethodConfig]


@dataclass(frozen=True)
class Rule:
    methods: tuple[str, ...]
    reason: str
    fix: str
    # Only a conflict when this holds for the configs of ``methods``; None means always.
    when: Callable[[Configs], bool] | None = None
    condition: str = ""  # human-readable form of ``when``
    example: tuple[Any, ...] = ()  # a strategy this rule refuses (default: the bare method names)

    def message(self) -> str:
        quoted = [f"'{m}'" for m in self.methods]
        cond = f" ({self.condition})" if self.condition else ""
        if len(quoted) == 2:
            return f"{quoted[0]} cannot be combined with {quoted[1]}{cond}: {self.reason}; {self.fix}"
        return f"{', '.join(quoted[:-1])} and {quoted[-1]} cannot be combined{cond}: {self.reason}; {self.fix}"

    def applies(self, configs: Configs) -> bool:
        return all(m in configs for m in self.methods) and (self.when is None or self.when(configs))

    def refused_example(self) -> list[Any]:
        return list(self.example) if self.example else list(self.methods)


def _deepspeed(name: str) -> Callable[[Configs], bool]:
    return lambda configs: getattr(configs[name], "implementation", None) == "deepspeed"


def _permuted_data_groups(configs: Configs) -> bool:
    """parallel_mode's rank_order puts a data group's ranks out of ascending order."""
    from atorch.parallel_layout import DATA, ParallelLayout

    mode = configs["parallel_mode"]
    if mode.rank_order is None:
        return False
    dims = tuple(mode.dims)
    if any(size < 1 for _, size in dims):  # not fitted to a world size yet: judge the fitted form
        return False
    try:
        layout = ParallelLayout(dims, tuple(mode.rank_order))
    except ValueError:  # sizes and order disagree: parallel_mode's own check reports that
        return False
    return not layout.groups_follow_coordinates(DATA)


RULES: tuple[Rule, ...] = (
    Rule(("zero1", "zero2"), "both shard optimizer state", "keep one ZeRO stage"),
    Rule(("zero1", "fsdp"), "fsdp already shards optimizer state", "drop 'zero1'"),
    Rule(("zero2", "fsdp"), "fsdp already shards gradients and optimizer state", "drop 'zero2'"),
    Rule(
        ("half", "amp_native"), "'half' casts the whole model while 'amp_native' autocasts fp32 weights",
        "keep one of them",
    ),
    *(
        Rule(
            (zero, precision), "DeepSpeed manages precision inside its engine",
            f"use implementation 'fsdp2'/'torch' for '{zero}', or drop '{precision}'",
            when=_deepspeed(zero), condition=f"{zero} implementation='deepspeed'",
            example=((zero, {"implementation": "deepspeed"}), precision),
        )
        for zero in ("zero1", "zero2")
        for precision in ("amp_native", "half")
    ),
    *(
        Rule(
            ("parallel_mode", sharding),
            "torch numbers a process group's ranks in ascending order, so with this rank_order FSDP2 would "
            "place each shard by group rank while its checkpoint metadata follows the mesh position "
            "(a saved checkpoint would reload the wrong weights)",
            "give each data-parallel group's ranks in ascending order (or drop rank_order)",
            when=_permuted_data_groups, condition="rank_order permutes a data-parallel group",
            example=(("parallel_mode", {"dims": [["data", 2]], "rank_order": [1, 0]}), sharding),
        )
        for sharding in ("fsdp", "zero2")
    ),
)


def conflicts_in(configs: Configs) -> list[str]:
    """Messages for every rule the given methods and configs break."""
    return [rule.message() for rule in RULES if rule.applies(configs)]


def forbidden_pairs() -> set[frozenset[str]]:
    """Pairs that conflict whatever their configs."""
    return {frozenset(r.methods) for r in RULES if r.when is None and len(r.methods) == 2}


def allowed_pairs(names: list[str]) -> list[tuple[str, str]]:
    """Every pair of the given methods that the table allows with default configs."""
    forbidden = forbidden_pairs()
    return [(a, b) for a, b in combinations(names, 2) if frozenset((a, b)) not in forbidden]
