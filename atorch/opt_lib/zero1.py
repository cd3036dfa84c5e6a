"""zero1: optimizer state sharded across data-parallel ranks.

With a 'tensor' dimension the parameters are tensor-parallel DTensors, which ZeroRedundancyOptimizer cannot
partition (it broadcasts them with plain c10d collectives). There zero1 runs as FSDP2 over the data dimension
without resharding after forward (what zero2 runs: ``runs_on_fsdp2``): the optimizer state is sharded as named,
and the gradients are reduce-scattered to their shards too, which is more than ZeRO-1 shards. The traffic is
Megatron's distributed optimizer's (a reduce-scatter of the gradients, an all-gather of the parameters per step);
the parameters are kept gathered from forward to backward and sharded between steps.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from atorch.opt_lib.base import Categorical, Dimension, Method, SearchRole
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
    summary = ("ZeRO-1: optimizer state sharded across data-parallel ranks; gradients all-reduced by DDP (with a "
               "tensor dimension: FSDP2 without resharding after forward, which shards the gradients too).")
    # "ddp": none of the sharding methods (parallel_mode alone: plain data parallel)
    search_role = SearchRole("choice", "sharding", position=20, rank=0, off="ddp")
    Config = Zero1Config
    mesh_dims = ("data",)

    def search_space(self, ctx: Any) -> dict[str, Dimension]:
        return {"implementation": Categorical(("torch", "deepspeed") if deepspeed_reason() is None else ("torch",))}

    def model_problems(self, ctx: Any, config: Zero1Config) -> list[str]:  # type: ignore[override]
        return deepspeed_problems(ctx, config)


def deepspeed_problems(ctx: Any, config: Any) -> list[str]:
    """What keeps the DeepSpeed implementation from running here."""
    if config.implementation != "deepspeed":
        return []
    reason = deepspeed_reason()
    problems = [f"implementation 'deepspeed': {reason}; or use the default implementation"] if reason else []
    if ctx.layout.data_size != ctx.env.world_size:
        problems.append("implementation 'deepspeed' needs every process data parallel; remove other parallel_mode dims")
    return problems


def runs_on_fsdp2(configs: Any) -> bool:
    """True where zero1 (torch implementation) runs as FSDP2 over the data dimension, as zero2 does: with a 'tensor'
    dimension, whose DTensor parameters ZeroRedundancyOptimizer cannot partition. ``configs``: a Strategy or the
    method configs by name."""
    zero1, mode = configs.get("zero1"), configs.get("parallel_mode")
    return (zero1 is not None and zero1.implementation == "torch" and mode is not None
            and "tensor" in dict(mode.dims))

