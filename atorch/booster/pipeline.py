"""``Booster.execute_pipeline``: atorch's pipeline schedule over one batch, without the optimizer step
(Colossal-AI's split: the user steps), and the global gradient norm over pipeline stages."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from atorch.errors import SetupError
from atorch.opt_lib.pipeline_parallel import (
    PipelinedModel,
    average_gradients,
    clip_grad_norm_over_stages,
    sync_tied,
)

clip_pipeline_grad_norm = clip_grad_norm_over_stages  # the Booster's name (wrappers.py)


def input_format_of(batch: Any) -> str | None:
    """How the stages are called on a batch: dict → model(**batch), list/tuple → model(*batch), else model(batch)."""
    if isinstance(batch, Mapping):
        return "unpack_dict"
    if isinstance(batch, (list, tuple)):
        return "unpack_sequence"
    return None


def run_pipeline(result: Any, data_iter: Iterator[Any]) -> torch.Tensor:
    """Forward and backward of one batch from ``data_iter`` through the schedule (its micro-batches), the
    gradients made ready for ``optimizer.step()`` (averaged over data-parallel ranks, tied copies summed).
    Returns this data-parallel rank's batch loss on every stage of its pipeline (sent from the last)."""
    model: PipelinedModel = result.model
    runner = model.runner
    if runner is None:
        raise SetupError("this pipeline model has no schedule (built without communication)")
    try:
        batch = next(data_iter)
    except StopIteration:
        raise
    except TypeError as exc:
        raise SetupError(f"execute_pipeline takes an iterator of batches (iter(dataloader)), got "
                         f"{type(data_iter).__name__}") from exc
    runner.input_format = input_format_of(batch)
    loss = runner.step(result.prepare_input(batch, result.args.device))
    average_gradients(model)
    sync_tied(model, grads=True)
    dist.all_reduce(loss, group=runner.group)  # [communication] the last stage's loss to every stage
    return loss
