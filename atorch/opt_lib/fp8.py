"""fp8: Transformer Engine fp8 Linear layers, only where the hardware and package allow it."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field
from torch import nn

from atorch.log import get_logger
from atorch.opt_lib.base import Method, MethodConfig
from atorch.opt_lib.forward_context import run_forward_in
from atorch.opt_lib.registry import register

if TYPE_CHECKING:
    from atorch.opt_lib.build_state import Build

logger = get_logger(__name__)

FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer have fp8 tensor cores
FP8_DIM_MULTIPLE = 16  # fp8 GEMMs need both weight dimensions divisible by 16


class FP8Config(MethodConfig):
    """ATorch's fp8 config: which nn.Linear layers, and Transformer Engine's DelayedScaling recipe."""

    include: tuple[str, ...] | None = Field(
        default=None, description="only nn.Linear layers whose name contains one of these substrings (null: all)"
    )
    exclude: tuple[str, ...] | None = Field(
        default=None, description="leave out nn.Linear layers whose name contains one of these substrings"
    )
    margin: int = Field(default=0, ge=0, description="DelayedScaling margin: scale factor headroom as a power of 2")
    interval: int = Field(
        default=1, ge=1, description="steps between scale updates (older Transformer Engine releases only)"
    )
    fp8_format: Literal["HYBRID", "E4M3"] = Field(
        default="HYBRID", description="HYBRID: E4M3 forward, E5M2 backward; E4M3: both"
    )
    amax_history_len: int = Field(default=1024, ge=1, description="length of the amax history window")
    amax_compute_algo: Literal["max", "most_recent"] = Field(
        default="max", description="how the scale is taken from the amax history"
    )
    reduce_amax: bool = Field(
        default=True, description="all-reduce the amax over the ranks before the scale update (DelayedScaling's)"
    )
    verbose: bool = Field(default=False, description="log the name of every nn.Linear replaced by te.Linear")


def fp8_linear_names(
    model: nn.Module, include: tuple[str, ...] | None = None, exclude: tuple[str, ...] | None = None
) -> list[str]:
    """Names of the nn.Linear modules that fp8 would replace.

    A layer qualifies if its name contains one of ``include`` (when given), none of ``exclude``,
    and both weight dimensions are multiples of 16.
    """
    names = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        if include and not any(s in name for s in include):
            continue
        if exclude and any(s in name for s in exclude):
            continue
        out_features, in_features = module.weight.shape
        if out_features % FP8_DIM_MULTIPLE or in_features % FP8_DIM_MULTIPLE:
            continue
        names.append(name)
    return names


def fp8_unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return "fp8 needs a CUDA GPU with compute capability >= 8.9; this process runs on " + device.type
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        return f"fp8 needs compute capability >= 8.9, this GPU has {capability[0]}.{capability[1]}"
    if importlib.util.find_spec("transformer_engine") is None:
        return "transformer_engine is not installed (pip install 'atorch[fp8]')"
    return None


@register
class FP8(Method):
    name = "fp8"
    group = "precision"
    summary = "fp8 matmuls through Transformer Engine (CUDA sm >= 8.9 only; skipped with a reason elsewhere)."
    Config = FP8Config
    skip_when_inapplicable = True
    numerics = "mixed"  # fp8 matmuls; Transformer Engine keeps fp32 master weights

    def applicable(self, ctx: Any) -> str | None:
        return fp8_unavailable_reason(ctx.env.device)

    # ----- behaviour (atorch.apply.apply_strategy) -----------------------------------------------------------
    def apply(self, build: Build, config: FP8Config) -> None:  # type: ignore[override]
        use_fp8_linears(build.ctx, config)

    def compute_dtype(self, config: MethodConfig, dtype: str) -> str:
        # the matmuls outside the fp8 layers: in bf16 unless a cast or autocast says otherwise
        return "bf16" if dtype == "fp32" else dtype

    def trace_problem(self, config: MethodConfig, layout: Any) -> str | None:
        return "fp8 layers are not traced"


def use_fp8_linears(ctx: Any, config: FP8Config) -> None:
    """Swap the chosen nn.Linear layers for Transformer Engine's and run forward under fp8 autocast."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    names = fp8_linear_names(ctx.model, config.include, config.exclude)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = ctx.model.get_submodule(parent_name) if parent_name else ctx.model
        old: nn.Linear = getattr(parent, child)
        new = te.Linear(
            old.in_features, old.out_features, bias=old.bias is not None,
            params_dtype=old.weight.dtype, device=old.weight.device,
        )
        with torch.no_grad():
            new.weight.copy_(old.weight)
            if old.bias is not None:
                new.bias.copy_(old.bias)
        setattr(parent, child, new)
    options: dict[str, Any] = dict(
        margin=config.margin, fp8_format=Format[config.fp8_format],
        amax_history_len=config.amax_history_len, amax_compute_algo=config.amax_compute_algo,
    )
    recipe_fields = getattr(DelayedScaling, "__dataclass_fields__", {})
    if "interval" in recipe_fields:  # removed in newer TE
        options["interval"] = config.interval
    if "reduce_amax" in recipe_fields:
        options["reduce_amax"] = config.reduce_amax
    recipe = DelayedScaling(**options)
    run_forward_in(ctx.model, lambda: te.fp8_autocast(enabled=True, fp8_recipe=recipe), "fp8_autocast")
    logger.info("fp8: %d Linear layers use Transformer Engine%s", len(names),
                f": {', '.join(names)}" if config.verbose else "")
