"""pipeline_parallel: the model split into stages over the 'pipeline' dimension (torch.distributed.pipelining).

The split (pipeline_split.py) is automatic, at the repeated-block boundaries (an nn.Sequential without
them: at its children; an encoder-decoder model: encoder | decoder), balanced by cost, and checked on
one sample against the whole model. Rank r of the pipeline group holds stage r (GPipe, 1F1B), stages r,
r+p, ... (interleaved schedules, loop order) or stages r and 2p-1-r (ZBV and DualPipeV, V order). Training goes
through ``atorch.train_step``, which runs the schedule: every rank of a pipeline group loads the same
batch, the first stage takes its model inputs and the last stage runs the user's ``loss_func(data,
output)`` per micro-batch. Under fp16 ``amp_native`` the last stage scales that loss with the optimizer's
GradScaler; the step unscales each stage's gradients and an overflow on any rank skips it on every rank
(the scaler's inf/nan flag is agreed over all ranks: precision.grad_scaler_for), so the scale stays equal.

What the batch must be: tensors (in a dict, list/tuple or alone) whose first dimension is the batch;
each micro-batch is a slice of it, and every stage calls the model on it as ``model_input_format`` says
(a later stage's first block then takes the previous stage's hidden states). For a transformers
model the output given to loss_func is the model's output with ``.logits`` and, when the batch has
``labels``, ``.loss`` computed by the model's own loss function; other models give their output tensor.

Every stage starts from rank 0's model: its parameters and buffers are broadcast before the split, as
DDP and FSDP start from rank 0's weights. Weights used by two stages (GPT-2's tied ``wte``/``lm_head``)
are kept in both; they start equal and their gradients are summed over the pipeline group before each
step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from pydantic import Field
from torch import nn

from atorch import grad_sync
from atorch.class_ref import matches
from atorch.errors import SetupError
from atorch.log import get_logger
from atorch.opt_lib.base import Categorical, Dimension, Method, MethodConfig, SearchRole, StrategyCheck
from atorch.opt_lib.blocks import block_classes
from atorch.opt_lib.expert_parallel import is_expert_param
from atorch.opt_lib.parallel_mode import ParallelMode
from atorch.opt_lib.pipeline_router import RouterCarry, router_loss_on
from atorch.opt_lib.pipeline_split import (
    StageModule,
    build_stage,
    check_split,
    find_units,
    in_call_order,
    is_transformers,
    plan_stages,
    stage_kwargs,
)
from atorch.opt_lib.registry import register
from atorch.state_names import StagedModel

if TYPE_CHECKING:
    from atorch.opt_lib.build_state import Build

logger = get_logger(__name__)

PIPELINE = "pipeline"
Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"]
SINGLE = ("gpipe", "1f1b")  # one stage per rank
V_ORDER = ("zbv", "dualpipev")  # two stages per rank: r and 2p-1-r


class PipelineParallelConfig(MethodConfig):
    """Needs a 'pipeline' dimension in parallel_mode, e.g. ``([("pipeline", 2), ("data", -1)], None)``."""

    schedule: Schedule = Field(
        default="1f1b", description="gpipe, 1f1b, interleaved_1f1b, interleaved_zb (zero bubble), zbv (zero "
        "bubble, V order, 2 stages per rank) or dualpipev (DeepSeek's DualPipe folded into a V: 2 stages per rank, "
        "a forward and a backward of two micro-batches overlapped; at least 2 x pipeline micro-batches)")
    micro_batches: int | None = Field(
        default=None, ge=1, description="micro-batches per step (divides the per-rank batch); null: 2 × pipeline size")
    virtual_stages: int | None = Field(
        default=None, ge=1, description="stages per rank; null: 1 for gpipe/1f1b, 2 for the others")

    def stages_per_rank(self) -> int:
        return self.virtual_stages or (1 if self.schedule in SINGLE else 2)

    def micro_batch_count(self, pipeline: int) -> int:
        return self.micro_batches or 2 * pipeline


# ----- the model under pipeline parallel ----------------------------------------------------------------
class PipelinedModel(StagedModel):
    """``result.model`` under pipeline parallel: this rank's stages (their parameters are the optimizer's).
    It cannot be called: the schedule runs the stages (``atorch.train_step``)."""

    def __init__(self, stages: list[nn.Module], no_split: Any) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        if no_split:
            self._no_split_modules = list(no_split)
        self.runner: PipelineRunner | None = None
        # checks of a batch before a schedule runs it (a method's refusal inside a stage's forward would leave the
        # next stage waiting for its activations; every rank of the pipeline group reads the same batch)
        self.batch_checks: list[Callable[[Any], None]] = []
        # gradient reductions of a method's own parameters after each schedule, beside the data-parallel average
        # (expert_parallel: the experts' gradients over the ranks holding the same experts)
        self.gradient_syncs: list[Callable[[], None]] = []

    def state_roots(self) -> list[nn.Module]:
        return [_stage_module(stage).module for stage in self.stages]  # a stage may be wrapped

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise SetupError(
            "under pipeline_parallel the model cannot be called directly (each rank holds only some layers, "
            "and a schedule runs them over micro-batches); train with atorch.train_step(result, [batch]), "
            "which runs the schedule and the optimizer step and returns the loss"
        )


def _stage_indices(config: PipelineParallelConfig, rank: int, size: int) -> list[int]:
    if config.schedule in V_ORDER:
        return [rank, 2 * size - 1 - rank]
    return [rank + k * size for k in range(config.stages_per_rank())]


def _tied_groups(model: nn.Module) -> list[tuple[str, ...]]:
    """Names that share one parameter (tied weights), in a fixed order on every rank."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return sorted(tuple(names) for names in by_id.values() if len(names) > 1)


