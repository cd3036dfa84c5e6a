"""The one registry of optimization methods: every method, the module that defines it, and the order they
are applied in.

The registry loads the methods itself: every lookup here first imports the modules listed below once
(``load_methods``), and each module's ``@register`` adds its Method. No caller imports a method's module to
have it registered. A method defined outside atorch joins with ``register_method`` at a stated place in the order;
``scoped()`` puts the registry back as it was (tests).
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from atorch.opt_lib import compatibility
from atorch.opt_lib.base import Method, MethodConfig, SearchRole

# Every method and its module (in atorch.opt_lib), in the order atorch.apply.apply_strategy transforms the model
# with them (it iterates this order; after the last, it builds the optimizer, then DDP or DeepSpeed, loss scaling
# and the pipeline schedule). Listings (the CLI, the docs' tables, Strategy.in_apply_order) follow it too. A new
# built-in method is one line here; a user's method is placed by register_method (below). Why this order:
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
    # the attention swapped and the inputs split by hooks on the whole model, before DDP/FSDP wrap it (they average
    # over data × context)
    "context_parallel": "context_parallel",
    "checkpoint": "activation_checkpoint",  # wraps the plain (split) blocks: it ends up inside any sharding unit
    "compile": "compile",  # opt-in: the forward as the steps above left it; fsdp and DDP wrap the compiled model
    "fsdp": "sharding",  # sharding wraps last [communication: rank 0's weights first, as DDP's constructor does]
    "zero2": "sharding",
    # changes the optimizer, built after the model steps (with a tensor dimension: FSDP2 as zero2, see zero1.py)
    "zero1": "zero1",
}

# The registry's state: the apply order (the built-in methods', with every user method placed in it by
# register_method) and each registered Method. One value, so that ``scoped()`` can put it back whole.
@dataclass
class _State:
    order: list[str] = field(default_factory=lambda: list(METHOD_MODULES))
    methods: dict[str, Method] = field(default_factory=dict)
    placed: dict[str, str] = field(default_factory=dict)  # user method -> why it is applied where it is
    loaded: bool = False


_state = _State()


def load_methods() -> None:
    """Import every built-in method's module once (each registers its Method); a lookup does this first."""
    if _state.loaded:
        return
    _state.loaded = True  # first: a lookup made while a method's module loads does not start loading again
    try:
        for module in dict.fromkeys(METHOD_MODULES.values()):
            importlib.import_module(f"{__package__}.{module}")
    except BaseException:
        _state.loaded = False
        raise
    missing = [name for name in METHOD_MODULES if name not in _state.methods]
    if missing:
        raise RuntimeError(f"method(s) {missing} are listed in METHOD_MODULES but their modules do not register them")


def register(cls: type[Method]) -> type[Method]:
    """Class decorator of each built-in Method in its module (listed in METHOD_MODULES)."""
    if cls.name not in METHOD_MODULES:
        raise RuntimeError(f"method {cls.name!r} must be listed in METHOD_MODULES before it is registered "
                           "(a method defined outside atorch: atorch.register_method)")
    if cls.name in _state.methods:
        raise RuntimeError(f"method {cls.name!r} registered twice")
    _state.methods[cls.name] = cls()
    return cls


def apply_order() -> tuple[str, ...]:
    """Every registered method's name, in the order atorch.apply.apply_strategy applies them."""
    load_methods()
    return tuple(name for name in _state.order if name in _state.methods)


GROUPS = ("parallel", "precision", "memory", "module")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def register_method(method_cls: type[Method], *, after: str | None = None, before: str | None = None,
                    reason: str = "", rules: Iterable[compatibility.Rule] = ()) -> type[Method]:
    """Add a Method defined outside atorch to the registry, applied right after ``after`` (else right before
    ``before``; neither: after every other method). ``before`` with ``after`` is checked, not used to place it.
    ``reason`` says why it goes there (shown by ``placement``); ``rules``: compatibility rules naming it (a method
    without rules combines with every other). Returns the class. Semi-automatic strategies can then name it; the
    automatic search offers it when it declares a ``search_role``."""
    load_methods()
    problems = _definition_problems(method_cls)
    if problems:
        raise TypeError(f"register_method({getattr(method_cls, '__name__', method_cls)!r}): " + "; ".join(problems))
    name = method_cls.name
    if name in _state.methods:
        raise ValueError(f"method {name!r} is already registered")
    order = list(apply_order())
    for anchor in (after, before):
        if anchor is not None and anchor not in order:
            raise ValueError(f"register_method({name!r}): no registered method {anchor!r} to place it by; known: "
                             f"{', '.join(order)}")
    if after is not None and before is not None and order.index(after) >= order.index(before):
        raise ValueError(f"register_method({name!r}): {after!r} is applied after {before!r}, so nothing lies "
                         "between them")
    rules = tuple(rules)
    for rule in rules:
        unknown = [m for m in rule.methods if m != name and m not in _state.methods]
        if name not in rule.methods or unknown:
            raise ValueError(f"register_method({name!r}): a rule must name {name!r} and registered methods only: "
                             f"{rule.methods}")
    at = _state.order.index(after) + 1 if after is not None else \
        _state.order.index(before) if before is not None else len(_state.order)
    _state.order.insert(at, name)
    _state.methods[name] = method_cls()
    _state.placed[name] = reason
    compatibility.add_rules(rules)
    return method_cls


def _definition_problems(cls: object) -> list[str]:
    if not (isinstance(cls, type) and issubclass(cls, Method)):
        return ["give a subclass of atorch.opt_lib.Method (the class, not an instance)"]
    name, group = getattr(cls, "name", None), getattr(cls, "group", None)
    problems = []
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        problems.append(f"its name must be an identifier-like string, got {name!r}")
    if group not in GROUPS:
        problems.append(f"its group must be one of {GROUPS}, got {group!r}")
    if not isinstance(getattr(cls, "summary", None), str):
        problems.append("it needs a summary (one line for listings)")
    if not (isinstance(cls.Config, type) and issubclass(cls.Config, MethodConfig)):
        problems.append("its Config must subclass atorch.opt_lib.MethodConfig")
    return problems


@contextlib.contextmanager
def scoped() -> Iterator[None]:
    """Methods and rules registered in the block are gone after it: the registry (and the rule table's additions)
    as they were before. For tests and for code that tries a method without keeping it."""
    global _state
    load_methods()  # the built-in methods first: their modules register them only once per process
    saved = _State(list(_state.order), dict(_state.methods), dict(_state.placed), _state.loaded)
    saved_rules = compatibility.added_rules()
    try:
        yield
    finally:
        _state = saved
        compatibility.set_added_rules(saved_rules)


def get_method(name: str) -> Method:
    load_methods()
    return _state.methods[name]


def method_names() -> list[str]:
    """Registered method names, in apply order."""
    return list(apply_order())


def is_registered(name: str) -> bool:
    load_methods()
    return name in _state.methods


def methods_in_group(group: str) -> list[str]:
    """The registered methods of one group ("precision": those that change the compute dtype), in apply order."""
    return [name for name in apply_order() if _state.methods[name].group == group]


def placement(name: str) -> str:
    """Why a user method is applied where it is (register_method's ``reason``); "" for a built-in one."""
    return _state.placed.get(name, "")


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
        method = _state.methods[name]
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
