"""What the distributed test workers share: the single-process reference, the losses of a result,
and running scenarios so that one failing scenario is reported without stopping the others."""

from __future__ import annotations

import copy
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset

from atorch.model_context import call_model
from atorch.opt_lib.tp_sequence_vocab import plain, step_context
from atorch.training import train_step

# The reference training of the strategy workers: steps, global batch, and plain SGD's learning rate
# (rounding differences are not amplified as AdamW's normalisation does near zero grads).
STEPS = 4
GLOBAL_BATCH = 8
LR = 0.1


def repeated_batch(dataset: Any) -> Subset:
    """The first global batch, once per step: memorised, so the loss falls far more than the tolerance."""
    return Subset(dataset, [i % GLOBAL_BATCH for i in range((STEPS + 1) * GLOBAL_BATCH)])


def gathered(value: float) -> list[float]:
    """``value`` from every rank, in rank order."""
    mine = torch.tensor([value], dtype=torch.float64)
    out = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [o.item() for o in out]


def reference_losses(
    model: torch.nn.Module, dataset: Any, loss: Callable[..., torch.Tensor], input_format: str | None,
    make_optimizer: Callable[[Any], torch.optim.Optimizer], steps: int, batch_size: int,
) -> list[float]:
    """Plain fp32 training in this one process on whole global batches (then one evaluation):
    what every strategy must match."""
    model = copy.deepcopy(model)
    optim = make_optimizer(model.parameters())
    batches = iter(DataLoader(dataset, batch_size=batch_size))
    losses = []
    for _ in range(steps):
        batch = next(batches)
        value = loss(batch, call_model(model, batch, input_format))
        value.backward()
        optim.step()
        optim.zero_grad()
        losses.append(value.item())
    with torch.no_grad():
        batch = next(batches)
        losses.append(loss(batch, call_model(model, batch, input_format)).item())
    return losses


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().float().reshape(1).cpu()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def losses_of(result: Any, steps: int, loss: Callable[..., torch.Tensor], input_format: str | None) -> list[float]:
    """``steps`` training steps of an accelerated result, then one evaluation: global mean losses."""
    batches = iter(result.dataloader)
    losses = [mean_over_ranks(train_step(result, [next(batches)])) for _ in range(steps)]
    # Under tensor_parallel's loss_parallel a loss on the (vocabulary-sharded) logits runs inside loss_parallel().
    with torch.no_grad(), step_context(result.model):
        data = result.prepare_input(next(batches), result.args.device)
        losses.append(mean_over_ranks(plain(loss(data, call_model(result.model, data, input_format)))))
    return losses


def run_each(scenarios: dict[str, Callable[[], dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Run every scenario on every rank; a failure on any rank is reported as that scenario's error."""
    report = {}
    for name, scenario in scenarios.items():
        try:
            entry = scenario()
        except Exception as exc:  # reported per scenario; the others still run
            entry = {"error": "".join(traceback.format_exception_only(exc)).strip()[-2000:]}
            print(f"[rank {dist.get_rank()}] {name} failed:\n{traceback.format_exc()}", file=sys.stderr)
        failed = torch.tensor([1.0 if "error" in entry else 0.0])
        dist.all_reduce(failed)
        if failed.item() and "error" not in entry:
            entry = {"error": "failed on another rank (see its stderr)"}
        report[name] = entry
        dist.barrier()
    return report
