"""Applying a strategy: one function, every method in one fixed order.

Transformations of the model (module swaps, casts, autocast, recompute, sharding wrappers) do not
communicate. The steps that do (making the initial weights equal on every rank, DDP's constructor,
DeepSpeed's engine) are named below and are left out with ``communicate=False``, so the same
function can transform a model made of fake or meta tensors for the cost model.
"""

from __future__ import annotations

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
from atorch.opt_lib.fp8 import use_fp8_linears
from atorch.opt_lib.mixed_parallel import expand_mixed
from atorch.opt_lib.module_replace import replace_registered
from atorch.opt_lib.pipeline_parallel import build_schedule, replicate_stages, shard_stages, split_into_stages
from atorch.opt_lib.precision import TORCH_DTYPES, autocast_forward, cast_to_half, grad_scaler_for
from atorch.opt_lib.sharding import broadcast_from_first, shard_model
from atorch.opt_lib.tensor_data_parallel import replicate_tensor_parallel
from atorch.opt_lib.tensor_parallel import parallelize
from atorch.strategy import Strategy

logger = get_logger(__name__)


def apply_strategy(ctx: ModelContext, strategy: Strategy, communicate: bool = True) -> None:
    """Apply a checked strategy to ``ctx.model`` (a fresh copy) and build the optimizer for it."""
    cfg = {item.name: item.config for item in strategy.methods if item.name not in ctx.skipped}
    cfg = expand_mixed(cfg)  # [mixed_parallel] its tensor_parallel and pipeline_parallel, on their dimensions
    ctx.strategy = strategy
    half, amp = cfg.get("half"), cfg.get("amp_native")
    zero1, zero2, fsdp = cfg.get("zero1"), cfg.get("zero2"), cfg.get("fsdp")
    deepspeed_stage = next(
        (stage for stage, c in ((1, zero1), (2, zero2)) if c is not None and c.implementation == "deepspeed"), None
    )
    sharding = fsdp if fsdp is not None else zero2 if deepspeed_stage is None else None

    # 0. A model built on the meta device is materialised and initialised identically on every rank,
    #    here as a whole, or under FSDP2 one unit at a time as it is sharded (meta_init.py).
    if sharding is None and is_meta(ctx.model):
        materialise(ctx.model, ctx.env.device)
    # 1. Module swaps first: every later step sees the replaced modules (Conv1D -> Linear, ...).
    if "module_replace" in cfg:
        dtype = TORCH_DTYPES[half.dtype] if half is not None else next(ctx.model.parameters()).dtype
        replace_registered(ctx, cfg["module_replace"], dtype)
    # 1a. [ds_3d_parallel] DeepSpeed's pipeline engine takes model and optimizer from here (ds_3d_parallel.py).
    if "ds_3d_parallel" in cfg and communicate:
        return start_ds_pipeline(ctx, cfg["ds_3d_parallel"])
    # 1b. [pipeline] This rank's stages replace the model: every later step sees only them. [communication,
    #     with communicate=True] tied weights across stages start equal.
    pipeline = cfg.get("pipeline_parallel")
    if pipeline is not None:
        split_into_stages(ctx, pipeline, communicate)
    # 2. Whole-model dtype before anything captures parameters or their dtype.
    if half is not None:
        cast_to_half(ctx, half)
    # 3. fp8 layers, then autocast around the whole forward (fp8's context runs inside autocast's).
    if "fp8" in cfg:
        use_fp8_linears(ctx, cfg["fp8"])
    if amp is not None:
        autocast_forward(ctx, amp)
    # 4a. Tensor parallel splits the plain layers (DTensor) before recompute wraps the blocks and before
    #     FSDP2 shards over the data dimension (2-D: FSDP2 takes DTensor parameters). [communication, with
    #     communicate=True] the tensor group first takes its first rank's weights.
    if "tensor_parallel" in cfg:
        parallelize(ctx, cfg["tensor_parallel"], communicate)
    # 4b. Activation recompute wraps the plain blocks, so it ends up inside any sharding unit.
    if "checkpoint" in cfg:
        checkpoint_blocks(ctx, cfg["checkpoint"])
    # 5. [communication] Every data-parallel rank starts from rank 0's weights. DDP does this in its
    #    constructor and DeepSpeed in its engine; FSDP2 does not, so it happens here.
    #    A model on the meta device is initialised identically on every rank instead (meta_init.py).
    if communicate and sharding is not None and sharding.sync_module_states and ctx.dp_size > 1 \
            and not is_meta(ctx.model):
        broadcast_from_first(ctx.model, ctx.data_mesh)
    # 6. Data parallel: shard (fsdp, zero2) ...
    if sharding is not None and pipeline is not None:  # [pipeline] each stage its own FSDP2 root
        shard_stages(ctx, shard_model, sharding, reshard_after_forward=fsdp is not None and fsdp.reshard_after_forward,
                     label="fsdp" if fsdp is not None else "zero2")
    elif sharding is not None:
        shard_model(ctx, sharding, reshard_after_forward=fsdp is not None and fsdp.reshard_after_forward,
                    label="fsdp" if fsdp is not None else "zero2")
    # 7. ... the optimizer over the parameters the model now trains (the user's groups, by name) ...
    params = _optimizer_params(ctx)
    if ctx.setup.optim_func is None:  # ATorch's optim_func=None: no optimizer (atorch/no_optimizer.py)
        ctx.optimizer = None
    elif zero1 is not None and deepspeed_stage is None:
        ctx.optimizer = _zero_redundancy(ctx, params)
    else:
        ctx.optimizer = ctx.setup.optim_func(params, **ctx.setup.optim_args)
    # 8. ... or [communication] replicate with DDP, or hand model and optimizer to DeepSpeed.
    if communicate and deepspeed_stage is not None:
        start_deepspeed(ctx, deepspeed_stage)
    elif communicate and sharding is None and ctx.dp_size > 1 and pipeline is None and "tensor_parallel" in cfg:
        replicate_tensor_parallel(ctx)  # [tensor_parallel] replicas of DTensor shards: DDP refuses them, see there
    elif communicate and sharding is None and ctx.dp_size > 1:
        replicate_stages(ctx) if pipeline is not None else _wrap_ddp(ctx)  # [pipeline] not DDP: see there
    # 9. Loss scaling for fp16 autocast (DeepSpeed scales inside its engine).
    if amp is not None and ctx.engine is None and ctx.optimizer is not None:  # no optimizer: nothing to scale for
        ctx.grad_scaler = grad_scaler_for(ctx, amp)
    # 10. [pipeline] The schedule over this rank's (wrapped) stages; train_step runs it.
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

