"""ATorch's ``atorch.auto.accelerate``: the same ``auto_accelerate`` as ``atorch.auto_accelerate``."""

from atorch.accelerate import auto_accelerate

__all__ = ["auto_accelerate"]
