"""Plan a training job for a cluster that is not here: every layout, predicted by the search's cost model.

``plan_job(shape, gpus, global_batch, profile)`` enumerates every layout atorch's registry runs at that world
size — tensor size (dividing the GPUs per node and the heads: a tensor group stays in a node), pipeline size
with its schedules (1F1B, GPipe, interleaved 1F1B with its virtual stages), the data dimension's sharding
(none / ZeRO-1 / ZeRO-2 / FSDP, as the compatibility rules allow), activation recompute, sequence parallel
and micro-batch size × count — builds each one's Strategy, and predicts it with
``plan_terms.predict_transformer`` (the cost model's transformer terms; with a measured profile,
``cost_model.predict``). Plans are ranked: the ones that fit the memory per GPU by step time, then the rest by
how much they overshoot.

Strategies are built once per distinct layout and checked once with ``Strategy.problems`` (the rules
``atorch check`` applies); a layout the rules refuse is never proposed, but ``--layout`` may still name one
and see its prediction next to the runnable ones (with the rules' reasons).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from atorch.errors import SetupError
from atorch.opt_lib import registry
from atorch.opt_lib.activation_checkpoint import ActivationCheckpoint
from atorch.opt_lib.context_parallel import ContextParallel
from atorch.opt_lib.expert_parallel import ExpertParallel
from atorch.opt_lib.fp8 import FP8
from atorch.opt_lib.mixed_parallel import MixedParallel
from atorch.opt_lib.parallel_mode import ParallelMode
from atorch.opt_lib.pipeline_parallel import PipelineParallel
from atorch.opt_lib.precision import AmpNative
from atorch.opt_lib.sharding import FSDP, Zero2
from atorch.opt_lib.tensor_parallel import TensorParallel
from atorch.opt_lib.zero1 import Zero1
from atorch.parallel_layout import ParallelLayout
from atorch.strategy import Strategy, StrategyItem
from atorch.strategy_search.cluster.model_shapes import stats_of
from atorch.strategy_search.cluster.plan_terms import TransformerShape, predict_transformer
from atorch.strategy_search.cluster.precision import REGIMES, default_regime
from atorch.strategy_search.costing.analyser import ModelStats
from atorch.strategy_search.costing.cost_model import Prediction, predict
from atorch.strategy_search.costing.hardware import HardwareProfile

SHARDINGS = ("none", Zero1.name, Zero2.name, FSDP.name)  # a layout's sharding: none or the method's name
RECOMPUTE = ("none", "full")  # atorch's checkpoint method recomputes whole blocks; selective is the cost model's only
SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe")
# published schedules atorch does not run: evaluated for --layout only (matched on an enumerated layout of the first
# schedule, then evaluated with their own terms), their strategies written with the second, atorch's nearest (DualPipe
# as DualPipeV: the same overlapped forward and backward of two micro-batches, two stages per rank folded into a V,
# one copy of the parameters where DualPipe keeps two)
FOREIGN_SCHEDULES = {"dualpipe": ("1f1b", "dualpipev")}
MAX_MICRO_BATCH = 16
MAX_VIRTUAL_STAGES = 8  # enumerated; ``--layout`` may ask for more, down to one layer per virtual stage
LAYOUT_KEYS = ("tensor", "pipeline", "data", "sharding", "recompute", "schedule", "virtual_stages",
               "sequence_parallel", "micro_batch_size", "expert", "fp8", "context")
# The memory figure's error band: the analytical cost model's measured error (the same band the automatic search
# allows its analytical predictions, strategy_search.search.automatic.ANALYTICAL_MEMORY_BAND; the transformer terms came
# within 1-6% of one H100's peak, bench/plan.py --gpu-check)
MEMORY_BAND = 0.15
EXPERT_METHOD = ExpertParallel.name  # the registry's method that splits experts over an 'expert' dimension
# Context parallel is enumerated for long sequences only (Llama 3 used it from 131k tokens; below this the
# activations of a sequence fit with tensor parallel and recompute), in powers of two up to MAX_CONTEXT.
CONTEXT_MIN_SEQ = 32768
MAX_CONTEXT = 32


@dataclass(frozen=True)
class Layout:
    """One point of the plan: the parallel sizes and every choice that makes a Strategy."""

    tensor: int
    pipeline: int
    data: int
    sharding: str
    recompute: str
    schedule: str  # "none" without a pipeline
    virtual_stages: int
    sequence_parallel: bool
    micro_batch_size: int
    micro_batches: int  # per step: the schedule's micro-batches, or gradient accumulation without a pipeline
    # the embedding and LM head split over the tensor ranks (atorch's loss_parallel: without a pipeline only)
    vocab_parallel: bool = False
    expert: int = 1  # a MoE model's experts split over this many of the data ranks (expert ranks are data ranks)
    fp8: bool = False  # the layers' linears in fp8 (atorch's fp8 method; evaluated for --layout only)
    # each sequence split over this many ranks (context_parallel), besides tensor × pipeline × data
    context: int = 1

    @property
    def gpus(self) -> int:
        return self.tensor * self.context * self.pipeline * self.data

    def structure(self) -> tuple[Any, ...]:
        return (self.tensor, self.pipeline, self.sharding, self.recompute, self.schedule, self.virtual_stages,
                self.sequence_parallel, self.vocab_parallel, self.expert, self.fp8, self.context)

    def describe(self) -> str:
        text = f"t{self.tensor}" + (f"·c{self.context}" if self.context > 1 else "") + \
            f"·p{self.pipeline}·d{self.data}" + (f"·e{self.expert}" if self.expert > 1 else "")
        if self.pipeline > 1:
            text += f" {self.schedule}" + (f"×{self.virtual_stages}" if self.virtual_stages > 1 else "")
        return text


@dataclass
class Plan:
    layout: Layout
    prediction: Prediction
    fits: bool
    over_by: int  # bytes above the memory per GPU (0 when it fits)
    tokens_per_s: float
    tflops_per_gpu: float  # hardware FLOPs (recompute included), Megatron's definition
    model_tflops_per_gpu: float
    mfu: float
    problems: tuple[str, ...] = ()  # the rules' reasons where atorch cannot run it (only a given layout)
    given: bool = False
    strategy: Strategy | None = field(default=None, repr=False)
    precision: str = AmpNative.name  # the precision regime its memory is counted in (precision.REGIMES)
    peak_tflops: float = 0.0  # the profile's datasheet peak per GPU
    mfu_ceiling: float = 1.0  # the profile's measured matmul rate over that peak: no real run computes faster
    memory_limit: int = 0
    fp8_ceiling_tflops: float = 0.0
    notes: tuple[str, ...] = ()  # how the emitted strategy differs from what was predicted
    moe: dict[str, float] | None = None  # a MoE model's experts on a rank and its all-to-all volume

    @property
    def above_ceiling(self) -> bool:
        """Predicted faster than the matmul rate the profile measured (hardware FLOPs, recompute included): such a
        figure is not believable, whatever the terms say."""
        return bool(self.ceiling_tflops) and self.tflops_per_gpu > self.ceiling_tflops * (1 + 1e-9)

    @property
    def ceiling_tflops(self) -> float:
        """The matmul rate the profile measured, of the fastest matmuls the layout uses (fp8 where it has them)."""
        return self.fp8_ceiling_tflops if self.layout.fp8 and self.fp8_ceiling_tflops else \
            self.mfu_ceiling * self.peak_tflops

    @property
    def memory_range(self) -> tuple[int, int]:
        peak = self.prediction.memory.peak
        return round(peak * (1 - MEMORY_BAND)), round(peak * (1 + MEMORY_BAND))

    @property
    def runs_in_atorch(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        lay, mem, t = self.layout, self.prediction.memory, self.prediction.time
        return {
            # 'context' only where sequences are split (the layouts of short sequences keep their form)
            "layout": {"tensor": lay.tensor, "pipeline": lay.pipeline, "data": lay.data, "expert": lay.expert,
                       **({"context": lay.context} if lay.context > 1 else {})},
            "fp8": lay.fp8, "moe": self.moe,
            "schedule": lay.schedule, "virtual_stages": lay.virtual_stages, "sharding": lay.sharding,
            "recompute": lay.recompute, "sequence_parallel": lay.sequence_parallel,
            "micro_batch_size": lay.micro_batch_size, "micro_batches": lay.micro_batches,
            "fits": self.fits, "over_by_bytes": self.over_by, "memory_per_gpu_bytes": mem.peak,
            "memory_band": MEMORY_BAND, "memory_per_gpu_range_bytes": list(self.memory_range),
            "fits_with_band": self.memory_range[1] <= self.memory_limit, "precision_regime": self.precision,
            "memory": {"parameters": mem.parameters, "gradients": mem.gradients,
                       "optimizer_state": mem.optimizer_state, "activations": mem.activations,
                       "temporary": mem.temporary},
            "step_time_s": t.step,
            "time": {"compute": t.compute, "communication": t.communication, "bubble": t.bubble,
                     "optimizer": t.optimizer},
            "tokens_per_s": self.tokens_per_s, "tflops_per_gpu": self.tflops_per_gpu,
            "model_tflops_per_gpu": self.model_tflops_per_gpu, "mfu": self.mfu, "mfu_ceiling": self.mfu_ceiling,
            "ceiling_tflops_per_gpu": self.ceiling_tflops, "above_mfu_ceiling": self.above_ceiling,
            "given": self.given,
            "runnable": not self.problems, "problems": list(self.problems), "notes": list(self.notes),
            "strategy": json.loads(self.strategy.to_json()) if self.strategy else None,
        }


@dataclass
class PlanResult:
    plans: list[Plan]  # ranked; a given layout's plan first
    considered: int
    seconds: float
    memory_limit: int


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _item(name: str, config: dict[str, Any] | None = None) -> StrategyItem:
    return StrategyItem(name=name, config=registry.get_method(name).parse_config(config or {}))


def strategy_for(lay: Layout) -> Strategy:
    """The Strategy a layout stands for (what ``--emit-strategy`` writes)."""
    names: dict[str, dict[str, Any]] = {AmpNative.name: {"dtype": "bf16"}}
    # expert ranks next to the tensor ranks (inside a node where they fit), then the pipeline
    expert = lay.expert > 1 and EXPERT_METHOD in registry.method_names()
    # context ranks next to the tensor ranks (Llama 3's order: tensor, context, pipeline, data)
    dims = [(n, s) for n, s in (("tensor", lay.tensor), ("context", lay.context), ("expert", lay.expert if expert
                                                                                     else 1),
                                ("pipeline", lay.pipeline)) if s > 1]
    if expert:
        names[EXPERT_METHOD] = {}
    if lay.context > 1:
        names[ContextParallel.name] = {}
    if lay.fp8:
        names[FP8.name] = {}
    if dims:
        names[ParallelMode.name] = {"dims": [*dims, ("data", -1)]}
    tensor = {"sequence_parallel": lay.sequence_parallel, "loss_parallel": lay.vocab_parallel}
    pipe: dict[str, Any] = {"schedule": FOREIGN_SCHEDULES[lay.schedule][1] if lay.schedule in FOREIGN_SCHEDULES
                            else lay.schedule,
                            "micro_batches": lay.micro_batches}
    if lay.schedule == "interleaved_1f1b":
        pipe["virtual_stages"] = lay.virtual_stages
    if lay.tensor > 1 and lay.pipeline > 1:
        names[MixedParallel.name] = {"tensor": tensor, "pipeline": pipe}
    elif lay.tensor > 1:
        names[TensorParallel.name] = tensor
    elif lay.pipeline > 1:
        names[PipelineParallel.name] = pipe
    if lay.recompute == "full":
        names[ActivationCheckpoint.name] = {}
    if lay.sharding != "none":
        names[lay.sharding] = {}
    return Strategy(methods=tuple(_item(n, names[n]) for n in registry.apply_order() if n in names))


@lru_cache(maxsize=4096)
def _problems(structure: tuple[Any, ...], gpus: int) -> tuple[str, ...]:
    t, p, sharding, recompute, schedule, v, sp, vocab, ep, fp8, cp = structure
    lay = Layout(t, p, gpus // (t * p * cp), sharding, recompute, schedule, v, sp, 1, max(2 * p, 1), vocab, ep, fp8,
                 cp)
    found = list(strategy_for(lay).problems(gpus))
    if schedule in FOREIGN_SCHEDULES:
        found.append(f"atorch has no {schedule} schedule: the strategy is written with "
                     f"{FOREIGN_SCHEDULES[schedule][1]}, its nearest (torch's DualPipeV: two stages per rank in a V, "
                     "one copy of the parameters)")
    if ep > 1 and EXPERT_METHOD not in registry.method_names():
        found.append(f"an expert dimension needs an '{EXPERT_METHOD}' method, which this atorch version's registry "
                     f"does not have: the strategy is written without it (every rank would hold every expert)")
    return tuple(found)


def _micro_batch_sizes(per_rank: int, pipeline: int) -> list[int]:
    return [b for b in _divisors(per_rank) if b <= MAX_MICRO_BATCH and per_rank // b >= pipeline]


def layouts(shape: TransformerShape, gpus: int, gpus_per_node: int, global_batch: int,
            virtual_stages: int | None = None, context: int | None = None) -> Iterator[Layout]:
    """Every layout of ``gpus`` the model's sizes admit (the rules are checked apart); ``virtual_stages``: also that
    many per rank where it exceeds the enumerated ones (at most one layer per virtual stage); ``context``: also that
    context size at a sequence shorter than CONTEXT_MIN_SEQ (a layout given as published: Megatron-Bridge's 405B
    splits 8,192 tokens over 2)."""
    for t in _divisors(min(gpus, gpus_per_node)):
        if gpus % t or shape.heads % t or (shape.kv_heads % t and t % shape.kv_heads):
            continue
        # context sizes (long sequences only): powers of two whose 2·c chunks divide the sequence
        sizes = {2 ** k for k in range(1, MAX_CONTEXT.bit_length()) if shape.seq >= CONTEXT_MIN_SEQ} | (
            {context} if context and context > 1 else set())
        contexts = [1] + [size for size in sorted(sizes) if (gpus // t) % size == 0 and shape.seq % (2 * size) == 0]
        for c, p in [(size, p) for size in contexts for p in _divisors(gpus // t // size)]:
            if p > shape.layers:
                continue
            dp = gpus // (t * p * c)
            if global_batch % dp:
                continue
            # a MoE model's expert dimension: a size dividing the experts and the data ranks
            experts = [e for e in _divisors(dp) if shape.experts % e == 0] if shape.moe else [1]
            schedules: list[tuple[str, int]] = [("none", 1)] if p == 1 else [("1f1b", 1), ("gpipe", 1)]
            if p > 1:  # atorch splits the blocks as evenly as it can: the stages need not hold equal counts
                extra = {virtual_stages} if virtual_stages and virtual_stages > MAX_VIRTUAL_STAGES else set()
                schedules += [("interleaved_1f1b", v) for v in sorted(set(range(2, MAX_VIRTUAL_STAGES + 1)) | extra)
                              if p * v <= shape.layers]
            for schedule, v in schedules:
                # sharding spans the data × context ranks (the gradients are reduced over both)
                for sharding in SHARDINGS if dp * c > 1 else ("none",):
                    for recompute in RECOMPUTE:
                        # atorch's vocabulary split needs a tensor dimension and no pipeline; its sequence parallel
                        # a tensor dimension (the stages exchange sequence shards).
                        split = t > 1 and p == 1
                        for sp in ((False, True) if t > 1 and shape.seq % t == 0 else (False,)):
                            for b in _micro_batch_sizes(global_batch // dp, p):
                                m = global_batch // dp // b
                                if schedule == "interleaved_1f1b" and m % p:
                                    continue  # the interleaved schedule runs micro-batches in groups of p
                                for ep in experts:
                                    yield Layout(t, p, dp, sharding, recompute, schedule, v, sp, b, m, split, ep,
                                                 context=c)


def regime_of(shape: TransformerShape, lay: Layout, precision: str | None, runnable: bool) -> str:
    """The precision regime a layout is evaluated in: the one asked for, else the shape's (16 bits throughout, no
    autocast: Megatron-LM's), else the layout's default (``default_regime``)."""
    if precision is not None and precision not in REGIMES:
        raise SetupError([f"--precision-regime must be one of {list(REGIMES)}, got {precision!r}"])
    if precision or shape.precision:
        return precision or str(shape.precision)
    return "megatron" if not shape.autocast else default_regime(lay.sharding, lay.tensor, runnable)


def _regime_notes(lay: Layout, regime: str) -> tuple[str, ...]:
    """Where the emitted strategy's precision is not the regime the plan was predicted in (atorch runs amp_native:
    autocast over fp32 weights, with FSDP2's mixed-precision policy under zero2/fsdp)."""
    as_zero2 = lay.sharding == Zero1.name and lay.tensor > 1
    atorch_runs = "fsdp_mixed" if lay.sharding in (Zero2.name, FSDP.name) or as_zero2 else AmpNative.name
    notes = (("zero1 across the tensor dimension runs as zero2 in atorch (FSDP2 over the data dimension: the "
              "gradients are sharded too, ZeroRedundancyOptimizer cannot partition tensor-parallel parameters)"
              + ("; predicted as Megatron-LM's distributed optimizer" if regime == "megatron" else
                 "; predicted so"),) if as_zero2 else ())
    if regime == atorch_runs:
        return notes
    return (f"predicted in the {regime} regime ({REGIMES[regime].summary}); the emitted strategy runs "
            f"{atorch_runs} ({REGIMES[atorch_runs].summary})", *notes)


