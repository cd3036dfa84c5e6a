"""compile: the model's forward compiled with ``torch.compile`` (``nn.Module.compile``, in place).

In place, so the model keeps its class, its parameter names and its state dict (``torch.compile(model)`` would
wrap it and prefix every name with ``_orig_mod.``). Nothing is compiled when the strategy is applied: torch
compiles at the model's first call (the first training step, which then takes longer: ~40 s with inductor and a
cold cache on a CPU), and again when input shapes change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from atorch.log import get_logger
from atorch.opt_lib.base import Method, MethodConfig, StrategyCheck
from atorch.opt_lib.registry import register

if TYPE_CHECKING:
    from atorch.opt_lib.build_state import Build

logger = get_logger(__name__)


class CompileConfig(MethodConfig):
    """torch.compile's own arguments."""

    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = Field(
        default=None, description="torch.compile's mode; null: torch's default")
    backend: str = Field(default="inductor", description="torch.compile's backend ('eager' and 'aot_eager' only "
                         "trace: for checks; 'inductor' generates kernels)")


@register
class Compile(Method):
    name = "compile"
    group = "module"
    summary = "torch.compile of the model's forward (nn.Module.compile: in place; compiled at the first call)."
    Config = CompileConfig

    def check(self, config: CompileConfig, check: StrategyCheck) -> list[str]:  # type: ignore[override]
        import torch._dynamo

        known = torch._dynamo.list_backends(exclude_tags=())
        if config.backend not in known:
            return [f"backend {config.backend!r} is not a torch.compile backend here; known: {', '.join(known)}"]
        return []

    # ----- behaviour (atorch.apply.apply_strategy) -----------------------------------------------------------
    def apply(self, build: Build, config: CompileConfig) -> None:  # type: ignore[override]
        build.ctx.model.compile(mode=config.mode, backend=config.backend)
        logger.info("compile: the model's forward is compiled at its first call (backend %s%s)", config.backend,
                    f", mode {config.mode}" if config.mode else "")

    def trace_problem(self, config: MethodConfig, layout: Any) -> str | None:
        return "compiled models are not traced"
