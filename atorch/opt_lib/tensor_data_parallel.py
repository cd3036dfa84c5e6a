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
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from atorch.log import get_logger

logger = get_logger(__name__)

BUCKET_BYTES = 25 * 2**20


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def average_local_gradients(params: list[torch.Tensor], group: Any) -> None:
    """[communication] Every gradient's local tensor averaged over the group, in buckets per (device, dtype)."""
    size = dist.get_world_size(group)
    buckets: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
    for param in params:
        if param.grad is None:
            continue
        grad = _local(param.grad)
        lists = buckets.setdefault((grad.device, grad.dtype), [[]])
        if lists[-1] and sum(g.numel() * g.element_size() for g in lists[-1]) >= BUCKET_BYTES:
            lists.append([])
        lists[-1].append(grad)
    with torch.no_grad():
        for lists in buckets.values():
            for bucket in lists:
                flat = _flatten_dense_tensors(bucket)
                dist.all_reduce(flat, group=group)
                flat.div_(size)
                for grad, averaged in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                    grad.copy_(averaged)


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
        average_local_gradients([p for p in model.parameters() if p.requires_grad], self.group)
        self._pending = False


def replicate_tensor_parallel(ctx: Any) -> None:
    """Data parallel over ctx.data_mesh for a tensor-parallel model (apply.py step 8, no fsdp/zero2)."""
    from atorch.opt_lib.sharding import broadcast_from_first

    broadcast_from_first(ctx.model, ctx.data_mesh)
    ctx.gradient_sync = ReplicaGradientSync(ctx.model, ctx.data_mesh.get_group())
    logger.info("data parallel: tensor-parallel replicas over %d processes (gradients averaged before each step)",
                ctx.dp_size)
