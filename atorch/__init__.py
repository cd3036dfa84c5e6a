"""atorch: a strategy-search auto-accelerator for PyTorch training."""

from atorch.accelerate import auto_accelerate
from atorch.build import AccelerateArgs, AccelerateResult
from atorch.checkpoint import CheckpointError, export_consolidated, load_checkpoint, save_checkpoint
from atorch.errors import AtorchError, SetupError, StrategyError
from atorch.opt_lib.module_replace import register_replace_pair
from atorch.strategy import Strategy
from atorch.training import train_step

__version__ = "0.1.0"

__all__ = [
    "AccelerateArgs", "AccelerateResult", "AtorchError", "CheckpointError", "SetupError", "Strategy", "StrategyError",
    "auto_accelerate", "export_consolidated", "load_checkpoint", "register_replace_pair", "save_checkpoint",
    "train_step",
]
