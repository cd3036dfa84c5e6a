"""``Booster(mixed_precision=...)``: Colossal-AI's precision names onto atorch's precision methods."""

from __future__ import annotations

from typing import Any

from atorch.errors import SetupError
from atorch.opt_lib.fp8 import FP8
from atorch.opt_lib.precision import AmpNative

# name -> the methods added to the plugin's strategy
MIXED_PRECISION: dict[str, list[Any]] = {
    "fp16": [(AmpNative.name, {"dtype": "fp16"})],  # autocast + GradScaler (loss scaling in booster.backward)
    "bf16": [(AmpNative.name, {"dtype": "bf16"})],
    "fp8": [FP8.name],  # Transformer Engine fp8 linears; skipped with the reason (booster.skipped) where unsupported
}


def mixed_precision_methods(mixed_precision: Any) -> list[Any]:
    if mixed_precision is None:
        return []
    if not isinstance(mixed_precision, str) or mixed_precision not in MIXED_PRECISION:
        raise SetupError(f"mixed_precision={mixed_precision!r} is not supported; accepted: "
                         f"{', '.join(map(repr, MIXED_PRECISION))} (or None for fp32)")
    return list(MIXED_PRECISION[mixed_precision])
