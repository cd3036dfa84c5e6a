"""Finding the repeated blocks of a model (transformer layers), by class, for wrapping."""

from __future__ import annotations

from collections import Counter

from torch import nn

from atorch.class_ref import class_path


def block_classes(model: nn.Module) -> tuple[str, ...]:
    """Import paths of the model's repeated block classes.

    Uses transformers' ``_no_split_modules`` when the model declares it; otherwise the class that
    fills the largest ``nn.ModuleList`` of identical, parameter-holding modules.
    """
    declared = getattr(model, "_no_split_modules", None)
    if declared:
        names = set(declared)
        found = {class_path(type(m)) for m in model.modules() if type(m).__name__ in names}
        if found:
            return tuple(sorted(found))
    best: tuple[int, str] | None = None
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        kinds = Counter(type(child) for child in module)
        if len(kinds) != 1:
            continue
        kind = next(iter(kinds))
        params = sum(p.numel() for p in module.parameters())
        if params and (best is None or params > best[0]):
            best = (params, class_path(kind))
    return (best[1],) if best else ()
