"""Releasing what an accelerated result holds (``result.close()``)."""

from __future__ import annotations

import importlib
import sys
import threading
from typing import Any

from torch import nn

# Per-module dicts of hooks that wrappers (DDP, FSDP2, checkpointing) register and that may point
# back at the module or its state.
_HOOK_DICTS = (
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)


def release(result: Any) -> None:
    """Free every tensor the result holds and break the links between its parts.

    The objects stay (the user may still hold them) but are empty: the model has no parameters or
    buffers, the optimizer no state, the DeepSpeed engine is destroyed.
    """
    engine = getattr(result.optim, "engine", None)
    if engine is not None and hasattr(engine, "destroy"):
        engine.destroy()
    _empty_optimizer(result.optim)
    if isinstance(result.model, nn.Module):
        _empty_module(result.model)
    scaler = getattr(result.optim, "grad_scaler", None)
    if scaler is not None:
        scaler.__dict__.clear()
    if result.lr_scheduler is not None:
        result.lr_scheduler.__dict__.pop("optimizer", None)


def _empty_optimizer(optim: Any) -> None:
    inner = getattr(optim, "optimizer", None)
    if inner is not None and inner is not optim:
        _empty_optimizer(inner)
    zero_inner = getattr(optim, "optim", None)  # ZeroRedundancyOptimizer's local optimizer
    if zero_inner is not None:
        _empty_optimizer(zero_inner)
    state = getattr(optim, "state", None)
    if isinstance(state, dict):
        state.clear()
    groups = getattr(optim, "param_groups", None)
    if isinstance(groups, list):
        groups.clear()
    names = getattr(optim, "param_names", None)  # parameter -> name, for the Booster's checkpoints
    if isinstance(names, dict):
        names.clear()


def _empty_module(model: nn.Module) -> None:
    for module in list(model.modules()):
        for name in _HOOK_DICTS:
            hooks = module.__dict__.get(name)
            if hooks is not None:
                hooks.clear()
        for param in module._parameters.values():
            if param is not None:
                param.grad = None
        module._parameters.clear()
        module._buffers.clear()
        # Wrapper state kept on the module: composable APIs (FSDP2) keep theirs under a private key,
        # and it refers back to the module (a cycle); DDP keeps its reducer and the wrapped module.
        for key in [k for k in module.__dict__ if k.startswith("__composable_api_state_key") or k in _WRAPPER_STATE]:
            for state in getattr(module.__dict__[key], "values", lambda: ())():
                state.__dict__.clear()  # FSDP2's state: parameter groups, shards, the list of all states
            del module.__dict__[key]


_WRAPPER_STATE = frozenset({"reducer", "logger", "process_group", "_module_copies", "_comm_hooks"})


def import_off_the_stack(module: str) -> None:
    """Import ``module`` in a helper thread if it is not imported yet.

    Importing torch._dynamo (which DTensor does lazily, on its first use inside FSDP2) keeps the
    frames of the importing call stack alive for good; imported from inside a build, that stack
    holds the user's model and the build's context. A thread's stack starts empty.
    """
    if module in sys.modules:
        return
    thread = threading.Thread(target=importlib.import_module, args=(module,), name=f"atorch-import-{module}")
    thread.start()
    thread.join()
