"""atorch: a strategy-search auto-accelerator for PyTorch training."""

from atorch.accelerate import AccelerateArgs, AccelerateResult, auto_accelerate
from atorch.errors import AtorchError, SetupError, StrategyError
from atorch.opt_lib.module_replace import register_replace_pair
from atorch.strategy import Strategy

__version__ = "0.1.0"

__all__ = [
    "AccelerateArgs", "AccelerateResult", "AtorchError", "SetupError", "Strategy", "StrategyError",
    "auto_accelerate", "register_replace_pair",
]
