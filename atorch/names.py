"""Parameter names as the user wrote them, whatever wrappers a strategy put around the model."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

# Module-name parts that wrappers insert; a clean name leaves them out (as get_state_dict does).
WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def clean_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def unwrapped(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper or a DeepSpeed engine (``.module``), else the model."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) or type(model).__name__ == "DeepSpeedEngine":
        return model.module
    return model


def param_names(model: nn.Module) -> dict[torch.Tensor, str]:
    """Each parameter's clean name."""
    return {param: clean_name(name) for name, param in unwrapped(model).named_parameters()}


def user_param_groups(user_model: nn.Module, groups: Any, model: nn.Module) -> list[dict[str, Any]]:
    """Parameter groups that ``optim_param_func(user_model)`` returned, moved onto ``model``.

    The user's function sees their own module and names (so name-based groups, like no weight decay
    on biases and norms, mean the same under every strategy); each parameter it returns is matched
    by name to the parameter that the strategy's model trains in its place.
    """
    names = {id(p): n for n, p in user_model.named_parameters(remove_duplicate=False)}
    by_name = {clean_name(n): p for n, p in unwrapped(model).named_parameters(remove_duplicate=False)}

    def moved(params: Iterable[Any]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for param in params:
            name = names.get(id(param))
            if name is None:
                raise ValueError(
                    "optim_param_func returned a tensor that is not a parameter of the model passed to it; "
                    "return model.parameters() (or groups of them) of the module it receives"
                )
            if all(by_name[name] is not p for p in out):  # a tied weight is listed under each of its names
                out.append(by_name[name])
        return out

    groups = list(groups)
    if groups and not isinstance(groups[0], dict):
        return [{"params": moved(groups)}]
    result = []
    for group in groups:
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else params
        result.append({**group, "params": moved(params)})
    return result
