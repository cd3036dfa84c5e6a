"""ds_3d_parallel (DeepSpeed's pipeline engine, ZeRO-1) on real processes, against plain single-process fp32.

Usage: ``torchrun --nproc_per_node=N ds3d_worker.py GROUP`` (see GROUPS). Rank 0 also trains each model in
plain fp32 in one process on the whole global batch, and prints
``RESULT {"reference": {model: [...]}, "scenarios": {name: {...} or {"error": ...}}}``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import functools
import json
import sys
from typing import Any

import shard_models as sm
import torch
import torch.distributed as dist
from torch import nn
from worker_common import GLOBAL_BATCH, LR, STEPS, gathered, reference_losses, repeated_batch, run_each

import atorch
from atorch.training import train_step


def sequential_model() -> nn.Sequential:
    """A plain nn.Sequential (blocks in a nested Sequential): the generic conversion, no transformers."""
    return nn.Sequential(nn.Linear(16, 32), nn.Sequential(*[sm.MixerBlock(32) for _ in range(4)]), nn.LayerNorm(32),
                         nn.Linear(32, 8))


class VectorDataset(torch.utils.data.Dataset):
    """Random 16-vectors, each sample alone (the Sequential's one input)."""

    def __init__(self, samples: int = 64) -> None:
        self.x = torch.randn(samples, 16, generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.x[index]


def output_energy(data: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """A loss that reads the data and the output: the squared distance of the output to the input's first 8."""
    return (output - data[:, :8]).pow(2).mean()


MODELS = {
    "gpt2": sm.Setup(functools.partial(sm.tiny_gpt2, layers=4), sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    "llama": sm.Setup(functools.partial(sm.tiny_llama, layers=4), sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    "sequential": sm.Setup(sequential_model, VectorDataset, output_energy, None),
}


def mode(*dims: tuple[str, int]) -> tuple[str, dict[str, Any]]:
    return ("parallel_mode", {"dims": [list(d) for d in dims]})


PP2 = mode(("pipeline", 2), ("data", -1))
DS = ("ds_3d_parallel", {})

# launch group -> scenario name -> (model, load_strategy)
GROUPS: dict[str, dict[str, tuple[str, list[Any]]]] = {
    "pp2": {
        "gpt2/pp2": ("gpt2", [PP2, DS]),
        "llama/pp2": ("llama", [PP2, DS]),
        "gpt2/pp2[parameters,recompute]": ("gpt2", [PP2, ("ds_3d_parallel", {
            "partition_method": "parameters", "activation_checkpoint_interval": 1, "micro_batches": 2})]),
        "sequential/pp2": ("sequential", [PP2, DS]),
    },
    "pp2xdp2": {
        "gpt2/pp2xdp2": ("gpt2", [PP2, DS]),
        "llama/pp2xdp2": ("llama", [PP2, DS]),
    },
}


def make(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name].make()


def tied_checksum(layers: nn.Module) -> float:
    """The sum of this rank's copy of the tied embedding/head weight (0 if none)."""
    for name, param in layers.named_parameters():
        if name.startswith("tied_modules."):
            return float(param.detach().double().sum())
    return 0.0


def run_scenario(name: str, model_name: str, strategy: list[Any]) -> dict[str, Any]:
    setup = MODELS[model_name]
    model, dataset = make(model_name), repeated_batch(setup.dataset())
    _, result, _ = atorch.auto_accelerate(
        model, torch.optim.SGD, dataset, setup.loss, model_input_format=setup.input_format,
        optim_args={"lr": LR}, dataloader_args={"batch_size": GLOBAL_BATCH, "shuffle": False},
        load_strategy=strategy,
    )
    layers = result.model.module  # this rank's PipelineModule
    entry: dict[str, Any] = {"whole": sum(p.numel() for p in model.parameters())}
    entry["local"] = gathered(sum(p.numel() for p in layers.parameters()))
    entry["stage"] = gathered(layers._topo.get_coord(dist.get_rank()).pipe)
    entry["engine"] = type(result.model).__name__
    # ZeRO-1: the fp32 optimizer partition this rank updates (its share of the stage's parameters).
    entry["zero_partition"] = gathered(sum(t.numel() for t in result.model.optimizer.single_partition_of_fp32_groups))
    batches = iter(result.dataloader)
    entry["losses"] = [train_step(result, [next(batches)]).item() for _ in range(STEPS)]
    entry["loss_on_ranks"] = gathered(entry["losses"][-1])
    entry["tied"] = gathered(tied_checksum(layers))
    try:  # a hand-written forward points to train_step
        result.model(result.prepare_input(next(batches), result.args.device))
        entry["forward_error"] = None
    except atorch.SetupError as exc:
        entry["forward_error"] = str(exc)
    result.close()
    return entry


def main() -> None:
    scenarios = GROUPS[sys.argv[1]]
    report: dict[str, Any] = {"reference": {}, "scenarios": run_each({
        name: functools.partial(run_scenario, name, model, strategy) for name, (model, strategy) in scenarios.items()
    })}
    if dist.get_rank() == 0:
        for model_name in sorted({m for m, _ in scenarios.values()}):
            setup = MODELS[model_name]
            report["reference"][model_name] = reference_losses(
                make(model_name), repeated_batch(setup.dataset()), setup.loss, setup.input_format,
                lambda p: torch.optim.SGD(p, lr=LR), STEPS, GLOBAL_BATCH,
            )[:STEPS]
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
