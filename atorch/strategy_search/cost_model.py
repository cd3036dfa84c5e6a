"""Cost model: predicted peak memory per rank and step time of a strategy, from its arguments alone.

``predict(stats, strategy, layout, profile, global_batch, micro_batches)`` is a pure function: the
model's statistics (``analyser.ModelStats``), the strategy, the parallel layout and a hardware profile
(measured here or read from a table for another cluster) are all it reads, so a plan for a 1,000-GPU
job can be made on a laptop. Every term is analytical and listed here; the constants marked
"calibrated" were fitted against ``bench/cost_model.py``, which measures each candidate with the
dry-run the search uses (``atorch.dryrun``: the peak increase of live tensor bytes over a baseline taken
before the candidate is built, over build and warm-up, max over ranks; median step time after
warm-up), on a small GPT-2, an MLP and a small ResNet at 2 ranks (see bench/README.md).

For a transformer whose shape is known (``predict(..., transformer=TransformerShape(...))``, what ``atorch plan``
passes), the activation, FLOP and communication terms are the transformer terms at the end of this module
(Megatron-LM's formulas, hierarchical collectives across nodes); without it every term below applies as is.

Memory from the program: the search (``automatic.py``) takes a candidate's peak memory from
``tracing.py`` wherever tracing covers it — the real build and two training steps on fake tensors and the
fake process group, counted by torch's ``MemTracker`` — and from this model only where tracing does not
(DeepSpeed's ZeRO, pipeline schedules, fp16 autocast, tensor-parallel replicas without sharding; see
tracing.py) or a family's trace failed. This analytical memory stays pure and fast for those, for plans made
without the model's code (a cluster planner), and for step time, which is analytical throughout. Of the
constants below, only ``DDP_PERSISTENT`` enters a traced figure (DDP's C++ reducer is invisible to the trace):
measured, not fitted. The ones marked "calibrated" were fitted on bench/cost_model.py's ``gpt2``, ``mlp`` and
``cnn`` (the bench reports those models apart from the held-out ones).

Notation: ``dp`` = data-parallel size, ``P`` = trainable parameter bytes (fp32 as built), ``F`` = frozen
parameter bytes, ``B`` = buffer bytes, ``k`` = ``optimizer_state_factor`` (states per parameter: AdamW 2,
SGD with momentum 1, plain SGD 0), ``m`` = samples per micro-batch on one rank =
``global_batch / dp / micro_batches``, ``A`` = activation bytes saved for backward at ``m`` samples
(the analyser's figure at ``stats.batch_size`` scaled linearly).

Memory per rank (bytes). The state that lives across steps — parameters, optimizer state and the
wrappers' persistent buffers — plus the largest of three phases:

* forward (end of forward / start of backward): activations ``A`` at ``m`` samples, plus the output's
  gradient and the loss's temporaries (calibrated: ``LOSS_TEMP_FACTOR`` × the largest saved tensor; with
  recompute, part of them is freed before the largest block is recomputed, so the factor is smaller),
  plus the gathered parameters that exist then;
* backward: the activations plus the gathered parameters and unsharded gradients that exist then. At one
  micro-batch per step the saved activations are freed as the gradients appear (gradients are None at
  the start of a step), so it holds the larger of the two, not their sum; with gradient accumulation
  the micro-batches after the first run forward and backward with every gradient already there, so both
  phases add the gradients
  (FSDP2's unsharded ones in the compute dtype: atorch turns its gradient sync off for all micro-batches
  but the last, and FSDP2 then accumulates unsharded gradients);
* optimizer (the step): the gradients plus the optimizer's temporaries. On an accelerator torch's foreach
  AdamW takes the square root of every second moment a rank owns at once and works in place after it:
  ``OPTIMIZER_TEMP_PER_STATE`` (0.5) × ``k`` × the owned parameters (checked on an H100: 321.13 MiB
  predicted, 321.14 measured, for a 64 MiB MLP whose peak is its step). On a CPU torch has no foreach
  kernels and runs its single-tensor loop, whose ``sqrt() / c`` holds two temporaries of one parameter:
  ``SINGLE_TENSOR_TEMP_PER_STATE`` (1.0) × ``k`` × the largest parameter (a shard of it under FSDP).
  DeepSpeed steps on its flat fp32 partition, one tensor, and measures as the foreach term on it
  (calibrated on the small GPT-2's DeepSpeed rows).

``peak_phase`` says which phase won; ``temporary`` is the persistent buffers plus that phase's
temporaries (so parameters + optimizer_state + temporary + that phase's activations or gradients = peak).
Gradients are set to None after each step (``train_step``), so they do not coexist with the forward's
activations; in steady state (the second step on) the optimizer state exists during forward and backward. Per method:

* plain / DDP: ``P + F + B`` parameters, ``P`` gradients, ``k·P`` optimizer state (in the parameter
  dtype). DDP (dp > 1) keeps its reducer's buckets, one gradient-sized copy, from construction on
  (``DDP_PERSISTENT`` = 1 × ``P``, measured).
* zero1 (ZeroRedundancyOptimizer under DDP): optimizer state ``k·P / dp``; the step also holds part of
  the other ranks' updated parameters as they are broadcast (calibrated ``ZERO1_BROADCAST_FRACTION`` ×
  ``P (dp−1)/dp``: ZeroRedundancyOptimizer broadcasts per parameter, so how many coexist with the step's
  temporaries depends on the partition); the rest as DDP.
* zero1 / zero2 with ``implementation: deepspeed`` (tracing cannot build its engine; derived from DeepSpeed
  0.19's deepspeed/runtime/zero/stage_1_and_2.py, each term checked against the live storages at the
  dry-run's peak): every parameter stays in the module (one flat buffer, ``P + F + B``), an fp32 copy of the
  rank's partition (``P / dp``), state ``k·P / dp``, and from the first gradient hook on the reduce bucket
  (``setup_buckets``: ``reduce_bucket_size`` fp32 elements; atorch passes min(DeepSpeed's default, the trainable
  elements), so ``P`` here); gradients ``P / dp`` (zero2) or ``P`` (zero1). The reduction at the end of a
  backward (``independent_gradient_partition_epilogue``) is a phase of its own: ``allreduce_bucket`` flattens
  the bucket's gradients (one more bucket) and ``copy_grads_in_partition`` copies this rank's part into
  ``grads_in_partition`` (the parameters of its partition, whole: ``P / dp`` and the ones straddling its start
  or end; ``get_partition_info``); ZeRO-2 does this every micro-batch, and under accumulation the previous
  micro-batch's partition is freed only by Python's cycle collector, so one or two exist then, by its timing
  (``ZERO2_ACCUMULATED_PARTITIONS``: the midpoint); ZeRO-1 reduces at the boundary only. Its step holds the
  gradient partition (``P / dp``, zero1 too: the full gradients are
  reduced into it and freed) and, zero2 under gradient accumulation, the accumulated partition besides.
* fsdp (FSDP2, reshard after forward): parameters, gradients and state ``/ dp``; the root unit (everything
  outside the repeated blocks) stays gathered across steps (calibrated ``FSDP_ROOT_PERSISTENT`` = 2 × its
  gathered bytes: the parameters and their all-gather buffer); a block unit is gathered while it runs, so
  the forward's peak (at the head) holds none and the backward one (``unit``). With gradient accumulation
  FSDP2 accumulates unsharded gradients in the reduce dtype (fp32) while atorch keeps the sync off.
* zero2 (FSDP2 without resharding after forward; ``reshard_after_forward: false`` alike): as fsdp, but
  every block stays gathered from its forward until its own backward has run. The end of the forward and
  the start of the blocks' backward hold all of them (no block recomputed yet); from there one block is
  resharded after each block's backward, and the backward goes on as fsdp's. The peak is the larger of the
  two: with recompute, the start (measured block by block on bench/search.py's GPT-2s: 4 blocks and 64
  blocks, within 1%).
* tensor / pipeline parallel (``t`` × ``p`` ranks per model replica): the repeated blocks' parameters,
  gradients and state are split ``t·p`` ways (a single key/value head's projections, which tensor parallel
  keeps whole: ``p`` ways); the rest (embeddings, head: the vocabulary is kept whole)
  stays whole on a rank (the first / last stage under pipeline parallel: that stage is counted). A
  block's saved activations shrink to ``TP_REPLICATED_ACTIVATIONS + (1 − that) / t`` (norms and residuals
  are replicated); a stage holds ``1/p`` of the blocks for each micro-batch in flight: ``p`` of them
  under 1f1b and the interleaved schedules, all under gpipe. The schedule's micro-batches accumulate
  into the stage's gradients like gradient accumulation.
* cpu_offload (with fsdp / zero2): the sharded parameters, gradients and state live in host memory: on
  a CUDA device the device figure leaves them out (``host_bytes`` holds them); on a CPU device host
  memory is the device's, and nothing changes.
* amp_native: parameters stay fp32; under FSDP the gathered copies are in the autocast dtype (half);
  without FSDP autocast caches a 16-bit cast of every weight until the forward ends (``(P + F) / 2``);
  activations: matmul / convolution outputs are saved in 16 bits, the rest in 32: the share is the
  analyser's (the same forward run under bf16 autocast on fake tensors, weight casts left out: 0.57 for
  the small GPT-2, 0.50 for the ResNet), or the calibrated ``AMP_ACTIVATION_FACTOR`` (0.6) without it.
* half: every parameter, gradient, state and activation in 16 bits (half of each fp32 figure).
* checkpoint (every repeated block): a block keeps only its inputs (the analyser's ``input_bytes_total``;
  for statistics without it, calibrated ``CHECKPOINT_INPUT_FRACTION`` of the blocks' saved bytes) and one
  block's activations exist again during its recompute: ``A_outside + Σ block inputs + the largest block``;
  the backward of an attention block (the analyser saw attention or a softmax run in it) also holds their
  gradients as it runs through the block (the largest such block once more; measured on GPT-2, while the
  ResNet's convolution blocks fit within 4% without it).

Known limits of the memory model against the dry-run (bench/README.md): DeepSpeed's memory on a CPU depends on
when Python's cycle collector runs (ZeRO-2 under accumulation: one or two gradient partitions; the bench's rows
flip between runs), predicted within half a partition of either outcome; an fp16 trial whose loss scale never
lets a warm-up step through is failed, not measured.

Step time (seconds): compute + overhead + exposed communication + optimizer (elementwise traffic).

* compute = FLOPs per sample (forward+backward) × samples per rank per step / matmul throughput of the
  compute dtype (fp32; bf16/fp16 under amp_native or half) at the model's average matmul size (the side of a
  square matmul with the FLOPs of one of the analyser's forward matmuls at this micro-batch, split by tensor
  parallel; the profile's rate by size, interpolated); checkpoint adds one more forward of the blocks.
* overhead = operations × the profile's per-operation latency (``op_latency_s``: Python, the dispatcher,
  a kernel launch), which dominates small models. Operations per micro-batch are the analyser's counts
  of aten operations in forward and backward (independent of the batch size); checkpoint adds the
  blocks' forward operations (recompute); amp_native adds ``AMP_CAST_OPS`` per matmul / convolution /
  attention of the forward (two input casts and their backward); the optimizer step runs
  ``OPTIMIZER_OPS`` foreach operations (2 + 4 per state: AdamW's lerp, mul, addcmul, sqrt, div, add,
  addcdiv and weight decay); FSDP runs ``FSDP_UNIT_OPS`` per unit and ``FSDP_PARAM_OPS`` per parameter
  (calibrated: FSDP2's parameters are DTensors, whose per-parameter work costs tens of plain operations)
  around each all-gather and reduce-scatter;
  DeepSpeed's ZeRO runs ``DEEPSPEED_PARAM_OPS`` per parameter and micro-batch (its gradient hook, the copy
  into its bucket and into the fp32 partition, the updated parameter copied back: Python per parameter).
* tensor / pipeline parallel: a rank computes its share of the matmuls (the blocks' FLOPs split
  ``t·p`` ways, parameter bytes as the proxy for FLOPs), the busiest stage runs ``1/p`` of the blocks'
  operations and all of those outside them (the embedding's on the first stage, the head's and the loss's on
  the last, as their parameters stay whole; the blocks' share of the backward taken as of the forward), and the
  pipeline's fill and drain idle each stage: × ``(n + p − 1) / n`` for ``n`` micro-batches. Tensor
  parallel adds ``TP_BLOCK_OPS`` all-reduces of a block's hidden states per block and micro-batch;
  pipeline parallel sends each micro-batch's hidden states forward and their gradient back. Each layer the
  tensor-parallel plan splits runs as DTensor operations, whose dispatch the profile measures
  (``tensor_parallel_linear_s`` per layer and micro-batch, its forward's part again under checkpoint,
  ``dtensor_param_step_s`` per DTensor parameter and optimizer step, scaled by the optimizer's foreach
  operations against AdamW's): on a CPU it is milliseconds per layer, most of a small model's step.
* communication: a collective of ``n`` bytes costs ``n·f / busbw + latency`` (nccl-tests convention,
  ``f`` = 2(dp−1)/dp for all-reduce, (dp−1)/dp for all-gather and reduce-scatter). DDP: all-reduce of
  ``P`` in 25 MB buckets; zero1: the same + the updated parameters sent from their owners (torch's
  ZeroRedundancyOptimizer: one broadcast per parameter; DeepSpeed: bucketed all-gathers); zero2: one all-gather
  of the parameters per micro-batch + reduce-scatter of the gradients; fsdp: all-gather in forward and
  again in backward (reshard after forward) + reduce-scatter, one collective per unit; every step
  all-reduces its loss (one latency). Gathers move 16-bit parameters under amp_native; gradients are
  reduced in fp32. With gradient accumulation only the last micro-batch reduces under DDP; FSDP gathers
  on every micro-batch. Exposed communication = ``(1 − overlap) ×`` that: ``overlap = 0`` (the default)
  assumes nothing overlaps (right for gloo on CPU, where the collectives run on the same cores); on
  GPUs pass the fraction hidden behind compute.
* optimizer (elementwise traffic at the profile's ``memory_bytes_per_s``): the update makes
  ``OPTIMIZER_PASSES`` = 4 + 8k passes over the parameter bytes a rank owns (AdamW: 20, counted from its
  foreach operations: reads and writes of parameters, gradients and the two states, and the temporary
  denominator); DDP copies gradients into and out of its buckets (2 × ``P``) and FSDP its gathered
  parameters and reduce-scatter inputs (2 × the bytes gathered and reduced).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from atorch.opt_lib.deepspeed_zero import DEEPSPEED_BUCKET_ELEMENTS
from atorch.parallel_layout import ParallelLayout
from atorch.strategy import Strategy
from atorch.strategy_search.analyser import ModelStats
from atorch.strategy_search.hardware import HardwareProfile
from atorch.strategy_search.precision import REGIMES, PrecisionRegime, default_regime, rank_bytes

# Where each constant comes from: "calibrated" = fitted on bench/cost_model.py's gpt2 / mlp / cnn (bench/README.md
# "Cost model"); "measured" = read off one dry-run or a kernel's code; the rest are counts from torch's code.
# Traced memory (tracing.py) uses DDP_PERSISTENT only; the memory constants serve the untraced candidates. DeepSpeed's
# memory terms have no constant of their own: its bucket size is atorch's (DEEPSPEED_BUCKET_ELEMENTS, imported).
AMP_ACTIVATION_FACTOR = 0.6  # share of fp32 activation bytes kept under autocast (matmul outputs in 16 bits)
CHECKPOINT_INPUT_FRACTION = 0.03  # without the analyser's block inputs: their share of the blocks' saved bytes
LOSS_TEMP_FACTOR = (2.5, 1.5)  # output, its gradient, the loss's temporaries x largest saved (without, with recompute)
ZERO1_BROADCAST_FRACTION = 0.5  # share of the other ranks' updated parameters alive at zero1's step peak
OPTIMIZER_TEMP_PER_STATE = 0.5  # foreach step's temporaries per state x owned bytes (AdamW: 1 x; H100: to 0.01%)
SINGLE_TENSOR_TEMP_PER_STATE = 1.0  # single-tensor loop's, per state x the largest tensor (AdamW: sqrt, then / c)
DDP_PERSISTENT = 1.0  # DDP reducer's buckets (x P), alive from construction on
FSDP_ROOT_PERSISTENT = 2.0  # FSDP2's root unit: gathered bytes kept across steps (the parameters and their buffer)
# DeepSpeed ZeRO-2 under accumulation: grads_in_partition buffers alive at a reduction: 1 or 2 by the cycle
# collector's timing (see predict); the midpoint of the two outcomes, not fitted
ZERO2_ACCUMULATED_PARTITIONS = 1.5
DEFAULT_MEMORY_BYTES_PER_S = 5e9  # a profile without memory_bytes_per_s (an older table)
AMP_CAST_OPS = 4  # per autocast matmul: its two inputs cast in forward, and those casts' backward
OPTIMIZER_OPS = (2, 4)  # foreach operations of an optimizer step: 2 + 4 per state (AdamW: 10)
OPTIMIZER_PASSES = (4, 8)  # passes over the parameter bytes of an update: 4 + 8 per state (AdamW: 20)
FSDP_UNIT_OPS = 6  # operations FSDP2 runs per unit around each collective (copy-in, split, copy-out, hooks)
FSDP_PARAM_OPS = 30  # ... and per parameter: DTensor work (wrapping, views into the gathered buffer, its sharded
# gradient) costs tens of plain operations; calibrated on bench/search.py's small GPT-2 and ResNet spaces
DEEPSPEED_PARAM_OPS = 8  # DeepSpeed ZeRO's Python work per parameter and micro-batch (calibrated, bench/README.md)
DDP_BUCKET_BYTES = 25 * 1024 * 1024
SHARDED = ("fsdp", "zero2")
TP_REPLICATED_ACTIVATIONS = 10 / 34  # share of a block's saved bytes tensor parallel does not split (Megatron)
TP_BLOCK_OPS = 4  # collectives per block and micro-batch under tensor parallel (2 in forward, 2 in backward)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class MemoryPrediction(_Frozen):
    """Peak device bytes per rank and its terms (see the module docstring for how they make ``peak``)."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    temporary: int  # DDP buckets, gathered (unsharded) FSDP parameters and gradients, 16-bit weight casts
    peak: int
    peak_phase: str = ""  # "forward" (end of forward), "backward" or "optimizer" (the step)
    host_bytes: int = 0  # state kept in host memory by cpu_offload (not in peak)


