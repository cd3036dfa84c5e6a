"""Module classes in strategy configs, kept as JSON-safe strings.

A class is stored as its import path ("pkg.module.ClassName"); a bare name ("GPT2Block") is also
accepted and matches any class of that name. Matching compares names, so nothing is imported or
unpickled when a strategy is read.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator
from torch import nn


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _to_ref(value: Any) -> Any:
    if isinstance(value, type):
        return class_path(value)
    return value


ClassRef = Annotated[str, BeforeValidator(_to_ref)]
"""A config field that holds a module class: given as a class or a string, stored as a string."""


def _to_ref_tuple(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, (type, str)):
        value = (value,)
    return tuple(_to_ref(v) for v in value)


ClassRefs = Annotated[tuple[str, ...] | None, BeforeValidator(_to_ref_tuple)]
"""Zero or more module classes (a single class or name is accepted too)."""


def matches(module: nn.Module, refs: tuple[str, ...]) -> bool:
    """True if the module's class is named by one of refs (full import path or bare class name)."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    # FSDP2 swaps a sharded module's class for a dynamic subclass; match the user's class instead.
    if isinstance(module, FSDPModule):
        cls = cls.__mro__[1]
    return class_path(cls) in refs or cls.__name__ in refs
