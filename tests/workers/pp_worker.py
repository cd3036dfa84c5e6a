"""Pipeline parallel (alone, × data, × tensor) on real processes, against plain single-process fp32.

Usage: ``torchrun --nproc_per_node=N pp_worker.py GROUP`` (see GROUPS). Rank 0 also trains each model in
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
from torch.utils.data import Subset
from worker_common import reference_losses, run_each

import atorch
from atorch.optimizer import local_tensor
from atorch.training import train_step

STEPS = 4
GLOBAL_BATCH = 8
LR = 0.1  # plain SGD: rounding differences are not amplified as AdamW's normalisation does near zero grads


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x)) + x


class SmallCNN(nn.Module):
    """A non-transformers CNN, its residual blocks in one nn.Sequential: 4 blocks make 4 stages of one
    block (interleaved_1f1b on 2 ranks), so a rank holds two StageModules and no two blocks in one stage."""

    def __init__(self, channels: int = 4, blocks: int = 4, classes: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*[ConvBlock(channels) for _ in range(blocks)])
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.blocks(torch.relu(self.stem(x))).mean(dim=(2, 3)))


MODELS = {
    "cnn": sm.Setup(SmallCNN, sm.image_dataset, sm.class_loss, "unpack_sequence"),
    "gpt2": sm.Setup(functools.partial(sm.tiny_gpt2, layers=4), sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    "llama": sm.Setup(functools.partial(sm.tiny_llama, layers=4), sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    "gpt2_2layers": sm.Setup(sm.tiny_gpt2, sm.TokenDataset, sm.hf_loss, "unpack_dict"),
}


def mode(*dims: tuple[str, int]) -> tuple[str, dict[str, Any]]:
    return ("parallel_mode", {"dims": [list(d) for d in dims]})


PP2 = mode(("pipeline", 2), ("data", -1))
TPxPP = mode(("tensor", 2), ("data", -1), ("pipeline", 2))  # the first listed varies fastest


def pp(schedule: str, **extra: Any) -> tuple[str, dict[str, Any]]:
    return ("pipeline_parallel", {"schedule": schedule, **extra})


# launch group -> scenario name -> (model, load_strategy)
GROUPS: dict[str, dict[str, tuple[str, list[Any]]]] = {
    "pp2": {
        "gpt2/pp2[1f1b]": ("gpt2", [PP2, pp("1f1b")]),
        "llama/pp2[gpipe]": ("llama", [PP2, pp("gpipe")]),
        "gpt2/pp2[interleaved_1f1b]+checkpoint": ("gpt2", [PP2, pp("interleaved_1f1b"), "checkpoint"]),
        "cnn/pp2[interleaved_1f1b]+checkpoint": ("cnn", [PP2, pp("interleaved_1f1b"), "checkpoint"]),
        "gpt2/pp2+amp_native[bf16]": ("gpt2", [PP2, pp("1f1b"), ("amp_native", {"dtype": "bf16"})]),
        "forward/pp2": ("gpt2", [PP2, pp("1f1b")]),
        "refused/too few blocks": ("gpt2_2layers", [PP2, pp("interleaved_1f1b")]),
        "refused/micro-batches": ("gpt2", [PP2, pp("1f1b", micro_batches=3)]),
    },
    "pp2xdp2": {
        **{f"{m}/pp2xdp2[{s}]": (m, [PP2, pp(s)]) for m in ("gpt2", "llama")
           for s in ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv")},
        "gpt2/pp2xdp2+fsdp[1f1b]": ("gpt2", [PP2, pp("1f1b"), "fsdp"]),
        "gpt2/tp2xpp2": ("gpt2", [TPxPP, "module_replace", "tensor_parallel", pp("1f1b")]),
        "llama/tp2xpp2": ("llama", [TPxPP, "tensor_parallel", pp("1f1b")]),
    },
    # 8 processes, ATorch's mixed-parallel order (tensor first): tensor 2 × pipeline 2 × data 2 with fsdp,
    # as mixed_parallel in ATorch's config form (Llama's tensor 2 × pipeline 2 runs in the 4-process group).
    "tp2xpp2xdp2": {
        "gpt2/mixed_parallel[tp2xpp2xdp2]+fsdp": ("gpt2", [
            mode(("tensor", 2), ("pipeline", 2), ("data", 2)), "module_replace",
            ("mixed_parallel", {"pipe_config": {"pipe_schedule": "Interleaved1F1B"}}), "fsdp"]),
    },
}


def repeated_batch(dataset: Any) -> Subset:
    """The first global batch, once per step: memorised, so the loss falls far more than the tolerance."""
    return Subset(dataset, [i % GLOBAL_BATCH for i in range((STEPS + 1) * GLOBAL_BATCH)])


def make(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name].make()


def _gathered(value: float) -> list[float]:
    mine = torch.tensor([value], dtype=torch.float64)
    out = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [o.item() for o in out]


def local_param_count(model: nn.Module) -> int:
    """Parameters held on this rank, from local tensors (tied copies within one module counted once)."""
    return sum(local_tensor(p).numel() for p in model.parameters())


def tied_checksum(model: nn.Module) -> float:
    """The sum of this rank's copies of GPT-2's tied wte/lm_head weight (0 if none)."""
    for name, param in model.named_parameters():
        if name.endswith("wte.weight") or name.endswith("lm_head.weight"):
            return float(local_tensor(param).detach().double().sum())
    return 0.0


def run_scenario(name: str, model_name: str, strategy: list[Any]) -> dict[str, Any]:
    setup = MODELS[model_name]
    model, dataset = make(model_name), repeated_batch(setup.dataset())
    try:
        _, result, _ = atorch.auto_accelerate(
            model, torch.optim.SGD, dataset, setup.loss, model_input_format=setup.input_format,
            optim_args={"lr": LR}, dataloader_args={"batch_size": GLOBAL_BATCH, "shuffle": False},
            load_strategy=strategy,
        )
    except atorch.StrategyError as exc:
        return {"refused": list(exc.problems)}
    entry: dict[str, Any] = {"whole": sum(p.numel() for p in model.parameters())}
    if name.startswith("forward/"):
        batch = result.prepare_input(next(iter(result.dataloader)), result.args.device)
        try:
            result.model(**batch)
            entry["forward_error"] = None
        except atorch.SetupError as exc:
            entry["forward_error"] = str(exc)
        result.close()
        return entry
    entry["local"] = _gathered(local_param_count(result.model))
    entry["first_stage"] = _gathered(min(result.model.indices))  # the first stage each rank holds
    batches = iter(result.dataloader)
    entry["losses"] = [train_step(result, [next(batches)]).item() for _ in range(STEPS)]
    entry["loss_on_ranks"] = _gathered(entry["losses"][-1])
    entry["tied"] = _gathered(tied_checksum(result.model))
    result.close()
    return entry


def main() -> None:
    scenarios = GROUPS[sys.argv[1]]
    only = sys.argv[2:]  # optional scenario names, for a quick run by hand
    report: dict[str, Any] = {"reference": {}, "scenarios": run_each({
        name: functools.partial(run_scenario, name, model, strategy)
        for name, (model, strategy) in scenarios.items() if not only or name in only
    })}
    if dist.get_rank() == 0:
        for model_name in sorted({m for n, (m, _) in scenarios.items() if not n.startswith(("refused/", "forward/"))}):
            setup = MODELS[model_name]
            report["reference"][model_name] = reference_losses(
                make(model_name), repeated_batch(setup.dataset()), setup.loss, setup.input_format,
                lambda p: torch.optim.SGD(p, lr=LR), STEPS, GLOBAL_BATCH,
            )[:STEPS]
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
