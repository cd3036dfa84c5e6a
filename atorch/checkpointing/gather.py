"""Whole tensors on rank 0 from wherever they live (DTensor shards, a ZeRO-1 owner, a pipeline stage),
and whole tensors put back into this rank's layout. Nothing is pickled: names, shapes and dtypes
travel as JSON, tensor data as raw bytes."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from atorch.distributed import all_gather_json


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def whole_local(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of the whole tensor ([communication] all-gather over a DTensor's mesh), owning its memory."""
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().to("cpu", copy=True).contiguous()


def gather_to_rank0(entries: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Collective: every named tensor of every rank, whole, on rank 0 (empty dict elsewhere).

    A name held by several ranks (replicas, tied copies) comes from the lowest of them. DTensors are
    gathered in name order, the same on every rank of their mesh (ranks of one mesh hold the same names).
    """
    local: dict[str, torch.Tensor] = {}
    for name, tensor in sorted(entries, key=lambda e: e[0]):
        if name not in local:
            local[name] = whole_local(tensor)
    if _world() == 1:
        return local
    described = all_gather_json({n: [list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in local.items()})
    owners: dict[str, int] = {}
    for rank, names in enumerate(described):
        for name in names:
            owners.setdefault(name, rank)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    out = local if _rank() == 0 else {}
    for name in sorted(owners):
        owner = owners[name]
        if owner == 0:
            continue
        if _rank() == owner:  # raw bytes: every dtype travels, whatever the backend supports
            dist.send(local[name].reshape(-1).view(torch.uint8).to(device), dst=0)
        elif _rank() == 0:
            shape, dtype = described[owner][name]
            dtype = getattr(torch, dtype)
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
            dist.recv(buffer, src=owner)
            out[name] = buffer.cpu().view(dtype).reshape(shape)
    return out


def put_whole(live: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy a whole tensor into a live one (cast to its dtype); a DTensor takes its own part, no communication."""
    with torch.no_grad():
        if hasattr(live, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor

            part = distribute_tensor(whole.to(device=live.device, dtype=live.dtype), live.device_mesh,
                                     live.placements, src_data_rank=None)
            live.to_local().copy_(part.to_local())
        else:
            live.copy_(whole)


def like_live(live: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """``whole`` in the layout of ``live`` (a DTensor shaped as it when the shapes match), on its device."""
    if hasattr(live, "device_mesh") and tuple(whole.shape) == tuple(live.shape):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(whole.to(live.device), live.device_mesh, live.placements, src_data_rank=None)
    return whole
