"""An optimizer the user already built, as the factory ``auto_accelerate`` takes.

The faces people already know (the Booster, the Lightning strategy) receive a built optimizer, while
the engine builds its own on the parameters the strategy trains (sharded, cast, wrapped). The
translation keeps what the user chose: the class, its defaults and every parameter group with its
hyper-parameters, matched by parameter name through ``optim_param_func`` (``atorch.names``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from atorch.errors import SetupError


@dataclass(frozen=True)
class OptimizerFactory:
    """``optim_func``, ``optim_args`` and ``optim_param_func`` that rebuild ``optimizer`` on a new model."""

    optim_func: Callable[..., torch.optim.Optimizer]
    optim_args: dict[str, Any]
    optim_param_func: Callable[[nn.Module], Any]

    def as_kwargs(self) -> dict[str, Any]:
        return {"optim_func": self.optim_func, "optim_args": dict(self.optim_args),
                "optim_param_func": self.optim_param_func}


def factory_from_optimizer(optimizer: Any, model: nn.Module) -> OptimizerFactory:
    """The factory that rebuilds ``optimizer`` (built on ``model``'s parameters) for the accelerated model.

    Refused with the reason: an object that is not a torch optimizer, one that has already stepped
    (its state would be silently dropped), and one holding tensors that are not ``model``'s parameters.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise SetupError(f"optimizer must be a torch.optim.Optimizer built on the model's parameters, "
                         f"got {type(optimizer).__name__}")
    if any(optimizer.state.values()):
        raise SetupError("the optimizer has already stepped: its state would be lost when the strategy rebuilds "
                         "it on the accelerated model; pass a freshly built optimizer (load its state afterwards "
                         "with the checkpoint functions)")
    owned = {id(p) for p in model.parameters()}
    strangers = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in owned)
    if strangers:
        raise SetupError(f"the optimizer holds {strangers} tensor(s) that are not parameters of the model passed "
                         f"with it; build it on model.parameters() (or groups of them)")
    groups = [{key: value for key, value in group.items()} for group in optimizer.param_groups]
    defaults = _constructor_defaults(optimizer)

    def param_groups(_: nn.Module) -> list[dict[str, Any]]:
        # fresh lists each call: the engine moves them onto the accelerated model's parameters
        return [{**group, "params": list(group["params"])} for group in groups]

    return OptimizerFactory(type(optimizer), defaults, param_groups)


def _constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor takes (AdamW records keys it does not accept)."""
    params = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(optimizer.defaults)
    return {key: value for key, value in optimizer.defaults.items() if key in params}
