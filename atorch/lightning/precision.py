"""Lightning's precision flags as atorch precision methods, and the precision plugin that routes
backward, step and clipping through atorch's optimizer.

Lightning hands a strategy resolved by name its generic plugin (``MixedPrecision`` with a GradScaler
for "16-mixed"); kept, it would scale the loss a second time on top of atorch's scaler. So the flag is
read from the plugin it gives and the plugin is replaced: atorch's method does the work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from atorch.errors import SetupError
from atorch.opt_lib.precision import AmpNative, Half

# Lightning flag -> atorch method (None: fp32, nothing to add).
FLAG_TO_METHOD: dict[str, tuple[str, Any] | None] = {
    "32-true": None,
    "bf16-mixed": (AmpNative.name, {"dtype": "bf16"}),
    "16-mixed": (AmpNative.name, {"dtype": "fp16"}),
    "bf16-true": (Half.name, {"dtype": "bf16"}),
    "16-true": (Half.name, {"dtype": "fp16"}),
}


def flag_of(plugin: Any) -> str:
    """The precision flag a Lightning plugin stands for; refuses flags atorch has no method for."""
    flag = str(getattr(plugin, "precision", "32-true"))
    known_classes = {"Precision", "MixedPrecision", "HalfPrecision", "ATorchPrecision"}
    if type(plugin).__name__ not in known_classes or flag not in FLAG_TO_METHOD:
        raise SetupError(
            f"ATorchStrategy does not support precision {flag!r} ({type(plugin).__name__}); use one of "
            f"{', '.join(repr(f) for f in FLAG_TO_METHOD)} (Trainer(precision=...)), or put atorch's precision "
            "methods (amp_native, half, fp8) in load_strategy with precision='32-true'"
        )
    return flag


def _engine_optimizer(optimizer: Any, fallback: Callable[[], Any]) -> Any:
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the real one
    return optimizer if hasattr(optimizer, "clip_grad_norm_") else fallback()


class PrecisionMixin:
    """Shared body of the per-namespace ``ATorchPrecision(Precision)`` classes."""

    def __init__(self, flag: str, strategy: Any) -> None:
        super().__init__()
        self.precision = flag
        self._strategy = strategy  # the engine (its optimizer and input dtype) is built in setup

    def _optimizer(self, optimizer: Any = None) -> Any:
        return _engine_optimizer(optimizer, lambda: self._strategy.engine.optimizer)

    def convert_input(self, data: Any) -> Any:
        engine = self._strategy.engine
        dtype = engine.input_dtype if engine is not None else None
        return data if dtype is None else _cast(data, dtype)

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        # atorch's optimizer scales (fp16) or hands the loss to DeepSpeed's engine.
        self._optimizer(optimizer).backward(tensor)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        closure_result = closure()
        self._after_closure(model, optimizer)  # on_before_optimizer_step, then gradient clipping
        if closure_result is None and getattr(model, "automatic_optimization", True):
            return None  # training_step returned None: no backward ran, nothing to step
        return self._optimizer(optimizer).step(**kwargs)

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        self._optimizer(optimizer).clip_grad_norm_(float(clip_val))  # the global, unscaled norm over shards

    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        self._optimizer(optimizer).clip_grad_value_(float(clip_val))

    def state_dict(self) -> dict[str, Any]:
        return {}  # atorch's checkpoint holds the grad scaler


def _cast(data: Any, dtype: torch.dtype) -> Any:
    """Floating tensors of a batch in ``dtype`` (for 'half'), on the device they are on."""
    if isinstance(data, torch.Tensor):
        return data.to(dtype) if data.is_floating_point() else data
    if isinstance(data, dict):
        return type(data)((k, _cast(v, dtype)) for k, v in data.items())
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_cast(v, dtype) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_cast(v, dtype) for v in data)
    return data
