"""A mixture of experts' router load-balancing loss under pipeline parallel.

transformers computes that loss (``output_router_logits=True``) from every MoE layer's router logits at once: a
statistic over all layers' routing (tokens per expert times mean router probability), not a sum of per-layer terms,
so no stage can compute its share alone. Each stage therefore passes on, beside its hidden states, the router logits
of every MoE layer so far (layers × tokens × experts, with their autograd history); the last stage adds its own and
calls the family's own ``load_balancing_loss_func`` on them, exactly as the model's forward does in one process. The
loss's gradient reaches each stage's routers back through the schedule, like the hidden states' gradient. The cost
is one extra tensor per micro-batch between stages: layers so far × tokens × experts values (a 48-layer, 64-expert
model at 4,096 tokens per micro-batch: 48 MiB in fp32 at the last boundary).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def _recorder(model: nn.Module) -> Any:
    """transformers' declaration of where a model's router logits come from (module class, output index), or None."""
    return (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")


def _balance_function(model: nn.Module) -> Callable[..., torch.Tensor] | None:
    return getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)


def router_loss_on(model: nn.Module) -> bool:
    """Whether the model adds its router's load-balancing loss to its loss (transformers' MoE families)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0.0))


def router_loss_problem(model: nn.Module) -> str | None:
    """Why the stages cannot carry this model's router loss, or None."""
    if _recorder(model) is None or _balance_function(model) is None \
            or not all(hasattr(model, a) for a in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")):
        return (f"{type(model).__name__} does not declare its router logits and load-balancing function as "
                "transformers' MoE families do (_can_record_outputs['router_logits'], load_balancing_loss_func), so "
                "the stages cannot compute its router loss")
    return None


class RouterCarry:
    """On one stage's model: records the router logits its MoE layers compute during the stage's forward, and
    makes what the stage passes on (``carried``) or, on the last stage, the load-balancing loss (``loss``)."""

    def __init__(self, model: nn.Module, stage: nn.Module) -> None:
        recorder = _recorder(model)
        self.balance = _balance_function(model)
        self.num_experts, self.top_k = int(model.num_experts), int(model.num_experts_per_tok)
        self.index = recorder.index
        # During the stage's forward only: a checkpointed block's recompute in backward must not record again.
        self.recorded: list[torch.Tensor] | None = None
        for name, module in stage.named_modules():
            if isinstance(module, recorder.target_class) and (recorder.layer_name is None
                                                              or recorder.layer_name in name):
                module.register_forward_hook(self._record)
        # The stage computes the loss itself: transformers' own recording would only see this stage's layers.
        stage.config.output_router_logits = False

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.recorded is not None:
            self.recorded.append(output[self.index] if isinstance(output, tuple) else output)

    def layers(self, received: torch.Tensor | None) -> list[torch.Tensor]:
        """The router logits of every MoE layer so far: those received, then this stage's (tokens × experts each)."""
        assert self.recorded is not None
        return [*(received.unbind(0) if received is not None else ()), *self.recorded]

    def carried(self, received: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """What a non-last stage passes on beside its hidden states: layers × tokens × experts."""
        layers = self.layers(received)
        if not layers:  # no MoE layer yet (dense first layers): an empty carry keeps every stage's outputs alike
            return torch.zeros(0, 1, self.num_experts, dtype=like.dtype, device=like.device)
        dtype = layers[-1].dtype
        return torch.stack([layer.to(dtype) for layer in layers])

    def loss(self, received: torch.Tensor | None, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The last stage's load-balancing loss over every MoE layer's router logits, as the model computes it."""
        assert self.balance is not None
        layers = self.layers(received)
        if not layers:
            raise RuntimeError("pipeline_parallel: no MoE layer recorded router logits on any stage; set "
                               "model.config.output_router_logits = False for this model")
        return self.balance(tuple(layers), self.num_experts, self.top_k, attention_mask).float().reshape(1)
