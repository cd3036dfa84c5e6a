"""Plain data parallel (replicas, gradients averaged) next to tensor_parallel, without fsdp: tp × DDP.

Torch's DDP cannot hold tensor-parallel parameters: its constructor and reducer use plain c10d
collectives on the parameters, which DTensor refuses. Here every data rank holds the same shards
([communication] data rank 0's weights to the others once), and before each optimizer step the
gradients' local tensors are averaged over the data group: what DDP computes, without overlapping the
reduction with backward. A tensor group's ranks hold different shards and average with their own data
peers only (the data group joins the ranks at one tensor position).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from atorch.grad_sync import PendingGradientSync, average_gradients
from atorch.log import get_logger
from atorch.opt_lib.expert_parallel import is_expert_param

logger = get_logger(__name__)

class ReplicaGradientSync(PendingGradientSync):
    """The optimizer's gradient sync: ``complete()`` averages once the gradients of the passes since the last
    average over the data group."""

    def __init__(self, model: nn.Module, group: Any) -> None:
        super().__init__(model)
        self.group = group

    def complete(self) -> None:
        model = self.due()
        if model is None:
            return
        # Averaging is linear: the average of the accumulated sums is the sum of the averages. [expert_parallel] The
        # experts are averaged over the ranks that hold the same experts (expert_parallel.ExpertGradientSync).
        average_gradients([p for p in model.parameters() if p.requires_grad and not is_expert_param(p)], self.group)
        self._pending = False


def replicate_tensor_parallel(ctx: Any) -> None:
    """Data parallel over ctx.data_mesh for a tensor-parallel model (TensorParallel.replicate: no fsdp/zero2)."""
    from atorch.opt_lib.sharding import broadcast_from_first

    broadcast_from_first(ctx.model, ctx.data_mesh)
    ctx.gradient_sync = ReplicaGradientSync(ctx.model, ctx.data_mesh.get_group())
    logger.info("data parallel: tensor-parallel replicas over %d processes (gradients averaged before each step)",
                ctx.replica_size)
