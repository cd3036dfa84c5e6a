"""Gradient norms and clipping over gradients that may be sharded (DTensor) or replicated.

The norm is that of the whole (global-batch) gradient, the same on every rank: DTensor shards
are combined across ranks by DTensor itself; plain gradients are whole and already identical on
every rank (DDP, ZeRO-1, fsdp's ignored modules), so they count once.
"""

from __future__ import annotations

from typing import Any

import torch


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
    if sharded:
        # DTensor norms are partial per rank; the public total-norm helper reduces them as DTensors.
        parts.append(torch.nn.utils.get_total_norm(sharded, norm_type, foreach=False).full_tensor().float())
    if whole:
        parts.append(_norm_of(whole, norm_type))
    if not parts:
        return torch.zeros(())
    device = parts[0].device
    return torch.linalg.vector_norm(torch.stack([p.to(device) for p in parts]), norm_type)


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