class TimePrediction(_Frozen):
    """Seconds per optimizer step and what they are made of (the terms add up to ``step``)."""

    compute: float  # matmul FLOPs / throughput
    overhead: float = 0.0  # operations x the profile's per-operation latency
    communication: float  # exposed: (1 - overlap) x all collectives
    optimizer: float  # elementwise traffic: the update and the copies into / out of communication buffers
    step: float
    ops: int = 0  # operations per step counted in overhead
    bubble: float = 0.0  # pipeline fill and drain (transformer terms only; in ``compute`` otherwise)


class Prediction(_Frozen):
    memory: MemoryPrediction
    time: TimePrediction
    samples_per_rank: float  # per micro-batch
    notes: tuple[str, ...] = ()


def _collective_s(profile: HardwareProfile, name: str, nbytes: float, dp: int, count: int) -> float:
    """Time of ``count`` collectives moving ``nbytes`` in all (nccl-tests bus-bandwidth convention)."""
    if dp <= 1 or nbytes <= 0:
        return 0.0
    stats = profile.collectives.get(name)
    if stats is None:
        return 0.0
    factor = 2 * (dp - 1) / dp if name == "all_reduce" else (dp - 1) / dp
    return nbytes * factor / stats.bus_bandwidth + stats.latency_s * count


