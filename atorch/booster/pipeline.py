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
    agreed_meta,
    average_gradients,
    sync_tied,
    tied_copies,
)


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


def clip_pipeline_grad_norm(optim: Any, model: PipelinedModel, max_norm: float, norm_type: float) -> torch.Tensor:
    """atorch's clipping with the norm taken over all stages: each stage's norm (sharded gradients combined by
    atorch's ``total_norm``), a tied weight counted once (on its lowest stage), combined over the pipeline group."""
    from atorch.clipping import clip_by_norm, total_norm

    grads = optim._unscaled_grads()
    duplicate: set[int] = set()
    for names in model.tied:  # type: ignore[attr-defined]
        copies = tied_copies(model, names)
        _, _, lowest = agreed_meta(copies, model.group)  # type: ignore[attr-defined]
        duplicate |= {id(p.grad) for index, p in copies if index != lowest and p.grad is not None}
    local = total_norm([g for g in grads if id(g) not in duplicate], norm_type).float().reshape(())
    if norm_type == float("inf"):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=model.group)  # type: ignore[attr-defined]
        norm = local
    else:
        powered = local ** norm_type
        dist.all_reduce(powered, group=model.group)  # type: ignore[attr-defined]
        norm = powered ** (1.0 / norm_type)
    if max_norm != float("inf"):
        clip_by_norm(grads, max_norm, norm)
    return norm