def _pipeline_mesh(ctx: Any) -> Any:
    return ctx.layout.mesh(ctx.env.device.type)[PIPELINE]


def split_into_stages(ctx: Any, config: PipelineParallelConfig, communicate: bool) -> None:
    """Replace ctx.model by this rank's stages (a PipelinedModel). [communication] every rank first takes
    rank 0's parameters and buffers (a model built differently per rank trains as rank 0's model); tied
    copies start equal."""
    model = ctx.model
    blocks, why = find_units(model)
    if blocks is None:  # checked before building; seen here only if the model changed in between
        raise SetupError(f"pipeline_parallel: {why}")
    # With communicate=False (a fake or meta model for the cost model) no process group is needed: the
    # position comes from the layout. Otherwise from the group, which numbers its ranks in ascending order.
    group = _pipeline_mesh(ctx).get_group() if communicate else None
    size = ctx.layout.size(PIPELINE)
    rank = dist.get_group_rank(group, dist.get_rank()) if communicate else \
        ctx.layout.coordinate(ctx.env.rank).get(PIPELINE, 0)
    fmt = ctx.setup.model_input_format
    if communicate:
        broadcast_from_rank0(model)
        sample = _one_sample(ctx)
        if sample is not None:  # which modules run before the blocks and which after (pipeline_split)
            blocks = in_call_order(model, blocks, sample, fmt)
    total = size * config.stages_per_rank()
    owned = plan_stages(model, blocks, total)
    indices = _stage_indices(config, rank, size)
    no_split = getattr(model, "_no_split_modules", None) or _block_class_names(model)
    stages = [StageModule(_built(model, blocks, owned[i], i == 0, i == total - 1), i, i == 0, i == total - 1,
                          no_split, fmt) for i in indices]
    pipelined = PipelinedModel(stages, no_split)
    pipelined.tied = _tied_groups(model)  # type: ignore[assignment]
    pipelined.stage_count, pipelined.indices, pipelined.group = total, indices, group  # type: ignore[assignment]
    if communicate:
        sync_tied(pipelined, grads=False)
    ctx.model = pipelined
    logger.info("pipeline_parallel: %d stages over %d processes (blocks per stage %s), this rank holds %s",
                total, size, [len(o) for o in owned], indices)