def _p2p_s(profile: HardwareProfile, nbytes: float, count: int) -> float:
    """Time of ``count`` point-to-point transfers moving ``nbytes`` in all (the all-gather link's figures)."""
    stats = profile.collectives.get("all_gather")
    if stats is None or nbytes <= 0:
        return 0.0
    return nbytes / stats.bus_bandwidth + stats.latency_s * count


def _pipeline_config(strategy: Strategy) -> Any:
    config = strategy.get("pipeline_parallel")
    mixed = strategy.get("mixed_parallel")
    return mixed.pipeline if config is None and mixed is not None else config


def _schedule(strategy: Strategy) -> str:
    return str(getattr(_pipeline_config(strategy), "schedule", "1f1b"))


def _schedule_micro_batches(strategy: Strategy, pipeline: int) -> int:
    config = _pipeline_config(strategy)
    return config.micro_batch_count(pipeline) if config is not None and pipeline > 1 else 1


def _deepspeed_grads_in_partition(stats: ModelStats, dp: int) -> float:
    """Bytes of DeepSpeed's ``grads_in_partition`` on the rank with most: every parameter whose elements start in
    the rank's part of the flat buffer, or that straddles its start, counts whole (stage_1_and_2.py's
    ``get_partition_info``, which ``copy_grads_in_partition`` sizes it by); the parts are ``P / dp`` each, in
    ``parameters()`` order. Statistics without the tensor sizes: ``P / dp``."""
    sizes = stats.trainable_tensor_bytes
    if not sizes or dp <= 1:
        return stats.trainable_param_bytes / dp
    part = math.ceil(sum(sizes) / dp)
    most = 0
    for rank in range(dp):
        low, high = rank * part, (rank + 1) * part
        held, offset = 0, 0
        for size in sizes:
            if low <= offset < high or offset < low < offset + size:
                held += size
            offset += size
        most = max(most, held)
    return float(most)


def _compute_dtype(strategy: Strategy) -> str:
    for name in ("half", "amp_native"):
        config = strategy.get(name)
        if config is not None:
            return {"bf16": "bfloat16", "fp16": "float16"}.get(str(config.dtype), str(config.dtype))
    return "float32"


@dataclass(frozen=True)
class _Facts:
    """What a strategy makes of the model on one rank, shared by the memory and the time terms: the layout's
    sizes, which methods are on, and the parameter bytes this rank holds (after tensor / pipeline splits)."""

    dp: int
    samples: float  # per rank per step
    micro_batches: int  # per step, the pipeline schedule's own included
    micro: float  # samples per micro-batch
    sharding: str | None  # "fsdp" / "zero2" or None
    deepspeed: bool
    reshard: bool
    offload: bool
    zero1: bool
    half: bool
    amp: bool
    checkpoint: bool
    scale: float  # 0.5 under half: everything in 16 bits
    shard: int  # the parameters' sharding degree
    trainable: float
    frozen: float
    buffers: float
    block_params: float
    biggest_block: float
    root_params: float
    tp: int
    pp: int
    split: int
    share: float  # the share of the model's parameters (and, as a proxy, of its matmul FLOPs) on this rank
    rank_param_bytes: float
    rank_trainable_bytes: float
    owned: float  # the parameters whose optimizer state this rank keeps
    gather: float  # FSDP mixed precision gathers 16-bit copies
    schedule: str  # the pipeline schedule


def _facts(stats: ModelStats, strategy: Strategy, layout: ParallelLayout, global_batch: int,
           micro_batches: int) -> _Facts:
    dp = layout.data_size
    if global_batch % (dp * micro_batches):
        raise ValueError(f"global_batch {global_batch} is not divisible by dp {dp} x micro_batches {micro_batches}")
    samples = global_batch / dp  # per rank per step
    # under pipeline parallel the schedule splits each batch it is given into its own micro-batches
    micro_batches *= _schedule_micro_batches(strategy, layout.size("pipeline"))
    micro = samples / micro_batches

    sharding = next((name for name in SHARDED if name in strategy), None)
    config = strategy.get(sharding) if sharding else None
    deepspeed = getattr(config, "implementation", None) == "deepspeed" or getattr(
        strategy.get("zero1"), "implementation", None) == "deepspeed"
    reshard = sharding == "fsdp" and bool(getattr(config, "reshard_after_forward", True))
    offload = bool(getattr(config, "cpu_offload", False))
    zero1 = "zero1" in strategy and sharding is None
    half = "half" in strategy
    amp = "amp_native" in strategy
    checkpoint = "checkpoint" in strategy
    scale = 0.5 if half else 1.0  # everything in 16 bits under half
    shard = dp if sharding else 1

    trainable = stats.trainable_param_bytes * scale
    frozen = stats.frozen_param_bytes * scale
    buffers = stats.buffer_bytes * scale
    block_params = sum(b.param_bytes_total for b in stats.blocks) * scale
    biggest_block = max((b.param_bytes for b in stats.blocks), default=0) * scale
    root_params = (stats.param_bytes * scale) - block_params
    # Tensor and pipeline parallel split the repeated blocks (tensor: each block's matmuls; pipeline: the blocks
    # over the stages); what is outside them (embeddings, head: the vocabulary is kept whole) stays whole, on
    # the first / last stage under pipeline parallel: the stage holding it is the one counted.
    tp, pp = layout.size("tensor"), layout.size("pipeline")
    split = tp * pp
    share = 1.0  # the share of the model's parameters (and, as a proxy, of its matmul FLOPs) on this rank
    if split > 1 and stats.param_bytes:
        # [tensor_parallel] key/value projections with fewer heads than tp stay whole on each rank of the group
        whole = sum(size for kv_heads, size in stats.tp_kv_param_bytes if kv_heads < tp) * scale
        per_block = whole / max(sum(b.count for b in stats.blocks), 1)
        share = (root_params + (block_params - whole) / split + whole / pp) / (stats.param_bytes * scale)
        trainable, frozen = trainable * share, frozen * share
        block_params = (block_params - whole) / split + whole / pp
        biggest_block = (biggest_block - per_block) / tp + per_block
    rank_param_bytes = stats.param_bytes * share
    rank_trainable_bytes = stats.trainable_param_bytes * share

    owned = trainable / (dp if (sharding or zero1) else 1)  # the parameters whose state this rank keeps
    gather = 0.5 if amp and not half else 1.0  # FSDP mixed precision gathers 16-bit copies
    return _Facts(dp=dp, samples=samples, micro_batches=micro_batches, micro=micro, sharding=sharding,
                  deepspeed=deepspeed, reshard=reshard, offload=offload, zero1=zero1, half=half, amp=amp,
                  checkpoint=checkpoint, scale=scale, shard=shard, trainable=trainable, frozen=frozen,
                  buffers=buffers, block_params=block_params, biggest_block=biggest_block, root_params=root_params,
                  tp=tp, pp=pp, split=split, share=share, rank_param_bytes=rank_param_bytes,
                  rank_trainable_bytes=rank_trainable_bytes, owned=owned, gather=gather,
                  schedule=_schedule(strategy))