def evaluate(shape: TransformerShape, lay: Layout, profile: HardwareProfile, global_batch: int,
             memory_limit: int, strategy: Strategy | None = None, stats: ModelStats | None = None,
             precision: str | None = None, runnable: bool = True) -> Plan:
    """One layout's plan: ``predict`` with the transformer terms, and the figures a plan reports. With the
    analyser's ``stats`` of the model, ``predict`` uses the automatic search's own terms instead (measured
    per-operation and DTensor costs: what ranks small models on the local processes)."""
    strategy = strategy or strategy_for(lay)
    regime = regime_of(shape, lay, precision, runnable)
    per_layout = {"precision": regime, "expert_ranks": lay.expert, "dualpipe": lay.schedule == "dualpipe",
                  "context_ranks": lay.context}
    if stats is None and any(getattr(shape, k) != v for k, v in per_layout.items()):
        shape = shape.model_copy(update=per_layout)
    predicted = strategy
    if regime == "megatron" and lay.tensor > 1 and not lay.vocab_parallel and stats is None:
        # Megatron-LM always splits the embedding and the LM head over the tensor ranks (atorch's loss_parallel
        # only without a pipeline): predicted so, the emitted strategy keeps atorch's choice
        predicted = strategy_for(replace(lay, vocab_parallel=True))
    context = (("context", lay.context),) if lay.context > 1 else ()
    mesh = ParallelLayout((("tensor", lay.tensor), *context, ("pipeline", lay.pipeline), ("data", lay.data)))
    accumulation = 1 if lay.pipeline > 1 else lay.micro_batches  # a pipeline's micro-batches are its schedule's
    if stats is not None:
        pred = predict(stats, strategy, mesh, profile, global_batch, accumulation)
    else:
        pred = predict_transformer(shape, _stats(shape), predicted, mesh, profile, global_batch, accumulation)
    gpus = lay.gpus
    tokens = global_batch * shape.seq
    step = pred.time.step
    model_flops = shape.model_flops_per_token() * tokens
    hardware_flops = model_flops + shape.recompute_flops_per_token(lay.recompute) * tokens
    dtype = "bfloat16" if "bfloat16" in profile.matmul_tflops else "float32"
    peak = profile.matmul_tflops.get(dtype, 0.0)
    over = max(0, pred.memory.peak - memory_limit)
    return Plan(layout=lay, prediction=pred, fits=over == 0, over_by=over, tokens_per_s=tokens / step,
                tflops_per_gpu=hardware_flops / step / gpus / 1e12,
                model_tflops_per_gpu=model_flops / step / gpus / 1e12,
                mfu=model_flops / step / gpus / (peak * 1e12) if peak else 0.0, strategy=strategy,
                precision=regime, peak_tflops=peak, mfu_ceiling=profile.matmul_efficiency.get(dtype, 1.0),
                memory_limit=memory_limit, fp8_ceiling_tflops=profile.matmul_tflops.get("float8", 0.0)
                * profile.matmul_efficiency.get("float8", 1.0),
                notes=_regime_notes(lay, regime) if stats is None else (),
                moe=_moe_figures(shape, lay) if shape.moe else None)


