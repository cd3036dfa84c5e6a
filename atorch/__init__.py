"""atorch: a strategy-search auto-accelerator for PyTorch training."""

from atorch.accelerate import auto_accelerate
from atorch.build import AccelerateArgs
from atorch.checkpointing.state_io import CheckpointError, export_consolidated, load_checkpoint, save_checkpoint
from atorch.distributed import shutdown
from atorch.errors import AtorchError, NoStrategyFound, SetupError, StrategyError
from atorch.opt_lib.module_replace import register_replace_pair
from atorch.opt_lib.registry import register_method
from atorch.result import AccelerateResult
from atorch.strategy import Strategy
from atorch.training import train_step

__version__ = "0.1.0"


def _register_with_lightning() -> None:
    """``Trainer(strategy="atorch")`` after ``import atorch`` when Lightning is already imported. Lightning (2.3 and
    later) has no hook through which a package can register a strategy name (its only entry-point group, callbacks,
    is read after the strategy name is checked), so a script that imports atorch first imports atorch.lightning."""
    import sys

    if "lightning.pytorch" in sys.modules or "pytorch_lightning" in sys.modules:
        import atorch.lightning  # noqa: F401  (registers "atorch")


_register_with_lightning()

__all__ = [
    "AccelerateArgs", "AccelerateResult", "AtorchError", "CheckpointError", "NoStrategyFound", "SetupError", "Strategy",
    "StrategyError",
    "auto_accelerate", "export_consolidated", "load_checkpoint", "register_method", "register_replace_pair",
    "save_checkpoint",
    "shutdown",
    "train_step",
]
