"""Applying a strategy: one function, every method in the registry's order (``registry.apply_order()``).

Each method owns its part (``Method.apply`` and the finishing hooks next to its class); this module only runs them
in order and keeps plain data parallel (DDP) as the default. Transformations of the model (module swaps, casts,
autocast, recompute, sharding wrappers) do not communicate. The steps that do (making the initial weights equal on
every rank, DDP's constructor, DeepSpeed's engine) are marked [communication] where they are, and are left out with
``communicate=False``, so the same function can transform a model made of fake or meta tensors for the cost model.
"""

from __future__ import annotations

import contextlib
from typing import Any

from atorch.grad_sync import DDPGradientSync
from atorch.log import get_logger
from atorch.meta_init import is_meta, materialise
from atorch.model_context import ModelContext
from atorch.names import user_param_groups
from atorch.opt_lib.base import Method
from atorch.opt_lib.build_state import Build
from atorch.opt_lib.expert_parallel import expert_param_names
from atorch.opt_lib.registry import apply_order, get_method
from atorch.strategy import Strategy

logger = get_logger(__name__)


def apply_strategy(ctx: ModelContext, strategy: Strategy, communicate: bool = True, runs_checks: bool = False) -> None:
    """Apply a checked strategy to ``ctx.model`` (a fresh copy) and build the optimizer for it: each method's
    transformation of the model in the registry's order (registry.METHOD_MODULES says why each comes where it
    does), then the optimizer and what wraps model and optimizer (DDP, or a method's own way), loss scaling and the
    pipeline schedule: the finishing hooks, in the reverse order (the method applied last finishes first)."""
    given = {item.name: item.config for item in strategy.methods if item.name not in ctx.skipped}
    configs: dict[str, Any] = {}
    for name, config in given.items():  # [mixed_parallel] its tensor_parallel and pipeline_parallel
        configs.update(get_method(name).stands_for(config, given))
    ctx.strategy = strategy
    build = Build(ctx, configs, communicate, runs_checks=runs_checks)
    steps = [(name, get_method(name)) for name in apply_order() if name in configs]

    # A model built on the meta device is materialised and initialised identically on every rank, here as a
    # whole before any step, or under FSDP2 one unit at a time as it is sharded (meta_init.py).
    if not any(method.shards_data(configs[name]) for name, method in steps) and is_meta(ctx.model):
        materialise(ctx.model, ctx.env.device)
    for name, method in steps:
        try:
            if method.apply(build, configs[name]):  # the build ended there (DeepSpeed's pipeline engine)
                return
        except Exception as exc:
            # which method's step failed: a dry-run names it, and the search rules that method out at this layout
            # (its other settings cannot help a transformation that refuses the model)
            with contextlib.suppress(AttributeError):
                exc.atorch_method = name  # type: ignore[attr-defined]
            raise
    _finish(build, [(method, configs[name]) for name, method in reversed(steps)])


def _finish(b: Build, methods: list[tuple[Method, Any]]) -> None:
    """The optimizer over the parameters the model now trains, then what wraps model and optimizer."""
    ctx = b.ctx
    params = _optimizer_params(ctx)  # the user's groups, by name
    ctx.optimizer = None  # ATorch's optim_func=None: no optimizer (atorch/no_optimizer.py)
    if ctx.setup.optim_func is not None:
        built = (method.build_optimizer(b, config, params) for method, config in methods)
        ctx.optimizer = next((o for o in built if o is not None), None)
        if ctx.optimizer is None:
            ctx.optimizer = ctx.setup.optim_func(params, **ctx.setup.optim_args)
    # [communication] The replicas kept in step: by a method's own way (FSDP2, DeepSpeed, ...), else by DDP.
    if b.communicate and not any(method.replicate(b, config) for method, config in methods) and ctx.replica_size > 1:
        _wrap_ddp(ctx)
    for method, config in methods:
        method.finish(b, config)


def _optimizer_params(ctx: ModelContext) -> Any:
    if ctx.setup.optim_param_func is None:
        return list(ctx.model.parameters())
    return user_param_groups(ctx.setup.model, ctx.setup.optim_param_func(ctx.setup.model), ctx.model)


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
    logger.info("data parallel: DDP over %d processes", ctx.replica_size)