def _built(model: nn.Module, blocks: Any, owned: tuple[str, ...], first: bool, last: bool) -> nn.Module:
    """One stage's model; where the model adds its router's load-balancing loss, the stage passes its routing on
    to the last stage, which computes that loss (pipeline_router)."""
    stage = build_stage(model, blocks, owned, first, last)
    if router_loss_on(model):
        stage.atorch_router = RouterCarry(model, stage)  # read by StageModule
    return stage


def broadcast_from_rank0(model: nn.Module) -> None:
    """[communication] Every parameter and buffer of the whole model from global rank 0, before the split:
    each stage then holds rank 0's values (the tensor and data dimensions too, so later broadcasts over
    them change nothing)."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


def _block_class_names(model: nn.Module) -> list[str]:
    """The class names of the whole model's repeated blocks, declared on the stages as transformers declares
    ``_no_split_modules``: block detection on a stage or on this rank's stages (checkpoint, fsdp) must find the
    model's blocks, not the stages themselves (two StageModules in a list look like repeated blocks)."""
    classes = block_classes(model)
    return sorted({type(m).__name__ for m in model.modules() if classes and matches(m, classes)})


def tied_copies(pipelined: PipelinedModel, names: tuple[str, ...]) -> list[tuple[int, torch.Tensor]]:
    """(stage index, parameter) for each copy of one tied parameter on this rank."""
    copies = []
    for stage in pipelined.stages:
        inner = _stage_module(stage)
        params = dict(inner.module.named_parameters(remove_duplicate=False))
        found = next((params[n] for n in names if n in params), None)
        if found is not None:
            copies.append((inner.index, found))
    return copies


def _stage_module(module: nn.Module) -> StageModule:
    return module.module if not isinstance(module, StageModule) else module  # type: ignore[return-value]


def sync_tied(pipelined: PipelinedModel, grads: bool) -> None:
    """Tied copies across stages: gradients summed (grads=True), or values set to the copy of the lowest stage.

    [communication] per tied parameter, one small all-reduce of its metadata and one of its value over the
    pipeline group (a rank without a copy adds zeros).
    """
    from atorch.optimizer import local_tensor

    group = pipelined.group  # type: ignore[attr-defined]
    for names in pipelined.tied:  # type: ignore[attr-defined]
        copies = tied_copies(pipelined, names)
        shape, dtype, lowest = agreed_meta(copies, group)
        with torch.no_grad():
            total = torch.zeros(shape, dtype=dtype, device=local_tensor(copies[0][1]).device if copies else None)
            for index, param in copies:
                if grads and param.grad is not None:
                    total += local_tensor(param.grad)
                elif not grads and index == lowest:
                    total.copy_(local_tensor(param))
            dist.all_reduce(total, group=group)
            for _, param in copies:
                if not grads:
                    local_tensor(param).copy_(total)
                elif param.grad is not None:
                    local_tensor(param.grad).copy_(total)


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def agreed_meta(copies: list[tuple[int, torch.Tensor]], group: Any) -> tuple[list[int], torch.dtype, int]:
    """Local shape, dtype and lowest holding stage of a tied parameter, agreed over the pipeline group
    (ranks without a copy learn them). Encoded as maxima: -index gives the lowest stage."""
    from atorch.optimizer import local_tensor

    meta = torch.full((7,), -(2**40), dtype=torch.int64)
    if copies:
        local = local_tensor(copies[0][1])
        if local.dim() > 4:
            raise SetupError("a tied parameter with more than 4 dimensions is not supported by pipeline_parallel")
        meta[:4] = 0
        meta[:local.dim()] = torch.tensor(list(local.shape))
        meta[4] = local.dim()
        meta[5] = _DTYPES.index(local.dtype)
        meta[6] = -min(index for index, _ in copies)
    dist.all_reduce(meta, op=dist.ReduceOp.MAX, group=group)
    dims = int(meta[4])
    return [int(d) for d in meta[:dims]], _DTYPES[int(meta[5])], -int(meta[6])


