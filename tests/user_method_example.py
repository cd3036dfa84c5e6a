"""A method defined outside atorch, as a user writes one: the model's output multiplied by a factor (a forward
hook). tests/test_user_methods.py registers it in one process, tests/workers/user_method_worker.py on 2 ranks."""

from __future__ import annotations

from pydantic import Field

from atorch.opt_lib import Build, Method, MethodConfig


class ScaleConfig(MethodConfig):
    factor: float = Field(default=2.0, description="what the model's output is multiplied by")


class ScaleOutput(Method):
    """A user's method: the model's output multiplied by a factor (a forward hook)."""

    name = "scale_output"
    group = "module"
    summary = "The model's output multiplied by a factor."
    Config = ScaleConfig

    def apply(self, build: Build, config: ScaleConfig) -> None:  # type: ignore[override]
        build.ctx.model.register_forward_hook(lambda module, args, output: output * config.factor)
