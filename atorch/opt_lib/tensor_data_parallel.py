"""Plain data parallel (replicas, gradients averaged) next to tensor_parallel, without fsdp: tp × DDP.

Torch's DDP cannot hold tensor-parallel parameters: its constructor and reducer use plain c10d
collectives on the parameters, which DTensor refuses. Here every data rank holds the same shards
([communication] data rank 0's weights to the others once), and before each optimizer step the
gradients' local tensors are averaged over the data group: what DDP computes, without overlapping the
reduction with backward. A tensor group's ranks hold different shards and average with their own data
peers only (the data group joins the ranks at one tensor position).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from atorch.grad_sync import average_gradients
from atorch.log import get_logger

logger = get_logger(__name__)

class ReplicaGradientSync:
    """The optimizer's gradient sync: called with the accumulation boundary flag; ``complete()`` (before the
    step, and before clipping) averages once the gradients of the passes since the last average."""

    def __init__(self, model: nn.Module, group: Any) -> None:
        self._model, self.group = weakref.ref(model), group  # weak: the model's hook holds this object
        self.enabled, self._pending = True, False
        model.register_forward_pre_hook(self._record)

    def _record(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self._pending = True

    def __call__(self, enabled: bool) -> None:
        self.enabled = enabled

    def complete(self) -> None:
        model = self._model()
        if model is None or not (self.enabled and self._pending):
            return
        # Averaging is linear: the average of the accumulated sums is the sum of the averages.
        average_gradients([p for p in model.parameters() if p.requires_grad], self.group)
        self._pending = False


def replicate_tensor_parallel(ctx: Any) -> None:
    """Data parallel over ctx.data_mesh for a tensor-parallel model (apply.py step 8, no fsdp/zero2)."""
    from atorch.opt_lib.sharding import broadcast_from_first

    broadcast_from_first(ctx.model, ctx.data_mesh)
    ctx.gradient_sync = ReplicaGradientSync(ctx.model, ctx.data_mesh.get_group())
    logger.info("data parallel: tensor-parallel replicas over %d processes (gradients averaged before each step)",
                ctx.dp_size)
