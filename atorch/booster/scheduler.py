"""An LR scheduler built on the user's optimizer, moved onto the optimizer the engine rebuilt.

The rebuilt optimizer's parameter groups already carry every key of the user's (``lr`` as the scheduler
left it, ``initial_lr``, OneCycleLR's ``max_lr``, ...); the scheduler (and any it chains) is re-targeted,
so its schedule continues where it was.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from atorch.errors import SetupError


def carry_group_keys(user_optimizer: torch.optim.Optimizer, rebuilt: torch.optim.Optimizer) -> None:
    """Every non-parameter key of the user's groups onto the rebuilt groups (same order)."""
    if len(user_optimizer.param_groups) != len(rebuilt.param_groups):
        raise SetupError(f"the rebuilt optimizer has {len(rebuilt.param_groups)} parameter group(s), the given one "
                         f"{len(user_optimizer.param_groups)}")
    for mine, theirs in zip(user_optimizer.param_groups, rebuilt.param_groups, strict=True):
        theirs.update({key: value for key, value in mine.items() if key != "params"})


def retarget(scheduler: Any, user_optimizer: torch.optim.Optimizer | None, rebuilt: torch.optim.Optimizer) -> Any:
    """Point ``scheduler`` (and the schedulers it chains) at ``rebuilt``; it keeps its state and step count."""
    if scheduler is None:
        return None
    if user_optimizer is None or getattr(scheduler, "optimizer", None) is not user_optimizer:
        raise SetupError("the lr_scheduler must be built on the optimizer passed to booster.boost (before boost)")
    for sched in [scheduler, *getattr(scheduler, "_schedulers", [])]:
        if getattr(sched, "optimizer", None) is user_optimizer:
            sched.optimizer = rebuilt
    _track_step(rebuilt)
    return scheduler


def _track_step(optimizer: torch.optim.Optimizer) -> None:
    """What torch's LRScheduler does to its optimizer: mark ``optimizer.step`` calls, so the scheduler's
    order check (step after optimizer.step) works on the rebuilt optimizer."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    func = type(optimizer).step
    ref = weakref.ref(optimizer)  # no cycle: the optimizer is freed without the cycle collector

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return func(opt, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]
    optimizer._opt_called = True  # type: ignore[attr-defined]  # the user's scheduler was already set up
