"""Applying a strategy: one function, every method in the registry's order (``registry.APPLY_ORDER``).

Transformations of the model (module swaps, casts, autocast, recompute, sharding wrappers) do not
communicate. The steps that do (making the initial weights equal on every rank, DDP's constructor,
DeepSpeed's engine) are named below and are left out with ``communicate=False``, so the same
function can transform a model made of fake or meta tensors for the cost model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from atorch.grad_sync import DDPGradientSync
from atorch.log import get_logger
from atorch.meta_init import is_meta, materialise
from atorch.model_context import ModelContext
from atorch.names import user_param_groups
from atorch.opt_lib.activation_checkpoint import checkpoint_blocks
from atorch.opt_lib.deepspeed_zero import start_deepspeed
from atorch.opt_lib.ds_3d_parallel import start_ds_pipeline
from atorch.opt_lib.expert_parallel import expert_param_names, reduce_expert_gradients, split_experts
from atorch.opt_lib.fp8 import use_fp8_linears
from atorch.opt_lib.mixed_parallel import expand_mixed
from atorch.opt_lib.module_replace import replace_registered
from atorch.opt_lib.pipeline_parallel import build_schedule, replicate_stages, shard_stages, split_into_stages
from atorch.opt_lib.precision import TORCH_DTYPES, autocast_forward, cast_to_half, grad_scaler_for
from atorch.opt_lib.registry import APPLY_ORDER
from atorch.opt_lib.sharding import broadcast_from_first, shard_model, zero1_sharding
from atorch.opt_lib.tensor_data_parallel import replicate_tensor_parallel
from atorch.opt_lib.tensor_parallel import parallelize
from atorch.opt_lib.zero1 import runs_on_fsdp2
from atorch.strategy import Strategy

logger = get_logger(__name__)


@dataclass
class _Build:
    """What the steps of one apply_strategy share: the context, every method's config, and the choices read from
    several of them."""

    ctx: ModelContext
    cfg: dict[str, Any]
    communicate: bool
    deepspeed_stage: int | None  # ZeRO through DeepSpeed's engine (zero1 / zero2 with implementation="deepspeed")
    sharding: Any  # the FSDP2 config (fsdp, zero2 on FSDP2, or zero1 with a tensor dimension: zero1.py), or None

    @property
    def reshard_after_forward(self) -> bool:
        fsdp = self.cfg.get("fsdp")
        return fsdp is not None and fsdp.reshard_after_forward


# Each method's transformation of the model, run in the registry's order (registry.METHOD_MODULES says why each
# comes where it does). A step returns True when it finished the whole build (DeepSpeed's pipeline engine).
# parallel_mode (the layout), mixed_parallel (expanded up front) and zero1 (the optimizer, below) have none.
def _replace_modules(b: _Build, config: Any) -> None:
    half = b.cfg.get("half")
    dtype = TORCH_DTYPES[half.dtype] if half is not None else next(b.ctx.model.parameters()).dtype
    replace_registered(b.ctx, config, dtype)


def _split_stages(b: _Build, config: Any) -> None:
    split_into_stages(b.ctx, config, b.communicate)


def _start_ds_pipeline(b: _Build, config: Any) -> bool:
    if not b.communicate:  # (the cost model measures the model as transformed so far)
        return False
    start_ds_pipeline(b.ctx, config)
    return True


def _split_tensors(b: _Build, config: Any) -> None:
    parallelize(b.ctx, config, b.communicate)


def _shard(b: _Build, config: Any) -> None:
    if config is not b.sharding:  # zero2 through DeepSpeed: its engine shards, after the optimizer is built
        return
    ctx, label = b.ctx, next(name for name in ("fsdp", "zero2", "zero1") if name in b.cfg)
    # [communication] Every data-parallel rank starts from rank 0's weights. DDP does this in its constructor and
    # DeepSpeed in its engine; FSDP2 does not, so it happens here. A model on the meta device is initialised
    # identically on every rank instead (meta_init.py).
    if b.communicate and config.sync_module_states and ctx.dp_size > 1 and not is_meta(ctx.model):
        broadcast_from_first(ctx.model, ctx.data_mesh)
    if "pipeline_parallel" in b.cfg:  # [pipeline] each stage its own FSDP2 root
        shard_stages(ctx, shard_model, config, reshard_after_forward=b.reshard_after_forward, label=label)
    else:
        shard_model(ctx, config, reshard_after_forward=b.reshard_after_forward, label=label)


_MODEL_STEPS: dict[str, Callable[[_Build, Any], bool | None]] = {
    "module_replace": _replace_modules,
    "pipeline_parallel": _split_stages,
    "ds_3d_parallel": _start_ds_pipeline,
    "half": lambda b, config: cast_to_half(b.ctx, config),
    "fp8": lambda b, config: use_fp8_linears(b.ctx, config),
    "amp_native": lambda b, config: autocast_forward(b.ctx, config),
    "tensor_parallel": _split_tensors,
    "expert_parallel": lambda b, config: split_experts(b.ctx, config, b.communicate),
    "checkpoint": lambda b, config: checkpoint_blocks(b.ctx, config),
    "fsdp": _shard,
    "zero2": _shard,
    "zero1": lambda b, config: _shard(b, b.sharding) if runs_on_fsdp2(b.cfg) else None,  # [zero1] see zero1.py
}


def apply_strategy(ctx: ModelContext, strategy: Strategy, communicate: bool = True) -> None:
    """Apply a checked strategy to ``ctx.model`` (a fresh copy) and build the optimizer for it: each method's
    transformation of the model in the registry's order (``registry.APPLY_ORDER``), then the optimizer and
    what wraps model and optimizer (DDP or DeepSpeed, loss scaling, the pipeline schedule)."""
    cfg = {item.name: item.config for item in strategy.methods if item.name not in ctx.skipped}
    cfg = expand_mixed(cfg)  # [mixed_parallel] its tensor_parallel and pipeline_parallel, on their dimensions
    ctx.strategy = strategy
    zero1, zero2, fsdp = cfg.get("zero1"), cfg.get("zero2"), cfg.get("fsdp")
    deepspeed_stage = next(
        (stage for stage, c in ((1, zero1), (2, zero2)) if c is not None and c.implementation == "deepspeed"), None
    )
    sharding = fsdp if fsdp is not None else zero2 if deepspeed_stage is None else None
    if sharding is None and runs_on_fsdp2(cfg):
        sharding = zero1_sharding()
    build = _Build(ctx, cfg, communicate, deepspeed_stage, sharding=sharding)

    # A model built on the meta device is materialised and initialised identically on every rank, here as a
    # whole before any step, or under FSDP2 one unit at a time as it is sharded (meta_init.py).
    if build.sharding is None and is_meta(ctx.model):
        materialise(ctx.model, ctx.env.device)
    for name in APPLY_ORDER:
        step = _MODEL_STEPS.get(name)
        if step is None or name not in cfg:
            continue
        try:
            if step(build, cfg[name]):
                return
        except Exception as exc:
            # which method's step failed: a dry-run names it, and the search rules that method out at this layout
            # (its other settings cannot help a transformation that refuses the model)
            with contextlib.suppress(AttributeError):
                exc.atorch_method = name  # type: ignore[attr-defined]
            raise
    _finish(build)


def _finish(b: _Build) -> None:
    """The optimizer over the parameters the model now trains, then what wraps model and optimizer."""
    ctx, cfg, communicate = b.ctx, b.cfg, b.communicate
    amp, zero1, pipeline = cfg.get("amp_native"), cfg.get("zero1"), cfg.get("pipeline_parallel")
    params = _optimizer_params(ctx)  # the user's groups, by name
    if ctx.setup.optim_func is None:  # ATorch's optim_func=None: no optimizer (atorch/no_optimizer.py)
        ctx.optimizer = None
    elif zero1 is not None and b.deepspeed_stage is None and b.sharding is None:
        ctx.optimizer = _zero_redundancy(ctx, params)
    else:
        ctx.optimizer = ctx.setup.optim_func(params, **ctx.setup.optim_args)
    # [communication] Replicate with DDP, or hand model and optimizer to DeepSpeed.
    if communicate and b.deepspeed_stage is not None:
        start_deepspeed(ctx, b.deepspeed_stage)
    elif communicate and b.sharding is None and ctx.dp_size > 1 and pipeline is None and "tensor_parallel" in cfg:
        replicate_tensor_parallel(ctx)  # [tensor_parallel] replicas of DTensor shards: DDP refuses them, see there
    elif communicate and b.sharding is None and ctx.dp_size > 1:
        replicate_stages(ctx) if pipeline is not None else _wrap_ddp(ctx)  # [pipeline] not DDP: see there
    if communicate and "expert_parallel" in cfg:  # [expert_parallel] expert gradients: over their replicas only
        reduce_expert_gradients(ctx)
    # Loss scaling for fp16 autocast (DeepSpeed scales inside its engine).
    if amp is not None and ctx.engine is None and ctx.optimizer is not None:  # no optimizer: nothing to scale for
        ctx.grad_scaler = grad_scaler_for(ctx, amp)
    # [pipeline] The schedule over this rank's (wrapped) stages; train_step runs it.
    if pipeline is not None and communicate:
        build_schedule(ctx, pipeline)


def _optimizer_params(ctx: ModelContext) -> Any:
    if ctx.setup.optim_param_func is None:
        return list(ctx.model.parameters())
    return user_param_groups(ctx.setup.model, ctx.setup.optim_param_func(ctx.setup.model), ctx.model)


def _zero_redundancy(ctx: ModelContext, params: Any) -> torch.optim.Optimizer:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    optimizer = ZeroRedundancyOptimizer(
        params, optimizer_class=ctx.setup.optim_func, process_group=ctx.data_mesh.get_group(), **ctx.setup.optim_args
    )
    logger.info("zero1: optimizer state sharded over %d processes", ctx.dp_size)
    return optimizer


def _wrap_ddp(ctx: ModelContext) -> None:
    from torch.nn.parallel import DistributedDataParallel

    cuda = ctx.env.device.type == "cuda"
    # [expert_parallel] each rank's experts differ: DDP neither broadcasts nor averages them (expert_parallel.py)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(ctx.model, expert_param_names(ctx.model))
    model = DistributedDataParallel(
        ctx.model,
        device_ids=[ctx.env.device.index] if cuda else None,
        process_group=ctx.data_mesh.get_group(),
        find_unused_parameters=ctx.setup.find_unused_parameters,
    )
    ctx.model = model
    # The boundary may be declared before forward or before backward: see atorch/grad_sync.py.
    ctx.gradient_sync = DDPGradientSync(model, ctx.data_mesh.get_group())
    logger.info("data parallel: DDP over %d processes", ctx.dp_size)

