"""Per-rank bytes of parameters, gradients and optimizer state under DDP, zero1, zero2 and fsdp.

Usage: ``torchrun --nproc_per_node=2 memory_worker.py``. Every count is of tensor bytes held on
this rank (a DTensor counts its local shard), not process memory, so it is exact and unaffected by
allocator caching. Rank 0 prints ``RESULT {"full": {...}, "strategies": {name: {kind: [bytes per rank]}}}``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import json
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import toy_models
from torch.distributed.optim import ZeroRedundancyOptimizer

import atorch
from atorch.model_context import call_model
from atorch.optimizer import local_tensor

GLOBAL_BATCH = 8
# Wide and deep enough that sharding is plain (about 0.5M parameters), small enough to step in well under a second.
DIM, DEPTH = 256, 8
STRATEGIES: dict[str, list[Any]] = {
    "ddp": ["parallel_mode"], "zero1": ["zero1"], "zero2": ["zero2"], "fsdp": ["fsdp"],
}


def local_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    total = 0
    for tensor in tensors:
        if tensor is not None:
            local = local_tensor(tensor)
            total += local.numel() * local.element_size()
    return total


def inner_optimizer(optim: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state (ZeroRedundancyOptimizer keeps it in ``.optim``)."""
    inner = getattr(optim, "optimizer", optim)
    return inner.optim if isinstance(inner, ZeroRedundancyOptimizer) else inner


def optimizer_state_bytes(optim: torch.optim.Optimizer) -> int:
    # The moment tensors; 0-dim 'step' counters (a few bytes per parameter tensor) are left out so
    # that shards add up exactly to the unsharded total.
    state = inner_optimizer(optim).state.values()
    return local_bytes(v for s in state for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def per_rank(value: int) -> list[int]:
    mine = torch.tensor([value], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [int(t.item()) for t in gathered]


def measure(strategy: list[Any]) -> dict[str, list[int]]:
    """One training step, with the bytes this rank holds at each point of it."""
    torch.manual_seed(0)
    model = toy_models.MLP(dim=DIM, depth=DEPTH)
    _, result, _ = atorch.auto_accelerate(
        model, torch.optim.AdamW, toy_models.mlp_dataset(), toy_models.mlp_loss,
        model_input_format="unpack_sequence", dataloader_args={"batch_size": GLOBAL_BATCH}, load_strategy=strategy,
    )
    net, optim = result.model, result.optim
    data = result.prepare_input(next(iter(result.dataloader)), result.args.device)
    loss = result.loss_func(data, call_model(net, data, "unpack_sequence"))
    between = local_bytes(net.parameters())  # parameters held between forward and backward
    loss.backward()
    grads = local_bytes(p.grad for p in net.parameters())
    optim.step()
    state = optimizer_state_bytes(optim)
    optim.zero_grad(set_to_none=True)
    return {
        "params_between_forward_and_backward": per_rank(between),
        "grads": per_rank(grads),
        "optimizer_state": per_rank(state),
        "params_at_rest": per_rank(local_bytes(net.parameters())),
    }


def main() -> None:
    torch.manual_seed(0)
    reference = toy_models.MLP(dim=DIM, depth=DEPTH)
    sizes = [p.numel() for p in reference.parameters()]
    report: dict[str, Any] = {
        "full": {"param_bytes": 4 * sum(sizes), "largest_param_fraction": max(sizes) / sum(sizes)},
        "strategies": {name: measure(strategy) for name, strategy in STRATEGIES.items()},
    }
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