# ----- data parallel per stage ----------------------------------------------------------------------------
def replicate_stages(ctx: Any) -> None:
    """Data parallel for the stages without FSDP: [communication] data rank 0's weights to every data rank
    now, and the gradients averaged over the data group after each schedule (``average_gradients``).

    Not torch's DDP: its reducer rebuilds its buckets from the first backward and asserts when a schedule
    runs several backwards (micro-batches) before the first reduction.
    """
    from atorch.opt_lib.sharding import broadcast_from_first

    broadcast_from_first(ctx.model, ctx.data_mesh)
    ctx.model.data_group = ctx.data_mesh.get_group()
    logger.info("data parallel: pipeline stages replicated over %d processes (gradients averaged per step)",
                ctx.replica_size)


def average_gradients(pipelined: PipelinedModel) -> None:
    """[communication] Every gradient averaged over the data group (replicated stages), an expert's over the ranks
    that hold the same experts (``gradient_syncs``, expert_parallel's)."""
    group = getattr(pipelined, "data_group", None)
    if group is not None:
        grad_sync.average_gradients([p for p in pipelined.parameters() if not is_expert_param(p)], group)
    for sync in pipelined.gradient_syncs:
        sync()


def shard_stages(ctx: Any, shard: Any, *args: Any, **kwargs: Any) -> None:
    """FSDP2 per stage: each stage is its own root (the schedule calls the stages, never the whole)."""
    pipelined: PipelinedModel = ctx.model
    for stage in pipelined.stages:
        ctx.model = stage
        shard(ctx, *args, **kwargs)
    ctx.model = pipelined
    ctx.gradient_sync = None  # the schedule sets each stage's gradient sync per micro-batch


# ----- the schedule ---------------------------------------------------------------------------------------
_SCHEDULES = {
    "gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV",
}


