"""Function caches (``functools.lru_cache``) in a model's code, cleared after runs on fake tensors may have
filled them, before the real model runs again.

A model's code may keep tensors it computes from plain arguments in a function-level cache: transformers' BEiT
keeps its relative position index in an ``lru_cache`` keyed by the window size. atorch's input checks, analysis,
build check and memory traces run the model's code on fake tensors, and what they leave in such a cache is a fake
tensor that the next real step reads (``DataDependentOutputException`` at its first indexing). A cache's entries
cannot be read, so before a dry-run, a real build check and the build handed to the user, every cache that holds
anything is cleared in the packages that define the model's modules (module-level caches and those in a
module's classes): a cleared cache costs a recomputation, nothing else. Other packages are left alone.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Iterator
from typing import Any

from torch import nn

# Never cleared, even where a model's module is defined: they hold no model tensors, and some keep singletons.
_LEFT_ALONE = ("torch", "atorch", "transformers.utils")

_known: dict[frozenset[str], list[Any]] = {}  # the caches found, per set of packages scanned


def _left_alone(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in _LEFT_ALONE)


def model_packages(model: nn.Module) -> frozenset[str]:
    """The top-level packages that define the model's modules (``transformers``, the user's, ``__main__``)."""
    return frozenset(type(m).__module__.partition(".")[0] for m in model.modules()) - {"torch"}


def _caches_in(obj: Any, depth: int = 2) -> Iterator[Any]:
    """The caches ``obj`` is or wraps: a cache, a static or class method of one, or a function whose closure holds
    one (a decorator's wrapper, as transformers' ``compile_compatible_method_lru_cache``)."""
    if isinstance(obj, functools._lru_cache_wrapper):
        yield obj
        return
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if depth and isinstance(obj, types.FunctionType):
        for cell in obj.__closure__ or ():
            try:
                inner = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            yield from _caches_in(inner, depth - 1)


def _scan(packages: frozenset[str]) -> list[Any]:
    """Every cache at module level or in a module's classes, in ``packages``. Read from the loaded modules, not
    from the garbage collector: a dry-run freezes the heap (``gc.freeze``), and frozen objects are not listed."""
    found: dict[int, Any] = {}
    for name, module in list(sys.modules.items()):
        if module is None or name.partition(".")[0] not in packages or _left_alone(name):
            continue
        for value in list(getattr(module, "__dict__", {}).values()):
            is_own_class = isinstance(value, type) and value.__module__ == name
            for member in list(value.__dict__.values()) if is_own_class else [value]:
                for cache in _caches_in(member):
                    if not _left_alone(getattr(cache, "__module__", None) or ""):
                        found[id(cache)] = cache
    return list(found.values())


def forget_fake_fills(model: nn.Module, rescan: bool = False) -> int:
    """Clear every cache that holds anything in the packages of ``model``'s modules. They are found once per set
    of packages (again with ``rescan``: a module imported since may have brought its own). Returns how many
    were cleared."""
    packages = model_packages(model)
    if rescan or packages not in _known:
        _known[packages] = _scan(packages)
    cleared = 0
    for cache in _known[packages]:
        if cache.cache_info().currsize:
            cache.cache_clear()
            cleared += 1
    return cleared
