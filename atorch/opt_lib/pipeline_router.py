"""A mixture of experts' router load-balancing loss under pipeline parallel.

transformers computes that loss (``output_router_logits=True``) from every MoE layer's router logits at once: a
statistic over all layers' routing (the share of tokens sent to each expert times its mean router probability), not a
sum of per-layer terms, so no stage can compute its share alone. Each stage therefore passes something on beside its
hidden states, and the last stage computes the loss exactly as the model's forward does in one process; the loss's
gradient reaches each stage's routers back through the schedule, like the hidden states' gradient.

What is passed on is the loss's sufficient statistics: per expert, the tokens routed to it and the sum of its router
probabilities (with their autograd history), and the tokens counted, over every MoE layer so far (2 × experts + 1
values per micro-batch). That holds where the family's ``load_balancing_loss_func`` is that statistic, which a probe
on random logits checks when the stages are built (every transformers decoder family's function is, in 5.x). Where it
is not, the router logits themselves are passed on (layers so far × tokens × experts values: 48 MiB in fp32 for 48
layers, 64 experts and 4,096 tokens per micro-batch) and the last stage calls the family's own function on them.

Beside context ranks each stage's routers see this rank's share of every sequence: the statistics are summed over the
context group at each stage (one all-reduce of 2 × experts + 1 values), so every context rank carries the whole
sequence's. That needs the statistic form; the logits form is refused there.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def _recorder(model: nn.Module) -> Any:
    """transformers' declaration of where a model's router logits come from (module class, output index), or None."""
    return (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")


def balance_function(model: nn.Module) -> Callable[..., torch.Tensor] | None:
    """The family's ``load_balancing_loss_func``: transformers defines one in each MoE family's modeling module."""
    return getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)


def router_loss_on(model: nn.Module) -> bool:
    """Whether the model adds its router's load-balancing loss to its loss (transformers' MoE families)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0.0))


def router_loss_problem(model: nn.Module) -> str | None:
    """Why the stages cannot carry this model's router loss, or None."""
    if _recorder(model) is None or balance_function(model) is None \
            or not all(hasattr(model, a) for a in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")):
        return (f"{type(model).__name__} does not declare its router logits and load-balancing function as "
                "transformers' MoE families do (_can_record_outputs['router_logits'], load_balancing_loss_func), so "
                "the stages cannot compute its router loss")
    return None


def routing_statistics(layers: list[torch.Tensor], experts: int, top_k: int, mask: torch.Tensor | None,
                       device: torch.device) -> torch.Tensor:
    """Per expert, the tokens routed to it (top-k), then the sum of its router probabilities, then the tokens
    counted: over ``layers`` (tokens × experts router logits each), padding excluded where ``mask`` is given."""
    routed = torch.zeros(experts, dtype=torch.float32, device=device)
    probability = torch.zeros(experts, dtype=torch.float32, device=device)
    counted = torch.zeros(1, dtype=torch.float32, device=device)
    for logits in layers:
        weights = torch.softmax(logits, dim=-1)
        _, selected = torch.topk(weights, top_k, dim=-1)
        real = (torch.ones(weights.shape[0], dtype=torch.float32, device=weights.device) if mask is None
                else mask.reshape(-1).to(device=weights.device, dtype=torch.float32))
        # counts of whole tokens: exact in fp32, in any order of addition
        routed = routed + torch.zeros_like(routed).scatter_add_(0, selected.reshape(-1), real.repeat_interleave(top_k))
        probability = probability + (weights.float() * real.unsqueeze(-1)).sum(dim=0)
        counted = counted + real.sum()
    return torch.cat([routed, probability, counted])


def loss_from_statistics(statistics: torch.Tensor, experts: int) -> torch.Tensor:
    """The load-balancing loss from ``routing_statistics`` over every layer: experts × Σ share routed × mean
    probability. Only the probabilities carry a gradient, as in the model."""
    routed, probability = statistics[:experts].detach(), statistics[experts:2 * experts]
    counted = statistics[2 * experts:].detach()
    return (routed / counted * probability / counted).sum() * experts


def statistics_match(balance: Callable[..., Any], experts: int, top_k: int) -> bool:
    """Whether the family's function is ``loss_from_statistics`` of ``routing_statistics``: value and gradient on
    random logits of three layers, with and without padding."""
    generator = torch.Generator().manual_seed(0)
    layers = [torch.randn(8, experts, generator=generator, dtype=torch.float32) for _ in range(3)]
    for mask in (None, torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])):
        mine = [layer.clone().requires_grad_(True) for layer in layers]
        theirs = [layer.clone().requires_grad_(True) for layer in layers]
        try:
            expected = balance(tuple(theirs), experts, top_k, mask)
            if not isinstance(expected, torch.Tensor):
                return False
            expected.backward()
        except Exception:  # a function of another form: the logits are carried instead
            return False
        got = loss_from_statistics(routing_statistics(mine, experts, top_k, mask, torch.device("cpu")), experts)
        got.backward()
        if not torch.allclose(got, expected.float(), rtol=1e-5, atol=1e-7) or not all(
                b.grad is not None and torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7)
                for a, b in zip(mine, theirs, strict=True)):
            return False
    return True


