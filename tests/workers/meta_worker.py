"""Models built on the meta device, trained with DDP and with fsdp, on all launched processes.

Usage: ``torchrun --nproc_per_node=2 meta_worker.py``. Every rank builds each model under
``torch.device("meta")`` and seeds torch with 0; the weights atorch materialises must equal, on every
rank, those of a single-process ``meta_init.materialise`` with seed 0, and training must follow the
single-process fp32 training of those weights. Rank 0 prints ``RESULT {...}``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import dataclasses
import functools
import json
import logging
from typing import Any

import shard_models as sm
import torch
import torch.distributed as dist
import toy_models
from torch.distributed.tensor import DTensor
from torch.utils.data import Subset
from worker_common import losses_of, reference_losses, run_each

import atorch
from atorch import meta_init

STEPS = 4
GLOBAL_BATCH = 8
LR = 0.1
MODELS = {  # name -> (make, dataset, loss, input format)
    "mlp": (lambda: toy_models.MLP(depth=8), toy_models.mlp_dataset, toy_models.mlp_loss, "unpack_sequence"),
    "gpt2": (lambda: sm.tiny_gpt2(layers=4), sm.TokenDataset, sm.hf_loss, "unpack_dict"),
}
STRATEGIES = {"ddp": ["parallel_mode"], "fsdp": ["fsdp"]}
SCENARIOS = {f"{m}/{s}": (m, strategy) for m in MODELS for s, strategy in STRATEGIES.items()}
# Size-based units make GPT-2's c_proj layers units of their own, sharded before their parent, whose
# transformers init rescales them: the parent's init must still reach them (before they are sharded).
SCENARIOS["gpt2/zero2[size_based]"] = ("gpt2", [("zero2", {"wrap_min_num_params": 1000})])
# Modules kept whole are materialised before the units, so the parameters left out are the real ones.
SCENARIOS["mlp/fsdp[ignored_modules]"] = ("mlp", [("fsdp", {"ignored_modules": ["head", "blocks.7"]})])


def repeated_batch(dataset: Any) -> Subset:
    return Subset(dataset, [i % GLOBAL_BATCH for i in range((STEPS + 1) * GLOBAL_BATCH)])


def on_meta(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return MODELS[name][0]()


def reference(name: str) -> torch.nn.Module:
    return meta_init.materialise(on_meta(name), torch.device("cpu"), seed=0)


def clean(name: str) -> str:
    return name.removeprefix("module.").replace("_checkpoint_wrapped_module.", "")


def weight_gap(model: torch.nn.Module, ref: torch.nn.Module) -> float:
    """Largest |difference| between the model's full weights and the reference's (gathered if sharded)."""
    expected = dict(ref.named_parameters())
    gap = 0.0
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        gap = max(gap, (full.detach().cpu() - expected[clean(name)]).abs().max().item())
    return gap


def max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value])
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


class MaterialiseStatsLog(logging.Handler):
    """The figures of a one-unit-at-a-time materialisation, from the record atorch logs them with (rank 0 logs
    at INFO; the report is rank 0's)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.found: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        stats = getattr(record, meta_init.STATS_KEY, None)
        if stats is not None:
            self.found = dataclasses.asdict(stats)


def run_scenario(name: str, strategy: list[Any]) -> dict[str, Any]:
    _, make_dataset, loss, input_format = MODELS[name]
    model, dataset = on_meta(name), repeated_batch(make_dataset())
    torch.manual_seed(0)  # rank 0's seed is the one every rank initialises with
    stats = MaterialiseStatsLog()
    logging.getLogger("atorch").addHandler(stats)
    try:
        _, result, _ = atorch.auto_accelerate(
            model, torch.optim.SGD, dataset, loss, model_input_format=input_format,
            optim_args={"lr": LR}, dataloader_args={"batch_size": GLOBAL_BATCH, "shuffle": False},
            load_strategy=strategy,
        )
    finally:
        logging.getLogger("atorch").removeHandler(stats)
    entry: dict[str, Any] = {
        "weight_gap": max_over_ranks(weight_gap(result.model, reference(name))),
        "user_model_still_meta": meta_init.is_meta(model),
        "stats": stats.found,
        "whole": sorted(clean(n) for n, p in result.model.named_parameters() if not isinstance(p, DTensor)),
    }
    entry["losses"] = losses_of(result, STEPS, loss, input_format)
    return entry


def reference_losses_of(name: str) -> list[float]:
    _, make_dataset, loss, input_format = MODELS[name]
    return reference_losses(reference(name), repeated_batch(make_dataset()), loss, input_format,
                            lambda p: torch.optim.SGD(p, lr=LR), STEPS, GLOBAL_BATCH)


def main() -> None:
    report: dict[str, Any] = {"reference": {}, "scenarios": run_each({
        name: functools.partial(run_scenario, model, strategy) for name, (model, strategy) in SCENARIOS.items()
    })}
    if dist.get_rank() == 0:
        report["reference"] = {name: reference_losses_of(name) for name in MODELS}
        report["full_bytes"] = {name: meta_init.param_bytes(reference(name)) for name in MODELS}
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
