"""ATorch's ``atorch.auto.strategy``: the same ``Strategy`` as ``atorch.Strategy``."""

from atorch.strategy import Strategy

__all__ = ["Strategy"]
