"""Checkpoint keys under the user's names, whatever layout holds the state on this rank.

``get_state_dict`` names the state of ``result.model`` as it is built. For most strategies that is
already the user's names (wrapper parts left out). Under pipeline parallel ``result.model`` holds this
rank's stages, so its names carry a ``stages.<j>.module.`` prefix: it is removed, and a stage saves
only what it holds (DCP merges the ranks' entries into one layout-independent checkpoint).

Tied weights (GPT-2's ``transformer.wte.weight`` / ``lm_head.weight``) are one parameter in the user's
model but a copy on each of the first and last stage. Model weights keep their own names (each stage
saves the copy it holds, under the name it has; the copies are equal, as the pipeline keeps them),
so the checkpoint has the same model keys as one saved in one process. The optimizer state of a tied
parameter is keyed by the first name of its group, as ``get_state_dict`` keys it in one process;
both stages write that key with equal values, and DCP keeps one of them.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from atorch.names import clean_name, param_names

_STAGE_PREFIX = re.compile(r"^stages\.\d+\.module\.")


def is_pipelined(model: nn.Module) -> bool:
    from atorch.opt_lib.pipeline_parallel import PipelinedModel

    return isinstance(model, PipelinedModel)


class CheckpointNames:
    """Live names (as ``get_state_dict`` gives them for ``result.model``) to and from the user's names."""

    def __init__(self, model: nn.Module) -> None:
        self.pipelined = is_pipelined(model)
        self.live = param_names(model)  # parameter -> live name
        self.canonical: dict[str, str] = {}  # a tied name -> the first name of its group
        for group in getattr(model, "tied", []) if self.pipelined else []:
            names = [clean_name(n) for n in group]
            self.canonical.update({n: names[0] for n in names[1:]})

    def user(self, live: str) -> str:
        """The user's name of a model state entry."""
        return _STAGE_PREFIX.sub("", live) if self.pipelined else live

    def optim_key(self, live: str) -> str:
        """The user's name that keys a parameter's optimizer state (a tied parameter: its group's first)."""
        name = self.user(live)
        return self.canonical.get(name, name)

    def params(self) -> dict[torch.Tensor, str]:
        """Each parameter of this rank -> the name its optimizer state and param-group entry use."""
        return {p: self.optim_key(n) for p, n in self.live.items()}

    def outward(
        self, model_sd: dict[str, Any], optim_state: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """State dicts under live names -> under the user's names. Two stages of one rank holding a tied
        weight give one optimizer entry (their states are equal)."""
        return ({self.user(k): v for k, v in model_sd.items()},
                {self.optim_key(k): v for k, v in optim_state.items()})

    def inward(
        self, live_model: dict[str, Any], live_optim: dict[str, dict[str, Any]],
        model_sd: dict[str, Any], optim_state: dict[str, dict[str, Any]],
    ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """Loaded values under the user's names -> under the live names of ``live_model`` / ``live_optim``.
        A second copy of a tied parameter on this rank gets its own tensors (the optimizer updates its
        state in place, so two parameters must never share one)."""
        model = {k: model_sd[self.user(k)] for k in live_model}
        optim: dict[str, dict[str, Any]] = {}
        taken: set[str] = set()
        for live in live_optim:
            key = self.optim_key(live)
            entry = optim_state[key]
            if key in taken:
                entry = {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in entry.items()}
            taken.add(key)
            optim[live] = entry
        return model, optim

    def live_groups(self, saved: list[dict[str, Any]], live: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Saved param groups (hyper-parameters) naming this rank's parameters by their live names, as
        ``set_state_dict`` matches them."""
        return [{**sg, "params": [self.live[p] for p in lg["params"]]} for sg, lg in zip(saved, live, strict=True)]

