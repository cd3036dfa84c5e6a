"""The one registry of optimization methods, listed in the order they are applied in."""

from __future__ import annotations

from atorch.opt_lib.base import Method

# The order atorch.apply.apply_strategy applies methods in (the reasons are commented there):
# layout first; module swaps, then the pipeline split (every later method sees this rank's stages), or
# DeepSpeed's pipeline engine (ds_3d_parallel: it takes model and optimizer from there);
# dtype changes before anything captures parameters; autocast wraps the
# forward; tensor parallel splits the plain layers; activation checkpointing wraps the (split) blocks;
# sharding wraps last; ZeRO-1 changes the optimizer.
# Listings (the CLI, the README tables, Strategy.in_apply_order) follow it.
APPLY_ORDER: tuple[str, ...] = (
    "parallel_mode",
    "module_replace",
    "pipeline_parallel",
    "ds_3d_parallel",
    "half",
    "fp8",
    "amp_native",
    "tensor_parallel",
    "mixed_parallel",
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
