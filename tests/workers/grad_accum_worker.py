"""Gradient accumulation under DDP, zero1, zero2, fsdp and DeepSpeed, on all launched processes.

Usage: ``torchrun --nproc_per_node=2 grad_accum_worker.py``. For each strategy (SGD, so that
rounding differences stay proportional to the gradients; see tests/test_grad_accum.py):
- ``full``: STEPS steps over whole batches;
- ``accumulated``: the same steps over two half batches, for each ORDER of the boundary call
  (before the forward or before the backward of each training pass);
- ``probe``: one step by hand, to see whether gradients were reduced after each micro-batch.
After each run the weights of every rank are compared with rank 0's (replicas must stay equal).
Rank 0 prints ``RESULT {"strategies": {name: {...}}}`` (or ``{"error": ...}`` per strategy).
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import json
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
import toy_models

import atorch
from atorch.model_context import call_model
from atorch.training import train_step

STEPS = 3
GLOBAL_BATCH = 8
STRATEGIES: dict[str, list[Any]] = {
    "ddp": ["parallel_mode"], "zero1": ["zero1"], "zero2": ["zero2"], "fsdp": ["fsdp"],
    "zero2[use_ds_zero]": [("zero2", {"use_ds_zero": True})],
    "zero1[use_ds_zero]": [("zero1", {"use_ds_zero": True})],
}
ORDERS = ("before_forward", "before_backward")
LR = 0.1
# DeepSpeed's engine owns backward, so the by-hand gradient probe does not apply to it; the
# accumulation itself (through optim.set_gradient_accumulation_boundary) is checked all the same.
PROBED = [name for name in STRATEGIES if "use_ds_zero" not in name]


def build(strategy: list[Any]) -> Any:
    _, result, _ = atorch.auto_accelerate(
        toy_models.mlp(), torch.optim.SGD, toy_models.mlp_dataset(), toy_models.mlp_loss,
        model_input_format="unpack_sequence", optim_args={"lr": LR},
        dataloader_args={"batch_size": GLOBAL_BATCH}, load_strategy=strategy,
    )
    return result


def halves(batch: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    size = len(batch[0]) // 2
    return [[t[:size] for t in batch], [t[size:] for t in batch]]


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().float().reshape(1).clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a DTensor is gathered; collective for DTensors)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach()


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([full(p).detach().flatten().float() for p in model.parameters()])


def max_grad(model: torch.nn.Module) -> float:
    grads = [full(p.grad).abs().max() for p in model.parameters() if p.grad is not None]
    return torch.stack(grads).max().item() if grads else 0.0


def accumulate(result: Any, micro_batches: list[Any], order: str) -> tuple[torch.Tensor, float]:
    """train_step's loop with the boundary declared ``order``; returns this rank's loss and the
    largest gradient element before the step (0 where the engine holds the gradients)."""
    model, optim, args = result.model, result.optim, result.args
    count, total = len(micro_batches), torch.zeros(())
    for index, batch in enumerate(micro_batches):
        if order == "before_forward":
            optim.set_gradient_accumulation_boundary(index == count - 1)
        data = result.prepare_input(batch, args.device)
        loss = result.loss_func(data, call_model(model, data, args.model_input_format)) / count
        if order == "before_backward":
            optim.set_gradient_accumulation_boundary(index == count - 1)
        optim.backward(loss) if args.use_optim_backward else loss.backward()
        total += loss.detach().float()
    largest = max_grad(model)  # (for whole batches: the reduced gradient the step uses)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return total, largest


def train(strategy: list[Any], order: str | None) -> dict[str, Any]:
    """STEPS steps over whole batches (order None), or over two halves each: through train_step
    (which declares the boundary before the forward), or by hand with the boundary before the backward."""
    result = build(strategy)
    batches = iter(result.dataloader)
    losses, largest = [], 0.0
    for _ in range(STEPS):
        batch = next(batches)
        if order is None:
            loss, grad = accumulate(result, [batch], "before_forward")
        elif order == "before_forward":
            loss, grad = train_step(result, halves(batch)), 0.0
        else:
            loss, grad = accumulate(result, halves(batch), order)
        losses.append(mean_over_ranks(loss))
        largest = max(largest, grad)
    weights = flat_params(result.model)
    return {"losses": losses, "weights": weights, "replica_gap": differs_from_rank0(weights), "max_grad": largest}


def differs_from_rank0(vector: torch.Tensor) -> float:
    """Largest |this rank's vector - rank 0's| over all ranks."""
    theirs = vector.clone()
    dist.broadcast(theirs, src=0)
    gap = (vector - theirs).abs().max().reshape(1)
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return gap.item()


def grad_view(model: torch.nn.Module) -> dict[str, Any]:
    """What this rank's gradients look like: how many parameters hold one, whether sharded, and
    (where whole) how far they are from rank 0's."""
    grads = [p.grad for p in model.parameters()]
    held = [g for g in grads if g is not None]
    sharded = any(hasattr(g, "to_local") for g in held)
    view: dict[str, Any] = {"with_grad": len(held), "params": len(grads), "sharded": sharded}
    if held and not sharded:
        view["max_diff_across_ranks"] = differs_from_rank0(torch.cat([g.flatten() for g in held]))
    return view


def probe(strategy: list[Any]) -> dict[str, Any]:
    """train_step's first step by hand, looking at the gradients after each micro-batch."""
    result = build(strategy)
    model, optim = result.model, result.optim
    assert result.args.requires_set_gradient_accumulation_boundary, "accumulation needs the boundary call"
    views = []
    for index, batch in enumerate(halves(next(iter(result.dataloader)))):
        optim.set_gradient_accumulation_boundary(index == 1)
        data = result.prepare_input(batch, result.args.device)
        (result.loss_func(data, call_model(model, data, "unpack_sequence")) / 2).backward()
        views.append(grad_view(model))
    grads = torch.cat([full(p.grad).flatten() for p in model.parameters()])
    return {"after_first": views[0], "after_boundary": views[1], "grads": grads}


def run(name: str, strategy: list[Any]) -> dict[str, Any]:
    whole = train(strategy, None)
    entry: dict[str, Any] = {
        "full_losses": whole["losses"],
        "max_grad": whole["max_grad"],
        "replica_gap": {"full": whole["replica_gap"]},
        "max_weight_change": (whole["weights"] - flat_params(toy_models.mlp())).abs().max().item(),
        "orders": {},
    }
    for order in ORDERS:
        accumulated = train(strategy, order)
        entry["orders"][order] = {
            "losses": accumulated["losses"],
            "max_weight_diff": (whole["weights"] - accumulated["weights"]).abs().max().item(),
        }
        entry["replica_gap"][order] = accumulated["replica_gap"]
    return {**entry, **(probe(strategy) if name in PROBED else {})}


def main() -> None:
    report: dict[str, Any] = {"strategies": {}}
    for name, strategy in STRATEGIES.items():
        try:
            report["strategies"][name] = run(name, strategy)
        except Exception as exc:  # reported per strategy; the others still run
            report["strategies"][name] = {"error": "".join(traceback.format_exception_only(exc)).strip()[-2000:]}
            print(f"[rank {dist.get_rank()}] {name} failed:\n{traceback.format_exc()}", file=sys.stderr)
        dist.barrier()
    # The boundary gradient is the same whatever the strategy: compare each with DDP's.
    base = report["strategies"]["ddp"].get("grads")
    for entry in report["strategies"].values():
        grads = entry.pop("grads", None)
        if base is not None and grads is not None:
            entry["max_grad_diff_vs_ddp"] = (grads - base).abs().max().item()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
