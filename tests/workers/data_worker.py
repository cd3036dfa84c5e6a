"""Run under torchrun (2 processes): which samples each rank's dataloader yields, epoch after epoch.

Rank 0 prints ``RESULT {json}`` with, per scenario, every rank's sample ids per epoch.
"""

from __future__ import annotations

import json
import multiprocessing
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data.distributed import DistributedSampler

import atorch

SAMPLES = 32
GLOBAL_BATCH = 8


class Ids(Dataset):
    """Sample i is (i as a float feature row, i): the ids show which samples a rank got."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.full((4,), float(index)), index


class IdStream(IterableDataset):
    def __iter__(self):
        return ((torch.full((4,), float(i)), i) for i in range(SAMPLES))


class ModelOf4(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.lin(x)


class PlainSampler(DistributedSampler):
    """A user's distributed_sampler_cls without set_epoch (the loader must not need it)."""

    def __getattribute__(self, name: str) -> Any:
        if name == "set_epoch":
            raise AttributeError(name)
        return super().__getattribute__(name)


def loader(dataset: Any, epochs: int = 2, sampler_cls: type | None = None, **args: Any) -> dict[str, Any]:
    _, result, _ = atorch.auto_accelerate(
        ModelOf4(), torch.optim.SGD, dataset, lambda data, output: output.sum(), model_input_format="unpack_sequence",
        optim_args={"lr": 0.1}, dataloader_args={"batch_size": GLOBAL_BATCH, **args},
        distributed_sampler_cls=sampler_cls, load_strategy=["parallel_mode"],
    )
    dl = result.dataloader
    orders = [[int(i) for _, ids in dl for i in ids] for _ in range(epochs)]
    return {"orders": gathered(orders), "is_dataloader": isinstance(dl, DataLoader),
            "len": len(dl) if not isinstance(dataset, IterableDataset) else None,
            "batches": sum(1 for _ in dl)}


def gathered(orders: list[list[int]]) -> list[list[list[int]]]:
    """[rank][epoch] -> sample ids, gathered as tensors (all ranks have equal counts here)."""
    mine = torch.tensor(orders, dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [t.tolist() for t in everyone]


def fork_server() -> Any:
    """Workers forked by a fork server, not by this process: on Python before 3.11.10 a worker forked from a process
    whose gloo threads enter Python can hang at start-up (``atorch.data.worker_fork_hazard``; about 1 start in 2,000
    here). The server imports this script once."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__"])
    return context


def main() -> None:
    out = {
        "default": loader(Ids()),
        "no_shuffle": loader(Ids(), shuffle=False),
        "workers": loader(Ids(), num_workers=2, multiprocessing_context=fork_server()),
        "user_sampler": loader(Ids(), sampler_cls=PlainSampler, shuffle=True),
        "stream": loader(IdStream(), epochs=1),
        "stream_workers": loader(IdStream(), epochs=1, num_workers=2, multiprocessing_context=fork_server()),
    }
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
