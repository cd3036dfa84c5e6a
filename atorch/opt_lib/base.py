"""What every optimization method declares: config, applicability, search dimensions, apply."""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from atorch.opt_lib.cost_facts import NO_EFFECT, CostFacts

if TYPE_CHECKING:
    from atorch.model_context import ModelContext
    from atorch.opt_lib.build_state import Build
    from atorch.parallel_layout import ParallelLayout


@dataclass(frozen=True)
class Preparation:
    """One-time work a config needs in a process before its first use (compiling an extension):
    ``what`` names it for the log and keys it (done once per process), ``run`` does it."""

    what: str
    run: Callable[[], None]


class MethodConfig(BaseModel):
    """Base of every method's config: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def preparation(self) -> Preparation | None:
        """One-time work this config needs before its first use, or None. A dry-run session does it
        before the trial's clock starts, with a log line, so it counts in no candidate's time or timeout."""
        return None


class EmptyConfig(MethodConfig):
    pass


# How a method treats the user's numbers (the automatic search's contract with the user, SearchOptions.precision):
# "exact": the user's dtypes; "mixed": 16-bit compute, fp32 master weights and optimizer state;
# "low": weights and optimizer state in 16 bits (no fp32 master copy).
Numerics = Literal["exact", "mixed", "low"]
NUMERICS_ORDER: tuple[Numerics, ...] = ("exact", "mixed", "low")


@dataclass(frozen=True)
class Categorical:
    """A search dimension over a few discrete choices (Optuna's CategoricalDistribution)."""

    choices: tuple[Any, ...]


@dataclass(frozen=True)
class IntRange:
    """A search dimension over integers in [low, high] (Optuna's IntDistribution)."""

    low: int
    high: int
    log: bool = False


Dimension = Categorical | IntRange


@dataclass(frozen=True)
class SearchRole:
    """How the automatic search (atorch.strategy_search.search.space) offers a method: the point key that carries it and
    its value there. Adding a method to the search is this entry (and the method's ``search_space``), no edit to
    the space, the candidate table or the descriptions.

    ``kind``:
    - "choice": one of several methods on one dimension (``dimension``, e.g. "sharding"); the point's value is
      ``value`` (default: the method's name), or ``{value}_{dtype}`` once per searched dtype when ``per_dtype``
      (the method's ``dtype`` search field folds into the value: "amp_bf16"); ``off``: the value when none of the
      dimension's methods is used ("ddp", "fp32"). The chosen method's other search fields follow it in the tree.
    - "switch": an on/off dimension named ``dimension`` (``off`` False), its search fields following when on.
    - "layout": a model-parallel size (``dimension``: "tensor" or "pipeline", ``off`` 1), which the space builds
      from the sizes the model admits.
    ``position``: where the dimension sits in the tree, smaller first (layout sizes always come first, the
    micro-batch size last); ``rank``: the order of a method among its dimension's choices.
    ``in_family``: whether the choice changes how memory is laid out; a measured peak corrects the predictions
    of the candidates that agree on every such key (a "family", atorch.strategy_search.search.candidates.family_key)."""

    kind: Literal["choice", "switch", "layout"]
    dimension: str
    position: int = 0
    rank: int = 0
    value: str = ""
    off: Any = None
    per_dtype: bool = False
    in_family: bool = True

    def value_of(self, name: str) -> str:
        return self.value or name


@dataclass(frozen=True)
class StrategyCheck:
    """What config validation may look at before anything is built."""

    world_size: int
    configs: dict[str, MethodConfig]


class Method(ABC):
    """One optimization method. Subclasses are registered once in the registry.

    Contract:
    - ``Config``: typed config with documented defaults; ``parse_config`` also takes ATorch's shorthands.
    - ``check(config, check)``: config problems that need the world size or the other methods.
    - ``adjust(config, world_size)``: the config actually used at this world size.
    - ``applicable(ctx)``: None if the method can run here, else the reason it cannot.
    - ``model_problems(ctx, config)``: config problems with the user's model (e.g. no such class).
    - ``search_space(ctx)``: config fields a planner may vary, with their choices.
    - ``search_role``: how the automatic search offers the method (``SearchRole``), with ``searchable(model)``
      and ``offered_at(partial, space)`` where the model or earlier choices decide.

    A method owns its behaviour: ``atorch.apply.apply_strategy`` calls every method's ``apply`` in the registry's
    order (``registry.apply_order()``), then its finishing hooks (``build_optimizer``, ``replicate``, ``finish``)
    in the reverse order; ``compute_dtype`` and ``trace_problem`` answer for it where the search asks.
    """

    name: ClassVar[str]
    group: ClassVar[str]  # "parallel", "precision", "memory" or "module"
    summary: ClassVar[str]
    Config: ClassVar[type[MethodConfig]] = EmptyConfig
    mesh_dims: ClassVar[tuple[str, ...]] = ()  # parallel_mode dimensions this method consumes
    # True: where applicable() gives a reason, the method is skipped with a warning (fp8 off CUDA);
    # False: the reason is an error, because the rest of the strategy relies on the method.
    skip_when_inapplicable: ClassVar[bool] = False
    # The user's contract: a method that needs atorch.train_step (the model cannot be called in the user's own
    # loop) or changes the numerics is searched only when the user opts in (SearchOptions.loop / .precision).
    needs_train_step: ClassVar[bool] = False
    numerics: ClassVar[Numerics] = "exact"
    search_role: ClassVar[SearchRole | None] = None  # None: searched only when included or fine-tuned

    def searchable(self, model: Any) -> bool:
        """Whether the automatic search offers this method for ``model`` at all (checked once per space:
        checkpointing needs repeated blocks)."""
        return True

    def offered_at(self, partial: dict[str, Any], space: Any) -> bool:
        """Whether the search offers the method after the choices in ``partial`` (a SearchSpace's point). By
        default: where every mesh dimension it works over has more than one rank (sharding over one data rank
        shards nothing: a twin of the candidate without it)."""
        return all(space.mesh_size(partial, dim) > 1 for dim in self.mesh_dims)

    def schedule_micro_batches(self, config: MethodConfig) -> int:
        """The micro-batches a pipeline schedule splits one batch into under ``config`` (0: it runs none)."""
        return 0

    def requires_train_step(self, config: MethodConfig) -> bool:
        """Whether this config needs ``atorch.train_step`` (a config field may decide: loss_parallel)."""
        return self.needs_train_step

    def parse_config(self, raw: Any) -> MethodConfig:
        return self.Config.model_validate({} if raw is None else raw)

    def check(self, config: MethodConfig, check: StrategyCheck) -> list[str]:
        return []

    def adjust(self, config: MethodConfig, world_size: int) -> MethodConfig:
        """The config to use at this world size (e.g. parallel_mode fits its data size)."""
        return config

    def applicable(self, ctx: ModelContext) -> str | None:
        return None

    def model_problems(self, ctx: ModelContext, config: MethodConfig) -> list[str]:
        """Problems of this config with the user's model (read only, before any copy is made)."""
        return []

    def search_space(self, ctx: ModelContext) -> dict[str, Dimension]:
        return {}

    # ----- behaviour: what the method does to a build, and what it tells the search about that ----------------
    def stands_for(self, config: MethodConfig, configs: dict[str, MethodConfig]) -> dict[str, MethodConfig]:
        """The methods this config is applied as, by name (mixed_parallel: tensor_parallel and pipeline_parallel on
        the layout's dimensions); ``configs``: the whole strategy's. By default the method itself."""
        return {self.name: config}

    def apply(self, build: Build, config: MethodConfig) -> bool | None:
        """Transform ``build.ctx.model`` (in the registry's order). True: the build is finished here (DeepSpeed's
        pipeline engine took model and optimizer), no later step and no finishing hook runs."""
        return None

    def shards_data(self, config: MethodConfig) -> bool:
        """Whether this config shards the model over the data dimension in its apply step (FSDP2): such a step also
        materialises a model on the meta device unit by unit, and keeps the replicas in step without DDP."""
        return False

    def build_optimizer(self, build: Build, config: MethodConfig, params: Any) -> Any:
        """The optimizer over ``params`` (the user's parameter groups) if this method builds it its own way
        (zero1: ZeroRedundancyOptimizer), else None: the user's factory builds it."""
        return None

    def replicate(self, build: Build, config: MethodConfig) -> bool:
        """Keep the data-parallel replicas in step this method's way; True if it did (or its apply step did:
        FSDP2), and then neither DDP nor another method does. Called only when the build communicates."""
        return False

    def finish(self, build: Build, config: MethodConfig) -> None:
        """Last work once model and optimizer are wrapped (loss scaling, the pipeline schedule)."""
        return None

    # ----- what the user's setup must allow: the input checks ask these, by method, never by name ----------------
    def casts(self, config: MethodConfig | None) -> bool:
        """Whether the method casts inputs or parameters away from the model's own dtypes (autocast, 16-bit weights,
        fp8), so the user's step is not held to those dtypes; ``config`` None: named without one (a search's
        ``include``), answered for the method's configs at large."""
        return self.numerics != "exact"

    def optimizer_need(self, config: MethodConfig) -> str | None:
        """Why ``config`` cannot run without an optimizer (ATorch's ``optim_func=None``), completing "'<name>' ...",
        or None: it shards, owns or schedules the optimizer step."""
        return None

    def keeps_replicas_without_ddp(self, config: MethodConfig) -> bool:
        """Whether data parallel under ``config`` is not DDP (sharded, DeepSpeed's engine, a pipeline schedule or
        tensor-parallel replicas): DDP's unused-parameter failure cannot happen there."""
        return self.shards_data(config)

    def compute_dtype(self, config: MethodConfig, dtype: str) -> str:
        """The dtype the model's matmuls compute in after this method ("fp32", "bf16" or "fp16"), given ``dtype``,
        the one before it (methods are asked in apply order, from "fp32"). A method that changes it belongs to
        the "precision" group."""
        return dtype

    def traced_as(self, config: MethodConfig) -> MethodConfig:
        """The config the memory trace builds in this one's place: the same bytes on fake tensors (fp16 autocast is
        traced as bf16: its loss scaler reads a value fake tensors do not have). By default the config itself."""
        return config

    def trace_problem(self, config: MethodConfig, layout: ParallelLayout) -> str | None:
        """Why a model built with this config cannot be traced on fake tensors (the cost model's memory trace,
        atorch.strategy_search.costing.tracing), or None."""
        return None

    # ----- cost facts: what the cost model reads of a method (atorch.opt_lib.cost_facts) -----
    def cost_facts(self, config: MethodConfig, layout: ParallelLayout) -> CostFacts:
        """What ``config`` does to a training step's bytes, compute and communication at ``layout``. Stated here,
        next to the code that does it, so the cost model follows a change to the method. Default: no effect."""
        return NO_EFFECT
