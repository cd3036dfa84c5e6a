"""module_replace: swap modules for faster or better-supported equivalents, from a registry of pairs.

Built in: transformers' ``Conv1D`` (GPT-2 family) → ``nn.Linear``. Same math, but an nn.Linear is
what tensor parallel styles, fp8 and most kernels expect.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import Field
from torch import nn

from atorch.class_ref import class_path, matches
from atorch.log import get_logger
from atorch.opt_lib.base import Method, MethodConfig, SearchRole
from atorch.opt_lib.registry import register

logger = get_logger(__name__)


@dataclass(frozen=True)
class ReplacePair:
    name: str
    source: str  # import path (or bare name) of the class to replace
    build: Callable[[nn.Module], nn.Module]  # new module from an old one, weights included
    supported_dtypes: tuple[torch.dtype, ...]


_PAIRS: dict[str, ReplacePair] = {}


def register_replace_pair(
    name: str,
    supported_dtypes: tuple[torch.dtype, ...] | None = None,
    pair_cls: tuple[type | str, type] | None = None,
    build: Callable[[nn.Module], nn.Module] | None = None,
) -> None:
    """Register a replacement: modules of ``pair_cls[0]`` become ``pair_cls[1]``.

    The new module is made by ``build(old)`` if given, else by ``pair_cls[1].from_source(old)``.
    supported_dtypes: parameter dtypes the new module handles (default fp32, fp16, bf16).
    """
    if pair_cls is None or len(pair_cls) != 2:
        raise ValueError(f"register_replace_pair({name!r}): pass pair_cls=(SourceClass, TargetClass)")
    source, target = pair_cls
    if build is None:
        build = getattr(target, "from_source", None)
        if build is None:
            raise ValueError(
                f"register_replace_pair({name!r}): {target.__name__} has no from_source(old_module) "
                "classmethod; give build=callable(old_module) -> new_module"
            )
    _PAIRS[name] = ReplacePair(
        name=name,
        source=source if isinstance(source, str) else class_path(source),
        build=build,
        supported_dtypes=tuple(supported_dtypes or (torch.float32, torch.float16, torch.bfloat16)),
    )


def replace_pairs() -> dict[str, ReplacePair]:
    return dict(_PAIRS)


def _conv1d_to_linear(old: nn.Module) -> nn.Module:
    """transformers Conv1D stores weight as (in, out); nn.Linear as (out, in)."""
    in_features, out_features = old.weight.shape
    new = nn.Linear(in_features, out_features, bias=old.bias is not None,
                    device=old.weight.device, dtype=old.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(old.weight.t())
        if old.bias is not None:
            new.bias.copy_(old.bias)
    return new


register_replace_pair(
    "hf_conv1d_to_linear", pair_cls=("transformers.pytorch_utils.Conv1D", nn.Linear), build=_conv1d_to_linear
)


class ModuleReplaceConfig(MethodConfig):
    """Which registered replace pairs to apply."""

    pairs: tuple[str, ...] | None = Field(
        default=None,
        description="names of registered replace pairs to use (null: every pair whose source class is in the model)",
    )


def replace_modules(model: nn.Module, pairs: list[ReplacePair], dtype: torch.dtype | None = None) -> dict[str, int]:
    """Replace in place; returns how many modules each pair replaced. Skips pairs that do not
    support ``dtype`` (the dtype the model will run in)."""
    counts: dict[str, int] = {}
    for pair in pairs:
        if dtype is not None and dtype not in pair.supported_dtypes:
            logger.warning("module_replace: %s skipped, it does not support %s", pair.name, dtype)
            continue
        targets = [(n, m) for n, m in model.named_modules() if n and matches(m, (pair.source,))]
        for name, old in targets:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, pair.build(old))
        counts[pair.name] = len(targets)
    return counts


@register
class ModuleReplace(Method):
    name = "module_replace"
    group = "module"
    summary = "Replace modules by registered equivalents (built in: transformers Conv1D -> nn.Linear)."
    search_role = SearchRole("switch", "module_replace", position=50, off=False, in_family=False)

    def searchable(self, model: Any) -> bool:
        return any(matches(m, (pair.source,)) for pair in replace_pairs().values() for m in model.modules())

    def offered_at(self, partial: dict[str, Any], space: Any) -> bool:
        # tensor parallel on a model with Conv1D swaps it already (SearchSpace.strategy_of): no twin candidates
        return not (space.conv1d and int(partial.get("tensor", 1)) > 1)
    Config = ModuleReplaceConfig

    def check(self, config: ModuleReplaceConfig, check: Any) -> list[str]:  # type: ignore[override]
        unknown = [p for p in config.pairs or () if p not in _PAIRS]
        if unknown:
            return [f"unknown replace pair(s) {unknown}; registered: {sorted(_PAIRS)} (see register_replace_pair)"]
        return []


def replace_registered(ctx: Any, config: ModuleReplaceConfig, dtype: torch.dtype) -> None:
    """Apply the configured replace pairs to ctx.model, which will run in ``dtype``."""
    pairs = [_PAIRS[n] for n in config.pairs] if config.pairs else list(_PAIRS.values())
    counts = replace_modules(ctx.model, pairs, dtype)
    logger.info("module_replace: %s", {k: v for k, v in counts.items() if v} or "nothing to replace")
