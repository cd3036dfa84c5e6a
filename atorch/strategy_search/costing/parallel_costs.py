"""What tensor parallel's DTensors cost beyond plain tensors: micro-benchmarks of the hardware profile.

Under tensor parallel (DTensor ``parallelize_module``) every split linear runs through DTensor's dispatch
(sharding propagation, redistribution, autograd on the wrapper) in forward and in backward, and each of its
parameters is a DTensor in the optimizer's step. That dispatch is not the per-operation latency of plain
tensors: on a 2-core CPU with gloo it measured 1.8-3.0 ms per split linear per micro-batch (hidden 128-512),
hundreds of plain operations and more than a small model's whole matmul, so without it the cost model put
tensor-parallel steps at a third of their measured time. Measured on the group's ranks at once:

* ``tensor_parallel_linear_s``: a Megatron MLP (Linear colwise, GELU, Linear rowwise) over the group, forward
  and backward, less the same rank's share run as plain tensors and less the two all-reduces it runs (at what
  the cost model charges for them from the profile's collectives: it counts them as communication), per split
  linear;
  ``tensor_parallel_linear_forward_s``: the forward's part (activation checkpointing runs it again);
* ``dtensor_param_step_s``: an AdamW step (foreach) over those DTensor parameters less the same step over the
  plain ones, per parameter.

The functions compared alternate within each of a few rounds and each one's fastest round is kept (on a shared
machine the least disturbed); the differences are never below zero.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_HIDDEN = 256  # the MLP's width; its inner width is _HIDDEN x ranks (each rank's share: _HIDDEN)
_TOKENS = 64
_STEPS = 4  # calls per timed function and round
_ROUNDS = 9


def _round(fns: list[Callable[[], Any]], group: Any, device: torch.device) -> list[float]:
    """Seconds per call of each function: ``_STEPS`` calls each, one function after the other, each started
    together on all ranks (the ones compared run side by side, under the same load)."""
    times = []
    for fn in fns:
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(_STEPS):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) / _STEPS)
    return times


def _over_rounds(fns: list[Callable[[], Any]], combine: Callable[[list[float]], float], group: Any,
                 device: torch.device) -> float:
    """``combine`` of each function's fastest round (after a warm-up round): the rounds alternate the functions,
    and on a shared machine the fastest round of each is the least disturbed one."""
    _round(fns, group, device)  # warm-up: DTensor's sharding-propagation cache, buffers
    rounds = [_round(fns, group, device) for _ in range(_ROUNDS)]
    return combine([min(times) for times in zip(*rounds, strict=True)])


def _mlp(inner: int, device: torch.device) -> nn.Sequential:
    return nn.Sequential(nn.Linear(_HIDDEN, inner), nn.GELU(), nn.Linear(inner, _HIDDEN)).to(device)


def measure_parallel_costs(group: Any, world: int, device: torch.device,
                           all_reduce_s: Callable[[int], float]) -> dict[str, float]:
    """The profile's three DTensor figures (see the module docstring); zeros on one rank (nothing to split).
    ``all_reduce_s(bytes)``: what the cost model charges for one all-reduce of that size over the group (from the
    profile's measured collectives), taken off so that the two are not counted twice."""
    if world < 2:
        return {"tensor_parallel_linear_s": 0.0, "tensor_parallel_linear_forward_s": 0.0, "dtensor_param_step_s": 0.0}
    return _dtensor_costs(group, world, device, all_reduce_s)


def _dtensor_costs(group: Any, world: int, device: torch.device,
                   all_reduce_s: Callable[[int], float]) -> dict[str, float]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type)
    split = parallelize_module(_mlp(_HIDDEN * world, device), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    plain = _mlp(_HIDDEN, device)  # this rank's share of the same MLP as plain tensors
    x = torch.randn(1, _TOKENS, _HIDDEN, device=device, requires_grad=True)
    reduced = all_reduce_s(x.numel() * x.element_size())  # the all-reduce of the MLP's output / input's gradient

    def train(model: nn.Module) -> Callable[[], None]:
        return lambda: model(x).sum().backward()

    def forward(model: nn.Module) -> Callable[[], None]:
        # the sum reads the output: the rowwise all-reduce is waited for (as the next layer would), not left
        # pending (torch then warns of unwaited collectives at exit, and the time would miss the wait)
        return lambda: model(x).sum()

    def update(model: nn.Module) -> Callable[[], None]:
        model(x).sum().backward()  # gradients to update
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
        return lambda: opt.step()

    step = _over_rounds([train(split), train(plain)], lambda t: t[0] - t[1] - 2 * reduced, group, device)
    ahead = _over_rounds([forward(split), forward(plain)], lambda t: t[0] - t[1] - reduced, group, device)
    params = len(list(split.parameters()))
    optimizer = _over_rounds([update(split), update(plain)], lambda t: t[0] - t[1], group, device)
    return {"tensor_parallel_linear_s": max(0.0, step / 2), "tensor_parallel_linear_forward_s": max(0.0, ahead / 2),
            "dtensor_param_step_s": max(0.0, optimizer / params)}

