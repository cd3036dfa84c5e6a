"""The one registry of optimization methods, and the one order they are applied in."""

from __future__ import annotations

from atorch.opt_lib.base import Method

# Why this order: parallel layout first (everything else needs the mesh); module swaps and dtype
# changes before anything captures parameters; autocast and activation checkpointing wrap the
# plain modules; sharding (FSDP/ZeRO-2) wraps last; ZeRO-1 only changes the optimizer.
# The DDP wrapper, when no sharding method replaces it, and the optimizer are built after all
# ``apply`` steps; ``after_build`` hooks run after that, in this same order.
APPLY_ORDER: tuple[str, ...] = (
    "parallel_mode",
    "module_replace",
    "half",
    "fp8",
    "amp_native",
    "checkpoint",
    "fsdp",
    "zero2",
    "zero1",
)

_METHODS: dict[str, Method] = {}


def register(cls: type[Method]) -> type[Method]:
    if cls.name not in APPLY_ORDER:
        raise RuntimeError(f"method {cls.name!r} must be placed in APPLY_ORDER before it is registered")
    if cls.name in _METHODS:
        raise RuntimeError(f"method {cls.name!r} registered twice")
    _METHODS[cls.name] = cls()
    return cls


def get_method(name: str) -> Method:
    return _METHODS[name]


def method_names() -> list[str]:
    """Registered method names, in apply order."""
    return [name for name in APPLY_ORDER if name in _METHODS]


def is_registered(name: str) -> bool:
    return name in _METHODS
