"""Run a module's forward inside a context manager (autocast, fp8 autocast), set per instance."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from torch import nn


class ContextForward:
    """``module.forward`` replaced by the same forward under ``make_context()``.

    It is stored on the module itself, so it holds the module only weakly: a strong reference would
    be a cycle, and a dropped model would then wait for the cycle collector to be freed. An earlier
    per-instance forward (another ContextForward) is kept and called inside this one's context.
    """

    def __init__(self, module: nn.Module, make_context: Callable[[], AbstractContextManager], label: str) -> None:
        self._inner = module.__dict__.get("forward")
        self._module = weakref.ref(module)
        functools.update_wrapper(self, self._inner if self._inner is not None else type(module).forward)
        self._make_context, self._label = make_context, label

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._make_context():
            if self._inner is not None:
                return self._inner(*args, **kwargs)
            module = self._module()
            return type(module).forward(module, *args, **kwargs)

    def __repr__(self) -> str:
        return self._label


def run_forward_in(module: nn.Module, make_context: Callable[[], AbstractContextManager], label: str) -> None:
    module.forward = ContextForward(module, make_context, label)  # type: ignore[method-assign]
