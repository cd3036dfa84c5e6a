"""Sharding and checkpointing on models that used to crash or shard nothing, on all launched processes.

Usage: ``torchrun --nproc_per_node=2 sharding_worker.py``. Each scenario trains one model with one
strategy; rank 0 also trains each model in plain fp32 in one process on the whole global batch, and
prints ``RESULT {"reference": {model: [...]}, "scenarios": {name: {"losses": [...], ...} or {"error": ...}}}``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import functools
import json
import logging
from typing import Any

import shard_models as sm
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from worker_common import GLOBAL_BATCH, LR, STEPS, losses_of, reference_losses, repeated_batch, run_each

import atorch

MODELS = {
    "vit": sm.Setup(sm.SequentialViT, sm.vector_dataset, sm.class_loss, "unpack_sequence"),
    "cnn": sm.Setup(sm.StagedCNN, sm.image_dataset, sm.class_loss, "unpack_sequence"),
    "staged": sm.Setup(sm.StagedMLP, sm.vector_dataset, sm.class_loss, "unpack_sequence"),
    "flat": sm.Setup(sm.FlatMLP, sm.vector_dataset, sm.class_loss, "unpack_sequence"),
    "odd": sm.Setup(sm.OddMLP, sm.vector_dataset, sm.class_loss, "unpack_sequence"),
    "bert": sm.Setup(sm.tiny_bert_mlm, sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    "t5": sm.Setup(sm.tiny_t5, sm.TokenDataset, sm.hf_loss, "unpack_dict"),
}
MIXER, STAGE = "shard_models.MixerBlock", "shard_models.Stage"
# scenario name -> (model, load_strategy)
SCENARIOS: dict[str, tuple[str, list[Any]]] = {
    "vit/fsdp": ("vit", ["fsdp"]),
    "cnn/fsdp": ("cnn", ["fsdp"]),
    "vit/checkpoint": ("vit", ["checkpoint"]),
    "flat/fsdp": ("flat", ["fsdp"]),
    "staged/fsdp[nested]": ("staged", [("fsdp", {"atorch_wrap_cls": [STAGE, MIXER]})]),
    "staged/zero2[nested]": ("staged", [("zero2", {"atorch_wrap_cls": [STAGE, MIXER]})]),
    "staged/fsdp[classes+size]": ("staged", [("fsdp", {"atorch_wrap_cls": [MIXER], "wrap_min_num_params": 1000})]),
    "bert/fsdp": ("bert", ["fsdp"]),
    "bert/zero2": ("bert", ["zero2"]),
    "bert/fsdp[size_based]": ("bert", [("fsdp", {"wrap_min_num_params": 1000})]),
    "t5/checkpoint": ("t5", ["checkpoint"]),
    "t5/checkpoint+fsdp": ("t5", ["checkpoint", "fsdp"]),
    # DeepSpeed's engine on an odd parameter count (its all-gather bucket must be even)
    "odd/zero2[deepspeed]": ("odd", [("zero2", {"implementation": "deepspeed"})]),
    "odd/zero1[deepspeed]": ("odd", [("zero1", {"implementation": "deepspeed"})]),
}


def make(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name].make()


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_scenario(model_name: str, strategy: list[Any]) -> dict[str, Any]:
    setup = MODELS[model_name]
    model, dataset = make(model_name), repeated_batch(setup.dataset())
    records = Records()
    logging.getLogger("atorch").addHandler(records)
    try:
        _, result, _ = atorch.auto_accelerate(
            model, torch.optim.SGD, dataset, setup.loss, model_input_format=setup.input_format,
            optim_args={"lr": LR}, dataloader_args={"batch_size": GLOBAL_BATCH, "shuffle": False},
            load_strategy=strategy,
        )
    finally:
        logging.getLogger("atorch").removeHandler(records)
    wrapped = result.model
    entry: dict[str, Any] = {
        "units": sum(isinstance(m, FSDPModule) for m in wrapped.modules() if m is not wrapped),
        "warnings": records.messages,
    }
    if model_name == "bert":
        entry["tied"] = wrapped.cls.predictions.decoder.weight is wrapped.bert.embeddings.word_embeddings.weight
    losses = losses_of(result, STEPS, setup.loss, setup.input_format)
    entry["losses"] = losses
    return entry


def main() -> None:
    report: dict[str, Any] = {"reference": {}, "scenarios": run_each({
        name: functools.partial(run_scenario, model, strategy) for name, (model, strategy) in SCENARIOS.items()
    })}
    if dist.get_rank() == 0:
        for model_name in sorted({m for m, _ in SCENARIOS.values()}):
            setup = MODELS[model_name]
            report["reference"][model_name] = reference_losses(
                make(model_name), repeated_batch(setup.dataset()), setup.loss, setup.input_format,
                lambda p: torch.optim.SGD(p, lr=LR), STEPS, GLOBAL_BATCH,
            )
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
