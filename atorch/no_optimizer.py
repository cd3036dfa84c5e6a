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
    needs = {"zero1": "shards the optimizer's state", "ds_3d_parallel": "hands the optimizer to DeepSpeed's engine",
             "pipeline_parallel": "runs the optimizer step inside train_step's schedule",
             "mixed_parallel": "runs the optimizer step inside train_step's schedule"}
    for name, why in needs.items():
        if name in strategy:
            problems.append(f"'{name}' {why}: {_FIX}")
    for name in ("zero1", "zero2"):
        if getattr(strategy.get(name), "implementation", None) == "deepspeed" and name != "zero1":
            problems.append(f"'{name}' with implementation 'deepspeed' hands the optimizer to DeepSpeed: {_FIX}")
    return problems
