"""The README's training loop, run literally under every strategy on 2 ranks (tests/test_readme_loop.py).

The loop (between ``<!-- loop:start -->`` and ``<!-- loop:end -->`` in README.md) is executed as
written, with ``result`` from ``auto_accelerate`` and ``epochs`` given. Each strategy's final
weights are compared with a single-process reference that trains on the same global batches in the
same order (the distributed sampler's shuffled order, a new one each epoch), with the same
accumulation and clipping. Rank 0 prints ``RESULT {json}``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import json
import re
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import toy_models
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

import atorch
from atorch.distributed import init_distributed

README = Path(__file__).resolve().parents[2] / "README.md"
EPOCHS, GLOBAL_BATCH, ACCUMULATION, MAX_NORM, LR = 2, 8, 2, 1.0, 0.1
STRATEGIES: dict[str, list[Any]] = {
    "ddp": ["parallel_mode"], "zero1": ["zero1"], "zero2": ["zero2"], "fsdp": ["fsdp"],
    "checkpoint_fsdp": ["checkpoint", "fsdp"],
    "zero1_deepspeed": [("zero1", {"implementation": "deepspeed"})],
    "zero2_deepspeed": [("zero2", {"implementation": "deepspeed"})],
    "amp_fp16_ddp": ["parallel_mode", ("amp_native", {"dtype": "fp16"})],
    "amp_fp16_fsdp": ["fsdp", ("amp_native", {"dtype": "fp16"})],
}


class DictDataset(Dataset):
    """The MLP's samples as dicts, so that the README's ``model(**data)`` applies."""

    def __init__(self) -> None:
        self.inner = toy_models.mlp_dataset()

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x, y = self.inner[index]
        return {"x": x, "y": y}


def loss_func(data: dict[str, torch.Tensor], output: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output.float(), data["y"])


def readme_loop() -> str:
    text = README.read_text(encoding="utf-8")
    match = re.search(r"<!-- loop:start -->\n```python\n(.*?)```\n<!-- loop:end -->", text, re.S)
    assert match, "README.md lost its <!-- loop:start/end --> block"
    return match.group(1)


def flat_weights(model: torch.nn.Module) -> torch.Tensor:
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([p.detach().float().flatten() for p in params])


def reference(dataset: Dataset, world: int) -> torch.Tensor:
    """One process, no atorch: the same global micro-batches, accumulation and clipping."""
    model = toy_models.mlp()
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    local = GLOBAL_BATCH // world
    for epoch in range(EPOCHS):
        orders = []
        for rank in range(world):
            sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True)
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        for index in range(len(orders[0]) // local):
            ids = [i for order in orders for i in order[index * local:(index + 1) * local]]
            batch = [dataset[i] for i in ids]
            x, y = torch.stack([b["x"] for b in batch]), torch.stack([b["y"] for b in batch])
            (torch.nn.functional.cross_entropy(model(x), y) / ACCUMULATION).backward()
            if (index + 1) % ACCUMULATION == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                optim.step()
                optim.zero_grad()
    return flat_weights(model)


def run(strategy: list[Any], dataset: Dataset) -> dict[str, Any]:
    _, result, _ = atorch.auto_accelerate(
        toy_models.mlp(), torch.optim.SGD, dataset, loss_func, model_input_format="unpack_dict",
        optim_args={"lr": LR}, dataloader_args={"batch_size": GLOBAL_BATCH}, load_strategy=strategy,
    )
    exec(readme_loop(), {"result": result, "epochs": EPOCHS})  # the README's code, as written
    weights = flat_weights(result.model)
    mine = weights.clone()
    dist.broadcast(weights, src=0)
    replicas = (mine - weights).abs().max().reshape(1)
    dist.all_reduce(replicas, op=dist.ReduceOp.MAX)
    result.close()
    return {"weights": mine, "replica_gap": replicas.item()}


def main() -> None:
    init_distributed()
    dataset = DictDataset()
    expected = reference(dataset, dist.get_world_size())
    start = flat_weights(toy_models.mlp())
    report: dict[str, Any] = {"moved": (expected - start).abs().max().item(), "strategies": {}}
    for name, strategy in STRATEGIES.items():
        try:
            entry = run(strategy, dataset)
            entry["max_diff"] = (entry.pop("weights") - expected).abs().max().item()
            report["strategies"][name] = entry
        except Exception as exc:  # reported per strategy; the others still run
            report["strategies"][name] = {"error": "".join(traceback.format_exception_only(exc)).strip()[-2000:]}
            print(f"[rank {dist.get_rank()}] {name} failed:\n{traceback.format_exc()}", file=sys.stderr)
        dist.barrier()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
