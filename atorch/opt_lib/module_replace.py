"""module_replace: swap modules for faster or better-supported equivalents, from a registry of pairs.

Built in (replace_builtins.py):
- ``hf_attention_sdpa``: transformers models built with eager attention switched to torch's
  ``scaled_dot_product_attention`` (transformers' ``set_attn_implementation``; any family that supports sdpa).
- ``rms_norm_fused``: RMSNorm modules whose forward is torch's ``rms_norm`` become ``nn.RMSNorm``.
- ``hf_conv1d_to_linear``: transformers' ``Conv1D`` (GPT-2 family) → ``nn.Linear``. Same math, but an nn.Linear
  is what tensor parallel styles, fp8 and most kernels expect.

Users add class pairs with ``register_replace_pair``, in atorch's form or ATorch's (``kwargs``,
decorator mode). A pair that finds nothing to replace says so in the log, with the reason.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field, model_validator
from torch import nn

from atorch.class_ref import class_path, matches
from atorch.log import get_logger
from atorch.opt_lib.base import Method, MethodConfig, SearchRole
from atorch.opt_lib.precision import Half
from atorch.opt_lib.registry import register
from atorch.opt_lib.replace_builtins import (
    Replaced,
    conv1d_to_linear,
    holds_eager_attention,
    holds_replaceable_rms_norm,
    rms_norms_to_torch,
    switch_to_sdpa,
)

if TYPE_CHECKING:
    from atorch.opt_lib.build_state import Build

logger = get_logger(__name__)

ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class ReplacePair:
    name: str
    source: str  # import path (or bare name) of the class to replace; for a model-wide pair, what it replaces
    build: Callable[[nn.Module], nn.Module] | None  # new module from an old one, weights included
    supported_dtypes: tuple[torch.dtype, ...]
    # A model-wide pair (not one class for another): changes the model in place, says what it did.
    replace_all: Callable[[nn.Module], Replaced] | None = None
    applies_to: Callable[[nn.Module], bool] | None = None  # whether the model holds anything it would change

    def apply(self, model: nn.Module) -> Replaced:
        if self.replace_all is not None:
            return self.replace_all(model)
        assert self.build is not None
        targets = [(n, m) for n, m in model.named_modules() if n and matches(m, (self.source,))]
        for name, old in targets:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, self.build(old))
        return Replaced(len(targets), None if targets else f"no {self.source} module in the model")

    def found_in(self, model: nn.Module) -> bool:
        if self.applies_to is not None:
            return self.applies_to(model)
        return any(matches(m, (self.source,)) for m in model.modules())


_PAIRS: dict[str, ReplacePair] = {}

# ATorch's built-in pair names and what they are here (None: nothing to do, for the reason given).
ATORCH_PAIRS: dict[str, tuple[str | None, str]] = {
    **{f"HF_{family}Attention_FA": ("hf_attention_sdpa", "torch's scaled_dot_product_attention through "
                                    "transformers (flash / memory-efficient kernels where the device has them)")
       for family in ("Bert", "CLIP", "GPT2", "Llama")},
    "LayerNorm_Apex": (None, "torch's nn.LayerNorm is a fused kernel already"),
    "MultiheadAttention_FA": (None, "torch's nn.MultiheadAttention calls scaled_dot_product_attention itself "
                                    "when need_weights=False"),
}
_ATORCH_KWARGS = {"need_src_module", "init_from_attr", "config"}


def _init_params(cls: type) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(cls).parameters)


def _takes(cls: type, arg: str) -> bool:
    params = _init_params(cls)
    return arg in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _from_attrs(target: type, old: nn.Module) -> nn.Module:
    """ATorch's ``init_from_attr``: the target's constructor arguments read from the old module's attributes
    (those it lacks keep their defaults), then the old module's state dict loaded."""
    args: dict[str, Any] = {}
    for arg, param in _init_params(target).items():
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if hasattr(old, arg):
            args[arg] = getattr(old, arg)
        elif param.default is inspect.Parameter.empty:
            raise ValueError(f"module_replace: {target.__name__}'s argument {arg!r} is not an attribute of "
                             f"{type(old).__name__} (init_from_attr); register the pair with build=")
    new = target(**args)
    new.load_state_dict(old.state_dict())
    return new


def _atorch_builder(pair_name: str, target: type, kwargs: dict[str, Any]) -> Callable[[nn.Module], nn.Module]:
    """The build function ATorch's ``replace_module(**kwargs)`` amounts to."""
    unknown = set(kwargs) - _ATORCH_KWARGS
    if unknown:
        raise ValueError(f"register_replace_pair({pair_name!r}): unknown kwargs {sorted(unknown)}; "
                         f"ATorch's replace_module takes {sorted(_ATORCH_KWARGS)}")
    extra = {"config": kwargs["config"]} if kwargs.get("config") is not None else {}
    if kwargs.get("init_from_attr"):
        return lambda old: _from_attrs(target, old)
    if kwargs.get("need_src_module"):
        if not _takes(target, "src_module"):
            raise ValueError(f"register_replace_pair({pair_name!r}): need_src_module, but {target.__name__}() "
                             "takes no src_module argument")
        return lambda old: target(src_module=old, **extra)
    return lambda old: target(**extra)  # ATorch: a new module, its own initial weights


