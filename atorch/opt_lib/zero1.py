"""zero1: optimizer state sharded across data-parallel ranks (torch ZeroRedundancyOptimizer)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from atorch.log import get_logger
from atorch.opt_lib.base import Categorical, Dimension, Method, MethodConfig
from atorch.opt_lib.deepspeed_zero import DeepSpeedZero
from atorch.opt_lib.registry import register

logger = get_logger(__name__)


class Zero1Config(MethodConfig):
    """zero1's options."""

    use_ds_zero: bool = Field(
        default=False, description="use DeepSpeed ZeRO stage 1 instead of torch's ZeroRedundancyOptimizer"
    )


@register
class Zero1(DeepSpeedZero, Method):
    name = "zero1"
    group = "parallel"
    summary = "ZeRO-1: optimizer state sharded across data-parallel ranks; gradients all-reduced by DDP."
    Config = Zero1Config
    mesh_dims = ("data",)
    ds_stage = 1

    def search_space(self, ctx: Any) -> dict[str, Dimension]:
        return {"use_ds_zero": Categorical((False, True) if self.deepspeed_reason() is None else (False,))}

    def apply(self, ctx: Any, config: Zero1Config) -> None:  # type: ignore[override]
        if config.use_ds_zero:
            self.prepare_deepspeed(ctx)
            return
        from torch.distributed.optim import ZeroRedundancyOptimizer

        def zero_redundancy(params: Any) -> Any:
            return ZeroRedundancyOptimizer(
                params,
                optimizer_class=ctx.setup.optim_func,
                process_group=ctx.dp_mesh().get_group(),
                **ctx.setup.optim_args,
            )

        ctx.optimizer_factory = zero_redundancy
        logger.info("zero1: optimizer state sharded over %d processes", ctx.dp_size)

    def after_build(self, ctx: Any, config: Zero1Config) -> None:  # type: ignore[override]
        if config.use_ds_zero:
            self.start_deepspeed(ctx)