class _SumOverContext(torch.autograd.Function):
    """The routing statistics of a sequence split over context ranks: the sum of every rank's (the same on each).
    Backward scales the gradient by the group's size: each rank backpropagates its own tokens' share of the objective
    scaled by c, which DDP/FSDP's average over the context ranks divides again (context_parallel's convention)."""

    @staticmethod
    def forward(ctx: Any, statistics: torch.Tensor, shard: Any) -> torch.Tensor:
        ctx.size = shard.size
        total = statistics.detach().clone()
        dist.all_reduce(total, group=shard.group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.size, None


class RouterCarry:
    """On one stage's model: records the router logits its MoE layers compute during the stage's forward, and
    makes what the stage passes on (``passed_on``) or, on the last stage, the load-balancing loss (``loss``)."""

    def __init__(self, model: nn.Module, stage: nn.Module) -> None:
        recorder = _recorder(model)
        self.balance = balance_function(model)
        assert recorder is not None and self.balance is not None, router_loss_problem(model)
        self.experts, self.top_k = int(model.num_experts), int(model.num_experts_per_tok)
        self.index = recorder.index
        self.by_statistics = statistics_match(self.balance, self.experts, self.top_k)
        # During the stage's forward only: a checkpointed block's recompute in backward must not record again.
        self.recorded: list[torch.Tensor] | None = None
        # Set by context_parallel (its ContextShard): the stage's routers see this rank's share of each sequence.
        self.context: Any = None
        for name, module in stage.named_modules():
            if isinstance(module, recorder.target_class) and (recorder.layer_name is None
                                                              or recorder.layer_name in name):
                module.register_forward_hook(self._record)
        # The stage computes the loss itself: transformers' own recording would only see this stage's layers.
        stage.config.output_router_logits = False

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.recorded is not None:
            self.recorded.append(output[self.index] if isinstance(output, tuple) else output)

    def _layers(self, received: torch.Tensor | None) -> list[torch.Tensor]:
        """The router logits of every MoE layer so far: those received, then this stage's (tokens × experts each)."""
        assert self.recorded is not None
        return [*(received.unbind(0) if received is not None else ()), *self.recorded]

    def passed_on(self, received: torch.Tensor | None, mask: torch.Tensor | None, like: torch.Tensor
                  ) -> torch.Tensor:
        """What a non-last stage passes on beside its hidden states: the routing statistics over every MoE layer so
        far, or their router logits (layers × tokens × experts)."""
        assert self.recorded is not None
        if self.by_statistics:
            shard = self.context
            if shard is not None and mask is not None:  # this rank's tokens: context_parallel's zigzag share
                mask = mask[:, shard.positions(mask.shape[1] // shard.size, mask.device)]
            own = routing_statistics(self.recorded, self.experts, self.top_k, mask, like.device)
            if shard is not None:
                own = _SumOverContext.apply(own, shard)
            return own if received is None else received + own
        layers = self._layers(received)
        if not layers:  # no MoE layer yet (dense first layers): an empty carry keeps every stage's outputs alike
            return torch.zeros(0, 1, self.experts, dtype=like.dtype, device=like.device)
        return torch.stack([layer.to(layers[-1].dtype) for layer in layers])

    def loss(self, received: torch.Tensor | None, mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """The last stage's load-balancing loss over every MoE layer, as the model computes it (shape (1,))."""
        if self.by_statistics:
            return loss_from_statistics(self.passed_on(received, mask, like), self.experts).float().reshape(1)
        layers = self._layers(received)
        if not layers:
            raise RuntimeError("pipeline_parallel: no MoE layer recorded router logits on any stage; set "
                               "model.config.output_router_logits = False for this model")
        assert self.balance is not None
        return self.balance(tuple(layers), self.experts, self.top_k, mask).float().reshape(1)