def _placed_like(build: Callable[[nn.Module], nn.Module]) -> Callable[[nn.Module], nn.Module]:
    """The new module on the old one's device and in its floating dtype (ATorch moves it after the swap)."""
    def placed(old: nn.Module) -> nn.Module:
        new = build(old)
        ref = next(old.parameters(), None)
        if ref is not None and not ref.is_meta:
            new = new.to(device=ref.device, dtype=ref.dtype if ref.is_floating_point() else None)
        return new

    return placed


def register_replace_pair(
    pair_name: str,
    kwargs: dict[str, Any] | None = None,
    supported_dtypes: Iterable[torch.dtype] | None = None,
    pair_cls: tuple[type | str, type] | None = None,
    *,
    build: Callable[[nn.Module], nn.Module] | None = None,
) -> Callable[[type], type] | None:
    """Register a replacement: modules of ``pair_cls[0]`` become ``pair_cls[1]``. ATorch's signature.

    The new module is made by ``build(old)`` if given; else as ATorch's ``kwargs`` say
    (``{"need_src_module": True}``: ``Target(src_module=old)``; ``{"init_from_attr": True}``: the target's
    constructor arguments read from the old module, then its state dict loaded; ``"config"``: passed on);
    else by ``Target.from_source(old)``; else by ``Target(src_module=old)`` (ATorch's default).
    supported_dtypes: parameter dtypes the new module handles (default fp32, fp16, bf16).
    Without ``pair_cls`` and ``build`` it is ATorch's decorator: the decorated class replaces its
    ``_src_module_cls``, or else its base class.
    """
    dtypes = tuple(supported_dtypes or ALL_DTYPES)
    if pair_cls is None and build is None:
        def decorator(cls: type) -> type:
            source = getattr(cls, "_src_module_cls", None) or cls.__base__
            if source in (nn.Module, object):
                raise ValueError(f"register_replace_pair({pair_name!r}): {cls.__name__} names no class to "
                                 "replace; give it a _src_module_cls attribute or derive it from that class")
            register_replace_pair(pair_name, kwargs, dtypes, (source, cls))
            return cls

        return decorator
    if pair_cls is None or len(pair_cls) != 2:
        raise ValueError(f"register_replace_pair({pair_name!r}): pass pair_cls=(SourceClass, TargetClass)")
    source, target = pair_cls
    if build is None and kwargs is not None:
        build = _atorch_builder(pair_name, target, kwargs)
    if build is None:
        build = getattr(target, "from_source", None)
    if build is None and _takes(target, "src_module"):
        build = _atorch_builder(pair_name, target, {"need_src_module": True})
    if build is None:
        raise ValueError(
            f"register_replace_pair({pair_name!r}): {target.__name__} has no from_source(old_module) "
            "classmethod and takes no src_module argument; give build=callable(old_module) -> new_module, "
            "or ATorch's kwargs={'init_from_attr': True}"
        )
    _PAIRS[pair_name] = ReplacePair(
        name=pair_name,
        source=source if isinstance(source, str) else class_path(source),
        build=_placed_like(build),
        supported_dtypes=dtypes,
    )
    return None


def replace_pairs() -> dict[str, ReplacePair]:
    return dict(_PAIRS)


register_replace_pair(
    "hf_conv1d_to_linear", pair_cls=("transformers.pytorch_utils.Conv1D", nn.Linear), build=conv1d_to_linear
)
_PAIRS["hf_attention_sdpa"] = ReplacePair(
    "hf_attention_sdpa", "transformers model(s) with eager attention (-> sdpa)", None, ALL_DTYPES,
    replace_all=switch_to_sdpa, applies_to=holds_eager_attention)
_PAIRS["rms_norm_fused"] = ReplacePair(
    "rms_norm_fused", "RMSNorm module(s) computing torch's rms_norm (-> nn.RMSNorm)", None, ALL_DTYPES,
    replace_all=rms_norms_to_torch, applies_to=holds_replaceable_rms_norm)


