"""The one registry of optimization methods, listed in the order they are applied in."""

from __future__ import annotations

from dataclasses import dataclass

from atorch.opt_lib.base import Method, SearchRole

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
    for name in method_names():
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
