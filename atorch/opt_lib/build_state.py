"""What one ``atorch.apply.apply_strategy`` shares with the methods' hooks (``Method.apply`` and the finishing
hooks): defined here, below every method's module, so that each can read it without an import circle."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from atorch.model_context import ModelContext


@dataclass
class Build:
    """The context being built, every method's config and whether the build may communicate.

    ``communicate=False``: the model is made of fake or meta tensors for the cost model; the steps that
    communicate (equal initial weights, DDP's constructor, DeepSpeed's engine) are left out.
    """

    ctx: ModelContext
    configs: dict[str, Any]  # every applied method's config by name (mixed_parallel as what it stands for)
    communicate: bool
    # A build that only asks whether the strategy builds (search.buildable, without communication): the methods'
    # one-sample checks still run the sample through what they changed (a split that cannot compute raises), but
    # compare no numbers (the fake group's collectives return at once)
    runs_checks: bool = False
    # Set by the step that replaced the model by its pipeline stages: ``per_stage(ctx, wrap, *args)`` runs a
    # wrapper once per stage, each its own root (the schedule calls the stages, never the whole).
    per_stage: Callable[..., None] | None = None
