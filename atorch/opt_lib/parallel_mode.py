"""parallel_mode: the named process layout (a DeviceMesh); its "data" dimension is data parallel."""

from __future__ import annotations

import functools
import math
from typing import Any

from pydantic import Field, field_validator, model_validator

from atorch.log import get_logger
from atorch.opt_lib import registry
from atorch.opt_lib.base import Method, MethodConfig, StrategyCheck
from atorch.opt_lib.registry import register

logger = get_logger(__name__)


class ParallelModeConfig(MethodConfig):
    """ATorch form: ``([("tensor", 2), ("data", 2)], rank_order)``, the first listed dimension varying fastest
    (tensor groups [0, 1], [2, 3]). No config: all data parallel."""

    dims: tuple[tuple[str, int], ...] = Field(
        default=(("data", -1),),
        description="ordered (name, size) pairs, the first varying fastest (ATorch's order: list first the "
        "dimension that must stay inside a node); data's size is fitted to the world size",
    )
    rank_order: tuple[int, ...] | None = Field(
        default=None,
        description="the global rank at each mesh position, positions counted with the first dimension fastest "
        "(a permutation of 0..world-1); null: 0, 1, 2, ...",
    )

    @model_validator(mode="before")
    @classmethod
    def _atorch_form(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], (list, tuple)):
            return {"dims": value[0], "rank_order": value[1]}
        return value

    @field_validator("dims")
    @classmethod
    def _dims_valid(cls, dims: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
        names = [n for n, _ in dims]
        if not dims:
            raise ValueError("give at least one dimension, e.g. [('data', 2)]")
        if len(set(names)) != len(names):
            raise ValueError(f"dimension names must be unique, got {names}")
        for name, size in dims:
            if size == 0 or size < -1:
                raise ValueError(f"size of '{name}' must be positive (or -1 for 'fill up'), got {size}")
        if "zero" in names:  # ATorch's group for zero1/zero2/fsdp, set apart from its 'data' group
            size = dict(dims)["zero"]
            if "data" in names:
                raise ValueError("ATorch's 'zero' dimension next to 'data' asks for hybrid sharding (shard over "
                                 "'zero', replicate over 'data'), which atorch does not have: give one 'data' "
                                 "dimension (zero1/zero2/fsdp shard over all of it)")
            raise ValueError(f"ATorch's 'zero' dimension is atorch's 'data' dimension (zero1/zero2/fsdp shard over "
                             f"it): write ('data', {size}) in place of ('zero', {size})")
        return dims


@register
class ParallelMode(Method):
    name = "parallel_mode"
    group = "parallel"
    summary = "Process layout as a named DeviceMesh; the 'data' dimension trains data parallel (DDP)."
    Config = ParallelModeConfig
    mesh_dims = ("data",)

    def check(self, config: ParallelModeConfig, check: StrategyCheck) -> list[str]:  # type: ignore[override]
        problems = []
        world = check.world_size
        consumed = {d for name in check.configs for d in registry.get_method(name).mesh_dims}
        others = [(n, s) for n, s in config.dims if n != "data"]
        for name, size in others:
            if name not in consumed:
                problems.append(
                    f"dimension '{name}' is not used by any method in this strategy (dimensions in use: "
                    f"{', '.join(sorted(consumed))}); remove it or add the method that uses it"
                )
            if size == -1:
                problems.append(f"only 'data' may have size -1; give '{name}' a size")
            elif world % size:
                problems.append(f"size {size} of '{name}' does not divide the world size {world}")
        other_product = math.prod(max(s, 1) for _, s in others)
        if len(others) > 1 and world % other_product:
            problems.append(f"non-data sizes multiply to {other_product}, which does not divide world size {world}")
        if config.rank_order is not None and sorted(config.rank_order) != list(range(world)):
            problems.append(f"rank_order must be a permutation of 0..{world - 1}, got {list(config.rank_order)}")
        return problems

    def adjust(self, config: ParallelModeConfig, world_size: int) -> ParallelModeConfig:  # type: ignore[override]
        """ATorch's rule: the data size becomes world_size / (product of the other sizes)."""
        others = math.prod(s for n, s in config.dims if n != "data")
        data = world_size // others if others and world_size % others == 0 else 1
        dims = tuple((n, data if n == "data" else s) for n, s in config.dims)
        if "data" not in dict(dims):  # outermost (slowest): the listed dimensions keep their neighbours
            dims = dims + (("data", data),)
        if dict(config.dims).get("data", data) not in (-1, data):
            _warn_adjusted(dict(config.dims)["data"], data, world_size)
        return config.model_copy(update={"dims": dims})


@functools.lru_cache(maxsize=64)
def _warn_adjusted(given: int, data: int, world_size: int) -> None:
    """Once per process for each adjustment: a strategy is adjusted wherever it is checked and built."""
    logger.warning("parallel_mode: data size %s adjusted to %d to fit world size %d", given, data, world_size)
