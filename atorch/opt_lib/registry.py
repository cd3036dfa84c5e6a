"""The one registry of optimization methods: every method, the module that defines it, and the order they
are applied in.

The registry loads the methods itself: every lookup here first imports the modules listed below once
(``load_methods``), and each module's ``@register`` adds its Method. No caller imports a method's module to
have it registered.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from atorch.opt_lib.base import Method, SearchRole

# Every method and its module (in atorch.opt_lib), in the order atorch.apply.apply_strategy applies them (the
# reason for each step is commented there): layout first; module swaps, then the pipeline split (every later
# method sees this rank's stages), or DeepSpeed's pipeline engine (it takes model and optimizer from there);
# dtype changes before anything captures parameters; autocast wraps the forward; tensor parallel splits the plain
# layers; activation checkpointing wraps the (split) blocks; sharding wraps last; ZeRO-1 changes the optimizer.
# Listings (the CLI, the docs' tables, Strategy.in_apply_order) follow it. A new method is one line here.
METHOD_MODULES: dict[str, str] = {
    "parallel_mode": "parallel_mode",
    "module_replace": "module_replace",
    "pipeline_parallel": "pipeline_parallel",
    "ds_3d_parallel": "ds_3d_parallel",
    "half": "precision",
    "fp8": "fp8",
    "amp_native": "precision",
    "tensor_parallel": "tensor_parallel",
    "mixed_parallel": "mixed_parallel",
    "checkpoint": "activation_checkpoint",
    "fsdp": "sharding",
    "zero2": "sharding",
    "zero1": "zero1",
}
APPLY_ORDER: tuple[str, ...] = tuple(METHOD_MODULES)

_METHODS: dict[str, Method] = {}
_loaded = False


def load_methods() -> None:
    """Import every method's module once (each registers its Method); a lookup does this first."""
    global _loaded
    if _loaded:
        return
    _loaded = True  # first: a lookup made while a method's module loads does not start loading again
    try:
        for module in dict.fromkeys(METHOD_MODULES.values()):
            importlib.import_module(f"{__package__}.{module}")
    except BaseException:
        _loaded = False
        raise
    missing = [name for name in METHOD_MODULES if name not in _METHODS]
    if missing:
        raise RuntimeError(f"method(s) {missing} are listed in METHOD_MODULES but their modules do not register them")


def register(cls: type[Method]) -> type[Method]:
    """Class decorator of each Method in its module (listed in METHOD_MODULES)."""
    if cls.name not in APPLY_ORDER:
        raise RuntimeError(f"method {cls.name!r} must be placed in APPLY_ORDER before it is registered")
    if cls.name in _METHODS:
        raise RuntimeError(f"method {cls.name!r} registered twice")
    _METHODS[cls.name] = cls()
    return cls


def get_method(name: str) -> Method:
    load_methods()
    return _METHODS[name]


def method_names() -> list[str]:
    """Registered method names, in apply order."""
    load_methods()
    return [name for name in APPLY_ORDER if name in _METHODS]


def is_registered(name: str) -> bool:
    load_methods()
    return name in _METHODS


@dataclass(frozen=True)
class SearchDimension:
    """One dimension the automatic search builds from the methods' search roles: its name, kind ("choice",
    "switch" or "layout"), value when none of its methods is used, and its methods in rank order."""

    name: str
    kind: str
    off: object
    methods: tuple[Method, ...]

    def role(self, method: Method) -> SearchRole:
        return method.search_role  # type: ignore[return-value]


def search_dimensions() -> list[SearchDimension]:
    """The registered methods' search roles grouped by dimension, in tree order (``SearchRole.position``)."""
    grouped: dict[str, list[Method]] = {}
    for name in method_names():  # loads the methods
        method = _METHODS[name]
        if method.search_role is not None:
            grouped.setdefault(method.search_role.dimension, []).append(method)
    dims = []
    for name, methods in grouped.items():
        methods.sort(key=lambda m: m.search_role.rank)  # type: ignore[union-attr]
        roles = {m.search_role.kind for m in methods}, {repr(m.search_role.off) for m in methods}  # type: ignore[union-attr]
        if len(roles[0]) > 1 or len(roles[1]) > 1:
            raise RuntimeError(f"the methods of search dimension {name!r} disagree on its kind or 'off' value")
        first = methods[0].search_role
        dims.append((first.position, SearchDimension(name, first.kind, first.off, tuple(methods))))  # type: ignore[union-attr]
    return [d for _, d in sorted(dims, key=lambda pd: pd[0])]
