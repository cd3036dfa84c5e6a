"""Train every single method and every allowed pair on one model, on all launched processes.

Usage: ``torchrun --nproc_per_node=2 numerics_worker.py {mlp|gpt2}``. Every scenario trains the
same model from the same weights on the same global batches; rank 0 also trains a plain fp32
single-process reference (no atorch, whole global batch) and prints one line
``RESULT {"reference": [...], "scenarios": {name: {"losses": [...], ...} or {"error": ...}}}``.
Each scenario runs inside try/except so one failure is reported without hiding the others.

The scenario list is derived from the method registry and the compatibility table, so a newly
registered method is covered without editing this file.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import functools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import toy_models
from torch.utils.data import Subset
from worker_common import losses_of, reference_losses, run_each

import atorch
from atorch.opt_lib import allowed_pairs, get_method, method_names

STEPS = 4  # optimizer steps; one more forward-only loss checks the last update
GLOBAL_BATCH = 8
OPTIM_ARGS = {"lr": 1e-2}

# Methods whose default config does not suit plain AdamW training: 'half' defaults to fp16, where
# AdamW's second moment and eps (1e-8) underflow to zero, so the first step already gives NaN.
CONFIG_FOR: dict[str, Any] = {"half": "bf16"}
# Configs of a method that are tested as extra singles (name -> strategy).
EXTRA_SINGLES: dict[str, list[Any]] = {
    "amp_native[bf16]": [("amp_native", {"dtype": "bf16"})],
    # Sharding options: each must still train exactly like the reference.
    "fsdp[cpu_offload]": [("fsdp", {"cpu_offload": True})],
    "fsdp[size_based]": [("fsdp", {"wrap_min_num_params": 1000})],
    "fsdp[no_reshard]": [("fsdp", {"reshard_after_forward": False})],
    # One module kept whole per model ("head" in the MLP, the final LayerNorm in GPT-2): its
    # gradients must still be averaged over ranks, or the ranks drift apart from the reference.
    "fsdp[ignored_modules]": [("fsdp", {"ignored_modules": ["head", "transformer.ln_f"]})],
    "zero2[ignored_modules]": [("zero2", {"ignored_modules": ["head", "transformer.ln_f"]})],
}
# The DeepSpeed engines run last, so that nothing they set up in the process touches the others.
DEEPSPEED_SINGLES: dict[str, list[Any]] = {
    f"{name}[use_ds_zero]": [(name, {"use_ds_zero": True})] for name in ("zero1", "zero2")
}


def _item(name: str) -> Any:
    return (name, CONFIG_FOR[name]) if name in CONFIG_FOR else name


# Methods that need a layout dimension of their own ('tensor', 'pipeline' in parallel_mode): their
# numerics, alone and with the methods they combine with, are in tests/test_tensor_parallel.py and
# tests/test_pipeline_parallel.py.
OWN_LAYOUT = {name for name in method_names() if set(get_method(name).mesh_dims) - {"data"}}


def scenarios() -> dict[str, list[Any]]:
    """Scenario name -> load_strategy: every method alone, extra configs, every allowed pair."""
    names = [name for name in method_names() if name not in OWN_LAYOUT]
    found: dict[str, list[Any]] = {name: [_item(name)] for name in names}
    found.update(EXTRA_SINGLES)
    for first, second in allowed_pairs(names):
        found[f"{first}+{second}"] = [_item(first), _item(second)]
    found.update(DEEPSPEED_SINGLES)
    return found


@dataclass(frozen=True)
class ModelSetup:
    make: Callable[[], torch.nn.Module]
    dataset: Callable[[], Any]
    loss: Callable[[Any, Any], torch.Tensor]
    input_format: str


MODELS: dict[str, ModelSetup] = {
    "mlp": ModelSetup(toy_models.mlp, toy_models.mlp_dataset, toy_models.mlp_loss, "unpack_sequence"),
    "gpt2": ModelSetup(toy_models.tiny_gpt2, toy_models.TokenDataset, toy_models.gpt2_loss, "unpack_dict"),
}


def repeated_batch(dataset: Any) -> Subset:
    """The first global batch, once per step: the models memorise it, so the loss falls by far
    more than any tolerance and a strategy that trains wrongly (or not at all) shows."""
    return Subset(dataset, [i % GLOBAL_BATCH for i in range((STEPS + 1) * GLOBAL_BATCH)])


def run_scenario(setup: ModelSetup, model: torch.nn.Module, dataset: Any, strategy: list[Any]) -> dict[str, Any]:
    _, result, _ = atorch.auto_accelerate(
        model, torch.optim.AdamW, dataset, setup.loss, model_input_format=setup.input_format,
        optim_args=OPTIM_ARGS, dataloader_args={"batch_size": GLOBAL_BATCH, "shuffle": False}, load_strategy=strategy,
    )
    return {
        "losses": losses_of(result, STEPS, setup.loss, setup.input_format),
        "skipped": dict(result.args.skipped),
        "skipped_steps": int(getattr(result.optim, "skipped_steps", 0)),
        "device": result.args.device.type,
    }


def main(model_name: str) -> None:
    setup = MODELS[model_name]
    model, dataset = setup.make(), repeated_batch(setup.dataset())
    report: dict[str, Any] = {"scenarios": run_each({
        name: functools.partial(run_scenario, setup, model, dataset, strategy) for name, strategy in scenarios().items()
    })}
    if dist.get_rank() == 0:
        report["reference"] = reference_losses(
            model, dataset, setup.loss, setup.input_format, lambda p: torch.optim.AdamW(p, **OPTIM_ARGS), STEPS,
            GLOBAL_BATCH,
        )
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
