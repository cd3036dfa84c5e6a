"""ds_3d_parallel: DeepSpeed's pipeline engine over the 'pipeline' dimension, ZeRO-1 over 'data'.

``[("parallel_mode", ([("pipeline", p), ("data", d)], None)), ("ds_3d_parallel", {...})]`` converts the
model to DeepSpeed pipeline layers (ds_pipe_layers.py), builds ``deepspeed.pipe.PipelineModule`` on a
topology with atorch's rank layout, and hands it with the user's optimizer to ``deepspeed.initialize``,
which returns a ``PipelineEngine`` (ZeRO stage 1: optimizer state sharded over the data dimension).
``atorch.train_step(result, micro_batches)`` runs ``engine.train_batch``: the step's batch is cut into
``micro_batches`` equal micro-batches (DeepSpeed's gradient accumulation steps), the first stage reads
their model inputs, the last stage their whole data for the user's ``loss_func(data, output)``; the
returned loss (the micro-batches' mean, averaged over data ranks) is the same on every rank.

DeepSpeed's tensor ('model') axis expects layers written for Megatron's tensor parallelism, so the
layout's tensor size must be 1 (refused otherwise, in the compatibility rules).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from pydantic import Field

from atorch.errors import SetupError
from atorch.log import get_logger
from atorch.opt_lib.base import Method, MethodConfig, Preparation, StrategyCheck
from atorch.opt_lib.parallel_mode import ParallelMode
from atorch.opt_lib.registry import register

if TYPE_CHECKING:
    from atorch.opt_lib.build_state import Build

logger = get_logger(__name__)

PIPELINE, DATA, TENSOR = "pipeline", "data", "tensor"
_DS_AXES = {PIPELINE: "pipe", DATA: "data", TENSOR: "model"}  # atorch's dimension names -> DeepSpeed's axes


class Ds3dParallelConfig(MethodConfig):
    """Needs a 'pipeline' dimension in parallel_mode, e.g. ``([("pipeline", 2), ("data", -1)], None)``."""

    micro_batches: int | None = Field(
        default=None, ge=1, description="micro-batches per step (DeepSpeed's gradient_accumulation_steps; divides "
        "the per-rank batch); null: 2 × pipeline size")
    partition_method: str = Field(
        default="cost", description="how layers are split into stages: cost (blocks balanced by multiply-adds, "
        "embeddings on the first stage, head on the last), or DeepSpeed's parameters, uniform, type:REGEX")
    activation_checkpoint_interval: int = Field(
        default=0, ge=0, description="DeepSpeed recomputes activations every this many layers (0: never)")
    zero_stage: Literal[0, 1] = Field(
        default=1, description="ZeRO stage on the data dimension (DeepSpeed's pipeline engine supports 0 and 1)")

    def micro_batch_count(self, pipeline: int) -> int:
        return self.micro_batches or 2 * pipeline

    def preparation(self) -> Preparation | None:
        from atorch.opt_lib.deepspeed_zero import deepspeed_preparation

        return deepspeed_preparation()


def _partition_ok(method: str) -> bool:
    return method in ("cost", "parameters", "uniform") or (method.startswith("type:") and len(method) > 5)


# ----- building ------------------------------------------------------------------------------------------
def _pipeline_module_class() -> type:
    from deepspeed.pipe import PipelineModule

    class CostBalancedPipelineModule(PipelineModule):
        """DeepSpeed's PipelineModule, with stage bounds given (atorch's cost-balanced split)."""

        def __init__(self, *args: Any, bounds: list[int] | None = None, **kwargs: Any) -> None:
            object.__setattr__(self, "atorch_bounds", bounds)  # read in __init__, before nn.Module is set up
            super().__init__(*args, **kwargs)

        def _partition_layers(self, method: str = "uniform") -> None:
            if self.atorch_bounds is None:
                return super()._partition_layers(method)
            self.parts = list(self.atorch_bounds)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])
            return None

    return CostBalancedPipelineModule


def topology_of(layout: Any) -> Any:
    """DeepSpeed's process topology with atorch's rank layout, named as DeepSpeed names them; an axis the
    layout lacks has size 1. DeepSpeed's last axis varies fastest, atorch's first: the axes go in reverse."""
    from deepspeed.runtime.pipe.topology import ProcessTopology

    axes = [_DS_AXES[name] for name in reversed(layout.names)]
    dims = list(reversed(layout.shape))
    for name in ("pipe", "data", "model"):
        if name not in axes:
            axes.append(name)
            dims.append(1)
    return ProcessTopology(axes=axes, dims=dims)


class DsPipelineLoss:
    """DeepSpeed's ``loss_fn(outputs, labels)`` on the last stage: ``labels`` carries every tensor of the
    micro-batch, from which the user's data is rebuilt; a transformers model's output gets ``.loss`` from
    its own loss function, as the model would compute it."""

    def __init__(self, user_loss: Any, layers: Any) -> None:
        self.user_loss = user_loss
        self.layers = layers
        self.spec: Any = None  # the batch's structure (set per step: the same on every rank)

    def __call__(self, output: torch.Tensor, labels: Any) -> torch.Tensor:
        from torch.utils._pytree import tree_unflatten

        data = tree_unflatten(list(labels) if isinstance(labels, (tuple, list)) else [labels], self.spec)
        if self.layers.family != "sequential":
            from transformers.modeling_outputs import CausalLMOutput

            target = data.get("labels") if isinstance(data, dict) else None
            loss = None if target is None else self.layers.loss_function(
                logits=output, labels=target, vocab_size=self.layers.vocab_size)
            output = CausalLMOutput(loss=loss, logits=output)
        return self.user_loss(data, output)


def start_ds_pipeline(ctx: Any, config: Ds3dParallelConfig) -> None:
    """ctx.model becomes DeepSpeed's PipelineEngine over this rank's layers; ctx.optimizer its ZeRO optimizer.

    [communication] DeepSpeed makes its pipeline/data groups, makes tied copies equal and broadcasts the
    data-parallel ranks' weights from the first.
    """
    if ctx.env.device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", str(ctx.env.local_rank))  # a plain `python` run: DeepSpeed asserts on it
    import deepspeed

    from atorch.opt_lib.deepspeed_zero import bucket_elements, forget_destroyed_groups, wait_for_deepspeed_ops
    from atorch.opt_lib.ds_pipe_layers import CHECKPOINTABLE, build_layers, stage_bounds

    forget_destroyed_groups()
    wait_for_deepspeed_ops()
    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
    layers = build_layers(ctx.model)
    pipeline = ctx.layout.size(PIPELINE)
    loss = DsPipelineLoss(ctx.setup.loss_func, layers)
    bounds = stage_bounds(layers, pipeline) if config.partition_method == "cost" else None
    module = _pipeline_module_class()(
        layers=layers.specs, topology=topology_of(ctx.layout), loss_fn=loss, bounds=bounds,
        partition_method="parameters" if bounds is not None else config.partition_method,
        activation_checkpoint_interval=config.activation_checkpoint_interval,
        checkpointable_layers=list(CHECKPOINTABLE),
    )
    ctx.model = module  # the user's model copy is dropped: this rank keeps only its layers
    optimizer = ctx.setup.optim_func([p for p in module.parameters() if p.requires_grad], **ctx.setup.optim_args)
    micro = config.micro_batch_count(pipeline)
    local = ctx.local_batch_size()
    bucket = bucket_elements(module.parameters())
    ds_config = {
        "train_micro_batch_size_per_gpu": max(local // micro, 1),
        "gradient_accumulation_steps": micro,
        # Buckets no bigger than this stage (DeepSpeed's 5e8-element default is allocated whole).
        "zero_optimization": {"stage": config.zero_stage, "reduce_bucket_size": bucket,
                              "allgather_bucket_size": bucket},
        "steps_per_print": 2**31 - 1,
        "gradient_clipping": 0.0,  # the user's optimizer decides, as under every other method
        "zero_allow_untested_optimizer": True,
    }
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds_config,
                                                      dist_init_required=False)
    engine.forward = _no_direct_call  # DeepSpeed's own message does not say how atorch trains it
    engine.atorch_ds_pipeline = DsPipelineRun(engine, loss, micro, ctx.setup.model_input_format, layers.family)
    ctx.model, ctx.optimizer, ctx.engine = engine, ds_optimizer, engine
    ctx.sharded_gradients = config.zero_stage > 0
    ctx.gradient_sync = None
    logger.info("ds_3d_parallel: DeepSpeed pipeline engine, %d stages × %d data ranks (ZeRO-%d), stage bounds %s, "
                "%d micro-batches", pipeline, ctx.layout.data_size, config.zero_stage, module.parts, micro)


def _no_direct_call(*args: Any, **kwargs: Any) -> Any:
    raise SetupError(
        "under ds_3d_parallel the model cannot be called directly (DeepSpeed's pipeline engine holds only this "
        "rank's layers and runs them over micro-batches); train with atorch.train_step(result, [batch]), which "
        "runs engine.train_batch and returns the loss"
    )


# ----- the step ------------------------------------------------------------------------------------------
class DsPipelineRun:
    """How a step's batch becomes DeepSpeed's (inputs, labels) micro-batches."""

    def __init__(self, engine: Any, loss: DsPipelineLoss, micro: int, input_format: str | None, family: str) -> None:
        self.engine, self.loss, self.micro = engine, loss, micro
        self.input_format, self.family = input_format, family

    def model_input(self, data: Any) -> torch.Tensor:
        if self.family != "sequential":
            if not isinstance(data, dict) or "input_ids" not in data:
                raise SetupError("ds_3d_parallel feeds a transformers model its input_ids: give batches as a dict "
                                 "with 'input_ids' (and 'labels'), with model_input_format 'unpack_dict'")
            extra = sorted(set(data) - {"input_ids", "labels"})
            if extra:
                raise SetupError(f"ds_3d_parallel passes only input_ids between stages (the causal mask is made from "
                                 f"the positions), so the batch keys {extra} would be ignored; leave them out (no "
                                 "padding), or use pipeline_parallel")
            return data["input_ids"]
        if self.input_format in ("unpack_sequence", "input_target"):
            return data[0]
        if self.input_format == "unpack_dict" or not isinstance(data, torch.Tensor):
            raise SetupError("ds_3d_parallel feeds an nn.Sequential model one tensor: give batches as a tensor, or "
                             "as a sequence whose first element is the model input (model_input_format "
                             "'unpack_sequence')")
        return data

    def micro_batches(self, data: Any) -> Iterator[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
        from torch.utils._pytree import tree_flatten

        leaves, spec = tree_flatten(data)
        self.loss.spec = spec
        inputs = self.model_input(data)
        batch = inputs.shape[0]
        if batch % self.micro or any(not isinstance(t, torch.Tensor) or t.shape[:1] != (batch,) for t in leaves):
            raise SetupError(f"ds_3d_parallel cuts each batch into {self.micro} micro-batches along the first "
                             f"dimension: every tensor of the batch must have the batch ({batch} samples on this "
                             f"rank) as first dimension, a multiple of {self.micro}; change the batch size or set "
                             "micro_batches")
        size = batch // self.micro
        for i in range(self.micro):
            part = slice(i * size, (i + 1) * size)
            yield inputs[part], tuple(t[part] for t in leaves)


def is_ds_pipeline(model: Any) -> bool:
    return getattr(model, "atorch_ds_pipeline", None) is not None


def ds_pipeline_train_step(result: Any, micro_batches: Sequence[Any]) -> torch.Tensor:
    """train_step under ds_3d_parallel: one ``engine.train_batch`` over the concatenated micro-batches."""
    from atorch.opt_lib.pipeline_parallel import concatenated

    run: DsPipelineRun = result.model.atorch_ds_pipeline
    if len(micro_batches) == 0:
        raise ValueError("train_step needs at least one micro-batch")
    data = result.prepare_input(concatenated(micro_batches), result.args.device)
    loss = run.engine.train_batch(iter(run.micro_batches(data)))
    if result.lr_scheduler is not None:
        result.lr_scheduler.step()
    return loss.detach().float()


# ----- the method ----------------------------------------------------------------------------------------
@register
class Ds3dParallel(Method):
    name = "ds_3d_parallel"
    group = "parallel"
    summary = "DeepSpeed's pipeline engine on the 'pipeline' dimension (layers converted), ZeRO-1 on 'data'."

    def casts(self, config: MethodConfig | None) -> bool:
        return True  # DeepSpeed's engine runs its fp16/bf16 config: the step's dtypes are its own

    def optimizer_need(self, config: MethodConfig) -> str | None:
        return "hands the optimizer to DeepSpeed's engine"

    def keeps_replicas_without_ddp(self, config: MethodConfig) -> bool:
        return True

    def schedule_micro_batches(self, config: MethodConfig) -> int:
        return int(getattr(config, "micro_batches", None) or 0)
    Config = Ds3dParallelConfig
    mesh_dims = (PIPELINE, TENSOR)
    needs_train_step = True  # DeepSpeed's engine.train_batch runs the step

    def check(self, config: Ds3dParallelConfig, check: StrategyCheck) -> list[str]:  # type: ignore[override]
        problems = []
        mode = check.configs.get(ParallelMode.name)
        dims = dict(mode.dims) if mode is not None else {}
        if PIPELINE not in dims:
            problems.append("needs a 'pipeline' dimension: add ('parallel_mode', ([('pipeline', 2), ('data', -1)], "
                            "None))")
        other = sorted(set(dims) - set(_DS_AXES))
        if other:
            problems.append(f"DeepSpeed's topology has pipeline, data and tensor axes only, not {other}; remove them")
        if not _partition_ok(config.partition_method):
            problems.append(f"partition_method {config.partition_method!r} is not one of cost, parameters, uniform, "
                            "type:REGEX")
        return problems

    def applicable(self, ctx: Any) -> str | None:
        from atorch.opt_lib.deepspeed_zero import deepspeed_reason

        return deepspeed_reason()

    def model_problems(self, ctx: Any, config: Ds3dParallelConfig) -> list[str]:  # type: ignore[override]
        from atorch.opt_lib.ds_pipe_layers import conversion_problem
        from atorch.opt_lib.pipeline_split import find_blocks, split_setup_problems

        problems = split_setup_problems(ctx, "ds_3d_parallel")
        why = conversion_problem(ctx.model)
        if why is not None:
            problems.append(why)
        else:
            blocks, _ = find_blocks(ctx.model)
            size = ctx.layout.size(PIPELINE)
            if blocks is not None and len(blocks.names) < size:
                problems.append(f"the model has {len(blocks.names)} repeated blocks, too few for {size} pipeline "
                                "stages; use a smaller pipeline size")
            problems += _sample_problems(ctx)
        micro = config.micro_batch_count(ctx.layout.size(PIPELINE))
        local = ctx.local_batch_size()
        if ctx.setup.dataset is not None and local % micro:
            problems.append(f"the per-rank batch of {local} samples does not split into {micro} micro-batches; set "
                            "micro_batches to a divisor of it, or change the batch size")
        return problems

    # ----- behaviour (atorch.apply.apply_strategy) -----------------------------------------------------------
    def apply(self, build: Build, config: Ds3dParallelConfig) -> bool:  # type: ignore[override]
        if not build.communicate:  # (the cost model measures the model as transformed so far)
            return False
        start_ds_pipeline(build.ctx, config)
        return True  # DeepSpeed's pipeline engine took model and optimizer

    def trace_problem(self, config: MethodConfig, layout: Any) -> str | None:
        from atorch.opt_lib.pipeline_parallel import UNTRACED_SCHEDULE

        return UNTRACED_SCHEDULE


def _sample_problems(ctx: Any) -> list[str]:
    """A transformers model's samples must be input_ids (and labels): nothing else crosses the stages."""
    from atorch.opt_lib.pipeline_split import is_transformers

    dataset = ctx.setup.dataset
    if dataset is None or not is_transformers(ctx.model) or not hasattr(dataset, "__getitem__"):
        return []
    try:
        sample = dataset[0]
    except Exception:  # noqa: BLE001 - an unindexable dataset is checked at the step instead
        return []
    if not isinstance(sample, dict):
        return []
    extra = sorted(set(sample) - {"input_ids", "labels"})
    if "input_ids" not in sample:
        return ["ds_3d_parallel feeds a transformers model its input_ids: give samples as a dict with 'input_ids' "
                "(and 'labels')"]
    if extra:
        return [f"ds_3d_parallel passes only input_ids between stages (the causal mask is made from the positions), "
                f"so the sample keys {extra} would be ignored; leave them out (no padding), or use pipeline_parallel"]
    return []
