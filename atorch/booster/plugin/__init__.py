"""Colossal-AI's plugins, each a translation into an atorch strategy (see each class's table)."""

from atorch.booster.plugin.auto import AutoPlugin
from atorch.booster.plugin.base import Plugin
from atorch.booster.plugin.gemini import GeminiPlugin
from atorch.booster.plugin.hybrid_parallel import HybridParallelPlugin
from atorch.booster.plugin.low_level_zero import LowLevelZeroPlugin
from atorch.booster.plugin.torch_ddp import TorchDDPPlugin
from atorch.booster.plugin.torch_fsdp import TorchFSDPPlugin

__all__ = ["AutoPlugin", "GeminiPlugin", "HybridParallelPlugin", "LowLevelZeroPlugin", "Plugin", "TorchDDPPlugin",
           "TorchFSDPPlugin"]
