"""amp_native (autocast + loss scaling) and half (whole model in fp16/bf16)."""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Annotated, Any, Literal

import torch
from pydantic import BeforeValidator, Field, model_validator

from atorch.log import get_logger
from atorch.opt_lib.base import Categorical, Dimension, Method, MethodConfig, SearchRole
from atorch.opt_lib.cost_facts import CostFacts
from atorch.opt_lib.forward_context import run_forward_in
from atorch.opt_lib.registry import register

if TYPE_CHECKING:
    from atorch.opt_lib.build_state import Build

logger = get_logger(__name__)

_DTYPE_ALIASES = {
    torch.float16: "fp16", torch.bfloat16: "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
}
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _dtype_name(value: Any) -> Any:
    try:
        return _DTYPE_ALIASES.get(value, value)
    except TypeError:  # unhashable input; let pydantic report it
        return value


HalfDtype = Annotated[Literal["fp16", "bf16"], BeforeValidator(_dtype_name)]
"""A 16-bit float type, given as "fp16"/"bf16", a torch dtype, or an alias like "bfloat16"."""


class AmpConfig(MethodConfig):
    """ATorch form: ``{"dtype": torch.bfloat16}``, or the bare dtype ``"bf16"`` of ATorch's own example."""

    dtype: HalfDtype = Field(default="fp16", description="autocast dtype; fp16 adds a GradScaler")
    skip_if_nonfinite: bool = Field(
        default=False, description="skip an optimizer step whose gradients hold inf/nan on any rank (fp16 always does)"
    )

    @model_validator(mode="before")
    @classmethod
    def _bare_dtype(cls, value: Any) -> Any:  # ("amp_native", "bf16") in ATorch's example
        return {"dtype": value} if isinstance(value, (str, torch.dtype)) else value


def autocast_forward(ctx: Any, config: AmpConfig) -> None:
    """Run ctx.model's forward under autocast; remember the dtype for sharding's gather dtype."""
    dtype = TORCH_DTYPES[config.dtype]
    ctx.autocast_dtype = dtype
    ctx.skip_if_nonfinite = config.skip_if_nonfinite
    device_type = ctx.env.device.type
    run_forward_in(ctx.model, lambda: torch.autocast(device_type, dtype=dtype), f"autocast({dtype})")
    logger.info("amp_native: autocast %s%s", config.dtype, ", loss scaling" if config.dtype == "fp16" else "")


def grad_scaler_for(ctx: Any, config: AmpConfig) -> Any:
    """fp16 needs loss scaling; a sharded scaler when gradients are shards (agreed inf/nan check)."""
    if config.dtype != "fp16":
        return None
    device = ctx.env.device.type
    if ctx.layout.size("tensor") > 1 or ctx.layout.size("pipeline") > 1:
        import torch.distributed as dist

        # Tensor-parallel gradients are DTensors beside plain ones (what the plan leaves whole), and a pipeline
        # stage holds only its own layers' gradients: each rank checks its own, so every rank of the result
        # must agree on the flag (an overflow on one stage skips the step on all, and the scale stays equal
        # everywhere). dist.group.WORLD is read now: the group this result is built on (a search trial's own).
        return local_shard_grad_scaler()(device=device, process_group=dist.group.WORLD)
    if ctx.sharded_gradients:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        # The data-parallel group, explicitly: the default argument is whatever group was the world
        # when torch was imported, which is not this result's (a search trial's group, a tensor x data mesh).
        group = ctx.data_mesh.get_group() if ctx.replica_size > 1 else None
        return ShardedGradScaler(device=device, process_group=group)
    return torch.amp.GradScaler(device)


@functools.cache
def local_shard_grad_scaler() -> type:
    """A ShardedGradScaler that unscales each gradient's local part (``DTensor.to_local()``, a view), so a
    mix of DTensor and plain gradients, which torch's fused unscale refuses, is checked and unscaled on every
    rank; the inf/nan flag is then summed over its ``process_group`` as ShardedGradScaler does. Made once, on
    first use: torch's FSDP and DTensor modules are imported only then."""
    from collections import defaultdict

    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.distributed.tensor import DTensor

    class LocalShardGradScaler(ShardedGradScaler):
        def _unscale_grads_(self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                            allow_fp16: bool = True) -> dict[torch.device, torch.Tensor]:
            grouped: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
            with torch.no_grad():
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        if param.grad is None:
                            continue
                        local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                        grouped[(local.device, local.dtype)].append(local)
                flags: dict[torch.device, torch.Tensor] = {}
                for (where, _), grads in grouped.items():
                    flag = flags.setdefault(where, found_inf.to(where))
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale.to(where))
            if not flags:  # a rank with no gradient still takes part in the flag's all-reduce
                flags[found_inf.device] = found_inf
            return flags

    return LocalShardGradScaler


