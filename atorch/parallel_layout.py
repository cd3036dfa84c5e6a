"""The parallel layout: one validated value saying how the processes are arranged.

A layout is an ordered list of named dimensions, the **first varying fastest** as in ATorch's
``parallel_mode``: ``(("tensor", 4), ("pipeline", 2), ("data", 2))`` puts ranks 0-3 in one tensor group,
0 and 4 in one pipeline group, 0 and 8 in one data group (list the dimension whose traffic must stay inside
a node first). It also holds the global rank at each mesh position. It is
checked once against the world size, is the only place the data-parallel size and rank come from,
and builds the torch DeviceMesh. Meshes (and so process groups) are created once per layout and
process group, and reused: a search runs many trials in one job.

Everything but ``mesh()`` is pure arithmetic, so the cost model can reason about a layout of a
1,000-GPU job without any process group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from atorch.errors import StrategyError

DATA = "data"
# Expert-parallel ranks are data ranks too (torchtitan, DeepSpeed-MoE): each trains on its own share of the batch,
# so the batch is split over data × expert ranks, and data parallelism (DDP/FSDP of the non-expert parameters)
# runs over that group. The ranks holding the same experts are the 'data' dimension alone.
EXPERT = "expert"
BATCH_DIMS = (DATA, EXPERT)
# Context-parallel ranks split each sequence (atorch/opt_lib/context_parallel.py): they read the same batch (not in
# the batch split), but every parameter's gradient is averaged over them too, so DDP/FSDP run over
# data × expert × context (torchtitan's dp_shard_cp).
CONTEXT = "context"
REPLICA_DIMS = (DATA, EXPERT, CONTEXT)


@dataclass(frozen=True)
class ParallelLayout:
    dims: tuple[tuple[str, int], ...]
    # The global rank at each mesh position, positions counted with the first dimension fastest (ATorch's
    # rank order); None: 0, 1, 2, ...
    rank_order: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise StrategyError(problems, what="invalid parallel layout")

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def data_parallel(cls, world_size: int) -> ParallelLayout:
        """Every process data parallel (the layout when a strategy has no parallel_mode)."""
        return cls(((DATA, world_size),))

    # ----- pure facts ---------------------------------------------------------------------
    def problems(self) -> list[str]:
        names = [n for n, _ in self.dims]
        found = []
        if len(set(names)) != len(names):
            found.append(f"dimension names must be unique, got {names}")
        found += [f"size of '{n}' must be at least 1, got {s}" for n, s in self.dims if s < 1]
        if self.rank_order is not None and sorted(self.rank_order) != list(range(self.world_size)):
            found.append(f"rank_order must be a permutation of 0..{self.world_size - 1}, got {list(self.rank_order)}")
        return found

    @property
    def world_size(self) -> int:
        return math.prod(s for _, s in self.dims)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.dims)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.dims)

    def size(self, name: str) -> int:
        return dict(self.dims).get(name, 1)

    @property
    def data_size(self) -> int:
        """The data-parallel size: the ranks the batch is split over (data × expert)."""
        return self.size(DATA) * self.size(EXPERT)

    @property
    def replica_size(self) -> int:
        """The ranks gradients are averaged over (DDP/FSDP's group): data × expert × context."""
        return self.data_size * self.size(CONTEXT)

    def ranks(self) -> torch.Tensor:
        """The global rank at each mesh position, shaped like the mesh (dimension i of the tensor is
        ``dims[i]``); positions are numbered with the first dimension varying fastest."""
        order = self.rank_order if self.rank_order is not None else range(self.world_size)
        backwards = tuple(reversed(range(len(self.shape))))
        with unset_fake_temporarily():  # rank arithmetic, also while the cost model traces on fake tensors
            flat = torch.tensor(list(order), dtype=torch.int64)
            # row-major over the reversed shape makes the last reversed (= first listed) dimension fastest
            return flat.reshape(self.shape[::-1]).permute(backwards).contiguous()

    def coordinate(self, rank: int) -> dict[str, int]:
        """The mesh coordinate of a global rank, by dimension name."""
        order = list(self.rank_order if self.rank_order is not None else range(self.world_size))
        if order.count(rank) != 1:
            raise ValueError(f"rank {rank} is not in a layout of {self.world_size} processes")
        index, coords = order.index(rank), []
        for size in self.shape:  # the first dimension varies fastest
            coords.append(index % size)
            index //= size
        return dict(zip(self.names, coords, strict=True))

    def data_rank(self, rank: int) -> int:
        """The data-parallel rank of a global rank: its coordinate along 'data' (0 without one); with an 'expert'
        dimension, its place in its data × expert group (the group's ranks in ascending order, as torch numbers
        them)."""
        if EXPERT not in self.names:
            return self.coordinate(rank).get(DATA, 0)
        return next(group.index(rank) for group in self.batch_groups() if rank in group)

    def batch_groups(self, dims: tuple[str, ...] = BATCH_DIMS) -> list[list[int]]:
        """The data × expert groups (the ranks that split one batch), each in ascending rank order; with
        ``dims=REPLICA_DIMS`` the data × expert × context groups (the ranks gradients are averaged over)."""
        with unset_fake_temporarily():
            ranks = self.ranks()
            inner = [self.names.index(n) for n in dims if n in self.names]
            others = [i for i in range(len(self.names)) if i not in inner]
            size = math.prod(self.size(n) for n in dims)
            return [sorted(line) for line in ranks.permute(*others, *inner).reshape(-1, size).tolist()]

    def groups_follow_coordinates(self, name: str) -> bool:
        """True if along dimension ``name`` every group's ranks ascend with the coordinate.

        torch numbers a group's members in ascending global rank whatever the mesh says, so where
        this is False a group rank differs from the mesh coordinate (FSDP2 shards by the former,
        DTensor's metadata follows the latter).
        """
        if name not in self.names:
            return True
        with unset_fake_temporarily():
            lines = self.ranks().movedim(self.names.index(name), -1).reshape(-1, self.size(name))
            return bool((lines[:, 1:] > lines[:, :-1]).all())

    def stride(self, name: str) -> int:
        """The rank distance between neighbours of a group along ``name`` (without rank_order): the product of
        the sizes listed before it (1 for the first). A group of n spans n × stride consecutive ranks."""
        if self.rank_order is not None:
            raise ValueError("a layout with rank_order has no single stride; use ranks()")
        sizes = self.shape[: self.names.index(name)] if name in self.names else self.shape
        return math.prod(sizes)

    def groups_across_nodes(self, name: str, ranks_per_node: int) -> int:
        """How many groups along ``name`` span more than one node, with ``ranks_per_node`` consecutive global
        ranks per node (torchrun's numbering). Tensor-parallel groups should span none: list 'tensor' first."""
        if name not in self.names or ranks_per_node < 1:
            return 0
        with unset_fake_temporarily():
            lines = self.ranks().movedim(self.names.index(name), -1).reshape(-1, self.size(name)) // ranks_per_node
            return int((lines.amax(dim=1) != lines.amin(dim=1)).sum())

    def __str__(self) -> str:
        dims = " × ".join(f"{n} {s}" for n, s in self.dims)
        return dims + ("" if self.rank_order is None else f" (rank order {list(self.rank_order)})")

    # ----- the mesh (collective on first use, then cached) --------------------------------
    def mesh(self, device_type: str) -> Any:
        """The DeviceMesh of this layout over the current process group (created once, reused)."""
        import torch.distributed as dist

        group = dist.group.WORLD
        key = (self, device_type)
        cached = _MESHES.get(key)
        if cached is not None and cached[0] is group:
            return cached[1]
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh(device_type, self.ranks(), mesh_dim_names=self.names)
        _MESHES[key] = (group, mesh)
        _warn_if_tensor_groups_cross_nodes(self)
        return mesh

    def data_mesh(self, device_type: str) -> Any:
        """The 1-D data-parallel sub-mesh this process belongs to, the group DDP/FSDP average gradients over (with
        an 'expert' or 'context' dimension: data × expert × context). Where only one of those is above 1 it is the
        layout mesh's own slice, which FSDP2 can join to a tensor dimension; else a mesh of its own."""
        if EXPERT not in self.names and CONTEXT not in self.names:
            return self.mesh(device_type)[DATA]
        return self.group_mesh(device_type, REPLICA_DIMS)

    def group_mesh(self, device_type: str, dims: tuple[str, ...]) -> Any:
        """A 1-D mesh over the ranks this process shares every coordinate but ``dims`` with (``REPLICA_DIMS``: its
        data × expert × context group; ``(DATA, CONTEXT)``: the ranks holding the same experts). Where only one of
        ``dims`` is above 1 it is the layout mesh's own slice, which FSDP2 can join to a tensor dimension (2-D)."""
        spread = [name for name in dims if self.size(name) > 1]
        if len(spread) == 1 and self.groups_follow_coordinates(spread[0]):
            return self.mesh(device_type)[spread[0]]
        return self._made_mesh(device_type, dims)

    def _made_mesh(self, device_type: str, dims: tuple[str, ...]) -> Any:
        """A 1-D mesh over this process's group along ``dims``. A DeviceMesh slices only dimensions in its own order
        and flattens them row-major (the last fastest, ATorch's order reversed: ranks out of ascending order, which
        FSDP2 and DCP disagree on), so the groups are made here, every rank making every group."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        self.mesh(device_type)  # the layout's own mesh first, on every rank in the same order
        group, key = dist.group.WORLD, (self, device_type, dims)
        cached = _MESHES.get(key)
        if cached is not None and cached[0] is group:
            return cached[1]
        mine, _ = dist.new_subgroups_by_enumeration(self.batch_groups(dims))
        mesh = DeviceMesh.from_group(mine, device_type, mesh_dim_names=(DATA,))
        _MESHES[key] = (group, mesh)
        return mesh


def _warn_if_tensor_groups_cross_nodes(layout: ParallelLayout) -> None:
    import os

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or layout.world_size)
    crossing = layout.groups_across_nodes("tensor", per_node)
    if crossing:
        from atorch.log import get_logger

        get_logger(__name__).warning(
            "%d of %d tensor-parallel groups span nodes (%d ranks per node) in layout %s: tensor parallelism "
            "then communicates across nodes every layer; list 'tensor' first in parallel_mode (the first listed "
            "dimension varies fastest), e.g. [('tensor', %d), ('data', -1)]",
            crossing, layout.world_size // layout.size("tensor"), per_node, layout, layout.size("tensor"))


# (layout, device type[, "batch": the data × expert × context mesh]) -> (the default group it was made on, mesh).
# Entries made on a process group that has since been destroyed are replaced on next use; forget_meshes() drops
# them all.
_MESHES: dict[tuple[Any, ...], tuple[Any, Any]] = {}


def forget_meshes() -> None:
    """Drop every cached mesh (called when atorch tears its process group down or swaps it).

    DTensor's sharding-propagation caches key on DeviceMesh equality, which compares ranks and names
    but not process groups: after a swap they would hand out output specs on the old mesh, whose
    group no longer resolves ("Could not resolve the process group registered under the name N",
    seen in fp16 unscaling of FSDP2 gradients in the second dry-run of a search). They go too.
    """
    _MESHES.clear()
    _clear_dtensor_caches()


def _clear_dtensor_caches() -> None:
    import sys

    if "torch.distributed.tensor" not in sys.modules:  # nothing cached if DTensor was never used
        return
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # the Python caches and the C++ fast path's
