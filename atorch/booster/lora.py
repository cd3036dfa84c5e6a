"""LoRA adapters with peft: added before boosting, saved (gathered whole) as a peft folder after."""

from __future__ import annotations

from typing import Any

from torch import nn

from atorch.errors import SetupError
from atorch.names import unwrapped
from atorch.state_names import state_roots


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise SetupError("LoRA needs the peft package: pip install peft (or atorch[booster])") from None
    return peft


def enable_lora(model: nn.Module, pretrained_dir: str | None = None, lora_config: Any = None) -> nn.Module:
    """The model with LoRA adapters (a peft ``PeftModel``); call before boosting, and boost what it returns.

    ``lora_config`` (a ``peft.LoraConfig``) adds new adapters; ``pretrained_dir`` loads a saved adapter
    (trainable) instead.
    """
    peft = _peft()
    if pretrained_dir is None and lora_config is None:
        raise SetupError("enable_lora needs lora_config (a peft.LoraConfig, e.g. LoraConfig(r=8, "
                         "target_modules=[...])) to add new adapters, or pretrained_dir to load saved ones")
    if unwrapped(model) is not model or hasattr(model, "result") or hasattr(model, "stages"):
        raise SetupError("enable_lora must be called on the plain model before boost (this one is already "
                         "wrapped by a strategy); call it first and boost the model it returns")
    if isinstance(model, peft.PeftModel):
        raise SetupError("the model already has adapters (a PeftModel); enable_lora adds them once")
    if pretrained_dir is not None:
        return peft.PeftModel.from_pretrained(model, pretrained_dir, is_trainable=True)
    if not isinstance(lora_config, peft.PeftConfig):
        raise SetupError(f"lora_config must be a peft config such as peft.LoraConfig, got {type(lora_config).__name__}")
    return peft.get_peft_model(model, lora_config)


def peft_root(model: nn.Module, where: str) -> Any:
    """The PeftModel that holds the adapters on this rank (the model, or under pipeline parallel a stage's copy)."""
    peft = _peft()
    for root in state_roots(model):
        if isinstance(root, peft.PeftModel):
            return root
    from atorch.checkpointing.state_io import CheckpointError

    raise CheckpointError(where, ["the model has no LoRA adapters (not a peft PeftModel); call enable_lora on the "
                                  "model before boosting it"])