def _moe_figures(shape: TransformerShape, lay: Layout) -> dict[str, float]:
    """What a MoE layout puts on a rank: its experts per layer, their parameters on the busiest stage, and the
    bytes one MoE layer's all-to-alls send per micro-batch (dispatch and combine, forward and backward)."""
    stage_layers = -(-shape.layers // lay.pipeline)
    tokens = lay.micro_batch_size * shape.seq
    return {"experts_per_rank": shape.experts / lay.expert,
            "expert_params_per_rank": stage_layers * shape.layer_expert_params() / lay.tensor / lay.expert,
            "all_to_all_bytes_per_layer": 4 * tokens * shape.all_to_all_bytes_per_token() * (lay.expert - 1)
            / lay.expert}


@lru_cache(maxsize=64)
def _stats(shape: TransformerShape) -> Any:
    return stats_of(shape)


def _matches(lay: Layout, wanted: dict[str, Any]) -> bool:
    # fp8 and foreign schedules are not enumerated: matched on the rest, then set (plan_job)
    return all(getattr(lay, k) == (FOREIGN_SCHEDULES[v][0] if k == "schedule" and v in FOREIGN_SCHEDULES else v)
               for k, v in wanted.items() if k != "fp8")


def parse_layout(text: str) -> dict[str, Any]:
    """``tensor=8,pipeline=35,sharding=zero1,...`` -> the fields given (the rest are the planner's)."""
    aliases = {"tp": "tensor", "pp": "pipeline", "dp": "data", "virtual": "virtual_stages", "vp": "virtual_stages",
               "mbs": "micro_batch_size", "micro_batch": "micro_batch_size", "sp": "sequence_parallel",
               "ep": "expert", "cp": "context"}
    wanted: dict[str, Any] = {}
    problems = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        key = aliases.get(key.strip(), key.strip())
        if key not in LAYOUT_KEYS or not value:
            problems.append(f"--layout: {part!r} is not key=value with a key in {list(LAYOUT_KEYS)}")
            continue
        value = value.strip()
        if key in ("sequence_parallel", "fp8"):
            wanted[key] = value.lower() in ("1", "true", "yes", "on")
        elif key in ("sharding", "recompute", "schedule"):
            choices = {"sharding": SHARDINGS, "recompute": RECOMPUTE,
                       "schedule": (*SCHEDULES, *FOREIGN_SCHEDULES, "none")}[key]
            if value not in choices:
                problems.append(f"--layout: {key} must be one of {list(choices)}, got {value!r}")
            wanted[key] = value
        else:
            try:
                wanted[key] = int(value)
            except ValueError:
                problems.append(f"--layout: {key} takes a whole number, got {value!r}")
    if problems:
        raise SetupError(problems)
    return wanted


def check_job(gpus: int, gpus_per_node: int, global_batch: int, seq: int) -> None:
    problems = []
    if gpus < 1 or gpus_per_node < 1 or global_batch < 1 or seq < 1:
        problems.append("--gpus, --gpus-per-node, --global-batch and --seq must be at least 1")
    elif gpus > gpus_per_node and gpus % gpus_per_node:
        problems.append(f"{gpus} GPUs is not a whole number of {gpus_per_node}-GPU nodes: use a multiple of "
                        f"{gpus_per_node} (e.g. {gpus // gpus_per_node * gpus_per_node} or "
                        f"{(gpus // gpus_per_node + 1) * gpus_per_node})")
    if problems:
        raise SetupError(problems)


def plan_job(shape: TransformerShape, gpus: int, global_batch: int, profile: HardwareProfile,
             gpus_per_node: int | None = None, memory_limit: int | None = None,
             given: dict[str, Any] | None = None, stats: ModelStats | None = None,
             precision: str | None = None) -> PlanResult:
    """Every runnable layout, predicted and ranked; a ``given`` layout's best completion first. ``stats``: see
    ``evaluate``; ``precision``: the regime every layout is counted in (None: each layout's default)."""
    start = time.perf_counter()
    per_node = gpus_per_node or profile.gpus_per_node or profile.local_world_size
    check_job(gpus, per_node, global_batch, shape.seq)
    limit = memory_limit or profile.memory_per_rank
    profile = profile.model_copy(update={"gpus_per_node": per_node}) if per_node != profile.gpus_per_node else profile
    plans: list[Plan] = []
    given_plans: list[Plan] = []
    considered = 0
    for lay in layouts(shape, gpus, per_node, global_batch, (given or {}).get("virtual_stages"),
                       (given or {}).get("context")):
        considered += 1
        wanted = given is not None and _matches(lay, given)
        if wanted and given and (given.get("fp8") or given.get("schedule") in FOREIGN_SCHEDULES):
            lay = replace(lay, fp8=bool(given.get("fp8")), schedule=given.get("schedule", lay.schedule))
        if lay.sharding == Zero1.name and (lay.tensor > 1 or lay.expert > 1) and not wanted:
            continue  # atorch runs it as zero2 (zero1.runs_on_fsdp2): ranked once, as zero2
        problems = _problems(lay.structure(), gpus)
        if problems and not wanted:
            continue
        plan = evaluate(shape, lay, profile, global_batch, limit, stats=stats, precision=precision,
                        runnable=not problems)
        plan.problems = problems
        if not problems:
            plans.append(plan)
        if wanted:
            given_plans.append(plan)
    if not considered:
        raise SetupError([f"no layout divides {gpus} GPUs for a global batch of {global_batch}: the data size "
                          f"(GPUs / (tensor × pipeline)) must divide the global batch and the pipeline size must not "
                          f"exceed the {shape.layers} layers; choose a global batch that is a multiple of the GPU "
                          f"count, or a GPU count that divides it"])
    if given is not None and not given_plans:
        raise SetupError([f"no layout of {gpus} GPUs matches --layout {given}: check that its sizes multiply to "
                          f"the GPU count, tensor divides {per_node} and the heads ({shape.heads}), the micro-"
                          f"batch divides the per-rank batch, pipeline × virtual_stages is at most the "
                          f"{shape.layers} layers and, interleaved, the micro-batches are a multiple of the pipeline "
                          f"size"])
    ranked = sorted(plans, key=_rank)
    if given_plans:
        best = min(given_plans, key=lambda plan: (bool(plan.problems), *_rank(plan)))  # runnable completions first
        best.given = True
        ranked = [best, *(p for p in ranked if p is not best)]
    return PlanResult(plans=ranked, considered=considered, seconds=time.perf_counter() - start, memory_limit=limit)


def _rank(plan: Plan) -> tuple[bool, float]:
    return (not plan.fits, plan.prediction.time.step if plan.fits else float(plan.over_by))


def smallest_fitting_cluster(shape: TransformerShape, global_batch: int, profile: HardwareProfile,
                             gpus_per_node: int, memory_limit: int, max_nodes: int = 1 << 14) -> int | None:
    """The fewest GPUs (whole nodes, doubling) on which some layout fits, trying the memory-lightest
    choices only (full recompute, FSDP, micro-batch 1, sequence parallel): None if even ``max_nodes`` do not."""
    nodes = 1
    while nodes <= max_nodes:
        gpus = nodes * gpus_per_node
        for lay in layouts(shape, gpus, gpus_per_node, global_batch):
            if (lay.recompute != "full" or lay.micro_batch_size != 1 or lay.schedule == "gpipe"
                    or (lay.data > 1 and lay.sharding != FSDP.name) or (lay.tensor > 1 and not lay.sequence_parallel)):
                continue
            if _problems(lay.structure(), gpus):
                continue
            if evaluate(shape, lay, profile, global_batch, memory_limit).fits:
                return gpus
        nodes *= 2
    return None


def humanize_count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"

