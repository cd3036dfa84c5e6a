"""checkpoint: activation checkpointing of chosen blocks (recompute in backward, save memory).

Selective: ``every: k`` recomputes every k-th of the matched blocks (the first, the (k+1)-th, ...) and leaves the
others' activations saved, trading memory for less recompute; its cost facts follow (``recompute`` = 1/k)."""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Any

from pydantic import Field, model_validator
from torch import nn

from atorch.class_ref import ClassRefs, matches
from atorch.log import get_logger
from atorch.opt_lib.base import Categorical, Dimension, Method, MethodConfig, SearchRole
from atorch.opt_lib.blocks import block_classes, outermost
from atorch.opt_lib.cost_facts import CostFacts
from atorch.opt_lib.registry import register

if TYPE_CHECKING:
    from atorch.opt_lib.build_state import Build

logger = get_logger(__name__)


class CheckpointConfig(MethodConfig):
    """ATorch form: a tuple of classes, e.g. ``("checkpoint", (GPT2Block,))``."""

    wrap_class: ClassRefs = Field(
        default=None,
        description="module classes or class names to checkpoint; null detects the model's repeated blocks",
    )
    no_reentrant: bool = Field(
        default=True, description="torch's non-reentrant checkpoint (supports keyword arguments and nested use)"
    )
    every: int = Field(
        default=1, ge=1, description="recompute every k-th matched block (the first, the (k+1)-th, ...); 1: all"
    )

    @model_validator(mode="before")
    @classmethod
    def _tuple_form(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple, type, str)):
            return {"wrap_class": value}
        return value


def disable_kv_cache(model: nn.Module) -> int:
    """Turn transformers' KV cache off on every config of the model (a copy); returns how many changed.

    With ``use_cache`` on, a decoder fills a cache object in forward, and recomputing a block in
    backward sees a different cache, so a different number of tensors is saved and backward fails.
    transformers' own checkpointing turns the cache off for the same reason. Sub-models may hold
    their own config copies (T5's decoder stack), so every module's config is visited.
    """
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return 0
    changed = 0
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, transformers.PretrainedConfig) and getattr(config, "use_cache", False):
            config.use_cache = False
            changed += 1
    return changed


@register
class ActivationCheckpoint(Method):
    name = "checkpoint"
    group = "memory"
    summary = "Activation checkpointing of repeated blocks: recompute activations in backward."
    search_role = SearchRole("switch", "checkpoint", position=30, off=False)

    def searchable(self, model: Any) -> bool:
        return bool(block_classes(model))  # off or every repeated block: none, nothing to search
    Config = CheckpointConfig

    def search_space(self, ctx: Any) -> dict[str, Dimension]:
        return {"no_reentrant": Categorical((True,))}

    def model_problems(self, ctx: Any, config: CheckpointConfig) -> list[str]:  # type: ignore[override]
        classes = config.wrap_class or block_classes(ctx.model)
        if not classes:
            return [
                "no wrap_class given and no repeated blocks found in the model; "
                "pass ('checkpoint', {'wrap_class': [YourBlockClass]})"
            ]
        if not any(matches(m, classes) for m in ctx.model.modules()):
            return [f"wrap_class {list(classes)} matches no module of the model; use class objects or names"]
        return []

    # ----- behaviour (atorch.apply.apply_strategy) -----------------------------------------------------------
    def apply(self, build: Build, config: CheckpointConfig) -> None:  # type: ignore[override]
        checkpoint_blocks(build.ctx, config)

    # ----- cost facts -----
    def cost_facts(self, config: CheckpointConfig, layout: Any) -> CostFacts:  # type: ignore[override]
        # a recomputed block keeps only its inputs and runs its forward again in backward: 1 in ``every``
        return CostFacts(recompute=1.0 / config.every)


def checkpoint_blocks(ctx: Any, config: CheckpointConfig) -> None:
    """Wrap the chosen blocks of ctx.model so that their activations are recomputed in backward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    classes = config.wrap_class or block_classes(ctx.model)
    if disable_kv_cache(ctx.model):
        logger.info("checkpoint: use_cache set to False in the model's config (a KV cache breaks recompute)")
    # chosen before wrapping: the wrappers change what model.modules() yields; a block inside a chosen one is
    # recomputed with it, and wrapping it too would recompute it twice
    chosen = {id(m) for m in outermost(ctx.model, lambda m: matches(m, classes))[::config.every]}
    impl = CheckpointImpl.NO_REENTRANT if config.no_reentrant else CheckpointImpl.REENTRANT
    apply_activation_checkpointing(
        ctx.model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
        check_fn=lambda m: id(m) in chosen,
    )
    logger.info("checkpoint: %d modules of %s (%s%s)", len(chosen), list(classes), impl.name.lower(),
                f", every {config.every}" if config.every > 1 else "")