@register
class AmpNative(Method):
    name = "amp_native"
    group = "precision"
    summary = "Automatic mixed precision: forward under torch.autocast; GradScaler for fp16."
    # point value "amp_bf16" / "amp_fp16"; "fp32": no precision method (in_family: the layout of memory stays)
    search_role = SearchRole("choice", "precision", position=40, rank=0, value="amp", off="fp32", per_dtype=True,
                             in_family=False)
    Config = AmpConfig
    numerics = "mixed"  # 16-bit compute; fp32 weights and optimizer state

    def search_space(self, ctx: Any) -> dict[str, Dimension]:
        return {"dtype": Categorical(("bf16", "fp16"))}

    def applicable(self, ctx: Any) -> str | None:
        if not torch.amp.is_autocast_available(ctx.env.device.type):
            return f"torch.autocast is not available on device type {ctx.env.device.type!r}"
        return None

    # ----- behaviour (atorch.apply.apply_strategy) -----------------------------------------------------------
    def apply(self, build: Build, config: AmpConfig) -> None:  # type: ignore[override]
        autocast_forward(build.ctx, config)

    def finish(self, build: Build, config: AmpConfig) -> None:  # type: ignore[override]
        # Loss scaling for fp16 (DeepSpeed scales inside its engine; no optimizer: nothing to scale for).
        ctx = build.ctx
        if ctx.engine is None and ctx.optimizer is not None:
            ctx.grad_scaler = grad_scaler_for(ctx, config)

    def compute_dtype(self, config: AmpConfig, dtype: str) -> str:  # type: ignore[override]
        return str(config.dtype)

    def traced_as(self, config: AmpConfig) -> AmpConfig:  # type: ignore[override]
        # the same bytes (16-bit casts and activations, fp32 weights and state); fp16's overflow check reads a value
        return config.model_copy(update={"dtype": "bf16"}) if config.dtype == "fp16" else config

    # ----- cost facts -----
    def cost_facts(self, config: AmpConfig, layout: Any) -> CostFacts:  # type: ignore[override]
        # fp32 weights and state; the forward computes (and saves matmul outputs) in the autocast dtype
        return CostFacts(autocast=True)


FP16_SMALLEST_NORMAL = torch.finfo(torch.float16).tiny


def optimizer_eps(optim_func: Any, optim_args: dict[str, Any]) -> float | None:
    """The eps the optimizer will use: optim_args' value, else the default in its signature."""
    if "eps" in optim_args:
        value = optim_args["eps"]
    else:
        try:
            parameter = inspect.signature(optim_func).parameters.get("eps")
        except (TypeError, ValueError):  # no signature to read (a builtin or C callable)
            return None
        value = None if parameter is None else parameter.default
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class HalfConfig(MethodConfig):
    """ATorch form: ``"bf16"``."""

    dtype: HalfDtype = Field(default="fp16", description="dtype of the whole model and its floating inputs")

    @model_validator(mode="before")
    @classmethod
    def _bare_dtype(cls, value: Any) -> Any:
        return value if isinstance(value, dict) else {"dtype": value}


@register
class Half(Method):
    name = "half"
    group = "precision"
    summary = "Whole model and floating inputs in fp16 or bf16 (no fp32 master weights)."
    search_role = SearchRole("choice", "precision", position=40, rank=1, off="fp32", per_dtype=True, in_family=False)
    Config = HalfConfig
    numerics = "low"  # weights and optimizer state in 16 bits: no fp32 master copy

    def search_space(self, ctx: Any) -> dict[str, Dimension]:
        return {"dtype": Categorical(("bf16", "fp16"))}

    def model_problems(self, ctx: Any, config: HalfConfig) -> list[str]:  # type: ignore[override]
        if config.dtype != "fp16":
            return []
        eps = optimizer_eps(ctx.setup.optim_func, ctx.setup.optim_args)
        if eps is None or eps >= FP16_SMALLEST_NORMAL:
            return []
        # Adam-style optimizers divide by sqrt(v) + eps with v and eps held in the weights' dtype:
        # in fp16 v underflows to 0 for gradients below ~2.4e-4, and an eps under fp16's smallest
        # normal (6.1e-5) is 0 or a few-bit subnormal, so the update is inf/nan or huge
        # (1e-8 and 1e-6 turn every weight of a small MLP NaN within three steps; 1e-5 does not).
        return [
            f"('half', 'fp16') keeps the optimizer state in fp16, where the optimizer's eps={eps:g} "
            f"is below fp16's smallest normal number ({FP16_SMALLEST_NORMAL:.3g}): the first steps turn "
            "the weights inf/NaN. Use ('half', 'bf16'), or ('amp_native', {'dtype': 'fp16'}) (fp32 weights "
            "and optimizer state), or pass optim_args={'eps': 1e-4}"
        ]

    # ----- behaviour (atorch.apply.apply_strategy) -----------------------------------------------------------
    def apply(self, build: Build, config: HalfConfig) -> None:  # type: ignore[override]
        cast_to_half(build.ctx, config)

    def compute_dtype(self, config: HalfConfig, dtype: str) -> str:  # type: ignore[override]
        return str(config.dtype)

    # ----- cost facts -----
    def cost_facts(self, config: HalfConfig, layout: Any) -> CostFacts:  # type: ignore[override]
        # parameters, gradients, optimizer state and activations all in 16 bits
        return CostFacts(storage_bytes=0.5)


def cast_to_half(ctx: Any, config: HalfConfig) -> None:
    """The whole model, and later its floating inputs, in 16 bits."""
    dtype = TORCH_DTYPES[config.dtype]
    ctx.model.to(dtype)
    ctx.input_dtype = dtype
    logger.info("half: model and inputs in %s", config.dtype)