class PipelineRunner:
    """The schedule over this rank's stages, and how a batch becomes its inputs, target and loss."""

    def __init__(self, ctx: Any, config: PipelineParallelConfig) -> None:
        from torch.distributed.pipelining import PipelineStage, schedules

        pipelined: PipelinedModel = ctx.model
        self.pipelined = pipelined
        self.group = pipelined.group  # type: ignore[attr-defined]
        self.input_format = ctx.setup.model_input_format
        self.user_loss = ctx.setup.loss_func
        self.micro_batches = config.micro_batch_count(dist.get_world_size(self.group))
        self.data: Any = None  # the batch of the running step (the loss reads its micro-batches)
        # fp16: the last stage scales each micro-batch's loss (the scaled gradients flow back through every
        # stage); the optimizer's step unscales each rank's gradients and skips on all ranks if any overflowed.
        self.scaler = ctx.grad_scaler
        self._scaling = False  # True while a training schedule runs (evaluation does not scale)
        # this schedule's micro-batch losses before scaling, by the scaled loss's id: the schedule also calls the
        # loss once on placeholder outputs (torch's metadata inference on its first step), which must not count
        self._unscaled: dict[int, torch.Tensor] = {}
        stages = []
        for module in pipelined.stages:
            inner = _stage_module(module)
            inner.autocast_dtype = ctx.autocast_dtype
            if inner.last:
                self.last_model = inner.module
            stages.append(PipelineStage(module, inner.index, pipelined.stage_count, ctx.env.device,  # type: ignore[attr-defined]
                                        group=self.group))
        self.has_last = any(_stage_module(m).last for m in pipelined.stages)
        cls = getattr(schedules, _SCHEDULES[config.schedule])
        if config.schedule in SINGLE:
            self.schedule = cls(stages[0], self.micro_batches, loss_fn=self._loss)
        else:
            self.schedule = cls(stages, self.micro_batches, loss_fn=self._loss)

    def _loss(self, output: torch.Tensor | tuple[torch.Tensor, torch.Tensor], index: torch.Tensor) -> torch.Tensor:
        data = _take(self.data, index)
        router_loss = None
        if isinstance(output, tuple):  # (logits, the router's load-balancing loss): see pipeline_router
            output, router_loss = output
        if is_transformers(self.last_model):
            output = _transformers_output(self.last_model, output, data, router_loss)
        loss = self.user_loss(data, output)
        if not self._scaling:
            return loss
        loss = loss.float()  # scaled in fp32: 2**16 times a loss above 1 is past fp16's largest value
        scaled = self.scaler.scale(loss)
        self._unscaled[id(scaled)] = loss.detach()
        return scaled

    def step(self, data: Any) -> torch.Tensor:
        """One schedule over the batch; returns its mean loss (on the last stage; zero elsewhere)."""
        batch = _batch_size(data)
        if batch % self.micro_batches:
            raise SetupError(f"pipeline_parallel: the batch of {batch} samples on this rank does not split into "
                             f"{self.micro_batches} micro-batches; use a per-rank batch that is a multiple of "
                             f"{self.micro_batches}, or set micro_batches")
        for check in self.pipelined.batch_checks:
            check(data)
        self.data = data
        losses: list[torch.Tensor] = []
        target = torch.arange(batch, device=_device_of(data))
        if self.scaler is not None:
            # Every rank creates its scale now (GradScaler makes it on first use): the stages that never
            # scale a loss unscale their gradients with it in the optimizer's step.
            self.scaler.scale(torch.zeros((), device=target.device))
            self._scaling, self._unscaled = True, {}
        try:
            self.schedule.step(target=target, losses=losses, return_outputs=False,
                               **stage_kwargs(data, self.input_format))
        except Exception as exc:
            # The other stages only see their connection to this rank close: name the cause here, in the log.
            logger.error("pipeline_parallel: stage(s) %s on this rank failed: %s: %s",
                         self.pipelined.indices, type(exc).__name__, exc)  # type: ignore[attr-defined]
            raise
        finally:
            self.data, self._scaling = None, False
        if self.scaler is not None:  # the losses the schedule kept (its micro-batches'), unscaled
            losses = [self._unscaled[id(loss)] for loss in losses]
            self._unscaled = {}
        if self.has_last and losses:
            return torch.stack([loss.detach().float() for loss in losses]).mean()
        return torch.zeros((), device=target.device)

    def forward_only(self, data: Any) -> torch.Tensor | None:
        """The schedule's forward over the batch, no backward: the last stage's outputs (the model's output
        tensor, e.g. logits, for the whole batch), None on the other stages."""
        batch = _batch_size(data)
        if batch % self.micro_batches:
            raise SetupError(f"pipeline_parallel: an evaluation batch of {batch} samples does not split into "
                             f"{self.micro_batches} micro-batches; use a multiple of {self.micro_batches}")
        for check in self.pipelined.batch_checks:
            check(data)
        self.data = data
        try:
            with torch.no_grad():
                out = self.schedule.eval(target=torch.arange(batch, device=_device_of(data)), losses=[],
                                         return_outputs=True, **stage_kwargs(data, self.input_format))
        finally:
            self.data = None
        if not self.has_last:
            return None
        if isinstance(out, tuple):  # (logits, the router's load-balancing loss per micro-batch)
            out = out[0]
        whole = getattr(self.last_model, STAGE_LOGITS, None)
        return whole(out) if whole is not None else out


