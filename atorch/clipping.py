"""Gradient norms and clipping over gradients that may be sharded (DTensor) or replicated.

The norm is that of the whole (global-batch) gradient, the same on every rank: DTensor shards
are combined across ranks by DTensor itself; plain gradients are whole and already identical on
every rank (DDP, ZeRO-1, fsdp's ignored modules), so they count once.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def _norm_of(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    # fp32 accumulation: squared fp16/bf16 gradients overflow or lose precision.
    return torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]), norm_type
    )


def total_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of all gradients together, as a plain fp32 tensor with the full value on every rank."""
    sharded = [g for g in grads if hasattr(g, "full_tensor")]
    whole = [g for g in grads if not hasattr(g, "full_tensor")]
    parts: list[torch.Tensor] = []
    # Each mesh's norm on its own (tensor parallel's 2-D mesh beside FSDP's 1-D data mesh: DTensor refuses to
    # stack norms of different meshes), then the plain figures are combined.
    for group in _by_mesh(sharded):
        parts.append(_mesh_norm(group, norm_type))
    if whole:
        parts.append(_norm_of(whole, norm_type))
    if not parts:
        return torch.zeros(())
    device = parts[0].device
    return torch.linalg.vector_norm(torch.stack([p.to(device) for p in parts]), norm_type)


def _mesh_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of DTensor gradients of one mesh, from each rank's local shard: shards add up over the mesh's
    ranks, replicas count once. Reduced along each mesh dimension in turn, not through DTensor's redistribution:
    that flattens the mesh's dimensions and refuses a 2-D mesh whose first-named dimension varies slowest
    (parallel_mode's ``[("tensor", 2), ("data", -1)]``: "Mesh dim indices should be in ascending order")."""
    from torch.distributed.tensor import Partial

    mesh = grads[0].device_mesh  # type: ignore[attr-defined]
    if any(isinstance(p, Partial) for g in grads for p in g.placements):  # type: ignore[attr-defined]
        # not a reduced gradient: DTensor's own reduction knows how to sum the pending partial values
        return torch.nn.utils.get_total_norm(grads, norm_type, foreach=False).full_tensor().float()
    locals_ = [_local(g) for g in grads]
    if norm_type == float("inf"):
        value = torch.stack([g.abs().max().float() if g.numel() else torch.zeros((), device=g.device)
                             for g in locals_]).max()
        op = dist.ReduceOp.MAX
    else:
        value = sum((torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) ** norm_type
                     / _replicas(grad) for g, grad in zip(locals_, grads, strict=True)),
                    torch.zeros((), dtype=torch.float32, device=locals_[0].device))
        op = dist.ReduceOp.SUM
    for dim in range(mesh.ndim):
        if mesh.size(dim) > 1:
            dist.all_reduce(value, op=op, group=mesh.get_group(dim))
    return value if norm_type == float("inf") else value ** (1.0 / norm_type)


def _replicas(grad: torch.Tensor) -> int:
    """How many ranks of its mesh hold each element of a DTensor (its Replicate dimensions' sizes)."""
    mesh = grad.device_mesh  # type: ignore[attr-defined]
    return math.prod(mesh.size(i) for i, p in enumerate(grad.placements) if p.is_replicate())  # type: ignore[attr-defined]


def _by_mesh(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault(grad.device_mesh, []).append(grad)  # type: ignore[attr-defined]
    return list(groups.values())


def clip_by_norm(grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale gradients by max_norm / (norm + 1e-6) where that is below 1 (torch's formula)."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grad in grads:
        local = _local(grad)
        local.mul_(coef.to(local.device, local.dtype))


def clip_by_value(grads: list[torch.Tensor], clip_value: float) -> None:
    for grad in grads:
        _local(grad).clamp_(-clip_value, clip_value)


def deepspeed_total_norm(engine: Any, norm_type: float) -> torch.Tensor:
    """The global norm of a DeepSpeed ZeRO engine's (unscaled fp32) gradients, after backward.

    ``safe_get_full_grad`` assembles each parameter's gradient from the partitions (a collective
    per parameter): exact, and independent of DeepSpeed's internals.
    """
    from deepspeed.utils import safe_get_full_grad

    grads = [g for p in engine.module.parameters() if p.requires_grad and (g := safe_get_full_grad(p)) is not None]
    return _norm_of(grads, norm_type) if grads else torch.zeros(())
