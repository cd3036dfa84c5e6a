"""One optimizer step on an accelerated result: the loop every demo, benchmark and dry-run uses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from atorch.errors import SetupError
from atorch.model_context import call_model
from atorch.opt_lib.ds_3d_parallel import ds_pipeline_train_step, is_ds_pipeline
from atorch.opt_lib.pipeline_parallel import PipelinedModel, pipeline_train_step
from atorch.opt_lib.tp_sequence_vocab import plain, step_context, whole


def train_step(result: Any, micro_batches: Sequence[Any], max_norm: float | None = None) -> torch.Tensor:
    """Forward/backward over the micro-batches (gradient accumulation), then one optimizer step (after
    clipping the global gradient norm to ``max_norm`` when given: ``optim.clip_grad_norm_``, over every
    stage under pipeline_parallel).

    Gradients are synchronised only on the last micro-batch (the boundary is set before each
    forward, the order every strategy reads it in); each micro-batch loss is divided by the number
    of micro-batches so the step equals one over their concatenation. Returns the global batch's
    loss: the mean over data-parallel ranks, the same value on every rank (detached). Under
    pipeline_parallel a schedule runs the stages over the concatenated micro-batches instead.
    """
    # [pipeline] Under pipeline_parallel a schedule runs the stages over micro-batches (pipeline_parallel.py).
    if isinstance(result.model, PipelinedModel):
        return pipeline_train_step(result, micro_batches, max_norm)
    # [ds_3d_parallel] DeepSpeed's pipeline engine runs its own schedule (ds_3d_parallel.py).
    if is_ds_pipeline(result.model):
        if max_norm is not None:
            raise SetupError("train_step(max_norm=...) is not available under ds_3d_parallel (DeepSpeed's engine "
                             "runs the step); leave max_norm out")
        return ds_pipeline_train_step(result, micro_batches)
    model, optim, args = result.model, result.optim, result.args
    count = len(micro_batches)
    if count == 0:
        raise ValueError("train_step needs at least one micro-batch")
    losses = []
    # [tensor_parallel loss_parallel] forward, loss and backward inside torch's loss_parallel() (tp_sequence_vocab.py)
    with step_context(model):
        for index, batch in enumerate(micro_batches):
            if count > 1 and args.requires_set_gradient_accumulation_boundary:
                optim.set_gradient_accumulation_boundary(index == count - 1)
            data = result.prepare_input(batch, args.device)
            output = call_model(model, data, args.model_input_format)
            loss = result.loss_func(data, output)
            if count > 1:
                loss = loss / count
            if args.use_optim_backward:
                optim.backward(loss)
            else:
                loss.backward()
            losses.append(plain(loss.detach()))
    total = losses[0].float() if count == 1 else torch.stack(losses).float().sum()
    if max_norm is not None:
        optim.clip_grad_norm_(float(max_norm))
    # Started before the step so that it overlaps with it; the group is the data-parallel one.
    reduction = _start_mean(total, result)
    optim.step()
    optim.zero_grad(set_to_none=True)
    if result.lr_scheduler is not None:
        result.lr_scheduler.step()
    if reduction is not None:
        reduction.wait()
        total /= dist.get_world_size(args.data_parallel_group)  # [context_parallel] data × context: equal losses
    return total


def _start_mean(total: torch.Tensor, result: Any) -> Any:
    if result.args.data_parallel_group is None:
        return None
    return dist.all_reduce(total, group=result.args.data_parallel_group, async_op=True)


def eval_logits(result: Any, batch: Any) -> torch.Tensor | None:
    """The model's output tensor (a transformers model's ``.logits``) for one batch, without gradients.

    Under pipeline_parallel the stages run a forward-only schedule and only the last stage has the
    output: the other ranks get None.
    """
    data = result.prepare_input(batch, result.args.device)
    if isinstance(result.model, PipelinedModel):
        assert result.model.runner is not None
        return result.model.runner.forward_only(data)
    with torch.no_grad():
        output = call_model(result.model, data, result.args.model_input_format)
    logits = whole(getattr(output, "logits", output))  # [loss_parallel] vocabulary shards gathered
    return logits if isinstance(logits, torch.Tensor) else output[0]