def _device_of(data: Any) -> torch.device:
    from torch.utils._pytree import tree_leaves

    tensors = [t for t in tree_leaves(data) if isinstance(t, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")


def _batch_size(data: Any) -> int:
    from torch.utils._pytree import tree_leaves

    sizes = {t.shape[0] for t in tree_leaves(data) if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        raise SetupError("pipeline_parallel splits each batch into micro-batches along the first dimension, so "
                         "every tensor of the batch must have the batch as its first dimension; got first "
                         f"dimensions {sorted(sizes)}")
    return sizes.pop()


def _take(data: Any, index: torch.Tensor) -> Any:
    """The micro-batch ``index`` (sample positions) of a batch."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t[index] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, data)


# Set on the last stage's model by a method that splits what the stages compute (context_parallel: each rank's share
# of the sequence): (micro-batch, the stage's logits) -> the model's output as one process's model would give it;
# and (the logits of a forward-only schedule) -> the whole logits (eval_logits).
STAGE_OUTPUT, STAGE_LOGITS = "atorch_stage_output", "atorch_stage_logits"


def _transformers_output(model: nn.Module, logits: torch.Tensor, data: Any, router_loss: torch.Tensor | None = None
                         ) -> Any:
    """What the model would have returned: logits, and the loss from its own loss function given labels; with the
    router's load-balancing loss (a mixture of experts), that loss as ``aux_loss``, added to the loss with the model's
    coefficient as the model adds it."""
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    made = getattr(model, STAGE_OUTPUT, None)
    output = made(data, logits) if made is not None else _model_output(model, logits, data)
    if router_loss is None:
        return output
    aux = router_loss.reshape(())
    loss = None if output.loss is None else output.loss + model.router_aux_loss_coef * aux
    return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux, logits=output.logits)


def _model_output(model: nn.Module, logits: torch.Tensor, data: Any) -> Any:
    """Logits, and the loss from the model's own loss function given labels."""
    from transformers.modeling_outputs import CausalLMOutput, ImageClassifierOutput

    labels = data.get("labels") if isinstance(data, dict) else None
    # Classification heads (ViT) call their loss as (labels, logits, config); language models with vocab_size;
    # encoder-decoder models (T5, BART) take the labels as they are (the decoder's inputs are already shifted).
    classifier = getattr(model, "loss_type", None) in ("ForImageClassification", "ForSequenceClassification")
    loss = None
    if labels is not None and getattr(model.config, "is_encoder_decoder", False):
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100)
    elif labels is not None and classifier:
        loss = model.loss_function(labels, logits, model.config)
    elif labels is not None:
        loss = model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size)
    return (ImageClassifierOutput if classifier else CausalLMOutput)(loss=loss, logits=logits)


def build_schedule(ctx: Any, config: PipelineParallelConfig) -> None:
    ctx.model.runner = PipelineRunner(ctx, config)


def concatenated(batches: Sequence[Any]) -> Any:
    """The micro-batches of train_step as one batch (the schedule splits it again)."""
    if len(batches) == 1:
        return batches[0]
    from torch.utils._pytree import tree_flatten, tree_unflatten

    flat = [tree_flatten(b) for b in batches]
    leaves = [torch.cat(parts) if isinstance(parts[0], torch.Tensor) else parts[0]
              for parts in zip(*(f[0] for f in flat), strict=True)]
    return tree_unflatten(leaves, flat[0][1])


def pipeline_train_step(result: Any, micro_batches: Sequence[Any], max_norm: float | None = None) -> torch.Tensor:
    """train_step under pipeline parallel: one schedule, tied gradients summed, clipping to ``max_norm`` (the
    norm over every stage), the optimizer step; returns the step's loss on every rank (from the last stage,
    averaged over data-parallel ranks)."""
    model: PipelinedModel = result.model
    runner = model.runner
    assert runner is not None
    data = result.prepare_input(concatenated(micro_batches), result.args.device)
    loss = runner.step(data)
    average_gradients(model)
    sync_tied(model, grads=True)
    if max_norm is not None:
        clip_grad_norm_over_stages(result.optim, model, float(max_norm), 2.0)
    result.optim.step()
    result.optim.zero_grad(set_to_none=True)
    if result.lr_scheduler is not None:
        result.lr_scheduler.step()
    dist.all_reduce(loss, group=runner.group)  # [communication] the last stage's loss, to every stage
    if result.args.data_parallel_group is not None:  # data × context (whose ranks have the same loss)
        dist.all_reduce(loss, group=result.args.data_parallel_group)
        loss /= dist.get_world_size(result.args.data_parallel_group)
    return loss


def clip_grad_norm_over_stages(optim: Any, model: PipelinedModel, max_norm: float, norm_type: float) -> torch.Tensor:
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


def _one_sample(ctx: Any) -> Any:
    """Two samples of the user's dataset, as the dataloader collates them and prepare_input prepares them
    (None without a dataset)."""
    from torch.utils.data import DataLoader

    if ctx.setup.dataset is None:
        return None
    loader = DataLoader(ctx.setup.dataset, batch_size=2, collate_fn=ctx.setup.dataloader_args.get("collate_fn"))
    batch = next(iter(loader), None)
    return None if batch is None else ctx.input_preparer()(batch)


_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(stages, format): reason}


