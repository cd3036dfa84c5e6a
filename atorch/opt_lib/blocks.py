"""Finding the repeated blocks of a model (transformer layers, residual blocks), by class, for wrapping."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from torch import nn

from atorch.class_ref import class_path

# Modules that only hold others; a list of these (or of blocks) is where repeated blocks live.
CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _holds_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _repeated_groups(module: nn.Module) -> list[tuple[type, list[nn.Module]]]:
    """The groups of identical-class, parameter-holding children of one module that count as blocks.

    A container whose children are all of one class gives that class (``nn.Sequential(*[Block() ...])``,
    a ModuleList of layers). Other modules give each class that two or more of their children share,
    if those children are themselves composite (a repeated leaf such as two Linear layers of an MLP
    is not a block) and not containers (ResNet's stages are Sequentials of the real blocks).
    """
    children = [c for c in module.children() if _holds_params(c)]
    kinds = Counter(type(c) for c in children)
    # Every entry a parameter-holding module of one class: a list of blocks, with no stray layer.
    uniform = len(kinds) == 1 and len(children) >= 2 and len(children) == len(list(module.children()))
    if isinstance(module, CONTAINERS) and uniform:
        return [(type(children[0]), children)]
    groups = []
    for kind, count in kinds.items():
        if count < 2 or issubclass(kind, CONTAINERS):
            continue
        members = [c for c in children if type(c) is kind]
        if all(next(c.children(), None) is not None for c in members):
            groups.append((kind, members))
    return groups


def outermost(module: nn.Module, wanted: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """The modules under ``module`` (itself included) that ``wanted`` picks and no picked module holds, in
    ``modules()`` order: Mamba declares both its block and the mixer inside it, and a nested pair would be
    checkpointed twice (the mixer recomputed in its block's recompute, then again in its own)."""
    if wanted(module):
        return [module]
    return [found for child in module.children() for found in outermost(child, wanted)]


def block_classes(model: nn.Module) -> tuple[str, ...]:
    """Import paths of the model's repeated block classes.

    Uses transformers' ``_no_split_modules`` when the model declares it (the outermost of those, where one holds
    another); otherwise the class of the
    group of repeated blocks (in any container, or repeated children of a module) holding the most
    parameters.
    """
    declared = getattr(model, "_no_split_modules", None)
    if declared:
        names = set(declared)
        found = {class_path(type(m)) for m in outermost(model, lambda m: type(m).__name__ in names)}
        if found:
            return tuple(sorted(found))
    best: tuple[int, str] | None = None
    for module in model.modules():
        for kind, members in _repeated_groups(module):
            params = sum(p.numel() for m in members for p in m.parameters())
            if best is None or params > best[0]:
                best = (params, class_path(kind))
    return (best[1],) if best else ()
