"""A model's configured random layer skipping ("LayerDrop") and the methods it cannot run under.

transformers' speech encoders (Wav2Vec2, HuBERT, WavLM: ``layerdrop`` 0.1 by default) and its encoder-decoders
(``encoder_layerdrop``, ``decoder_layerdrop``) skip whole layers at random in training, each process drawing its
own. Under DDP a skipped layer's parameters get no gradient (``input_checks.unused_parameter_problems``); under a
method that communicates inside the layers, a process that skips a layer the others run leaves them waiting in
that layer's collective (gloo aborts the job on the mismatch: seen with Wav2Vec2 under tensor parallel).
"""

from __future__ import annotations

from torch import nn


def layer_drop_settings(model: nn.Module) -> list[tuple[str, float]]:
    """The model's layer-drop settings above 0 as ``(where, value)``: ``model.config.layerdrop``, or the
    submodule's path for a config that a submodule holds."""
    found: list[tuple[str, float]] = []
    seen: set[int] = set()
    for path, module in model.named_modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        for key, value in sorted(getattr(config, "__dict__", {}).items()):
            if key.endswith("layerdrop") and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and value > 0:
                found.append((f"model.{path + '.' if path else ''}config.{key}", float(value)))
    return found


def shown(dropped: list[tuple[str, float]]) -> str:
    """``layer_drop_settings``' findings as one phrase: "model.config.layerdrop = 0.1"."""
    return ", ".join(f"{where} = {value:g}" for where, value in dropped)


def layer_drop_problems(model: nn.Module, communicates: str) -> list[str]:
    """Why a method that communicates inside the layers (``communicates``: what it exchanges there) cannot train
    ``model``: [] unless the model skips layers at random."""
    dropped = layer_drop_settings(model)
    if not dropped:
        return []
    return [f"{shown(dropped)} skips whole layers at random in training, each process drawing its own, and "
            f"{communicates}: a process that skips a layer the others run leaves them waiting in that layer's "
            f"collective (gloo aborts the job); set {dropped[0][0]} = 0, or train with parallel_mode or zero1 and "
            "find_unused_parameters=True"]
