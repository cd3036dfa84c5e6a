"""ATorch's import paths, kept so that ported code runs unchanged: ``from atorch.auto import auto_accelerate``.

Each module under ``atorch.auto`` re-exports the documented names from where they live in atorch.
"""

from atorch.accelerate import auto_accelerate
from atorch.strategy import Strategy

__all__ = ["Strategy", "auto_accelerate"]
