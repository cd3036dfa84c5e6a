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

# Every method and its module (in atorch.opt_lib), in the order atorch.apply.apply_strategy transforms the model
# with them (it iterates this order; after the last, it builds the optimizer, then DDP or DeepSpeed, loss scaling
# and the pipeline schedule). Listings (the CLI, the docs' tables, Strategy.in_apply_order) follow it too. A new
# method is one line here (and its step in apply.py's _MODEL_STEPS if it transforms the model). Why this order:
METHOD_MODULES: dict[str, str] = {
    "parallel_mode": "parallel_mode",  # the layout: read by the build before any step
    "module_replace": "module_replace",  # module swaps first: every later step sees them (Conv1D -> Linear, ...)
    # this rank's stages replace the model: every later step sees only them [communication: rank 0's weights,
    # tied copies equal]
    "pipeline_parallel": "pipeline_parallel",
    "ds_3d_parallel": "ds_3d_parallel",  # DeepSpeed's pipeline engine takes model and optimizer: the build ends
    "half": "precision",  # whole-model dtype before anything captures parameters or their dtype
    "fp8": "fp8",  # fp8 layers, then autocast around the whole forward (fp8's context runs inside autocast's)
    "amp_native": "precision",
    # splits the plain layers before recompute wraps the blocks and before FSDP2 shards over the data dimension
    # (2-D: FSDP2 takes DTensor parameters) [communication: the tensor group takes its first rank's weights]
    "tensor_parallel": "tensor_parallel",
    "mixed_parallel": "mixed_parallel",  # expanded up front into tensor_parallel and pipeline_parallel
    # the experts split over the 'expert' dimension before recompute wraps the blocks and before DDP/FSDP, which
    # leave the expert parameters alone [communication: the experts take the first data × expert rank's weights]
    "expert_parallel": "expert_parallel",
    "checkpoint": "activation_checkpoint",  # wraps the plain (split) blocks: it ends up inside any sharding unit
    "fsdp": "sharding",  # sharding wraps last [communication: rank 0's weights first, as DDP's constructor does]
    "zero2": "sharding",
    # changes the optimizer, built after the model steps (with a tensor dimension: FSDP2 as zero2, see zero1.py)
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