def _checked_split(ctx: Any, blocks: Any, stages: int) -> str | None:
    """check_split on one sample of the user's data, once per model and stage count (the search asks
    again for every candidate). Skipped without a dataset, or for a model with fake or meta weights."""
    from torch._subclasses.fake_tensor import is_fake

    model = ctx.model
    if any(p.is_meta or is_fake(p) for p in model.parameters()):
        return None
    key = (stages, ctx.setup.model_input_format)
    known = _CHECKED.setdefault(model, {})
    if key not in known:
        sample, fmt = _one_sample(ctx), ctx.setup.model_input_format
        if sample is None:
            known[key] = None
        else:
            try:
                blocks = in_call_order(model, blocks, sample, fmt)
            except Exception as exc:  # noqa: BLE001 - the model's own forward failed: reported as such
                known[key] = f"the model's forward on one sample failed: {type(exc).__name__}: {exc}"
            else:
                known[key] = check_split(model, blocks, plan_stages(model, blocks, stages), sample, fmt)
    return known[key]


# ----- the method -----------------------------------------------------------------------------------------
# Why a candidate with a pipeline schedule is left to the analytical memory model (strategy_search.costing.tracing).
UNTRACED_SCHEDULE = "pipeline schedules are built by a communicating step"


@register
class PipelineParallel(Method):
    name = "pipeline_parallel"
    group = "parallel"
    summary = "Pipeline parallel (torch.distributed.pipelining) on the 'pipeline' dimension: automatic balanced split."
    search_role = SearchRole("layout", "pipeline", off=1)

    def optimizer_need(self, config: MethodConfig) -> str | None:
        return "runs the optimizer step inside train_step's schedule"

    def keeps_replicas_without_ddp(self, config: MethodConfig) -> bool:
        return True

    def schedule_micro_batches(self, config: MethodConfig) -> int:
        return int(getattr(config, "micro_batches", None) or 0)
    Config = PipelineParallelConfig
    mesh_dims = (PIPELINE,)
    needs_train_step = True  # a schedule runs the stages: the model cannot be called in the user's loop

    def check(self, config: PipelineParallelConfig, check: StrategyCheck) -> list[str]:  # type: ignore[override]
        problems = []
        mode = check.configs.get(ParallelMode.name)
        if mode is None or PIPELINE not in dict(mode.dims):
            problems.append("needs a 'pipeline' dimension: add ('parallel_mode', ([('pipeline', 2), ('data', -1)], "
                            "None))")
        v = config.stages_per_rank()
        if config.schedule in SINGLE and v != 1:
            problems.append(f"schedule '{config.schedule}' runs one stage per rank, but virtual_stages is {v}; use "
                            "schedule 'interleaved_1f1b' (or 'interleaved_zb') for several stages per rank")
        if config.schedule in V_ORDER and v != 2:
            problems.append(f"schedule '{config.schedule}' runs exactly 2 stages per rank (V order); set "
                            "virtual_stages to 2")
        size = dict(mode.dims).get(PIPELINE) if mode is not None else None
        if config.schedule == "dualpipev" and config.micro_batches is not None and isinstance(size, int) \
                and size > 0 and config.micro_batches < 2 * size:
            problems.append(f"schedule 'dualpipev' needs at least as many micro-batches as stages ({2 * size}: 2 per "
                            f"rank over pipeline size {size}), got {config.micro_batches}; set micro_batches to "
                            f"{2 * size} or more (or leave it unset)")
        if config.schedule not in SINGLE and v < 2:
            problems.append(f"schedule '{config.schedule}' interleaves several stages per rank; set virtual_stages "
                            "to 2 or more, or use 'gpipe' / '1f1b'")
        return problems

    def model_problems(self, ctx: Any, config: PipelineParallelConfig) -> list[str]:  # type: ignore[override]
        from atorch.opt_lib.pipeline_split import split_setup_problems

        problems = split_setup_problems(ctx, "pipeline_parallel", carries_router_loss=True)
        blocks, why = find_units(ctx.model)
        size = ctx.layout.size(PIPELINE)
        stages = size * config.stages_per_rank()
        if blocks is None:
            problems.append(why)
        elif blocks.kind == "encoder-decoder" and stages != 2:
            problems.append(f"an encoder-decoder model is split into 2 stages (its encoder and its decoder), not "
                            f"{stages} (pipeline size {size} × {config.stages_per_rank()} per rank); use pipeline "
                            "size 2 with schedule 'gpipe' or '1f1b'")
        elif len(blocks.names) < stages:
            problems.append(f"the model has {len(blocks.names)} repeated blocks, too few for {stages} stages "
                            f"(pipeline size {size} × {config.stages_per_rank()} per rank); use fewer stages")
        elif not problems:
            why = _checked_split(ctx, blocks, stages)
            if why is not None:
                problems.append(f"{why}; use a pipeline size of 1 for this model (data or tensor parallel)")
        local = ctx.local_batch_size()
        micro = config.micro_batch_count(size)
        if ctx.setup.dataset is not None and local % micro:
            problems.append(f"the per-rank batch of {local} samples does not split into {micro} micro-batches; set "
                            "micro_batches to a divisor of it, or change the batch size")
        return problems

    def search_space(self, ctx: Any) -> dict[str, Dimension]:
        size = ctx.layout.size(PIPELINE)
        return {"schedule": Categorical(("1f1b", "gpipe", "interleaved_1f1b")),
                "micro_batches": Categorical((size, 2 * size, 4 * size))}

    # ----- behaviour (atorch.apply.apply_strategy) -----------------------------------------------------------
    def apply(self, build: Build, config: PipelineParallelConfig) -> None:  # type: ignore[override]
        split_into_stages(build.ctx, config, build.communicate)
        build.per_stage = shard_stages  # later wrappers (FSDP2) take each stage as a root

    def replicate(self, build: Build, config: PipelineParallelConfig) -> bool:  # type: ignore[override]
        if build.ctx.replica_size <= 1:  # data × expert × context (context ranks hold the same stages too)
            return False
        replicate_stages(build.ctx)  # not DDP: see there
        return True

    def finish(self, build: Build, config: PipelineParallelConfig) -> None:  # type: ignore[override]
        if build.communicate:  # the schedule over this rank's (wrapped) stages; train_step runs it
            build_schedule(build.ctx, config)

    def trace_problem(self, config: MethodConfig, layout: Any) -> str | None:
        return UNTRACED_SCHEDULE