def _memory(stats: ModelStats, f: _Facts, profile: HardwareProfile,
            optimizer_state_factor: float) -> tuple[MemoryPrediction, list[str]]:
    """Peak bytes per rank: the terms of each phase (forward, backward, optimizer step, DeepSpeed's epilogue)."""
    notes: list[str] = []
    params = (f.trainable + f.frozen) / f.shard + f.buffers
    grads = f.trainable / f.shard
    state = optimizer_state_factor * f.owned
    unit = f.biggest_block if stats.blocks else f.rank_param_bytes * f.scale  # FSDP's largest unit
    persistent = 0.0  # buffers that live across steps
    fwd_temp = bwd_temp = 0.0  # gathered parameters / gradient buffers at the forward and backward peaks
    all_gathered = 0.0  # FSDP2 without resharding: every block's parameters, at the start of the blocks' backward
    epilogue = 0.0  # DeepSpeed: the reduction at the end of a backward (below)
    if f.deepspeed:
        # ZeRO-1/2 in DeepSpeed 0.19 (deepspeed/runtime/zero/stage_1_and_2.py): the module's parameters live in
        # one flat buffer (DeepSpeedZeroOptimizer.__init__, flatten_dense_tensors_aligned), each rank keeps an
        # fp32 copy of its partition (__init__: single_partition_of_fp32_groups) and, from the first gradient
        # hook on, the reduce bucket (setup_buckets: torch.empty(reduce_bucket_size) in fp32; atorch passes
        # reduce_bucket_size = min(DEEPSPEED_BUCKET_ELEMENTS, trainable elements): opt_lib/deepspeed_zero.py).
        params = f.trainable + f.frozen + f.buffers
        bucket = min(f.trainable, 4 * DEEPSPEED_BUCKET_ELEMENTS)
        persistent = f.trainable / f.dp + bucket
        # The reduction at the end of a backward (independent_gradient_partition_epilogue -> reduce_ipg_grads ->
        # allreduce_bucket, whose flatten() copies the bucket's gradients: one bucket) copies this rank's part
        # into grads_in_partition (copy_grads_in_partition: the parameters of its partition, whole). ZeRO-2
        # reduces every micro-batch; under accumulation the previous micro-batch's grads_in_partition is dropped
        # by DeepSpeed but still referenced from a reference cycle, so it is alive at this copy only until
        # Python's cycle collector next runs: two partitions or one, by the collector's timing (seen with the
        # collector off: two, and with it run after every allocation: one; the bench's DeepSpeed ZeRO-2 rows
        # flip between the two from run to run). Predicted: the midpoint, so either outcome is within half a
        # partition. ZeRO-1 reduces once, at the boundary.
        partitions = ZERO2_ACCUMULATED_PARTITIONS if f.sharding == "zero2" and f.micro_batches > 1 else 1
        epilogue = bucket + partitions * _deepspeed_grads_in_partition(stats, f.dp)
    elif f.sharding and f.dp > 1 and stats.blocks:
        # FSDP2 keeps the root unit (what is outside the blocks) gathered across steps (calibrated:
        # FSDP_ROOT_PERSISTENT x its gathered bytes); a block unit is gathered while it runs: in backward one
        # is (the forward's is freed before the head's peak). Without resharding after forward every block
        # stays gathered until its own backward has run: all of them at the forward's end and where the
        # blocks' backward starts (seen block by block on the bench's GPT-2s).
        persistent = FSDP_ROOT_PERSISTENT * f.root_params * f.gather
        fwd_temp, bwd_temp = (0.0, unit * f.gather) if f.reshard else (f.block_params * f.gather, unit * f.gather)
        all_gathered = 0.0 if f.reshard else f.block_params * f.gather
    elif f.sharding and f.dp > 1:  # no blocks: the root is the only unit, gathered for forward and backward
        fwd_temp = bwd_temp = unit * f.gather
    elif f.sharding and f.amp:  # dp = 1: FSDP2 still casts the parameters for compute
        fwd_temp = bwd_temp = f.rank_param_bytes * 0.5
    elif f.dp > 1:
        persistent = DDP_PERSISTENT * f.trainable
    if f.amp and (f.deepspeed or not f.sharding):
        fwd_temp += f.rank_param_bytes * 0.5  # autocast caches a 16-bit cast of every weight until forward ends
    # The step's temporaries. Foreach (accelerators) takes the square root of every second moment at once and
    # works in place after it: one owned-sized temporary for AdamW. Torch has no foreach kernels on a CPU and
    # runs its single-tensor loop, whose ``sqrt() / c`` holds two temporaries of one parameter at a time: the
    # largest decides (a shard of it under FSDP). DeepSpeed steps on its flat fp32 partition, one tensor, and
    # measures as one partition-sized temporary (calibrated on bench/search.py's small GPT-2).
    if profile.device_type != "cpu" or f.deepspeed:
        step_temp = OPTIMIZER_TEMP_PER_STATE * optimizer_state_factor * f.owned
    else:
        largest_tensor = (stats.largest_layer.param_bytes if stats.largest_layer else 0) * f.scale
        at_once = min(f.owned, largest_tensor / (f.shard if f.sharding else 1))
        step_temp = SINGLE_TENSOR_TEMP_PER_STATE * optimizer_state_factor * at_once
    if f.zero1 and f.dp > 1 and not f.deepspeed:  # the other ranks' updated parameters, broadcast after the step
        step_temp += ZERO1_BROADCAST_FRACTION * f.trainable * (f.dp - 1) / f.dp

    amp_factor = (stats.amp_activation_bytes / stats.activation_bytes if stats.amp_activation_bytes
                  and stats.activation_bytes else AMP_ACTIVATION_FACTOR)
    act_scale = f.micro / stats.batch_size * f.scale * (amp_factor if f.amp and not f.half else 1.0)
    block_act = sum(b.activation_bytes_total for b in stats.blocks)
    if f.checkpoint and stats.blocks:
        inputs = sum(b.input_bytes_total for b in stats.blocks) or CHECKPOINT_INPUT_FRACTION * block_act
        kept = stats.activation_bytes_outside_blocks + inputs + max(b.activation_bytes for b in stats.blocks)
    else:
        kept = stats.activation_bytes
    if f.split > 1 and stats.blocks:
        # tensor parallel: a block's matmul outputs are split, its norms' and residuals' inputs are not
        # (TP_REPLICATED_ACTIVATIONS of a block's saved bytes, Megatron's 10 of 34 bytes per token and hidden);
        # pipeline parallel: a stage holds 1/pp of the blocks for each micro-batch in flight: pp of them
        # under 1f1b and the interleaved schedules (so the first stage matches the whole model's blocks at one
        # micro-batch), every micro-batch under gpipe.
        in_blocks = kept - stats.activation_bytes_outside_blocks
        in_blocks *= TP_REPLICATED_ACTIVATIONS + (1 - TP_REPLICATED_ACTIVATIONS) / f.tp
        in_flight = f.micro_batches if f.schedule == "gpipe" else min(f.micro_batches, f.pp)
        kept = stats.activation_bytes_outside_blocks + in_blocks / f.pp * in_flight
    largest = stats.largest_activation.bytes if stats.largest_activation else 0
    activations = (kept + LOSS_TEMP_FACTOR[f.checkpoint and bool(stats.blocks)] * largest) * act_scale
    host = 0.0
    # On a CPU device host memory is the device's; DeepSpeed's offload (its optimizer state) is not modelled.
    offloaded = f.offload and f.sharding and profile.device_type != "cpu" and not f.deepspeed
    if offloaded:
        host = params - f.buffers + grads + state
        params, grads, state = f.buffers, 0.0, 0.0
        notes.append("cpu_offload: sharded parameters, gradients and optimizer state counted in host_bytes")
    # With gradient accumulation the micro-batches after the first run forward and backward with every
    # gradient already there. A single micro-batch frees its saved activations as its gradients appear:
    # its backward holds the larger of the two (at its start or at its end) besides the gathered state.
    # FSDP2 accumulates unsharded gradients (in the compute dtype) while its gradient sync is off (atorch
    # turns it off for all micro-batches but the last), so those are held whole.
    held_grads = (f.trainable if f.sharding and not f.deepspeed else grads) if f.micro_batches > 1 else 0.0
    # Under recompute an attention block's backward holds its recomputed activations (in ``activations``) and,
    # as it runs, their gradients: about as many bytes again (measured on GPT-2; the ResNet's convolution
    # blocks free theirs as they go, within 4% without this term).
    recompute = max((b.activation_bytes for b in stats.blocks if b.attention), default=0) * act_scale \
        if f.checkpoint else 0.0
    # DeepSpeed steps with its gradient partition only (ZeRO-1 too: the full gradients are reduced into it and
    # freed); ZeRO-2 under accumulation keeps a second partition, the accumulated one (measured on the 206M GPT-2).
    step_grads = grads
    if f.deepspeed:
        step_grads = f.trainable / f.dp * (2 if f.sharding == "zero2" and f.micro_batches > 1 else 1)
    # Backward at the start of the blocks' (every block still gathered without resharding, none recomputed yet)
    # and as it goes on (one block gathered and recomputed at a time).
    bwd_start = activations + held_grads + all_gathered
    bwd_on = (activations + held_grads if f.micro_batches > 1 else max(activations, grads)) + bwd_temp + recompute
    if bwd_start > bwd_on:
        bwd_temp = all_gathered
    phases = {
        "forward": activations + fwd_temp + held_grads,
        "backward": max(bwd_start, bwd_on),
        "optimizer": step_grads + (0.0 if offloaded else step_temp),
    }
    if f.deepspeed:
        phases["epilogue"] = epilogue
    phase = max(phases, key=phases.__getitem__)
    temporary = persistent + {"forward": fwd_temp, "backward": bwd_temp, "optimizer": step_temp,
                              "epilogue": epilogue}[phase]
    peak = params + state + persistent + phases[phase]

    memory = MemoryPrediction(
        parameters=round(params), gradients=round(grads), optimizer_state=round(state),
        activations=round(activations), temporary=round(temporary), peak=round(peak), peak_phase=phase,
        host_bytes=round(host),
    )
    return memory, notes


def _matmul_size(stats: ModelStats, f: _Facts) -> float | None:
    """The side of a square matmul with the FLOPs of the model's average one at this micro-batch (tensor
    parallel splits each matmul): the size whose measured throughput the compute term uses."""
    if not stats.fwd_lowp_ops or not stats.fwd_flops_per_sample:
        return None
    flops = stats.fwd_flops_per_sample * f.micro / stats.fwd_lowp_ops / f.tp
    return (flops / 2) ** (1 / 3)


