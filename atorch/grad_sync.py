"""Gradient-sync control for DDP that is right whether the boundary is declared before the
forward or before the backward of the boundary training pass.

DDP reads ``require_backward_grad_sync`` in forward (``prepare_for_backward``): a boundary
declared after that forward leaves the last backward un-reduced. ``DDPGradientSync`` records
the flag each forward ran with and, before the optimizer step, all-reduces gradients the last
backward left un-reduced. Averaging over ranks is linear and leaves already averaged values
unchanged, so reducing the sum of reduced and local parts again gives exactly the average.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

BUCKET_BYTES = 25 * 2**20  # as DDP's default bucket


def average_gradients(params: list[torch.Tensor], group: Any, bucket_bytes: int = BUCKET_BYTES) -> None:
    """[communication] Average the gradients of params over the group (a DTensor's local shard: ranks that
    hold the same shard average it), in flat buckets of about ``bucket_bytes`` per (device, dtype)."""
    from torch.distributed.tensor import DTensor

    size = dist.get_world_size(group)
    buckets: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
    for param in params:
        if param.grad is None:
            continue
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        lists = buckets.setdefault((grad.device, grad.dtype), [[]])
        if lists[-1] and sum(g.numel() * g.element_size() for g in lists[-1]) >= bucket_bytes:
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


class PendingGradientSync:
    """A gradient sync made once before the optimizer step (``complete()``, before clipping too) over what the
    training passes since the last one accumulated; called with the accumulation boundary flag. A forward pre-hook
    marks that a training pass ran (``due()`` is then the model), so a step with no pass syncs nothing."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)  # weak: the model's hook holds this object
        self.enabled, self._pending = True, False
        model.register_forward_pre_hook(self._record)

    def _record(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self._pending = True

    def __call__(self, enabled: bool) -> None:
        self.enabled = enabled

    def due(self) -> nn.Module | None:
        """The model when a sync is due (a boundary, after a training pass), else None."""
        model = self._model()
        return model if model is not None and self.enabled and self._pending else None


class DDPGradientSync:
    """Called with the boundary flag; ``complete()`` runs just before the optimizer step."""

    def __init__(self, ddp: nn.Module, group: Any) -> None:
        # DDP holds this object through its hook: a weak reference back keeps that from being a
        # cycle, so a dropped model is freed at once.
        self._ddp, self.group = weakref.ref(ddp), group
        self.last_forward_synced = True
        ddp.register_forward_pre_hook(self._record)

    @property
    def ddp(self) -> nn.Module:
        ddp = self._ddp()
        if ddp is None:
            raise RuntimeError("the model of this optimizer has been released")
        return ddp

    def _record(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():  # DDP prepares no backward without autograd
            self.last_forward_synced = bool(module.require_backward_grad_sync)

    def __call__(self, enabled: bool) -> None:
        self.ddp.require_backward_grad_sync = enabled

    def complete(self) -> None:
        """At a declared boundary, reduce what the last backward did not (declared after its forward)."""
        if self.ddp.require_backward_grad_sync and not self.last_forward_synced:
            average_gradients([p for p in self.ddp.parameters() if p.requires_grad], self.group)
            self.last_forward_synced = True
