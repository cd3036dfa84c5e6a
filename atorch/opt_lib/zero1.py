"""zero1: optimizer state sharded across data-parallel ranks."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from atorch.opt_lib.base import Categorical, Dimension, Method, SearchRole
from atorch.opt_lib.cost_facts import Collective, CostFacts
from atorch.opt_lib.deepspeed_zero import ZeroConfig, deepspeed_reason
from atorch.opt_lib.registry import register


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
    summary = "ZeRO-1: optimizer state sharded across data-parallel ranks; gradients all-reduced by DDP."
    # "ddp": none of the sharding methods (parallel_mode alone: plain data parallel)
    search_role = SearchRole("choice", "sharding", position=20, rank=0, off="ddp")
    Config = Zero1Config
    mesh_dims = ("data",)

    def search_space(self, ctx: Any) -> dict[str, Dimension]:
        return {"implementation": Categorical(("torch", "deepspeed") if deepspeed_reason() is None else ("torch",))}

    def model_problems(self, ctx: Any, config: Zero1Config) -> list[str]:  # type: ignore[override]
        return deepspeed_problems(ctx, config)

    # ----- cost facts -----
    def cost_facts(self, config: Zero1Config, layout: Any) -> CostFacts:  # type: ignore[override]
        # Optimizer state partitioned; DDP still all-reduces the whole gradients. The updated parameters go back
        # to every rank: ZeroRedundancyOptimizer broadcasts each from its owner, DeepSpeed all-gathers its buckets.
        if config.implementation == "deepspeed":
            return CostFacts(optimizer_state="data", engine="deepspeed", collectives=(Collective("all_gather"),))
        return CostFacts(optimizer_state="data", collectives=(Collective("broadcast", split="tensor"),))


def deepspeed_problems(ctx: Any, config: Any) -> list[str]:
    """What keeps the DeepSpeed implementation from running here."""
    if config.implementation != "deepspeed":
        return []
    reason = deepspeed_reason()
    problems = [f"implementation 'deepspeed': {reason}; or use the default implementation"] if reason else []
    if ctx.layout.data_size != ctx.env.world_size:
        problems.append("implementation 'deepspeed' needs every process data parallel; remove other parallel_mode dims")
    return problems