def _time(stats: ModelStats, f: _Facts, dtype: str, profile: HardwareProfile, optimizer_state_factor: float,
          overlap: float, optimizer_bytes_per_s: float | None) -> TimePrediction:
    """Seconds per step: compute, per-operation overhead, exposed communication, optimizer traffic."""
    tflops = profile.matmul_tflops_at(dtype, _matmul_size(stats, f))
    if not tflops:
        raise ValueError(f"hardware profile has no matmul throughput for {dtype} or float32")
    flops = stats.fwd_bwd_flops_per_sample * f.samples
    if f.checkpoint and stats.blocks:
        flops += stats.fwd_flops_per_sample * f.samples  # one more forward (of the blocks: most of it)
    flops *= f.share
    bubble = (f.micro_batches + f.pp - 1) / f.micro_batches if f.pp > 1 else 1.0  # stages idle while the pipe fills
    compute = flops / (tflops * 1e12) * bubble

    units = sum(b.count for b in stats.blocks) + 1
    gathers = f.micro_batches * (2 if f.reshard else 1) if f.sharding else 0
    ops = stats.fwd_ops + stats.bwd_ops  # per micro-batch, whatever its size
    if f.checkpoint and stats.blocks:
        ops += stats.block_fwd_ops  # the blocks' forward runs again in backward
    if f.amp and not f.half:
        ops += AMP_CAST_OPS * stats.fwd_lowp_ops
    if f.pp > 1:  # a stage runs its share of the blocks' operations; the busiest also those outside the blocks
        # (the embedding on the first stage, the head and the loss on the last: kept whole, as their parameters)
        inside = stats.block_fwd_ops / stats.fwd_ops if stats.fwd_ops and stats.blocks else 1.0
        ops = ops * ((1 - inside) + inside / f.pp) * bubble
    if f.tp > 1:
        ops += TP_BLOCK_OPS * sum(b.count for b in stats.blocks) / f.pp
    ops *= f.micro_batches
    ops += OPTIMIZER_OPS[0] + OPTIMIZER_OPS[1] * optimizer_state_factor
    if f.sharding and not f.deepspeed:  # every gather and the reduce-scatter, per unit and per parameter
        ops += (gathers + 1) * (FSDP_UNIT_OPS * units + FSDP_PARAM_OPS * stats.param_tensors)
    if f.deepspeed:  # DeepSpeed's per-parameter gradient hooks, bucket copies and partition copies (Python)
        ops += DEEPSPEED_PARAM_OPS * stats.param_tensors * f.micro_batches
    overhead = ops * profile.op_latency_s
    if f.tp > 1:  # DTensor's dispatch on every split linear (and its recompute) and on each DTensor parameter's update
        linear = profile.tensor_parallel_linear_s + (
            profile.tensor_parallel_linear_forward_s if f.checkpoint and stats.blocks else 0.0)
        overhead += stats.tp_split_layers / f.pp * f.micro_batches * linear
        adamw = OPTIMIZER_OPS[0] + OPTIMIZER_OPS[1] * 2  # the profile times AdamW's foreach step
        update = (OPTIMIZER_OPS[0] + OPTIMIZER_OPS[1] * optimizer_state_factor) / adamw
        overhead += stats.tp_split_params / f.pp * profile.dtensor_param_step_s * update

    comm = 0.0
    full_grads = f.rank_trainable_bytes * f.scale
    gathered = f.rank_param_bytes * f.scale * f.gather
    if f.sharding:
        comm += _collective_s(profile, "all_gather", gathered * gathers, f.dp, units * gathers)
        comm += _collective_s(profile, "reduce_scatter", full_grads, f.dp, units)
    elif f.dp > 1:
        buckets = max(1, math.ceil(full_grads / DDP_BUCKET_BYTES))
        comm += _collective_s(profile, "all_reduce", full_grads, f.dp, buckets)
        if f.zero1:  # ZeroRedundancyOptimizer broadcasts every parameter from its owner (one collective each);
            # DeepSpeed all-gathers the partitions in buckets
            if f.deepspeed:
                comm += _collective_s(profile, "all_gather", f.rank_trainable_bytes * f.scale, f.dp, 1)
            else:  # a broadcast moves what an all-gather does; its latency is an all-reduce's (one round)
                comm += _collective_s(profile, "all_gather", f.rank_trainable_bytes * f.scale, f.dp, 1)
                one = profile.collectives.get("all_reduce")
                comm += (one.latency_s if one else 0.0) * max(0, stats.param_tensors - 1)
    comm += _collective_s(profile, "all_reduce", 4, f.dp, 1)  # the step's loss, averaged over the ranks
    if f.split > 1 and stats.blocks:
        # a block's input (its hidden states) at one micro-batch, in the compute dtype
        hidden = sum(b.input_bytes_total for b in stats.blocks) / sum(b.count for b in stats.blocks) * (
            f.micro / stats.batch_size) * (0.5 if f.amp or f.half else 1.0)
        blocks_here = sum(b.count for b in stats.blocks) / f.pp
        if f.tp > 1:  # two all-reduces of the hidden states per block in forward, two in backward
            count = TP_BLOCK_OPS * blocks_here * f.micro_batches
            comm += _collective_s(profile, "all_reduce", hidden * count, f.tp, count)
        if f.pp > 1:  # a stage sends its output forward and receives its gradient back, per micro-batch
            comm += _p2p_s(profile, hidden * 2 * f.micro_batches, 2 * f.micro_batches)
        comm += _collective_s(profile, "all_reduce", 4, f.split, 1)  # the loss, from the last stage to every rank
    communication = comm * (1.0 - overlap)
    bandwidth = optimizer_bytes_per_s or profile.memory_bytes_per_s or DEFAULT_MEMORY_BYTES_PER_S
    passes = OPTIMIZER_PASSES[0] + OPTIMIZER_PASSES[1] * optimizer_state_factor
    optimizer = passes * f.owned / bandwidth
    # Gradients copied into and out of the communication buffers (DDP buckets, FSDP's reduce-scatter
    # input, gathered parameters copied out) once per step / gather: read and written.
    copies = 2 * (full_grads + gathered * gathers) if f.sharding else 2 * full_grads if f.dp > 1 else 0.0
    optimizer += copies / bandwidth

    return TimePrediction(compute=compute, overhead=overhead, communication=communication, optimizer=optimizer,
                          step=compute + overhead + communication + optimizer, ops=round(ops))


