"""zero1: optimizer state sharded across data-parallel ranks.

With a 'tensor' or an 'expert' dimension the parameters are DTensors (tensor-parallel layers, experts split over
the expert ranks), which ZeroRedundancyOptimizer cannot partition (it broadcasts them with plain c10d
collectives). There zero1 runs as FSDP2 over the data dimension (over data × expert ranks next to experts)
without resharding after forward (what zero2 runs: ``runs_on_fsdp2``): the optimizer state is sharded as named,
and the gradients are reduce-scattered to their shards too, which is more than ZeRO-1 shards. The traffic is
Megatron's distributed optimizer's (a reduce-scatter of the gradients, an all-gather of the parameters per step);
the parameters are kept gathered from forward to backward and sharded between steps.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from atorch.log import get_logger
from atorch.opt_lib.base import Categorical, Dimension, Method, MethodConfig, SearchRole
from atorch.opt_lib.cost_facts import Collective, CostFacts
from atorch.opt_lib.deepspeed_zero import (
    UNTRACED_ENGINE,
    ZeroConfig,
    deepspeed_problems,
    deepspeed_searchable,
    runs_on_fsdp2,
    start_deepspeed,
)
from atorch.opt_lib.registry import register

if TYPE_CHECKING:
    from atorch.opt_lib.build_state import Build

logger = get_logger(__name__)


class Zero1Config(ZeroConfig):
    """zero1's options (ATorch's ``{"use_ds_zero": True}`` means implementation "deepspeed")."""

    implementation: Literal["torch", "deepspeed"] = Field(
        default="torch",
        description="torch: ZeroRedundancyOptimizer under DDP; deepspeed: DeepSpeed's ZeRO stage 1 engine",
    )


@register
class Zero1(Method):
    name = "zero1"
    group = "parallel"
    summary = ("ZeRO-1: optimizer state sharded across data-parallel ranks; gradients all-reduced by DDP (with a "
               "tensor or expert dimension: FSDP2 without resharding after forward, which shards the gradients too).")
    # "ddp": none of the sharding methods (parallel_mode alone: plain data parallel)
    search_role = SearchRole("choice", "sharding", position=20, rank=0, off="ddp")
    Config = Zero1Config
    mesh_dims = ("data",)

    def optimizer_need(self, config: MethodConfig) -> str | None:
        return "shards the optimizer's state"

    def keeps_replicas_without_ddp(self, config: MethodConfig) -> bool:
        return getattr(config, "implementation", None) == "deepspeed"  # DeepSpeed's engine, not DDP

    def search_space(self, ctx: Any) -> dict[str, Dimension]:
        implementations = ("torch", "deepspeed") if deepspeed_searchable(ctx.model) else ("torch",)
        return {"implementation": Categorical(implementations)}

    def model_problems(self, ctx: Any, config: Zero1Config) -> list[str]:  # type: ignore[override]
        return deepspeed_problems(ctx, config)

    # ----- cost facts -----
    def cost_facts(self, config: Zero1Config, layout: Any) -> CostFacts:  # type: ignore[override]
        # Optimizer state partitioned; DDP still all-reduces the whole gradients. The updated parameters go back
        # to every rank: ZeroRedundancyOptimizer broadcasts each from its owner, DeepSpeed all-gathers its buckets.
        if config.implementation == "deepspeed":
            return CostFacts(optimizer_state="data", engine="deepspeed", collectives=(Collective("all_gather"),))
        if layout.size("tensor") > 1 or layout.size("expert") > 1:  # runs as zero2 there (runs_on_fsdp2): FSDP2, kept
            # from forward to backward
            from atorch.opt_lib.sharding import ShardingConfig, fsdp2_cost_facts

            return replace(fsdp2_cost_facts(ShardingConfig(), "forward_to_backward"), runs_as="zero2")
        return CostFacts(optimizer_state="data", collectives=(Collective("broadcast", split="tensor"),))

    # ----- behaviour (atorch.apply.apply_strategy) -----------------------------------------------------------
    def apply(self, build: Build, config: Zero1Config) -> None:  # type: ignore[override]
        if runs_on_fsdp2(build.configs):  # [tensor or expert dimension] FSDP2 over the data ranks, as zero2 runs
            from atorch.opt_lib.sharding import shard_over_data, zero1_sharding

            shard_over_data(build, zero1_sharding(), False, self.name)

    def build_optimizer(self, build: Build, config: Zero1Config, params: Any) -> Any:  # type: ignore[override]
        if config.implementation == "deepspeed" or runs_on_fsdp2(build.configs):
            return None  # DeepSpeed's engine shards the user's optimizer (replicate); FSDP2 shards its state
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ctx = build.ctx
        optimizer = ZeroRedundancyOptimizer(params, optimizer_class=ctx.setup.optim_func,
                                            process_group=ctx.data_mesh.get_group(), **ctx.setup.optim_args)
        logger.info("zero1: optimizer state sharded over %d processes", ctx.dp_size)
        return optimizer

    def replicate(self, build: Build, config: Zero1Config) -> bool:  # type: ignore[override]
        if runs_on_fsdp2(build.configs):
            return True  # FSDP2 keeps the shards in step (the apply step)
        if config.implementation != "deepspeed":
            return False  # ZeroRedundancyOptimizer under DDP
        start_deepspeed(build.ctx, 1)  # [communication] model and optimizer handed to DeepSpeed
        return True

    def trace_problem(self, config: Zero1Config, layout: Any) -> str | None:  # type: ignore[override]
        return UNTRACED_ENGINE if config.implementation == "deepspeed" else None
