"""Colossal-AI's Booster API on atorch's engine: ``Booster`` and ``atorch.booster.plugin``."""

from atorch.booster.booster import Booster
from atorch.booster.wrappers import BoostedModel, BoostedOptimizer

__all__ = ["BoostedModel", "BoostedOptimizer", "Booster"]