def predict(stats: ModelStats, strategy: Strategy, layout: ParallelLayout, profile: HardwareProfile,
            global_batch: int, micro_batches: int = 1, *, optimizer_state_factor: float = 2.0,
            overlap: float = 0.0, optimizer_bytes_per_s: float | None = None,
            transformer: TransformerShape | None = None, selective_recompute: bool = False) -> Prediction:
    """Peak memory per rank and step time of ``strategy`` (see the module docstring for every term): the facts
    of the strategy on this model, then the memory and the time they make.

    ``transformer``: the model's transformer shape (``atorch plan``): its activations, FLOPs and communication
    then come from the transformer terms (end of this module); ``selective_recompute`` applies to those only."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    facts = _facts(stats, strategy, layout, global_batch, micro_batches)
    if transformer is not None:
        return _transformer_prediction(transformer, strategy, facts, profile, _compute_dtype(strategy),
                                       optimizer_state_factor, selective_recompute)
    memory, notes = _memory(stats, facts, profile, optimizer_state_factor)
    time = _time(stats, facts, _compute_dtype(strategy), profile, optimizer_state_factor, overlap,
                 optimizer_bytes_per_s)
    return Prediction(memory=memory, time=time, samples_per_rank=facts.micro, notes=tuple(notes))


# ----- transformer terms (large runs: `atorch plan`) -------------------------------------------------------
# When ``predict`` is given the model's transformer shape (a decoder-only transformer: the planner's built-in
# architectures, a transformers config, or a module with one), the terms a large run lives on are analytical in
# that shape instead of scaled from the analyser's measured step; the strategy, layout and profile are read as
# above (``_facts``) and the result has the same form. Sources of each term:
#
# * FLOPs: Megatron-LM's count (Narayanan et al. 2021, appendix): a layer's forward is 2 x its matmul parameters
#   per token plus 4·s·h for the attention scores (QK^T and AV, causal masking not subtracted); the vocabulary
#   layer 2·h·V per token; backward twice the forward; full recompute one more forward of the layers, selective
#   recompute (Korthikanti et al. 2022) one more of the attention scores only. With h = a·d, f = 4h and MHA this
#   is the paper's 72·B·s·l·h²(1 + s/6h + V/12lh) (96 and V/16lh with full recompute). GQA shrinks K and V to
#   kv_heads·d, a gated MLP (SwiGLU) has three f×h matrices.
# * Activation memory per layer and micro-batch (Korthikanti et al. 2022, section 4): s·b·h·(34 + 5·a·s/h) bytes
#   in 16 bits without parallelism, of which 10 (norm and first-matmul inputs, dropout masks) are replicated over
#   tensor parallel ranks without sequence parallel and split with it; the a·s term (softmax output, its dropout)
#   is dropped by selective recompute and by fused (flash) attention. Generalised per token: replicated
#   4h (norm inputs) + 4h (inputs of QKV and the MLP's first matmul) + 2h masks (with dropout); split q 2h,
#   k and v 2·2h·kv/a, attention output 2h, MLP 2·2f (+2f gated); scores 2as (+3as with dropout).
#   Full recompute keeps each layer's input (2sbh, /t with sequence parallel) and recomputes one layer at a
#   time. The vocabulary layer's logits in fp32 for the loss: 4·s·b·V/t on the last stage.
# * In flight under pipeline parallel, on the first stage: p micro-batches of its l/p layers under 1F1B,
#   × (1 + (p−1)/(p·v)) interleaved with v stages per rank (Narayanan et al. 2021, section 2.2.2), all m
#   under GPipe.
# * Step time: each stage runs its micro-batches; the busiest one (the last: it has the vocabulary layer) sets
#   the pace; the pipeline's fill and drain add (p−1)/v micro-batch times (the interleaved bubble). A
#   micro-batch's time is its matmuls at the profile's achievable throughput (``matmul_efficiency`` × peak),
#   its elementwise work at ``memory_bytes_per_s`` (norms, residual adds, activations, softmax: bytes read and
#   written, backward twice the forward), its tensor-parallel collectives (two in forward, two in backward,
#   two more when recomputed; sequence parallel moves the same bytes as reduce-scatter + all-gather) and the
#   stage-to-stage sends (not overlapped: Megatron-LM 2021 and torch's pipelining run them in line). Unfused
#   attention's score matmuls are priced on the roofline (the longer of FLOPs and bytes: they read and write
#   s×s matrices); the step adds the weight gradients' accumulation over its micro-batches (bytes at the
#   memory bandwidth).
# * Data-parallel collectives: DDP all-reduces the gradients (fp32 under autocast; 16-bit in Megatron-LM's
#   --fp16), overlapped with the backward of the last micro-batch when there is no pipeline (DDP's buckets;
#   Megatron-LM's published runs without a pipeline used torch's DDP too); ZeRO-1 adds the updated parameters'
#   all-gather (after the step: exposed); FSDP / ZeRO-2 (FSDP2) all-gather 16-bit parameters ahead of use (prefetched:
#   hidden behind the compute of the micro-batch that needs them, all but the first layer's) and reduce-scatter
#   fp32 gradients (overlapped with the last backward); both use the same links, so together they hide behind
#   the step's compute. Under a pipeline the gradients are reduced after the flush (exposed),
#   and torch's pipelining keeps FSDP2's parameters gathered through backward across micro-batches: ZeRO-2
#   gathers once per step, fsdp once per micro-batch in forward.
# * Hierarchical collectives: a group of n ranks spanning nodes with k of them per node moves its bytes at
#   min(intra-node bus bandwidth, k × the per-GPU inter-node bandwidth) with the inter-node latency (NCCL's
#   rings and trees cross nodes through every GPU's own adapter). Ranks are ordered tensor fastest, then
#   pipeline, then data (parallel_mode's order), so a tensor group stays in a node.

# DualPipe keeps 20 of the H800's 132 SMs for its all-to-alls and sends (arXiv 2412.19437, section 3.2.2)
DUALPIPE_COMPUTE_SHARE = 112 / 132
ELEMENTWISE_PASSES = 4.0  # forward + backward (twice the forward) + recompute counted per pass (see below)
LOGITS_BYTES_AUTOCAST = 14.0  # bytes per token and vocabulary entry held by the loss under autocast (see below)
VOCAB_LOSS_BYTES = 24.0  # bytes per token and vocabulary entry the loss moves (logits, their cast, softmax, grads)


class TransformerShape(_Frozen):
    """A decoder-only transformer's sizes: what the transformer terms are computed from."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    gated_mlp: bool = False  # SwiGLU (Llama): gate, up and down matrices
    tied_embeddings: bool = False
    position_embeddings: int = 0  # learned positions (GPT-2/3): rows of the position table
    dropout: bool = False  # dropout masks saved (GPT-3 / Megatron-LM 2021), not in Llama
    flash_attention: bool = True  # fused attention: the s x s scores are never saved
    biases: bool = False
    # mixed precision as torch autocast runs it (atorch's amp_native): fp32 weights cast to 16 bits in every
    # forward, the residual stream and norms in fp32; False: 16 bits throughout, fp32 master weights in the
    # optimizer only, 16-bit gradients accumulated and all-reduced (Megatron-LM with --fp16)
    autocast: bool = True
    # the layer as Megatron-LM's 2021 code ran it (megatron/model/transformer.py, mpu/layers.py, on torch 1.8/1.9):
    # the QKV bias added after its matmul (ColumnParallelLinear calls F.linear on a 3-D input, which torch then
    # ran as matmul and add_), the attention output copied back to [s, b, h] (``permute(...).contiguous()``),
    # and stage-to-stage sends split over the tensor ranks and all-gathered on arrival (its scatter/gather
    # optimisation, on by default: Narayanan et al. 2021, section 4.1). False: torch's pipelining sends whole
    # tensors, and today's linear fuses the bias into the matmul.
    megatron_2021: bool = False
    # the precision regime (``precision.REGIMES``: amp_native, fsdp_mixed, megatron) the job runs under; None: the
    # layout's default (``autocast`` False: Megatron-LM's; ZeRO-2/FSDP: FSDP2's mixed precision; else amp_native).
    # A regime sets the bytes per parameter and whether the residual stream is fp32 (it overrides ``autocast``).
    precision: str | None = None
    # Mixture of experts (``experts`` 0: dense). A MoE layer routes each token to ``top_k`` of ``experts`` MLPs of
    # width ``expert_ffn`` (gated as ``gated_mlp``) plus ``shared_experts`` that every token runs, through a router
    # (h x experts); the first ``dense_layers`` layers keep a dense MLP of width ``ffn``. ``routing_node_limit``:
    # each token's experts sit on at most that many nodes (DeepSeek-V3's node-limited routing: a token crosses the
    # inter-node network once per node it visits); 0: no limit.
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    routing_node_limit: int = 0
    # attention sizes where they are not hidden / heads: the query-key and value head sizes (DeepSeek's MLA: 192
    # and 128) and the attention's matmul parameters per layer (its low-rank projections); 0: standard attention
    qk_head_dim: int = 0
    v_head_dim: int = 0
    attention_params: int = 0
    # the layout's expert dimension (set per layout by the planner): a MoE layer's experts split over that many
    # ranks of the data dimension, their gradients and states sharded over the rest
    expert_ranks: int = 1
    # DeepSeek-V3's DualPipe schedule (set per layout by the planner; atorch has none): each rank holds two stages
    # (both pipeline directions: twice the parameters and gradients), keeps pp + 1 micro-batches in flight, overlaps
    # a forward chunk's all-to-alls and sends with another's backward on the SMs it keeps for communication, and
    # fills (pp/2 − 1) x (F&B + B − 3W) of bubble (DeepSeek-AI 2024, arXiv 2412.19437, section 3.2.1, Table 2)
    dualpipe: bool = False
    # DeepSeek-V3's light recompute: RMSNorm and MLA's key/value up-projections are recomputed in backward, so
    # neither the norms' inputs nor K and V are saved (MLA's small compressed latent is; arXiv 2412.19437, 3.3.3)
    recompute_norms: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def mlp_width(self) -> int:
        """The MLP width a token runs through (per layer): the dense MLP's, or its experts' together."""
        return (self.top_k + self.shared_experts) * self.expert_ffn if self.moe else self.ffn

    def expert_params(self) -> int:
        """One expert's matmul parameters."""
        return (3 if self.gated_mlp else 2) * self.hidden * self.expert_ffn

    def layer_expert_params(self) -> int:
        """A MoE layer's routed experts' parameters: what an expert dimension splits."""
        return self.experts * self.expert_params() if self.moe else 0

    def _attention_matmul_params(self) -> int:
        h = self.hidden
        return self.attention_params or h * (h + 2 * self.kv_dim) + h * h

    def layer_matmul_params(self) -> int:
        """The matmul parameters a token runs through in a layer (a MoE layer: its top-k and shared experts and
        the router), what the FLOPs count."""
        h, f = self.hidden, self.ffn
        if self.moe:
            return self._attention_matmul_params() + h * self.experts + (
                self.top_k + self.shared_experts) * self.expert_params()
        return self._attention_matmul_params() + (3 if self.gated_mlp else 2) * h * f

    def layer_params(self) -> int:
        """Parameters of a layer (a MoE layer: every expert; the heaviest layer, what a stage holds)."""
        h, f = self.hidden, self.ffn
        bias = (h + 2 * self.kv_dim + h + f + h) if self.biases else 0
        norms = (4 if self.biases else 2) * h  # two norms (weight, and bias for LayerNorm)
        if self.moe:
            return (self._attention_matmul_params() + h * self.experts + (self.experts + self.shared_experts)
                    * self.expert_params() + norms)
        return self.layer_matmul_params() + bias + norms

    def _dense(self) -> TransformerShape:
        return self.model_copy(update={"experts": 0, "top_k": 0, "dense_layers": 0})

    def _layers_sum(self, per_layer: str) -> float:
        """A per-layer figure summed over the layers (a MoE model's first ``dense_layers`` are dense)."""
        moe_layers = self.layers - (self.dense_layers if self.moe else 0)
        dense = getattr(self._dense(), per_layer)() * (self.layers - moe_layers)
        return moe_layers * getattr(self, per_layer)() + dense

    def score_flops(self) -> float:
        """Forward FLOPs of the attention scores per token (Q·Kᵀ and probabilities·V): 4·s·h for standard heads."""
        qk, v = self.qk_head_dim or self.head_dim, self.v_head_dim or self.head_dim
        return 2.0 * self.seq * self.heads * (qk + v)

    def active_params(self) -> int:
        """Parameters a token runs through (a MoE model's active parameters; all of a dense model's)."""
        if not self.moe:
            return self.params()
        routed = (self.experts - self.top_k) * self.expert_params() * (self.layers - self.dense_layers)
        return self.params() - routed

    def all_to_all_bytes_per_token(self) -> float:
        """Bytes a MoE layer's token dispatch sends per token in one forward (16-bit hidden states to each of its
        top-k experts); the combine returns as many."""
        return 2.0 * self.hidden * self.top_k if self.moe else 0.0

    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.position_embeddings * self.hidden

    def head_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    def params(self) -> int:
        return round(self._layers_sum("layer_params")) + self.embedding_params() + self.head_params() + 2 * self.hidden

    def layer_fwd_flops(self) -> float:
        """Forward FLOPs of one layer per token."""
        return 2.0 * self.layer_matmul_params() + self.score_flops()

    def vocab_fwd_flops(self) -> float:
        return 2.0 * self.hidden * self.vocab

    def model_flops_per_token(self) -> float:
        """Forward + backward FLOPs per token, no recompute (what MFU counts)."""
        return 3.0 * (self._layers_sum("layer_fwd_flops") + self.vocab_fwd_flops())

    def recompute_flops_per_token(self, recompute: str) -> float:
        if recompute == "full":
            return self._layers_sum("layer_fwd_flops")
        if recompute == "selective":
            return self.layers * self.score_flops()
        return 0.0

    def layer_activation_bytes(self, tp: int, sequence_parallel: bool, scores: bool) -> float:
        """Bytes a layer saves for backward per token (Korthikanti et al. 2022, generalised; see above)."""
        h, f, a, s = self.hidden, self.mlp_width, self.heads, self.seq
        replicated = (4 if self.recompute_norms else 8) * h + (2 * h if self.dropout else 0)
        kv = 0.0 if self.recompute_norms else 4 * h * self.kv_heads / self.heads
        split = 2 * h + kv + 2 * h + 4 * f + (2 * f if self.gated_mlp else 0)
        score = (5 if self.dropout else 2) * a * s if scores and not self.flash_attention else 0.0
        if sequence_parallel:
            return (replicated + split + score) / tp
        return replicated + (split + score) / tp

    def attention_matmul_bytes(self, tp: int) -> float:
        """Bytes the attention's two batched matmuls read and write per token in one forward when attention is
        not fused, in 16 bits: Q·Kᵀ reads q (2h) and k (2·kv) and writes the scores (2as); probabilities·V reads
        them (2as) and v (2·kv) and writes its output (2h). Split with the heads over tensor ranks. Their
        backward (dP = dO·Vᵀ, dV = Pᵀ·dO, dQ = dS·K, dK = dSᵀ·Q) writes one s×s matrix and reads three: twice
        the forward, as for the FLOPs."""
        return (4 * self.hidden + 4 * self.kv_dim + 4 * self.heads * self.seq) / tp

    def layer_elementwise_bytes(self, tp: int, sequence_parallel: bool) -> float:
        """Bytes an elementwise pass (norms, residual adds, activation, softmax) reads and writes per token in
        one forward of a layer: two norms (read and write 2h each), two residual adds (read 4h, write 2h), the
        MLP's activation (gelu: read 2f write 2f; SwiGLU: read 4f write 2f), the scores' softmax without fused
        attention (read and write 2as), dropout (its mask written, h per dropout). Under autocast the residual
        stream is fp32: a norm reads and writes 4h and its output is cast for the matmul (read 4h, write 2h),
        a residual add reads 4h + 2h and writes 4h. Megatron-LM 2021 (``megatron_2021``) adds the QKV bias in a
        pass of its own (read and write 2·(h + 2·kv)) and copies the attention output (read and write 2h)."""
        h, f, a, s = self.hidden, self.mlp_width, self.heads, self.seq
        norms_residual = (2 * 14 * h + 2 * 10 * h) if self.autocast else (2 * 4 * h + 2 * 6 * h)
        norms_residual += 3 * h if self.dropout else 0
        mlp = (6 if self.gated_mlp else 4) * f
        if self.megatron_2021:
            mlp += 4 * (h + 2 * self.kv_dim) + 4 * h  # split over tensor ranks with the heads, as the MLP
        softmax = 0.0 if self.flash_attention else (4 + (5 if self.dropout else 0)) * a * s
        if sequence_parallel:
            return (norms_residual + mlp + softmax) / tp
        return norms_residual + (mlp + softmax) / tp