class ModuleReplaceConfig(MethodConfig):
    """Which registered replace pairs to apply."""

    pairs: tuple[str, ...] | None = Field(
        default=None,
        description="names of registered replace pairs to use (null: every registered pair; each one says in "
                    "the log what it replaced, or why nothing); ATorch's pair names (HF_GPT2Attention_FA, ...) are "
                    "read as atorch's",
    )

    @model_validator(mode="before")
    @classmethod
    def _atorch_form(cls, value: Any) -> Any:
        """ATorch's config: ``{pair_name: None, ..., "verbose": bool}`` (the log always names every pair)."""
        if not isinstance(value, dict) or not value or "pairs" in value:
            return value
        settings = {k: v for k, v in value.items() if k != "verbose" and v not in (None, {})}
        if settings:
            raise ValueError(f"per-pair replace settings {settings} are given to register_replace_pair(kwargs=...) "
                             "here; list the pair names only")
        names = [k for k in value if k != "verbose"]
        return {"pairs": names or None}


def resolve_pair_names(names: Iterable[str]) -> tuple[list[str], list[str]]:
    """(atorch pair names, log lines for ATorch's names read as atorch's or as nothing to do)."""
    resolved, notes = [], []
    for name in names:
        if name in _PAIRS or name not in ATORCH_PAIRS:
            resolved.append(name)
            continue
        ours, why = ATORCH_PAIRS[name]
        if ours is None:
            notes.append(f"ATorch's {name} has nothing to do here: {why}")
        elif ours not in resolved:
            resolved.append(ours)
            notes.append(f"ATorch's {name} is {ours} here: {why}")
    return resolved, notes


def replace_modules(model: nn.Module, pairs: list[ReplacePair], dtype: torch.dtype | None = None,
                    requested: bool = True) -> dict[str, int]:
    """Replace in place; returns how many modules each pair replaced. Skips pairs that do not support
    ``dtype`` (the dtype the model will run in). A pair that replaces nothing is named in the log with the
    reason: as a warning where the user asked for it (``requested``), else for information."""
    counts: dict[str, int] = {}
    for pair in pairs:
        if dtype is not None and dtype not in pair.supported_dtypes:
            logger.warning("module_replace: %s skipped, it does not support %s", pair.name, dtype)
            continue
        done = pair.apply(model)
        counts[pair.name] = done.count
        if done.count:
            logger.info("module_replace: %s replaced %d × %s%s", pair.name, done.count, pair.source,
                        f" ({done.why_not})" if done.why_not else "")
        else:
            logger.log(logging.WARNING if requested else logging.INFO, "module_replace: %s not applied: %s",
                       pair.name, done.why_not)
    return counts


@register
class ModuleReplace(Method):
    name = "module_replace"
    group = "module"
    summary = ("Replace modules by faster equivalents: transformers attention -> torch sdpa, RMSNorm -> torch "
               "rms_norm, Conv1D -> nn.Linear, and registered pairs.")
    search_role = SearchRole("switch", "module_replace", position=50, off=False, in_family=False)

    def searchable(self, model: Any) -> bool:
        return any(pair.found_in(model) for pair in replace_pairs().values())

    def offered_at(self, partial: dict[str, Any], space: Any) -> bool:
        # tensor parallel on a model with Conv1D swaps it already (SearchSpace.strategy_of): no twin candidates
        return not (space.conv1d and int(partial.get("tensor", 1)) > 1)
    Config = ModuleReplaceConfig

    def check(self, config: ModuleReplaceConfig, check: Any) -> list[str]:  # type: ignore[override]
        unknown = [p for p in config.pairs or () if p not in _PAIRS and p not in ATORCH_PAIRS]
        if unknown:
            return [f"unknown replace pair(s) {unknown}; registered: {sorted(_PAIRS)}, and ATorch's names "
                    f"{sorted(ATORCH_PAIRS)} (see register_replace_pair)"]
        return []

    # ----- behaviour (atorch.apply.apply_strategy) -----------------------------------------------------------
    def apply(self, build: Build, config: ModuleReplaceConfig) -> None:  # type: ignore[override]
        from atorch.opt_lib.precision import TORCH_DTYPES

        # the replacements are made in the dtype the model will run in: 'half' casts it right after
        half = build.configs.get(Half.name)
        dtype = TORCH_DTYPES[half.dtype] if half is not None else next(build.ctx.model.parameters()).dtype
        replace_registered(build.ctx, config, dtype)


def replace_registered(ctx: Any, config: ModuleReplaceConfig, dtype: torch.dtype) -> None:
    """Apply the configured replace pairs to ctx.model, which will run in ``dtype``."""
    names, notes = resolve_pair_names(config.pairs or ())
    for note in notes:
        logger.info("module_replace: %s", note)
    pairs = [_PAIRS[n] for n in names] if config.pairs else list(_PAIRS.values())
    counts = replace_modules(ctx.model, pairs, dtype, requested=bool(config.pairs))
    logger.info("module_replace: %s", {k: v for k, v in counts.items() if v} or "nothing to replace")
