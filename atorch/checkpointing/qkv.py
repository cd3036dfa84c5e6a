"""GPT-2-style fused q|k|v weights under tensor_parallel, in the user's row order in checkpoints.

tensor_parallel reorders ``c_attn``'s output rows from [q | k | v] to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] so
that tensor rank r's shard holds the q, k and v of its own heads. A checkpoint must not depend on that: on
save each such tensor (weight, bias and their optimizer state) is gathered and written whole, in the user's
order (the ranks holding it write equal copies; DCP keeps one); on load it is read whole, put back in the
live order and cut into this rank's shard as the live tensor is. One layer at a time, so the extra memory is
one c_attn weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from atorch.names import clean_name


def reordered_layers(model: nn.Module, user_name: Callable[[str], str]) -> dict[str, int]:
    """The user's name of each fused q|k|v layer whose rows tensor_parallel reordered -> its tensor size."""
    out = {}
    for name, module in model.named_modules():
        layer, split = getattr(module, "c_attn", None), getattr(module, "split_size", None)
        if isinstance(layer, nn.Linear) and isinstance(split, int) and 0 < split < layer.weight.shape[0] // 3:
            out[user_name(clean_name(f"{name}.c_attn" if name else "c_attn"))] = layer.weight.shape[0] // 3 // split
    return out


def _live_index(rows: int, t: int) -> torch.Tensor:
    """Live row i holds user row index[i] (the order tensor_parallel gives c_attn)."""
    width = rows // 3
    chunk = width // t
    return torch.cat([torch.arange(part * width + r * chunk, part * width + (r + 1) * chunk)
                      for r in range(t) for part in range(3)])


def _affected(key: str, tensor: torch.Tensor, layers: dict[str, int]) -> int:
    """The tensor size of the layer a flat checkpoint key belongs to (0: not a reordered tensor)."""
    for prefix, t in layers.items():
        for kind in ("weight", "bias"):
            if key == f"model.{prefix}.{kind}" or key.startswith(f"optim.{prefix}.{kind}."):
                return t if tensor.dim() > 0 else 0
    return 0


def to_user_order(tensors: dict[str, torch.Tensor], layers: dict[str, int]) -> dict[str, torch.Tensor]:
    """Flat checkpoint tensors with the reordered ones whole and in the user's order. Collective over each
    tensor's mesh: keys are visited in sorted order (the ranks of a mesh hold the same keys)."""
    from torch.distributed.tensor import DTensor

    if not layers:
        return tensors
    out = dict(tensors)
    for key in sorted(tensors):
        t = _affected(key, tensors[key], layers)
        if t:
            value = tensors[key].detach()
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            out[key] = whole[torch.argsort(_live_index(whole.shape[0], t)).to(whole.device)]
    return out


def user_order_targets(
    tensors: dict[str, torch.Tensor], layers: dict[str, int]
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, int]]]:
    """Load targets with whole tensors in place of the reordered ones, and (live tensor, tensor size) of each."""
    if not layers:
        return tensors, {}
    out, live = dict(tensors), {}
    for key, value in tensors.items():
        t = _affected(key, value, layers)
        if t:
            live[key] = (value, t)
            out[key] = torch.empty(value.shape, dtype=value.dtype, device=_local(value).device)
    return out, live


def to_live_order(tensors: dict[str, torch.Tensor], live: dict[str, tuple[torch.Tensor, int]]) -> None:
    """The whole tensors loaded by user_order_targets, back in the live order and sharding (in place)."""
    from torch.distributed.tensor import DTensor, Replicate

    for key, (like, t) in live.items():
        whole = tensors[key][_live_index(tensors[key].shape[0], t).to(tensors[key].device)]
        if isinstance(like, DTensor):
            mesh = like.device_mesh
            whole = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False).redistribute(
                mesh, like.placements)  # a local cut: every rank holds the whole tensor
        tensors[key] = whole


def _local(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value
