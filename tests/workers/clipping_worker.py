"""Gradient clipping through AcceleratedOptimizer, and the non-finite skip, on all launched processes.

Usage: ``torchrun --nproc_per_node=2 clipping_worker.py``. For each strategy, one SGD step on the
first global batch with ``clip_grad_norm_`` (and one with ``clip_grad_value_``), against the same
step in a single process on the whole global batch. Then, for ``skip`` strategies, a step whose
gradient holds inf on rank 1 only. Rank 0 prints ``RESULT {"clip": {...}, "skip": {...}}``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import contextlib
import json
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
import toy_models

import atorch
from atorch.model_context import call_model
from atorch.optimizer import local_tensor

GLOBAL_BATCH = 8
LR = 0.1
FP16_AMP = ("amp_native", {"dtype": "fp16"})
CLIP_STRATEGIES: dict[str, list[Any]] = {
    "ddp": ["parallel_mode"],
    "zero1": ["zero1"],
    "zero2": ["zero2"],
    "fsdp": ["fsdp"],
    "fsdp[ignored head]": [("fsdp", {"ignored_modules": ["head"]})],
    "amp_fp16": ["parallel_mode", FP16_AMP],
    "amp_fp16+fsdp": [FP16_AMP, "fsdp"],
    "zero2[use_ds_zero]": [("zero2", {"use_ds_zero": True})],
    "zero1[use_ds_zero]": [("zero1", {"use_ds_zero": True})],
}
SKIP_STRATEGIES: dict[str, list[Any]] = {
    "ddp": ["parallel_mode", ("amp_native", {"dtype": "bf16", "skip_if_nonfinite": True})],
    "fsdp": ["fsdp", ("amp_native", {"dtype": "bf16", "skip_if_nonfinite": True})],
}


def build(strategy: list[Any]) -> Any:
    _, result, _ = atorch.auto_accelerate(
        toy_models.mlp(), torch.optim.SGD, toy_models.mlp_dataset(), toy_models.mlp_loss,
        model_input_format="unpack_sequence", optim_args={"lr": LR},
        dataloader_args={"batch_size": GLOBAL_BATCH, "shuffle": False}, load_strategy=strategy,
    )
    return result


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach()


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([full(p).detach().flatten().float() for p in model.parameters()])


def replica_gap(vector: torch.Tensor) -> float:
    theirs = vector.clone()
    dist.broadcast(theirs, src=0)
    gap = (vector - theirs).abs().max().reshape(1)
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return gap.item()


def backward(result: Any) -> None:
    data = result.prepare_input(next(iter(result.dataloader)), result.args.device)
    loss = result.loss_func(data, call_model(result.model, data, "unpack_sequence"))
    result.optim.backward(loss) if result.args.use_optim_backward else loss.backward()


def reference(fp16_autocast: bool, clip: str, amount: float | None) -> dict[str, Any]:
    """One process, the whole global batch (samples 0..7, what the two ranks' first batches hold)."""
    model = toy_models.mlp()
    x, y = toy_models.mlp_dataset()[:GLOBAL_BATCH]
    autocast = torch.autocast("cpu", dtype=torch.float16) if fp16_autocast else contextlib.nullcontext()
    with autocast:
        output = model(x, y)
    toy_models.mlp_loss((x, y), output).backward()
    grads = [p.grad for p in model.parameters()]
    norm = torch.nn.utils.get_total_norm(grads).item()
    if clip == "norm":
        torch.nn.utils.clip_grad_norm_(model.parameters(), amount if amount is not None else norm / 2)
    else:
        torch.nn.utils.clip_grad_value_(model.parameters(), amount)
    max_grad = max(g.abs().max().item() for g in grads)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return {"norm": norm, "weights": flat_params(model), "max_grad": max_grad}


def clip_case(name: str, strategy: list[Any]) -> dict[str, Any]:
    fp16 = any(item == FP16_AMP for item in strategy)
    ref = reference(fp16, "norm", None)
    max_norm = ref["norm"] / 2  # clipping is active
    result = build(strategy)
    backward(result)
    # What torch's own function sees on this rank (the mistake the method exists for): scaled
    # gradients under fp16 loss scaling, this rank's shards only under sharding.
    local = [local_tensor(p.grad) for p in result.model.parameters() if p.grad is not None]
    naive = torch.nn.utils.get_total_norm(local).item() if local else None
    norm = result.optim.clip_grad_norm_(max_norm)
    result.optim.step()
    weights = flat_params(result.model)
    entry: dict[str, Any] = {
        "fp16": fp16,
        "norm": float(norm),
        "naive_norm": naive,
        "norm_is_plain_tensor": type(norm) is torch.Tensor,
        "reference_norm": ref["norm"],
        "reference_max_grad": ref["max_grad"],
        "weight_diff": (weights - ref["weights"]).abs().max().item(),
        "weight_change": (ref["weights"] - flat_params(toy_models.mlp())).abs().max().item(),
        "replica_gap": replica_gap(weights),
        "skipped": result.optim.skipped_steps,
    }
    clip_value = ref["max_grad"] / 4
    ref = reference(fp16, "value", clip_value)
    result = build(strategy)
    backward(result)
    try:
        result.optim.clip_grad_by_value(clip_value)  # the Colossal-AI name, same implementation
    except NotImplementedError as exc:
        entry["value_error"] = str(exc)
        return entry
    result.optim.step()
    weights = flat_params(result.model)
    entry["value_weight_diff"] = (weights - ref["weights"]).abs().max().item()
    entry["value_replica_gap"] = replica_gap(weights)
    return entry


def skip_case(strategy: list[Any]) -> dict[str, Any]:
    result = build(strategy)
    backward(result)
    result.optim.step()  # a finite step first
    result.optim.zero_grad()
    before = flat_params(result.model)
    backward(result)
    if dist.get_rank() == 1:  # after the reduction: only this rank's gradient holds inf
        grad = next(local_tensor(p.grad) for p in result.model.parameters() if local_tensor(p.grad).numel())
        grad.view(-1)[0] = float("inf")
    result.optim.step()
    after = flat_params(result.model)
    skipped = torch.tensor([float(result.optim.skipped_steps)])
    counts = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, skipped)
    changed = torch.tensor([(after - before).abs().max().item()])
    dist.all_reduce(changed, op=dist.ReduceOp.MAX)
    return {"skipped_per_rank": [c.item() for c in counts], "max_change": changed.item(),
            "replica_gap": replica_gap(after)}


def guarded(fn: Any, *args: Any) -> dict[str, Any]:
    try:
        return fn(*args)
    except Exception as exc:  # reported per case; the others still run
        print(f"[rank {dist.get_rank()}] failed:\n{traceback.format_exc()}", file=sys.stderr)
        return {"error": "".join(traceback.format_exception_only(exc)).strip()[-2000:]}
    finally:
        dist.barrier()


def main() -> None:
    report: dict[str, Any] = {
        "clip": {name: guarded(clip_case, name, strategy) for name, strategy in CLIP_STRATEGIES.items()},
        "skip": {name: guarded(skip_case, strategy) for name, strategy in SKIP_STRATEGIES.items()},
    }
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
