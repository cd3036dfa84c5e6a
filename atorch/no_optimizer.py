"""``optim_func=None``: as in ATorch, no optimizer is built (``result.optim`` is None), for a model that is only
evaluated or whose parameters the user updates: fp16 autocast then runs without loss scaling. What needs an
optimizer is refused before anything is built."""

from __future__ import annotations

from typing import Any

_FIX = "give optim_func (an optimizer class or a function (params, **optim_args) -> optimizer)"


def no_optimizer_problems(strategy: Any, lr_scheduler_cls: Any, searching: bool) -> list[str]:
    """What cannot run without an optimizer, with the fix; [] if nothing."""
    problems = []
    if searching:
        problems.append(f"the automatic search measures training steps, which need an optimizer: {_FIX}, or give "
                        "load_strategy")
    if lr_scheduler_cls is not None:
        problems.append(f"lr_scheduler_cls needs an optimizer to schedule: {_FIX}, or drop lr_scheduler_cls")
    if strategy is None:
        return problems
    from atorch.opt_lib.registry import get_method

    for item in strategy.methods:
        why = get_method(item.name).optimizer_need(item.config)
        if why is not None:
            problems.append(f"'{item.name}' {why}: {_FIX}")
    return problems