def _group_link(profile: HardwareProfile, name: str, size: int, stride: int) -> tuple[float, float]:
    """(bus bandwidth, latency) of collective ``name`` over ``size`` ranks ``stride`` apart: within a node, or
    hierarchical across nodes (see the transformer terms above)."""
    intra = profile.collectives.get(name)
    bandwidth, latency = (intra.bus_bandwidth, intra.latency_s) if intra else (float("inf"), 0.0)
    per_node = profile.gpus_per_node
    if per_node and size * stride > per_node and profile.inter_node.get(name) is not None:
        inter = profile.inter_node[name]
        here = max(1, min(size, per_node // stride)) if stride < per_node else 1
        bandwidth, latency = min(bandwidth, here * inter.bus_bandwidth), inter.latency_s
    return bandwidth, latency


def _group_collective_s(profile: HardwareProfile, name: str, nbytes: float, size: int, stride: int,
                        count: int) -> float:
    if size <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = _group_link(profile, name, size, stride)
    factor = 2 * (size - 1) / size if name == "all_reduce" else (size - 1) / size
    return nbytes * factor / bandwidth + latency * count


def _all_to_all_s(shape: TransformerShape, profile: HardwareProfile, tokens: float, stage_layers: int, ep: int,
                  tp: int, recompute: bool) -> float:
    """A micro-batch's expert all-to-alls on a stage: each MoE layer dispatches its tokens' hidden states to their
    top-k experts and combines the results back, in forward, again in backward (and in the recompute), in line
    with the compute. A rank keeps 1/ep of them, sends (local − 1)/ep over the node's links and the rest over its
    own inter-node adapter (expert ranks are adjacent after the tensor ranks, so a node holds ``local`` of them);
    node-limited routing caps the inter-node bytes at one copy per node a token visits."""
    if not shape.moe or ep <= 1:
        return 0.0
    moe_layers = min(stage_layers, shape.layers - shape.dense_layers)
    sent = tokens * shape.all_to_all_bytes_per_token()
    per_node = profile.gpus_per_node or ep * tp
    local = max(1, min(ep, per_node // tp))
    intra = profile.collectives.get("all_gather")
    inter = profile.inter_node.get("all_gather") or intra
    intra_bw, latency = (intra.bus_bandwidth, intra.latency_s) if intra else (float("inf"), 0.0)
    inter_bw = inter.bus_bandwidth if inter else float("inf")
    off_node = sent * (ep - local) / ep
    if shape.routing_node_limit:
        off_node = min(off_node, sent / shape.top_k * shape.routing_node_limit)
    one = sent * (local - 1) / ep / intra_bw + off_node / inter_bw + (inter.latency_s if inter else latency)
    return moe_layers * one * (6 if recompute else 4)


def _regime(shape: TransformerShape, sharding: str, half: bool) -> PrecisionRegime:
    """The precision regime the transformer terms count bytes with (``precision``; see TransformerShape)."""
    if half:  # everything in 16 bits, no master weights
        return PrecisionRegime("half", 2.0, 2.0, 2.0, 0.0, 2.0, autocast=False, fsdp2=True, summary="16 bits only")
    if shape.precision is not None:
        if shape.precision not in REGIMES:
            raise ValueError(f"unknown precision regime {shape.precision!r}: one of {list(REGIMES)}")
        return REGIMES[shape.precision]
    return REGIMES["megatron" if not shape.autocast else default_regime(sharding, 1)]


def _transformer_prediction(shape: TransformerShape, strategy: Strategy, f: _Facts, profile: HardwareProfile,
                            dtype: str, optimizer_state_factor: float, selective_recompute: bool) -> Prediction:
    """Memory and step time of a transformer on its busiest rank (see the transformer terms above)."""
    tp, pp, dp = f.tp, f.pp, f.dp
    tensor = strategy.get("tensor_parallel") or getattr(strategy.get("mixed_parallel"), "tensor", None)
    sp = bool(getattr(tensor, "sequence_parallel", False)) and tp > 1
    vocab_split = tp if getattr(tensor, "loss_parallel", False) else 1  # atorch's loss_parallel splits it
    pipe = _pipeline_config(strategy)
    v = pipe.stages_per_rank() if pipe is not None and pp > 1 else 1
    recompute = "full" if f.checkpoint else "selective" if selective_recompute else "none"
    sharding = f.sharding or ("zero1" if f.zero1 else "none")
    regime = _regime(shape, sharding, f.half)
    if regime.autocast != shape.autocast:
        shape = shape.model_copy(update={"autocast": regime.autocast})
    b, s, h, m = f.micro, shape.seq, shape.hidden, f.micro_batches
    tokens = b * s  # per micro-batch
    stage_layers = math.ceil(shape.layers / pp)
    wbytes = 2.0 if f.half else 4.0  # bytes per parameter of what the optimizer updates (fp32 master weights)
    # gradient bytes: the regime's (fp32 under autocast, FSDP2's fp32 reduction and Megatron-LM's fp32 buffer);
    # Megatron-LM 2021's --fp16 kept 16-bit gradients and all-reduced them so (without
    # --accumulate-allreduce-grads-in-fp32, which its published runs did not pass)
    grad_el = 2.0 if f.half or (shape.megatron_2021 and regime.name == "megatron") else regime.grads

    # Parameters on the busiest stage: its layers split over tensor ranks, plus the vocabulary layer(s) it holds
    # (first stage: the embedding; last: the head, a copy of the embedding when tied; pp = 1: both).
    # A MoE layer's routed experts split over the expert ranks too; they are replicated (and ZeRO-sharded) over
    # the data ranks that hold the same experts (data / expert).
    ep = max(1, shape.expert_ranks) if shape.moe else 1
    layer_experts = shape.layer_expert_params() / tp
    layer_dense = shape.layer_params() / tp - layer_experts
    first = shape.embedding_params() / vocab_split
    last = (shape.head_params() or shape.vocab * h) / vocab_split if pp > 1 else shape.head_params() / vocab_split
    n_experts = stage_layers * layer_experts / ep
    n_dense = stage_layers * layer_dense + (first + last if pp == 1 else max(first, last)) + 2 * h
    n_rank = n_dense + n_experts
    expert_dp = max(1, dp // ep)
    owned = n_dense / dp + n_experts / expert_dp if sharding != "none" else n_rank
    held = [rank_bytes(regime, sharding, n, layer_n, d, grads=grad_el, states=optimizer_state_factor)
            for n, layer_n, d in ((n_dense, layer_dense, dp), (n_experts, layer_experts / ep, expert_dp))]
    params, grads, state, temporary = (sum(getattr(b, k) for b in held)
                                       for k in ("parameters", "gradients", "optimizer_state", "temporary"))
    dualpipe = shape.dualpipe and pp > 1
    if dualpipe:  # two stages per rank
        params, grads = 2 * params, 2 * grads
    step_temp = OPTIMIZER_TEMP_PER_STATE * optimizer_state_factor * owned * wbytes

    # Activations on the first stage (it holds the most micro-batches in flight).
    scores = recompute == "none"
    per_layer = shape.layer_activation_bytes(tp, sp, scores) * tokens
    if recompute == "full":
        kept = stage_layers * 2 * tokens * h / (tp if sp else 1)
        recomputed = shape.layer_activation_bytes(tp, sp, True) * tokens
    else:
        kept, recomputed = stage_layers * per_layer, 0.0
    if pp == 1:
        in_flight = 1.0
    elif f.schedule == "gpipe":
        in_flight = float(m)
    elif dualpipe:
        in_flight = min(float(m), pp + 1.0)
    else:
        in_flight = min(float(m), pp * (1 + (pp - 1) / (pp * v)) if v > 1 else float(pp))
    # the loss's logits on the last stage: fp32 for the loss (Korthikanti: 4·s·b·V/t); under autocast also
    # the 16-bit logits, the log-softmax saved by cross-entropy and the logits' gradient (2 + 4 + 4 + 4)
    logits = (LOGITS_BYTES_AUTOCAST if shape.autocast else 4.0) * tokens * shape.vocab / vocab_split
    embedding_out = 2.0 * tokens * h / (tp if sp else 1)
    activations = kept * in_flight + recomputed + (logits if pp == 1 else 0.0) + embedding_out
    if pp > 1:  # the last stage holds fewer micro-batches but the logits: the larger of the two stages
        last_stage = kept * 1.0 + recomputed + logits
        activations = max(activations, last_stage)
    # Phases, as for the other models: forward / backward hold the activations, the gathered or cast weights
    # and, once a second micro-batch runs (accumulation, or a pipeline), the gradients; with one micro-batch the
    # gradients appear as the activations are freed (the larger of the two); the step holds the gradients
    # and the optimizer's temporaries.
    held_grads = grads if m > 1 else 0.0
    phases = {"backward": max(activations + held_grads, grads) + temporary, "optimizer": grads + step_temp}
    phase = max(phases, key=phases.__getitem__)
    peak = params + state + phases[phase]
    memory = MemoryPrediction(parameters=round(params), gradients=round(grads), optimizer_state=round(state),
                              activations=round(activations),
                              temporary=round(temporary if phase == "backward" else step_temp), peak=round(peak),
                              peak_phase=phase)

    # Time of one micro-batch on the busiest (last) stage.
    peak_tflops = profile.matmul_tflops.get(dtype) or profile.matmul_tflops.get("float32") or 0.0
    if not peak_tflops:
        raise ValueError(f"hardware profile has no matmul throughput for {dtype} or float32")
    flops_s = peak_tflops * 1e12 * profile.matmul_efficiency.get(dtype, 1.0)
    bandwidth = profile.memory_bytes_per_s or DEFAULT_MEMORY_BYTES_PER_S
    # The weights' matmuls are compute-bound at these sizes; the attention scores' batched matmuls (Q·Kᵀ and
    # probabilities·V, 4·s·h FLOPs per token, K = the head size) are not when attention is unfused: each one
    # writes or reads an s×s matrix per head, a·s elements per token against 4·s·h FLOPs, an intensity near the
    # head size (64–160 FLOP/byte), below the ridge of a GPU (A100: 312 TFLOP/s over 2 TB/s = 153). Priced on the
    # roofline: the longer of their FLOPs at the matmul rate and their bytes at the memory bandwidth.
    score_flops = shape.score_flops()
    score_passes = 3 + (1 if recompute in ("full", "selective") else 0)
    layer_flops = (shape.layer_fwd_flops() - score_flops) * (3 + (1 if recompute == "full" else 0))
    # fp8 (Transformer Engine's linears): the layers' matmuls at the profile's fp8 rate; attention and the vocabulary
    # layer stay in 16 bits
    layer_rate = flops_s
    if "fp8" in strategy and profile.matmul_tflops.get("float8"):
        layer_rate = profile.matmul_tflops["float8"] * 1e12 * profile.matmul_efficiency.get("float8", 1.0)
    mb_flops = tokens * (stage_layers * layer_flops * flops_s / layer_rate + 3 * shape.vocab_fwd_flops()) / tp
    score_s = score_flops / tp / flops_s
    if not shape.flash_attention:
        score_s = max(score_s, shape.attention_matmul_bytes(tp) / bandwidth)
    mb_scores = tokens * stage_layers * score_passes * score_s
    elementwise_passes = ELEMENTWISE_PASSES - (0.0 if recompute == "full" else 1.0)
    mb_elementwise = tokens * stage_layers * shape.layer_elementwise_bytes(tp, sp) * elementwise_passes
    # the loss on the last stage: 16-bit logits written (2V), cast to fp32 (read 2V, write 4V), cross-entropy
    # (read 4V, write 4V) and its backward (read 4V, write 4V, cast back: read 4V... ~24V bytes per token)
    mb_elementwise += tokens * VOCAB_LOSS_BYTES * shape.vocab / vocab_split
    if regime.autocast and not f.half:  # autocast casts every fp32 weight to 16 bits in each forward
        mb_elementwise += 6.0 * n_rank * (2 if recompute == "full" else 1)
    act_bytes = 2.0 * tokens * h  # a layer's hidden states in 16 bits
    tp_count = stage_layers * (4 + (2 if recompute == "full" else 0))
    mb_tp = _group_collective_s(profile, "all_reduce", act_bytes * tp_count, tp, 1, tp_count)
    mb_tp += _group_collective_s(profile, "all_reduce", 4.0 * tokens * 2, tp, 1, 2) if vocab_split > 1 else 0.0
    mb_p2p = 0.0
    if pp > 1:
        bandwidth_p2p, latency_p2p = _group_link(profile, "all_gather", 2, tp)
        sent = act_bytes / (tp if sp else 1)
        one = sent / bandwidth_p2p + latency_p2p
        if shape.megatron_2021 and tp > 1 and not sp:
            # each tensor rank sends 1/t of the replicated activations over its own link and the receiving stage
            # all-gathers them within its tensor group
            one = act_bytes / tp / bandwidth_p2p + latency_p2p + _group_collective_s(
                profile, "all_gather", act_bytes, tp, 1, 1)
        mb_p2p = 2 * v * one
    mb_compute = mb_flops / flops_s + mb_scores + mb_elementwise / bandwidth
    mb_tp += _all_to_all_s(shape, profile, tokens, stage_layers, ep, tp, recompute == "full")
    if dualpipe:  # the compute runs on the SMs communication leaves it and hides the in-line transfers
        mb_compute /= DUALPIPE_COMPUTE_SHARE
        mb_tp, mb_p2p = max(0.0, mb_tp + mb_p2p - mb_compute), 0.0
    mb_time = mb_compute + mb_tp + mb_p2p
    # Weight gradients accumulated over the step's micro-batches, at the memory bandwidth: torch's AccumulateGrad
    # adds each micro-batch's gradient into ``.grad`` from the second one on (reads both, writes one: 3 × the
    # gradient's bytes; Megatron-LM's own DDP adds the first one too, into its ``main_grad`` buffer).
    accumulate = (m - 1) * 3 * grad_el * n_rank
    compute = mb_compute * m + accumulate / bandwidth
    bubble = mb_time * (pp - 1) / v if pp > 1 else 0.0
    if dualpipe:  # F&B + B − 3W with W (the weights' gradients) a third of a micro-batch: two thirds of one
        bubble = mb_time * (pp / 2 - 1) * 2 / 3

    # Data-parallel collectives over the data group (stride t·p), exposed where nothing hides them.
    grad_bytes = n_rank * grad_el
    gather_bytes = n_rank * regime.gathered
    stride = tp * pp
    dp_comm, hidden_by = 0.0, 0.0
    if dp > 1:
        last_backward = mb_compute * 2 / 3
        if f.sharding:
            gathers = (1 if f.sharding == "zero2" else m) if pp > 1 else m * (1 if f.sharding == "zero2" else 2)
            gather = _group_collective_s(profile, "all_gather", gather_bytes * gathers, dp, stride,
                                         gathers * stage_layers)
            reduce = _group_collective_s(profile, "reduce_scatter", grad_bytes, dp, stride, stage_layers)
            # prefetched gathers hide behind the micro-batches' compute (all but the first layer's), the
            # reduction behind the last backward; both share the links, so together they hide behind the compute
            first = gather / gathers / max(1, stage_layers)
            if pp > 1:  # the reduction runs after the pipeline's flush
                exposed = max(0.0, gather - first - compute) + first + reduce
            else:
                exposed = max(0.0, gather - first + reduce - compute, reduce - last_backward) + first
            dp_comm = gather + reduce
            hidden_by = dp_comm - exposed
        else:
            reduce = _group_collective_s(profile, "all_reduce", grad_bytes, dp, stride,
                                         max(1, math.ceil(grad_bytes / DDP_BUCKET_BYTES)))
            exposed = reduce if pp > 1 else max(0.0, reduce - last_backward)
            dp_comm = reduce
            if f.zero1:
                dp_comm += _group_collective_s(profile, "all_gather", n_rank * regime.weights, dp, stride, 1)
            hidden_by = reduce - exposed
    exposed_comm = (mb_tp + mb_p2p) * m + dp_comm - hidden_by
    passes = OPTIMIZER_PASSES[0] + OPTIMIZER_PASSES[1] * optimizer_state_factor
    optimizer = passes * owned * wbytes / bandwidth
    step = compute + exposed_comm + bubble + optimizer
    time = TimePrediction(compute=compute, communication=exposed_comm, optimizer=optimizer, bubble=bubble,
                          step=step)
    notes = (f"transformer terms: tensor {tp}, pipeline {pp} (x{v} virtual), data {dp}, sharding {f.sharding or 'none'}"
             f"{' zero1' if f.zero1 else ''}, precision {regime.name}, recompute {recompute}, sequence parallel {sp}, "
             f"bubble {bubble:.4g} s",)
    return Prediction(memory=memory, time=time, samples_per_rank=f.micro, notes=notes)
