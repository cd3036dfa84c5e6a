"""A model's state under the user's names, whatever a strategy did to it (DDP / DeepSpeed wrappers,
activation-checkpoint wrappers, pipeline stages), for checkpoints that load into a plain model."""

from __future__ import annotations

import torch
from torch import nn

from atorch.names import clean_name, unwrapped


class StagedModel(nn.Module):
    """A model made of the pipeline stages this rank holds (pipeline parallel's ``result.model``); defined
    here, below the methods, so that naming state needs no method's module."""

    def state_roots(self) -> list[nn.Module]:
        """The user's module inside each stage this rank holds."""
        raise NotImplementedError


def state_roots(model: nn.Module) -> list[nn.Module]:
    """The modules whose state dicts use the user's names: the model inside a DDP wrapper or DeepSpeed
    engine, or, under pipeline parallel, the module of each stage this rank holds."""
    model = unwrapped(model)
    return model.state_roots() if isinstance(model, StagedModel) else [model]


def named_state(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(clean name, live tensor) of every entry of the state dict on this rank; a name held by two
    stages of this rank (a tied weight) appears once per copy."""
    out = []
    for root in state_roots(model):
        out += [(clean_name(name), value) for name, value in root.state_dict(keep_vars=True).items()]
    return out


class ParamNames(dict):
    """Parameter -> clean name, and ``tied``: the groups of names that share one parameter in the user's model."""

    tied: list[tuple[str, ...]]


def trained_param_names(model: nn.Module) -> ParamNames:
    """Each parameter this rank trains, by its clean name (a tied parameter by its first name)."""
    names = ParamNames()
    for root in state_roots(model):
        for name, param in root.named_parameters():
            names.setdefault(param, clean_name(name))
    names.tied = tied_names(model)
    return names


def tied_names(model: nn.Module) -> list[tuple[str, ...]]:
    """Groups of names that share one parameter in the user's model (GPT-2's wte / lm_head)."""
    inner = unwrapped(model)
    groups = {tuple(g) for g in getattr(inner, "tied", [])}  # pipeline parallel records the user's ties
    for root in state_roots(model):
        by_id: dict[int, list[str]] = {}
        for name, param in root.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(param), []).append(clean_name(name))
        groups |= {tuple(sorted(g)) for g in by_id.values() if len(g) > 1}
    return sorted(groups)
