"""The search space, built from the method registry: every valid (strategy, micro-batching) for one job.

A *point* is a flat dict of choices, e.g. ``{"sharding": "zero2", "zero2.implementation": "fsdp2",
"checkpoint": True, "precision": "amp_bf16", "module_replace": False, "micro_batch_size": 2}``.
Which keys a point has depends on earlier choices (``zero2.implementation`` only with zero2), so the
space is a tree of dimensions walked in a fixed order. Each method's tunable fields come from its
``search_space()`` in the registry, and the dimension that carries it, its point key and value, from its
``search_role`` (``atorch.opt_lib.base.SearchRole``): nothing here lists a method or its options by hand,
except the model-parallel layout (tensor and pipeline sizes, their methods' plans and schedules).

Validity is data, not code: a point becomes a Strategy and ``Strategy.problems(world_size)`` (the
method checks and the compatibility RULES) decides. ``enumerate()`` keeps only valid candidates, and
the Optuna view (``suggest``) offers at each dimension only the choices that some valid candidate
extends, so an invalid combination is never proposed to a trial.

The tree starts with the model-parallel layout: ``tensor`` and ``pipeline`` sizes (products dividing the
world size; the data size is what is left). A size above 1 is offered only where its method is allowed
and fits the model (tensor_parallel: a plan derives from it, and GPT-2's Conv1D is swapped by
module_replace in those points; pipeline_parallel: at least as many repeated blocks as stages). A
mixture-of-experts model whose experts the registry's 'expert' layout method can split (expert_parallel) also
gets an ``expert`` size beside the data, tensor and pipeline sizes: sizes dividing what they leave of the world
and the expert count; expert
ranks are data ranks too, so the data size (and micro-batching) is unchanged. A transformers decoder whose
sequences are long (``context_parallel_from`` tokens, 8,192 by default: the shortest sequence a published layout
splits, Megatron-Bridge's Llama 3 405B with context 2; any length when ``context_parallel`` is included by name)
gets a ``context`` size there too, and beside tensor, pipeline and expert sizes (sizes dividing what they leave of
the world whose ``2 × size`` chunks divide the sequence): context ranks read the same batch, so the data size is
what is left after them. Under pipeline parallel the schedule is a dimension too (1f1b, gpipe, interleaved 1f1b
where there are two blocks per stage), and a point's micro-batches are the schedule's
(``pipeline_parallel.micro_batches``), at least one per stage.

The user's contract decides which methods are searched at all (``loop``, ``precision``; a method declares
``needs_train_step`` and ``numerics`` in its registry entry): by default only strategies under which the
user's own training loop (README Quick start) runs unchanged and the weights and optimizer state stay fp32
(mixed precision with fp32 master weights included). A method named in ``included`` is an opt-in by name.

Activation checkpointing searches off / every repeated block. A subset of blocks (a fraction) is not
searched: ``checkpoint``'s config chooses blocks by class only and has no field for a subset.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from torch import nn

from atorch.errors import SetupError
from atorch.opt_lib import registry
from atorch.opt_lib.base import NUMERICS_ORDER, Method, Numerics, SearchRole
from atorch.opt_lib.mixed_parallel import MixedParallel
from atorch.opt_lib.module_replace import ModuleReplace
from atorch.opt_lib.parallel_mode import ParallelMode
from atorch.opt_lib.pipeline_parallel import PipelineParallel
from atorch.opt_lib.registry import SearchDimension, search_dimensions
from atorch.opt_lib.sharding import Zero2
from atorch.opt_lib.tensor_parallel import TensorParallel
from atorch.opt_lib.zero1 import Zero1
from atorch.parallel_layout import CONTEXT, EXPERT
from atorch.strategy import Strategy, StrategyItem
from atorch.strategy_search.costing.analyser import fingerprint

Point = dict[str, Any]

PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")  # searched under pipeline parallel
# Context parallel is offered for sequences this long: the shortest a published layout splits (Megatron-Bridge's Llama 3
# 405B at 8,192 tokens with context 2; Llama 3's own pretraining ran 8,192 without it, its 131k stage with 16).
CONTEXT_PARALLEL_FROM = 8192
# A method that keeps weights in 16 bits (numerics "low": half) has no fp32 master weights: in fp16 Adam's state
# underflows (see Half.model_problems), so by default only bf16 is searched for it.
DEFAULT_HALF_DTYPES = ("bf16",)


@dataclass(frozen=True)
class Dim:
    """One dimension of the tree: a name and the choices offered there."""

    name: str
    choices: tuple[Any, ...]


@dataclass(frozen=True)
class Candidate:
    """A strategy plus micro-batching: ``micro_batches`` micro-batches of ``micro_batch_size`` per rank
    make one optimizer step over the global batch."""

    strategy: Strategy
    micro_batch_size: int
    micro_batches: int
    point: tuple[tuple[str, Any], ...] = field(default=())

    @property
    def key(self) -> str:
        """A stable JSON text of the point (identifies the candidate in a study)."""
        return json.dumps(dict(self.point), sort_keys=True)

    def to_json(self) -> dict[str, Any]:
        return {
            "point": dict(self.point),
            "strategy": json.loads(self.strategy.to_json(indent=None)),
            "micro_batch_size": self.micro_batch_size,
            "micro_batches": self.micro_batches,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Candidate:
        return cls(strategy=Strategy.load(data["strategy"]), micro_batch_size=int(data["micro_batch_size"]),
                   micro_batches=int(data["micro_batches"]), point=tuple(data["point"].items()))

    def __str__(self) -> str:
        """The one description (atorch.strategy_search.search.describe); the data size is ``*`` here, where the world
        size is not known: callers that know it use ``describe_candidate`` with it."""
        from atorch.strategy_search.search.describe import describe_candidate

        return describe_candidate(self.strategy, self.micro_batch_size, self.micro_batches, None)


def _prefix_key(items: list[tuple[str, Any]]) -> str:
    return json.dumps(items)


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


class SearchSpace:
    """Every valid candidate for a model at a world size and a fixed global batch.

    supported_dtypes: the half dtypes the hardware runs ("bf16", "fp16"); fp32 is always there.
    excluded / included: method names never used / always used.
    finetune_strategy: search around a loaded strategy: its methods stay; the search dims of the
    items marked ``tunable`` vary, as does micro-batching.
    host_offload: whether the device has a host memory to offload to. On a CPU device it has not (the
    "offloaded" state stays in the same RAM, and the program is the same), so ``cpu_offload`` is not searched
    there: it would only add twins of candidates.
    loop: "user" searches only methods under which the user's own loop runs (no pipeline schedule);
    "train_step" adds the methods that need ``atorch.train_step``.
    precision: the most the numerics may change: "exact" (the user's dtypes), "mixed" (16-bit compute, fp32
    master weights and optimizer state), "low" (also 16-bit weights and optimizer state: ``half``).
    ranks_per_node: processes per node of a multi-node job (torchrun's LOCAL_WORLD_SIZE): tensor sizes divide it,
    so a tensor group (adjacent ranks) stays in a node. None: one node.
    """

    def __init__(
        self,
        model: nn.Module,
        world_size: int,
        global_batch: int,
        supported_dtypes: Sequence[str] = ("bf16", "fp16"),
        excluded: Iterable[str] = (),
        included: Iterable[str] = (),
        finetune_strategy: Any = None,
        half_dtypes: Sequence[str] = DEFAULT_HALF_DTYPES,
        max_micro_batch_size: int | None = None,
        host_offload: bool = True,
        loop: str = "user",
        precision: Numerics = "mixed",
        ranks_per_node: int | None = None,
        sequence_length: int | None = None,
        context_parallel_from: int = CONTEXT_PARALLEL_FROM,
    ) -> None:
        if loop not in ("user", "train_step"):
            raise SetupError([f"loop must be 'user' or 'train_step', got {loop!r}"])
        if precision not in NUMERICS_ORDER:
            raise SetupError([f"precision must be one of {list(NUMERICS_ORDER)}, got {precision!r}"])
        self.loop, self.precision = loop, precision
        self.world_size = world_size
        # a tensor group stays within a node (its collectives run every layer): tensor sizes divide this
        self.ranks_per_node = ranks_per_node or world_size
        self.global_batch = global_batch
        self.supported_dtypes = tuple(supported_dtypes)
        self.excluded = frozenset(excluded)
        self.included = frozenset(included)
        self.half_dtypes = tuple(half_dtypes)
        self.host_offload = host_offload
        unknown = sorted(n for n in self.excluded | self.included if not registry.is_registered(n))
        if unknown:
            raise SetupError([f"unknown method(s) {unknown} in excluded/included; known: {registry.method_names()}"])
        both = sorted(self.excluded & self.included)
        if both:
            raise SetupError([f"method(s) {both} are both excluded and included; keep each in one list"])
        self.finetune = Strategy.load(finetune_strategy) if finetune_strategy is not None else None
        self.model_fingerprint = fingerprint(model)
        self._ctx = SimpleNamespace(model=model)  # what Method.search_space may look at
        # the registry's choice and switch dimensions, in tree order, with the methods the model gives anything
        self.dimensions = [d for d in search_dimensions() if d.kind != "layout"]
        self._searchable = {m.name: m.searchable(model) for d in self.dimensions for m in d.methods}
        self.max_micro_batch_size = max_micro_batch_size
        self.dp = world_size  # the data size of the all-data-parallel layout
        if global_batch % self.dp:
            raise SetupError(
                [f"global batch {global_batch} is not divisible by the {self.dp} data-parallel ranks; "
                 "choose a multiple of the world size"]
            )
        self.micro_batch_sizes = self._micro_batch_sizes(1, 1)
        self.conv1d = False
        self.pipeline_blocks = 0
        self.tensor_sizes, self.pipeline_sizes = self._model_parallel_sizes(model)
        self.expert_method, self.expert_sizes = self._expert_sizes(model)
        self.context_method, self.context_sizes = self._context_sizes(model, sequence_length, context_parallel_from)
        self._candidates: list[Candidate] | None = None
        self._invalid: list[tuple[Point, list[str]]] = []
        self._degenerates: list[tuple[Point, list[str]]] = []  # choices that change nothing at their layout
        self._valid_points: list[Point] = []  # in walk order
        self._duplicates: list[tuple[Candidate, str]] = []  # (left out, the kept one's key): the same program
        self._prefixes: dict[str, set[str]] | None = None

    # ----- model-parallel layouts --------------------------------------------------------------
    def _model_parallel_sizes(self, model: nn.Module) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Tensor and pipeline sizes above 1 that the model and the allowed methods admit (1 always)."""
        if self.finetune is not None:
            return (1,), (1,)
        sizes = [d for d in _divisors(self.world_size) if d > 1 and self.global_batch % (self.world_size // d) == 0]
        tensor: list[int] = [1]
        if self._allowed(TensorParallel.name) and self.included.isdisjoint({PipelineParallel.name}) \
                and registry.get_method(TensorParallel.name).searchable(model):
            from atorch.opt_lib.tensor_parallel import TensorParallelConfig, derive_plan, has_conv1d

            self.conv1d = has_conv1d(model)
            if not self.conv1d or self._allowed(ModuleReplace.name):
                tensor += [t for t in sizes if self.ranks_per_node % t == 0
                           and not derive_plan(model, TensorParallelConfig(), t).problems]
        pipeline: list[int] = [1]
        if self._allowed(PipelineParallel.name) and self.included.isdisjoint({TensorParallel.name}):
            from atorch.opt_lib.pipeline_split import find_blocks

            blocks, _ = find_blocks(model)
            self.pipeline_blocks = len(blocks.names) if blocks is not None else 0
            pipeline += [p for p in sizes if self.pipeline_blocks >= p]
        return tuple(tensor), tuple(pipeline)

    def _expert_sizes(self, model: nn.Module) -> tuple[str | None, tuple[int, ...]]:
        """The registry's method for an 'expert' layout dimension (a mixture-of-experts model's experts split over
        it) and the sizes it offers for the model (1 always; more only where the model has experts it can split)."""
        method = next((m for d in search_dimensions() if d.kind == "layout" and d.name == EXPERT for m in d.methods),
                      None)
        if method is None or self.finetune is not None or not self._allowed(method.name) \
                or not method.searchable(model):
            return None, (1,)
        from atorch.opt_lib.expert_parallel import expert_sizes

        return method.name, (1, *expert_sizes(model, self.world_size))

    def _context_sizes(self, model: nn.Module, sequence: int | None, threshold: int) -> tuple[str | None,
                                                                                              tuple[int, ...]]:
        """The registry's method for a 'context' layout dimension (each sequence split over it) and the sizes it offers:
        1 always; more for a model it can split whose sequences are at least ``threshold`` tokens (any length where
        the method is included by name), sizes whose ``2 × size`` chunks divide the sequence and whose data ranks
        (world / size: context ranks read the same batch) divide the global batch."""
        method = next((m for d in search_dimensions() if d.kind == "layout" and d.name == CONTEXT for m in d.methods),
                      None)
        if method is None or self.finetune is not None or not self._allowed(method.name) or not sequence:
            return None, (1,)
        if (sequence < threshold and method.name not in self.included) or not method.searchable(model):
            return None, (1,)
        sizes = tuple(c for c in _divisors(self.world_size) if c > 1 and sequence % (2 * c) == 0
                      and self.global_batch % (self.world_size // c) == 0)
        return (method.name, (1, *sizes)) if sizes else (None, (1,))

    def _micro_batch_sizes(self, tensor: int, pipeline: int, context: int = 1) -> tuple[int, ...]:
        dp = self.world_size // (tensor * pipeline * context)
        if self.global_batch % dp:
            return ()
        per_rank = self.global_batch // dp
        # under pipeline parallel every stage needs a micro-batch in flight: at least `pipeline` of them
        return tuple(d for d in _divisors(per_rank) if (self.max_micro_batch_size is None or
                                                         d <= self.max_micro_batch_size) and per_rank // d >= pipeline)

    def data_size(self, point: Point) -> int:
        """The ranks the batch is split over: what the tensor, pipeline and context sizes leave (expert ranks are
        data ranks too)."""
        return self.world_size // (int(point.get("tensor", 1)) * int(point.get("pipeline", 1))
                                   * int(point.get(CONTEXT, 1)))

    def mesh_size(self, point: Point, dim: str) -> int:
        """The size of a parallel_mode dimension in a (partial) point, as the methods working over it see it: the
        layout's sizes; data the ranks DDP/FSDP average and shard over (ParallelLayout.replica_size: what the
        batch is split over, expert ranks included, × the context ranks, which read the same batch)."""
        return self.data_size(point) * int(point.get(CONTEXT, 1)) if dim == "data" else int(point.get(dim, 1))

    def _layout_dims(self, partial: Point) -> Iterator[Dim]:
        if len(self.tensor_sizes) > 1:
            yield Dim("tensor", self.tensor_sizes)
        t = int(partial.get("tensor", 1))
        pipeline = tuple(p for p in self.pipeline_sizes if self.world_size % (t * p) == 0)
        if len(pipeline) > 1:
            yield Dim("pipeline", pipeline)
        p = int(partial.get("pipeline", 1))
        if p > 1:  # interleaving needs two stages per rank, so twice as many blocks as ranks
            schedules = tuple(name for name in PIPELINE_SCHEDULES
                              if name != "interleaved_1f1b" or self.pipeline_blocks >= 2 * p)
            yield Dim("pipeline_parallel.schedule", schedules)
        expert = tuple(e for e in self.expert_sizes if self.world_size % (t * p * e) == 0)
        if len(expert) > 1:
            yield Dim(EXPERT, expert)
        e = int(partial.get(EXPERT, 1))
        # beside tensor, pipeline or experts too (every pipeline stage splits the micro-batch's sequences)
        context = tuple(c for c in self.context_sizes if self.world_size % (t * p * e * c) == 0)
        if len(context) > 1:
            yield Dim(CONTEXT, context)

    # ----- the tree of dimensions ------------------------------------------------------------
    def _method_dims(self, name: str) -> list[Dim]:
        """A method's registry search dims with more than one choice (dtype filtered by the hardware)."""
        dims = []
        for fname, dim in registry.get_method(name).search_space(self._ctx).items():
            choices = tuple(getattr(dim, "choices", ()) or range(dim.low, dim.high + 1))  # type: ignore[union-attr]
            if fname == "dtype":
                choices = tuple(c for c in choices if c in self.supported_dtypes)
            if fname == "cpu_offload" and not self.host_offload:
                choices = (False,)
            if len(choices) > 1:
                dims.append(Dim(f"{name}.{fname}", choices))
        return dims

    def _allowed(self, name: str) -> bool:
        """Searched: registered, not excluded, and within the user's contract (or included by name)."""
        if not registry.is_registered(name) or name in self.excluded:
            return False
        return name in self.included or self.keeps_contract(name)

    def keeps_contract(self, name: str) -> bool:
        """Whether a method keeps the user's loop and numerics as this space's options allow."""
        method = registry.get_method(name)
        if method.needs_train_step and self.loop != "train_step":
            return False
        return NUMERICS_ORDER.index(method.numerics) <= NUMERICS_ORDER.index(self.precision)

    def _choices(self, dim: SearchDimension) -> tuple[Any, ...]:
        """A choice dimension's values: ``off`` and every allowed method's; only the included ones' where the
        user included any (more than one: every candidate breaks a rule, reported as an empty space)."""
        forced = [m for m in dim.methods if m.name in self.included]
        values: list[Any] = [] if forced else [dim.off]
        for method in forced or [m for m in dim.methods if self._allowed(m.name) and self._searchable[m.name]]:
            values += self._values(method, dim.role(method))
        return tuple(values)

    def _values(self, method: Method, role: SearchRole) -> list[str]:
        """A method's values on its choice dimension: its name (or ``role.value``), or one per searched dtype."""
        if not role.per_dtype:
            return [role.value_of(method.name)]
        dtypes = method.search_space(self._ctx).get("dtype")
        return [f"{role.value_of(method.name)}_{dtype}" for dtype in getattr(dtypes, "choices", ())
                if dtype in self.supported_dtypes and (method.numerics != "low" or dtype in self.half_dtypes)]

    @staticmethod
    def _chosen(dim: SearchDimension, value: Any) -> tuple[Method, str | None]:
        """The method a choice dimension's ``value`` stands for, and its dtype where the value carries one."""
        for method in dim.methods:
            role = dim.role(method)
            prefix, _, dtype = str(value).rpartition("_") if role.per_dtype else (str(value), "", None)
            if prefix == role.value_of(method.name):
                return method, dtype
        raise SetupError([f"{dim.name}={value!r} names no registered method"])

    def _on_off(self, name: str) -> tuple[bool, ...]:
        if name in self.included:
            return (True,)
        return (False, True) if self._allowed(name) else (False,)

    def next_dim(self, partial: Point) -> Dim | None:
        """The next dimension after the choices in ``partial`` (None once the point is complete)."""
        for dim in self._dims_after(partial):
            if dim.name not in partial:
                return dim
        return None

    def _dims_after(self, partial: Point) -> Iterator[Dim]:
        if self.finetune is not None:
            for item in self.finetune.methods:
                if item.tunable:
                    yield from self._method_dims(item.name)
            yield Dim("micro_batch_size", self.micro_batch_sizes)
            return
        yield from self._layout_dims(partial)
        for dim in self.dimensions:
            if dim.kind == "switch":
                method = dim.methods[0]
                if not (self._searchable[method.name] and method.offered_at(partial, self)):
                    continue
                yield Dim(dim.name, self._on_off(method.name))
                if partial.get(dim.name):
                    yield from self._method_dims(method.name)
                continue
            yield Dim(dim.name, self._choices(dim))
            if dim.name in partial and partial[dim.name] != dim.off:
                chosen, dtype = self._chosen(dim, partial[dim.name])
                folded = f"{chosen.name}.dtype" if dtype is not None else None  # carried by the value
                yield from (d for d in self._method_dims(chosen.name) if d.name != folded)
        yield Dim("micro_batch_size", self._micro_batch_sizes(int(partial.get("tensor", 1)),
                                                              int(partial.get("pipeline", 1)),
                                                              int(partial.get(CONTEXT, 1))))

    def _points(self, partial: Point) -> Iterator[Point]:
        dim = self.next_dim(partial)
        if dim is None:
            yield dict(partial)
            return
        for choice in dim.choices:
            yield from self._points({**partial, dim.name: choice})

    # ----- points <-> candidates -------------------------------------------------------------
    def strategy_of(self, point: Point) -> Strategy:
        """The strategy a complete point stands for (not yet checked)."""
        configs: dict[str, dict[str, Any]] = {}
        for key, value in point.items():
            if "." in key:
                method, fname = key.split(".", 1)
                configs.setdefault(method, {})[fname] = value
        if self.finetune is not None:
            items = [
                item.model_copy(update={"config": registry.get_method(item.name).parse_config(
                    {**item.config.model_dump(mode="json", exclude_unset=True), **configs.get(item.name, {})}
                )}) if item.name in configs else item
                for item in self.finetune.methods
            ]
            return Strategy(methods=tuple(items))
        layout = ParallelMode.name
        names = {layout}
        tensor, pipeline = int(point.get("tensor", 1)), int(point.get("pipeline", 1))
        expert = int(point.get(EXPERT, 1)) if self.expert_method is not None else 1
        context = int(point.get(CONTEXT, 1)) if self.context_method is not None else 1
        dims = [(name, size) for name, size in (("tensor", tensor), ("pipeline", pipeline), (EXPERT, expert),
                                                (CONTEXT, context)) if size > 1]
        if dims:  # the data size is what is left either way
            configs[layout] = {"dims": [*dims, ("data", -1)]}
        if expert > 1:
            names.add(self.expert_method)  # type: ignore[arg-type]
        if context > 1:
            names.add(self.context_method)  # type: ignore[arg-type]
        if tensor > 1 or pipeline > 1:
            schedule = {"micro_batches": self.global_batch // self.data_size(point) // int(point["micro_batch_size"])}
            if pipeline > 1:
                schedule.update(configs.pop(PipelineParallel.name, {}))
            if tensor > 1 and pipeline > 1:
                names.add(MixedParallel.name)
                configs[MixedParallel.name] = {"pipeline": schedule}
            elif tensor > 1:
                names.add(TensorParallel.name)
            else:
                names.add(PipelineParallel.name)
                configs[PipelineParallel.name] = schedule
            if tensor > 1 and self.conv1d:
                names.add(ModuleReplace.name)  # DTensor cannot split transformers' Conv1D: swapped for nn.Linear
        for dim in self.dimensions:
            value = point.get(dim.name, dim.off)
            if dim.kind == "switch":
                if value:
                    names.add(dim.methods[0].name)
            elif value != dim.off:
                chosen, dtype = self._chosen(dim, value)
                names.add(chosen.name)
                if dtype is not None:
                    configs.setdefault(chosen.name, {})["dtype"] = dtype
        # Every included method is in every candidate (fp8 say, or two that the rules then refuse).
        names |= self.included
        items = [
            StrategyItem(name=n, config=registry.get_method(n).parse_config(configs.get(n)))
            for n in registry.apply_order() if n in names
        ]
        return Strategy(methods=tuple(items))

    def from_point(self, point: Point) -> Candidate:
        """The candidate of a complete point; raises SetupError if the point is not in the space."""
        expected = self._complete_keys(point)
        if set(point) != expected:
            raise SetupError([f"point {point} does not fit this space: it needs exactly the keys {sorted(expected)}"])
        strategy = self.strategy_of(point)
        problems = strategy.problems(self.world_size) + self._degenerate(point)
        if problems:
            raise SetupError([f"point {point} is not a valid strategy: {p}" for p in problems])
        return self._candidate(strategy, point)

    def _candidate(self, strategy: Strategy, point: Point) -> Candidate:
        mbs = int(point["micro_batch_size"])
        per_rank = self.global_batch // self.data_size(point)
        if int(point.get("pipeline", 1)) > 1:  # one batch per step: the schedule splits it into its micro-batches
            return Candidate(strategy, per_rank, 1, tuple(sorted(point.items())))
        return Candidate(strategy, mbs, per_rank // mbs, tuple(sorted(point.items())))

    def to_point(self, candidate: Candidate) -> Point:
        return dict(candidate.point)

    def _complete_keys(self, point: Point) -> set[str]:
        walked: Point = {}
        while (dim := self.next_dim(walked)) is not None:
            if dim.name not in point or point[dim.name] not in dim.choices:
                return {*walked, dim.name}
            walked[dim.name] = point[dim.name]
        return set(walked)

    # ----- the whole space -------------------------------------------------------------------
    def enumerate(self) -> list[Candidate]:
        """Every valid candidate (points whose strategy breaks a rule or check are left out)."""
        if self._candidates is None:
            self._candidates, self._invalid, self._duplicates, self._degenerates = [], [], [], []
            programs: dict[str, str] = {}  # program -> the key of the candidate kept for it
            for point in self._points({}):
                strategy = self.strategy_of(point)
                problems = strategy.problems(self.world_size)
                if problems:
                    self._invalid.append((point, problems))
                    continue
                twin = self._degenerate(point)
                if twin:
                    self._degenerates.append((point, twin))
                    continue
                cand = self._candidate(strategy, point)
                program = _program_key(cand)
                if program in programs:  # the same program as an earlier candidate: measured once, as that one
                    self._duplicates.append((cand, programs[program]))
                    continue
                programs[program] = cand.key
                self._valid_points.append(point)
                self._candidates.append(cand)
            if not self._candidates:
                why = sorted({p for _, ps in self._invalid for p in ps})[:5]
                raise SetupError([f"the search space has no valid strategy (excluded/included/finetune): {why}"])
        return list(self._candidates)

    def _degenerate(self, point: Point) -> list[str]:
        """Choices that change nothing at this point's layout (a method's ``offered_at``: sharding over one data
        rank is its twin without sharding); not candidates."""
        chosen = (self._chosen(d, point[d.name])[0] for d in self.dimensions
                  if d.kind == "choice" and point.get(d.name, d.off) != d.off)
        return [f"{m.name} over a {'/'.join(m.mesh_dims) or 'layout'} dimension of one rank changes nothing"
                for m in chosen if m.name not in self.included and not m.offered_at(point, self)]

    def valid_points(self) -> list[Point]:
        """The valid points in walk order, each keyed in walk order (what a CandidateTable is built from)."""
        self.enumerate()
        return [dict(p) for p in self._valid_points]

    def invalid_points(self) -> list[tuple[Point, list[str]]]:
        """Points the rules refused, with why (for reports and tests)."""
        self.enumerate()
        return list(self._invalid)

    def degenerate_points(self) -> list[tuple[Point, list[str]]]:
        """Points left out because a choice changes nothing at their layout (sharding over one data rank)."""
        self.enumerate()
        return list(self._degenerates)

    def duplicates(self) -> list[tuple[Candidate, str]]:
        """Candidates left out because an earlier one runs the same program (zero2 over FSDP2 is fsdp
        without resharding after forward), each with the kept candidate's key."""
        self.enumerate()
        return list(self._duplicates)

    def __len__(self) -> int:
        return len(self.enumerate())

    def signature(self) -> str:
        """A hash of the whole space (its valid points, world size and global batch)."""
        payload = {
            "world_size": self.world_size, "global_batch": self.global_batch,
            "points": sorted(c.key for c in self.enumerate()),
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    # ----- the Optuna view -------------------------------------------------------------------
    def _valid_choices(self, partial: Point, dim: Dim) -> tuple[Any, ...]:
        """The choices of ``dim`` that some valid candidate extending ``partial`` takes."""
        if self._prefixes is None:
            # Walk-ordered prefix of every valid point -> the choices taken next (built once).
            self._prefixes = {}
            for point in self._valid_points:
                items = list(point.items())
                for i, (_name, value) in enumerate(items):
                    self._prefixes.setdefault(_prefix_key(items[:i]), set()).add(json.dumps(value))
        seen = self._prefixes.get(_prefix_key(list(partial.items())), set())
        return tuple(c for c in dim.choices if json.dumps(c) in seen)


def _program_key(cand: Candidate) -> str:
    """What a candidate runs: its methods as programs (``sharding.same_program``) and its micro-batching."""
    from atorch.opt_lib.deepspeed_zero import runs_on_fsdp2
    from atorch.opt_lib.sharding import Zero2Config, same_program

    # zero1 across a tensor dimension runs as zero2 with its defaults (zero1.py): one program
    as_zero2 = runs_on_fsdp2(cand.strategy)
    items = [same_program(Zero2.name, Zero2Config()) if as_zero2 and item.name == Zero1.name
             else same_program(item.name, item.config) for item in cand.strategy.methods]
    return json.dumps([items, cand.micro_batch_size, cand.micro_batches], sort_keys=True, default=str)
