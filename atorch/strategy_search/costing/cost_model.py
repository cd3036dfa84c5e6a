"""Cost model: predicted peak memory per rank and step time of a strategy, from its arguments alone.

``predict(stats, strategy, layout, profile, global_batch, micro_batches)`` is a pure function: the
model's statistics (``analyser.ModelStats``), the strategy, the parallel layout and a hardware profile
(measured here or read from a table for another cluster) are all it reads, so a plan for a 1,000-GPU
job can be made on a laptop. Every term is analytical and listed here; the constants marked
"calibrated" were fitted against ``bench/cost_model.py``, which measures each candidate with the
dry-run the search uses (``atorch.dryrun``: the peak increase of live tensor bytes over a baseline taken
before the candidate is built, over build and warm-up, max over ranks; median step time after
warm-up), on a small GPT-2, an MLP and a small ResNet at 2 ranks (see bench/README.md).

What each method does is its own statement: ``Method.cost_facts(config, layout)`` (``atorch.opt_lib.cost_facts``:
sharding of parameters / gradients / optimizer state, gathering, storage and compute dtypes, the fraction of blocks
recomputed, collectives as multiples of parameter bytes), combined by ``strategy_facts``; the terms below read the
combined facts, never a method's name ("fsdp", "checkpoint" below name what the facts of those methods state).

For a transformer whose shape is known (what ``atorch plan`` plans), ``plan_terms.predict_transformer`` reads the
same facts of a strategy (``_facts``) and replaces the activation, FLOP and communication terms with the
transformer terms (Megatron-LM's formulas, hierarchical collectives across nodes); every term below applies to the
rest.

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
  outside the repeated blocks) stays gathered, and the gradients of its parameters that the forward uses after
  the last block (the output head; with tied embeddings the embedding itself: ``head_param_bytes``) appear first
  in backward and stay unsharded until the root's reduction at its end: root + head gathered bytes throughout
  (on the tuned, tied GPT-2 1.94 × the root, where a fitted 2 × had stood; on three untied decoders that nothing
  was fitted on, the FSDP rows' median error went from +8.2% to +3.3%: bench/memory_probe.py); a block unit is
  gathered while it runs, so
  the forward's peak (at the head) holds none and the backward one (``unit``). After a unit's backward its
  gradients are reduced (``foreach_reduce``): a reduce-scatter input of the unit's fp32 bytes (the reduce dtype,
  also under mixed precision) and its output (``unit / dp``; gloo reduces a whole copy instead: ``unit``), while
  the activations of the blocks before it are still held and so is the block before it, gathered by FSDP2's
  backward prefetch; block by block, last first, with each block's own sizes (``ModelStats.block_sequence``:
  a vision model's last stage can hold most parameters and the fewest activations); the backward's peak is the
  larger of the two moments. With gradient accumulation FSDP2 accumulates unsharded gradients in the reduce
  dtype (fp32) while atorch keeps the sync off.
* zero2 (FSDP2 without resharding after forward; ``reshard_after_forward: false`` alike): as fsdp, but
  every block stays gathered from its forward until its own backward has run. The end of the forward and
  the start of the blocks' backward hold all of them (no block recomputed yet); from there one block is
  resharded after each block's backward, and the backward goes on as fsdp's, every block before the one reducing
  still gathered (SegFormer's zero2 peak was 19% under without them). The peak is the larger of the
  two: with recompute, the start (measured block by block on bench/search.py's GPT-2s: 4 blocks and 64
  blocks, within 1%).
* tensor / pipeline parallel (``t`` × ``p`` ranks per model replica): the repeated blocks' parameters,
  gradients and state are split ``t·p`` ways (a single key/value head's projections, which tensor parallel
  keeps whole, and whatever in the blocks the plan does not split, such as norms or a hybrid block's
  convolutions: ``p`` ways); the rest (embeddings, head: the vocabulary is kept whole)
  stays whole on a rank (the first / last stage under pipeline parallel: that stage is counted). A
  block's saved activations shrink to ``TP_REPLICATED_ACTIVATIONS + (1 − that) / t`` (norms and residuals
  are replicated); a stage holds ``1/p`` of the blocks for each micro-batch in flight: ``p`` of them
  under 1f1b and the interleaved schedules (``p + 1`` under dualpipev), all under gpipe. The schedule's
  micro-batches accumulate into the stage's gradients like gradient accumulation.
* expert_parallel (``expert_split`` ``e``; a mixture-of-experts model: ``E`` = the experts' parameter bytes,
  ``ModelStats.expert_param_count`` at the model's bytes per parameter): a rank keeps ``E / e`` whole, with their
  gradients and optimizer state, outside the data-parallel sharding, DDP's buckets and FSDP's gathered units; the
  rest of the terms read ``P − E`` as the trainable bytes. Activations as without it (a rank's experts see its share
  of the routed rows in expectation) plus the copies of the routed rows its dispatch keeps (``routed_saved``: the
  combine's weighting, one copy of tokens × top-k × hidden per MoE layer). Fake-tensor tracing cannot run its
  dispatch: this figure stands for it.
* context_parallel (``context`` ``c``): context ranks read the same batch (``dp`` splits it over the data ranks)
  and average and shard the gradients with them (DDP/FSDP over data × context: ``sync``). Activations ``/ c``
  (a rank's 1/c of every sequence), plus what its attention keeps whole: the gathered K and V repeated to the
  query heads (``ModelStats.attention_kv_bytes_per_token`` × the sequence, of which the split counted 1/c; beside
  tensor parallel a rank's 1/t of the heads) and one boolean mask, the rank's queries × every key, shared by the
  layers. The trace runs whole sequences (the split is
  a communicating step): this figure stands for it.
* cpu_offload (with fsdp / zero2): the sharded parameters, gradients and state live in host memory: on
  a CUDA device the device figure leaves them out (``host_bytes`` holds them); on a CPU device host
  memory is the device's, and nothing changes.
* amp_native: parameters stay fp32; under FSDP the gathered copies are in the autocast dtype (half);
  without FSDP autocast caches a 16-bit cast of every weight until the forward ends (``(P + F) / 2``);
  activations: matmul / convolution outputs are saved in 16 bits, the rest in 32: the share is the
  analyser's (the same forward run under bf16 autocast on fake tensors, weight casts left out: 0.57 for
  the small GPT-2, 0.50 for the ResNet), or the calibrated ``AMP_ACTIVATION_FACTOR`` (0.6) without it.
* half: every parameter, gradient, state and activation in 16 bits (half of each fp32 figure).
* checkpoint (``recompute`` = the fraction of the repeated blocks recomputed; below for all of them; for a
  fraction ``r``, the others keep all they save, less the blocks freed before the last recomputed one runs again:
  ``(1 − r) × their bytes × (1 − 1/(r·blocks))``): a block keeps only its inputs (the analyser's
  ``input_bytes_total``; for statistics without it, calibrated ``CHECKPOINT_INPUT_FRACTION`` of the blocks' saved
  bytes) and one block's activations exist again during its recompute: ``A_outside + Σ block inputs + the largest
  block``; the backward of an attention block (the analyser saw attention or a softmax run in it) also holds the
  gradient of the largest tensor the block saved (the analyser's ``largest_saved_bytes``; the ResNet's convolution
  blocks fit within 4% without it).

Known limits of the memory model against the dry-run (bench/README.md): DeepSpeed's memory on a CPU depends on
when Python's cycle collector runs (ZeRO-2 under accumulation: one or two gradient partitions; the bench's rows
flip between runs), predicted within half a partition of either outcome; an fp16 trial whose loss scale never
lets a warm-up step through is failed, not measured.

Step time (seconds): compute + overhead + exposed communication + optimizer (elementwise traffic).

* compute = FLOPs per sample (forward+backward) × samples per rank per step / matmul throughput of the
  compute dtype (fp32; bf16/fp16 under amp_native or half) at the model's average matmul size (the side of a
  square matmul with the FLOPs of one of the analyser's forward matmuls at this micro-batch, split by tensor
  parallel; the profile's rate by size, interpolated); checkpoint adds one more forward of the blocks.
* a 16-bit compute dtype whose step the profile measured against fp32's (``dtype_step_ratio``, a small
  transformer-like block forward and backward, on a CPU; by matmul size, read at the model's): the matmuls at
  fp32's rate and the forward and backward's operations at fp32's count (no cast operations), both × that ratio.
  Without it (CUDA, tables, older profiles), the 16-bit matmul rate and the cast operations below.
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
* expert parallel: per MoE layer and micro-batch four all-to-alls (dispatch and combine, forward and backward) of
  the routed hidden states, tokens per rank × top-k × hidden (a block's input per token, in the compute dtype),
  each rank keeping 1/e (the all-to-all factor (e−1)/e), at the profile's all-to-all figures (all-gather's where it
  has none); the dispatch's operations (``CostFacts.moe_layer_ops``); the expert gradients' all-reduce over the
  ranks holding the same experts once per step. The compute is the analyser's FLOPs, which count each routed
  token's rows through its experts (top-k, ``fake_kernels.EXTRA_FLOPS``), so it is unchanged by the split.
* context parallel: a rank computes 1/c of the FLOPs (its tokens; the zigzag split gives every rank the same causal
  attention work) at the matmul size of its 1/c; per attention layer and micro-batch ``CONTEXT_LAYER_OPS``
  operations, an all-gather of the whole sequence's K and of its V in forward (``ModelStats.kv_bytes_per_token``
  × the sequence, in the compute dtype) and their gradients' reduce-scatter in backward (an all-reduce on a CPU:
  gloo has no reduce-scatter), over the ``c`` context ranks (beside tensor parallel, each rank its 1/t of the heads).
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

from atorch.opt_lib.cost_facts import Collective, StrategyFacts, combine
from atorch.opt_lib.deepspeed_zero import DEEPSPEED_BUCKET_ELEMENTS
from atorch.opt_lib.pipeline_parallel import PipelineParallel
from atorch.opt_lib.registry import get_method
from atorch.parallel_layout import ParallelLayout
from atorch.strategy import Strategy
from atorch.strategy_search.costing.analyser import ModelStats
from atorch.strategy_search.costing.hardware import ALL_TO_ALL, HardwareProfile

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
TP_REPLICATED_ACTIVATIONS = 10 / 34  # share of a block's saved bytes tensor parallel does not split (Megatron)
TP_BLOCK_OPS = 4  # collectives per block and micro-batch under tensor parallel (2 in forward, 2 in backward)
# context parallel's operations per attention layer and micro-batch, (a, b): a + b × context (counted from
# opt_lib/context_parallel.py's attention: per K and V a gather of c parts and their concatenation, and in backward
# a reduction and the rank's slice; the mask is made once per forward, shared by the layers)
CONTEXT_LAYER_OPS = (12, 2)


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
    stats = profile.collective(name)
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
    """The pipeline schedule's config, whichever method runs it (mixed_parallel stands for pipeline_parallel)."""
    return strategy.applied_configs().get(PipelineParallel.name)


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


def strategy_facts(strategy: Strategy, layout: ParallelLayout) -> StrategyFacts:
    """The cost facts of the strategy's methods at this layout, combined: each method states its own
    (``Method.cost_facts``, next to its code), so no term here checks a method's name; the compute dtype is the
    methods' own (``Strategy.compute_dtype``)."""
    return combine(((name, get_method(name).cost_facts(config, layout)) for name, config in strategy.configs().items()),
                   compute_dtype=_compute_dtype(strategy))


def _compute_dtype(strategy: Strategy) -> str:
    """The dtype the matmuls run in, by torch's name (the profile's throughput is keyed by it)."""
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[strategy.compute_dtype()]


@dataclass(frozen=True)
class _Facts:
    """What a strategy makes of the model on one rank, shared by the memory and the time terms: the layout's
    sizes, what its methods' cost facts state (``strategy_facts``), and the parameter bytes this rank holds
    (after tensor / pipeline splits)."""

    dp: int
    samples: float  # per rank per step
    micro_batches: int  # per step, the pipeline schedule's own included
    micro: float  # samples per micro-batch
    # the method whose facts shard the gradients (FSDP2's fsdp / zero2; under DeepSpeed's engine only its ZeRO-2
    # does: its ZeRO-1 shards the optimizer state alone), or None
    sharding: str | None
    deepspeed: bool  # DeepSpeed's engine keeps the state in its own buffers
    reshard: bool  # sharded parameters gathered for forward and again for backward
    offload: bool  # the sharded state lives in host memory
    zero1: bool  # optimizer state sharded, gradients whole
    half: bool  # parameters, gradients, state and activations stored in 16 bits
    amp: bool  # autocast: fp32 weights cast to 16 bits in the forward
    checkpoint: bool  # some blocks recomputed
    recompute: float  # the fraction of the repeated blocks recomputed in backward
    collectives: tuple[Collective, ...]  # the methods' collectives (and DDP's gradient sync where none syncs them)
    scale: float  # 0.5 under half: everything in 16 bits
    shard: int  # the parameters' sharding degree
    trainable: float
    frozen: float
    buffers: float
    block_params: float
    biggest_block: float
    root_params: float
    head_params: float  # the root's parameters used after the last block (their gradients come first in backward)
    tp: int
    pp: int
    split: int
    share: float  # the share of the model's parameters (and, as a proxy, of its matmul FLOPs) on this rank
    rank_param_bytes: float
    rank_trainable_bytes: float
    owned: float  # the parameters whose optimizer state this rank keeps
    experts: float  # expert parameter bytes kept whole on this rank (expert parallel), outside ``trainable``
    rank_expert_bytes: float  # the same before the storage scale (what the expert collectives move)
    routed_bytes: float  # hidden states a rank's tokens send to their top-k experts, all MoE layers, per micro-batch
    moe_layers: int
    ep: int  # the experts' split (expert parallel's 'expert' dimension)
    moe_layer_ops: int  # operations added per MoE layer and micro-batch (the token dispatch)
    routed_saved: float  # copies of the routed rows the dispatch keeps for backward
    gather: float  # FSDP mixed precision gathers 16-bit copies
    schedule: str  # the pipeline schedule
    context: int = 1  # each sequence split over this many ranks (context_parallel): activations / context
    sync: int = 1  # the ranks gradients are averaged and sharded over: data × expert × context


def _facts(stats: ModelStats, strategy: Strategy, layout: ParallelLayout, global_batch: int,
           micro_batches: int) -> _Facts:
    dp = layout.data_size
    if global_batch % (dp * micro_batches):
        raise ValueError(f"global_batch {global_batch} is not divisible by dp {dp} x micro_batches {micro_batches}")
    samples = global_batch / dp  # per rank per step
    # under pipeline parallel the schedule splits each batch it is given into its own micro-batches
    micro_batches *= _schedule_micro_batches(strategy, layout.size("pipeline"))
    micro = samples / micro_batches

    facts = strategy_facts(strategy, layout)
    sharding = facts.sharded_by
    deepspeed = facts.engine == "deepspeed"
    reshard = facts.gathering == "per_use"
    offload = facts.offload
    zero1 = facts.optimizer_state is not None and sharding is None
    half = facts.storage_bytes < 1.0
    amp = facts.autocast
    recompute = facts.recompute
    scale = facts.storage_bytes  # 0.5 under 16-bit storage: everything in 16 bits
    # [context_parallel] context ranks read the same batch (``dp`` splits it) but average and shard the gradients
    # with the data ranks (DDP/FSDP over data × context)
    sync = layout.replica_size
    shard = sync if sharding else 1
    # [expert_parallel] the experts split ep ways: a rank keeps 1/ep of them whole, with their gradients and state,
    # outside the data-parallel sharding and sync (the trainable bytes below are the rest); bytes per parameter as
    # the model's average
    ep = facts.expert_split if stats.experts > 1 else 1
    expert_bytes = stats.expert_param_count * stats.param_bytes / stats.param_count if ep > 1 and stats.param_count \
        else 0.0

    trainable = (stats.trainable_param_bytes - expert_bytes) * scale
    frozen = stats.frozen_param_bytes * scale
    buffers = stats.buffer_bytes * scale
    block_params = sum(b.param_bytes_total for b in stats.blocks) * scale
    biggest_block = max((b.param_bytes for b in stats.blocks), default=0) * scale
    root_params = (stats.param_bytes * scale) - block_params
    head_params = min(stats.head_param_bytes * scale, root_params)
    if expert_bytes and block_params:  # split experts stay out of FSDP's units: a MoE block gathers the rest
        block_params -= expert_bytes * scale
        biggest_block -= expert_bytes / max(1, stats.moe_layers) * scale
    # Tensor and pipeline parallel split the repeated blocks (tensor: each block's matmuls; pipeline: the blocks
    # over the stages); what is outside them (embeddings, head: the vocabulary is kept whole) stays whole, on
    # the first / last stage under pipeline parallel: the stage holding it is the one counted.
    tp, pp = layout.size("tensor"), layout.size("pipeline")
    split = tp * pp
    share = 1.0  # the share of the model's parameters (and, as a proxy, of its matmul FLOPs) on this rank
    if split > 1 and stats.param_bytes:
        # [tensor_parallel] key/value projections with fewer heads than tp stay whole on each rank of the group, and
        # so do the experts the plan does not split (those expert parallel splits are out of these terms already)
        whole = sum(size for kv_heads, size in stats.tp_kv_param_bytes if kv_heads < tp) * scale
        if tp > 1:  # what the plan does not split stays whole on every rank of the tensor group
            whole += stats.tp_whole_block_bytes * scale
        if tp > 1 and ep == 1:
            whole += stats.tp_whole_expert_bytes * scale
        per_block = whole / max(sum(b.count for b in stats.blocks), 1)
        share = (root_params + (block_params - whole) / split + whole / pp) / (stats.param_bytes * scale)
        trainable, frozen = trainable * share, frozen * share
        block_params = (block_params - whole) / split + whole / pp
        biggest_block = (biggest_block - per_block) / tp + per_block
    rank_expert_bytes = expert_bytes / ep
    rank_param_bytes = (stats.param_bytes - expert_bytes) * share + rank_expert_bytes
    rank_trainable_bytes = (stats.trainable_param_bytes - expert_bytes) * share
    experts = rank_expert_bytes * scale
    # a MoE layer's dispatch: each token's hidden state (a block's input per sample and layer) to each of its top-k
    hidden = sum(b.input_bytes_total for b in stats.blocks) / max(1, sum(b.count for b in stats.blocks)) \
        / stats.batch_size
    routed = hidden * micro * stats.experts_per_token * stats.moe_layers

    owned = trainable / (sync if (sharding or zero1) else 1) + experts  # the parameters whose state this rank keeps
    gather = 0.5 if amp and not half else 1.0  # FSDP mixed precision gathers 16-bit copies
    return _Facts(dp=dp, samples=samples, micro_batches=micro_batches, micro=micro, sharding=sharding,
                  deepspeed=deepspeed, reshard=reshard, offload=offload, zero1=zero1, half=half, amp=amp,
                  checkpoint=recompute > 0, recompute=recompute, collectives=facts.collectives, scale=scale,
                  shard=shard, trainable=trainable, frozen=frozen,
                  buffers=buffers, block_params=block_params, biggest_block=biggest_block, root_params=root_params,
                  head_params=head_params,
                  tp=tp, pp=pp, split=split, share=share, rank_param_bytes=rank_param_bytes,
                  rank_trainable_bytes=rank_trainable_bytes, owned=owned, experts=experts,
                  rank_expert_bytes=rank_expert_bytes, routed_bytes=routed, moe_layers=stats.moe_layers, ep=ep,
                  moe_layer_ops=facts.moe_layer_ops if ep > 1 else 0,
                  routed_saved=facts.routed_saved if ep > 1 else 0.0,
                  gather=gather,
                  schedule=_schedule(strategy),
                  context=layout.size(facts.activations) if facts.activations else 1, sync=sync)


def _reduce_scatter_bytes(unit: float, f: _Facts, profile: HardwareProfile) -> float:
    """FSDP2's gradient reduction of one unit, after its backward (``foreach_reduce``): the unit's gradients copied
    into one reduce-scatter input in the reduce dtype (fp32, also under mixed precision: ``unit`` is the unit's
    fp32 bytes) and its output, ``1 / dp`` of it. gloo has no reduce-scatter of its own: torch's gloo backend
    reduces a whole copy of the input, so on a CPU the output's place is taken by a whole unit (measured on the
    held-out MobileViT and RegNet: 2.0 units over the unit's resharded state, fp32 and amp alike)."""
    return unit * (1.0 + (1.0 if profile.device_type == "cpu" else 1 / f.sync))


def _fsdp_reductions(stats: ModelStats, f: _Facts, profile: HardwareProfile, activations: float, act_scale: float,
                     held_grads: float, grads: float, reduce_temp: float) -> tuple[float, float]:
    """The backward at its gradient reductions: (the largest such moment's bytes besides parameters and state, its
    temporaries). Without FSDP2 units (one root unit, DeepSpeed, none): the first one, the block that finished
    first freed, ``reduce_temp`` held. FSDP2's units unit by unit, last block first: the reduction's buffers and
    the blocks still gathered.

    When a unit's backward has run, FSDP2 frees its gathered parameters and reduce-scatters its gradients
    (``post_backward``). Then the activations of the blocks after it are freed (under recompute: the one block
    recomputed at a time), and the blocks before it that are gathered: with resharding after forward (fsdp) the one
    FSDP2's backward prefetch gathered as this one's backward began, without (zero2) all of them.
    Blocks of unequal size (a vision model's stages: SegFormer's last stage holds 46% of its block parameters and the
    fewest activations) make the first reduction the largest: counted with the largest unit and the largest block's
    activations freed, a zero2 peak was 19% under the measured one."""
    if not (f.sharding and f.sync > 1 and stats.blocks and not f.deepspeed):
        left = max(0.0, activations - max((b.activation_bytes for b in stats.blocks), default=0) * act_scale)
        return (left + held_grads if f.micro_batches > 1 else max(left, grads)) + reduce_temp, reduce_temp
    sequence = stats.block_sequence or tuple((b.param_bytes, b.activation_bytes) for b in stats.blocks
                                             for _ in range(b.count))  # an analysis from before the sequence
    # the facts' unit sizes include the layout's scaling and split (tensor / pipeline, experts kept out)
    per_param = f.biggest_block / max(1, max(p for p, _ in sequence))
    largest_act = max(a for _, a in sequence) * act_scale
    gathered, freed, best, temp = 0.0 if f.reshard else f.block_params * f.gather, 0.0, 0.0, 0.0
    for index in range(len(sequence) - 1, -1, -1):
        param_bytes, act_bytes = sequence[index]
        unit = param_bytes * per_param
        if f.reshard:  # the block before it, gathered by FSDP2's backward prefetch when this one's backward began
            gathered = sequence[index - 1][0] * per_param * f.gather if index else 0.0
        else:
            gathered = max(0.0, gathered - unit * f.gather)
        freed = largest_act if f.checkpoint else freed + act_bytes * act_scale
        left = max(0.0, activations - freed)
        reduction = _reduce_scatter_bytes(unit, f, profile) + gathered
        moment = (left + held_grads if f.micro_batches > 1 else max(left, grads)) + reduction
        if moment > best:
            best, temp = moment, reduction
    return best, temp


def _memory(stats: ModelStats, f: _Facts, profile: HardwareProfile,
            optimizer_state_factor: float) -> tuple[MemoryPrediction, list[str]]:
    """Peak bytes per rank: the terms of each phase (forward, backward, optimizer step, DeepSpeed's epilogue)."""
    notes: list[str] = []
    params = (f.trainable + f.frozen) / f.shard + f.experts + f.buffers
    grads = f.trainable / f.shard + f.experts
    state = optimizer_state_factor * f.owned
    unit = f.biggest_block if stats.blocks else f.rank_param_bytes * f.scale  # FSDP's largest unit
    persistent = 0.0  # buffers that live across steps
    fwd_temp = bwd_temp = 0.0  # gathered parameters / gradient buffers at the forward and backward peaks
    all_gathered = 0.0  # FSDP2 without resharding: every block's parameters, at the start of the blocks' backward
    epilogue = 0.0  # DeepSpeed: the reduction at the end of a backward (below)
    reduce_temp = 0.0  # FSDP2: a unit's gradient reduction after its backward (its gathered parameters freed)
    if f.deepspeed:
        # ZeRO-1/2 in DeepSpeed 0.19 (deepspeed/runtime/zero/stage_1_and_2.py): the module's parameters live in
        # one flat buffer (DeepSpeedZeroOptimizer.__init__, flatten_dense_tensors_aligned), each rank keeps an
        # fp32 copy of its partition (__init__: single_partition_of_fp32_groups) and, from the first gradient
        # hook on, the reduce bucket (setup_buckets: torch.empty(reduce_bucket_size) in fp32; atorch passes
        # reduce_bucket_size = min(DEEPSPEED_BUCKET_ELEMENTS, trainable elements): opt_lib/deepspeed_zero.py).
        params = f.trainable + f.frozen + f.buffers
        bucket = min(f.trainable, 4 * DEEPSPEED_BUCKET_ELEMENTS)
        persistent = f.trainable / f.sync + bucket
        # The reduction at the end of a backward (independent_gradient_partition_epilogue -> reduce_ipg_grads ->
        # allreduce_bucket, whose flatten() copies the bucket's gradients: one bucket) copies this rank's part
        # into grads_in_partition (copy_grads_in_partition: the parameters of its partition, whole). ZeRO-2
        # reduces every micro-batch; under accumulation the previous micro-batch's grads_in_partition is dropped
        # by DeepSpeed but still referenced from a reference cycle, so it is alive at this copy only until
        # Python's cycle collector next runs: two partitions or one, by the collector's timing (seen with the
        # collector off: two, and with it run after every allocation: one; the bench's DeepSpeed ZeRO-2 rows
        # flip between the two from run to run). Predicted: the midpoint, so either outcome is within half a
        # partition. ZeRO-1 reduces once, at the boundary.
        partitions = ZERO2_ACCUMULATED_PARTITIONS if f.sharding is not None and f.micro_batches > 1 else 1
        epilogue = bucket + partitions * _deepspeed_grads_in_partition(stats, f.sync)
    elif f.sharding and f.sync > 1 and stats.blocks:
        # FSDP2 keeps the root unit (what is outside the blocks) gathered, and from the start of backward the
        # unsharded gradients of its head (``head_params``) until its reduction; a block unit is gathered while it
        # runs: in backward one is (the forward's is freed before the head's peak). Without resharding after
        # forward every block stays gathered until its own backward has run: all of them at the forward's end and
        # where the blocks' backward starts (seen block by block on the bench's GPT-2s).
        persistent = (f.root_params + f.head_params) * f.gather
        fwd_temp, bwd_temp = (0.0, unit * f.gather) if f.reshard else (f.block_params * f.gather, unit * f.gather)
        reduce_temp = _reduce_scatter_bytes(unit, f, profile)
        all_gathered = 0.0 if f.reshard else f.block_params * f.gather
    elif f.sharding and f.sync > 1:  # no blocks: the root is the only unit, gathered for forward and backward
        fwd_temp = bwd_temp = unit * f.gather
        reduce_temp = _reduce_scatter_bytes(unit, f, profile)
    elif f.sharding and f.amp:  # dp = 1: FSDP2 still casts the parameters for compute
        fwd_temp = bwd_temp = f.rank_param_bytes * 0.5
    elif f.sync > 1:
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
    if f.zero1 and f.sync > 1 and not f.deepspeed:  # the other ranks' updated parameters, broadcast after the step
        step_temp += ZERO1_BROADCAST_FRACTION * f.trainable * (f.sync - 1) / f.sync

    amp_factor = (stats.amp_activation_bytes / stats.activation_bytes if stats.amp_activation_bytes
                  and stats.activation_bytes else AMP_ACTIVATION_FACTOR)
    act_scale = f.micro / stats.batch_size * f.scale * (amp_factor if f.amp and not f.half else 1.0) / f.context
    block_act = sum(b.activation_bytes_total for b in stats.blocks)
    if f.checkpoint and stats.blocks:
        # A recomputed block keeps its inputs, the others all they save. The backward peaks at the last recomputed
        # block's recompute: the 1/recompute blocks from it on have been freed by then, the rest are held.
        inputs = sum(b.input_bytes_total for b in stats.blocks) or CHECKPOINT_INPUT_FRACTION * block_act
        before = max(0.0, 1 - 1 / (f.recompute * sum(b.count for b in stats.blocks)))
        kept = stats.activation_bytes_outside_blocks + f.recompute * inputs \
            + (1 - f.recompute) * block_act * before + max(b.activation_bytes for b in stats.blocks)
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
        # DualPipe(V) holds one more (DeepSeek-V3's report, arXiv 2412.19437, Table 2: PP + 1 against 1F1B's PP)
        in_flight = f.micro_batches if f.schedule == "gpipe" else min(f.micro_batches,
                                                                      f.pp + (f.schedule == "dualpipev"))
        kept = stats.activation_bytes_outside_blocks + in_blocks / f.pp * in_flight
    largest = stats.largest_activation.bytes if stats.largest_activation else 0
    activations = (kept + LOSS_TEMP_FACTOR[f.checkpoint and bool(stats.blocks)] * largest) * act_scale
    activations += f.routed_saved * f.routed_bytes * f.scale * f.gather  # expert parallel's combine (at micro already)
    if f.context > 1 and stats.seq_len:
        # context parallel: each layer's attention saves the gathered K and V (repeated to the query heads) of the
        # whole sequence, which the split above counted at 1/c; and one boolean causal mask (its queries × every
        # key) that every layer shares
        # (beside tensor parallel a rank holds its 1/t of the query heads)
        whole_kv = (stats.attention_kv_bytes_per_token * stats.seq_len * f.micro * (0.5 if f.amp or f.half else 1.0)
                    / f.tp)
        activations += whole_kv * (1 - 1 / f.context) + stats.seq_len ** 2 / f.context
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
    # Under recompute an attention block's backward holds its recomputed activations (in ``activations``), which
    # it frees as it runs back through them, and the gradient of the largest tensor it saved (a block's backward
    # holds one such gradient at a time; as many bytes again as the block saved was 43% over the measured peak of
    # the held-out Swin's two-layer stages, 9-15% over the mixture-of-experts decoders'; the ResNet's convolution
    # blocks fit within 4% without any term).
    recompute = max((b.largest_saved_bytes for b in stats.blocks if b.attention), default=0) * act_scale \
        if f.checkpoint else 0.0
    # DeepSpeed steps with its gradient partition only (ZeRO-1 too: the full gradients are reduced into it and
    # freed); ZeRO-2 under accumulation keeps a second partition, the accumulated one (measured on the 206M GPT-2).
    step_grads = grads
    if f.deepspeed:
        step_grads = f.trainable / f.sync * (2 if f.sharding is not None and f.micro_batches > 1 else 1)
    # Backward at the start of the blocks' (every block still gathered without resharding, none recomputed yet)
    # and as it goes on (one block gathered and recomputed at a time).
    bwd_start = activations + held_grads + all_gathered
    bwd_on = (activations + held_grads if f.micro_batches > 1 else max(activations, grads)) + bwd_temp + recompute
    bwd_reduce, reduce_temp = _fsdp_reductions(stats, f, profile, activations, act_scale, held_grads, grads,
                                               reduce_temp)
    if bwd_start > bwd_on:
        bwd_temp = all_gathered
    if bwd_reduce > max(bwd_start, bwd_on):
        bwd_temp = reduce_temp
    phases = {
        "forward": activations + fwd_temp + held_grads,
        "backward": max(bwd_start, bwd_on, bwd_reduce),
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


def _attention_layers(stats: ModelStats) -> int:
    """The model's attention layers: its repeated blocks that attend (one attention each)."""
    return sum(b.count for b in stats.blocks if b.attention)


def _matmul_size(stats: ModelStats, f: _Facts) -> float | None:
    """The side of a square matmul with the FLOPs of the model's average one at this micro-batch (tensor
    parallel splits each matmul): the size whose measured throughput the compute term uses."""
    if not stats.fwd_lowp_ops or not stats.fwd_flops_per_sample:
        return None
    flops = stats.fwd_flops_per_sample * f.micro / stats.fwd_lowp_ops / f.tp / f.context
    return (flops / 2) ** (1 / 3)


def _collectives_s(stats: ModelStats, f: _Facts, profile: HardwareProfile, c: Collective, gathers: int,
                   units: int) -> list[float]:
    """Seconds of one kind of collective a method states (``Collective``: its volume as a multiple of parameter
    bytes) over one step, term by term; none where its mesh dimension has one rank."""
    # "replicas": the ranks holding the same experts, data × context
    ranks = {"data": f.sync, "replicas": f.sync // f.ep, "expert": f.ep, "tensor": f.tp,
             "pipeline": f.pp}.get(c.over, 1)
    if ranks <= 1:
        return []
    base = {"trainable": f.rank_trainable_bytes, "parameters": f.rank_param_bytes - f.rank_expert_bytes,
            "experts": f.rank_expert_bytes, "routed_tokens": f.routed_bytes}[c.of]
    nbytes = base * f.scale * (f.gather if c.dtype == "compute" else 1.0) * c.volume  # once
    times = {"step": 1, "micro_batch": f.micro_batches, "gather": gathers}[c.per]
    if c.kind == "broadcast":  # moves what an all-gather does; its latency is an all-reduce's (one round) per tensor
        one = profile.collectives.get("all_reduce")
        count = stats.param_tensors if c.split == "tensor" else 1
        return [_collective_s(profile, "all_gather", nbytes * times, ranks, times),
                (one.latency_s if one else 0.0) * max(0, count - 1) * times]
    count = {"whole": 1, "unit": units, "tensor": stats.param_tensors, "moe_layer": f.moe_layers,
             "bucket": max(1, math.ceil(nbytes / DDP_BUCKET_BYTES))}[c.split]
    return [_collective_s(profile, c.kind, nbytes * times, ranks, count * times)]


def _time(stats: ModelStats, f: _Facts, dtype: str, profile: HardwareProfile, optimizer_state_factor: float,
          overlap: float, optimizer_bytes_per_s: float | None) -> TimePrediction:
    """Seconds per step: compute, per-operation overhead, exposed communication, optimizer traffic."""
    size = _matmul_size(stats, f)
    # A 16-bit step the profile measured against fp32's (``dtype_step_ratio``: a small block under autocast or cast
    # to the dtype, on a CPU): the matmuls at fp32's rate and the forward and backward's operations at fp32's cost,
    # both times that ratio, in place of the 16-bit matmul rate and the autocast casts. The matmul rate alone said
    # bf16 is faster on a CPU whose casts, norms and softmax in bf16 make the step slower at a small model's sizes.
    ratio = profile.dtype_ratio_at(dtype, f.half, size) if dtype != "float32" else None
    tflops = profile.matmul_tflops_at("float32" if ratio is not None else dtype, size)
    if not tflops:
        raise ValueError(f"hardware profile has no matmul throughput for {dtype} or float32")
    flops = stats.fwd_bwd_flops_per_sample * f.samples
    if f.checkpoint and stats.blocks:  # one more forward of the recomputed blocks (the blocks: most of it)
        flops += f.recompute * stats.fwd_flops_per_sample * f.samples
    flops *= f.share / f.context  # context parallel: a rank computes its 1/c of every sequence (zigzag: of the
    # causal attention too)
    bubble = (f.micro_batches + f.pp - 1) / f.micro_batches if f.pp > 1 else 1.0  # stages idle while the pipe fills
    compute = flops / (tflops * 1e12) * bubble * (ratio or 1.0)

    units = sum(b.count for b in stats.blocks) + 1
    gathers = f.micro_batches * (2 if f.reshard else 1) if f.sharding else 0
    ops = stats.fwd_ops + stats.bwd_ops  # per micro-batch, whatever its size
    if f.checkpoint and stats.blocks:
        ops += f.recompute * stats.block_fwd_ops  # the recomputed blocks' forward runs again in backward
    if f.amp and not f.half and ratio is None:
        ops += AMP_CAST_OPS * stats.fwd_lowp_ops
    ops *= ratio or 1.0  # the forward and backward's operations, at the measured 16-bit cost
    if f.pp > 1:  # a stage runs its share of the blocks' operations; the busiest also those outside the blocks
        # (the embedding on the first stage, the head and the loss on the last: kept whole, as their parameters)
        inside = stats.block_fwd_ops / stats.fwd_ops if stats.fwd_ops and stats.blocks else 1.0
        ops = ops * ((1 - inside) + inside / f.pp) * bubble
    if f.tp > 1:
        ops += TP_BLOCK_OPS * sum(b.count for b in stats.blocks) / f.pp
    ops += f.moe_layer_ops * f.moe_layers  # expert parallel's token dispatch in every MoE layer
    if f.context > 1:  # the K/V gathers, positions and mask of every attention layer, and the gathers' backward
        ops += (CONTEXT_LAYER_OPS[0] + CONTEXT_LAYER_OPS[1] * f.context) * _attention_layers(stats)
    ops *= f.micro_batches
    ops += OPTIMIZER_OPS[0] + OPTIMIZER_OPS[1] * optimizer_state_factor
    if f.sharding and not f.deepspeed:  # every gather and the reduce-scatter, per unit and per parameter
        ops += (gathers + 1) * (FSDP_UNIT_OPS * units + FSDP_PARAM_OPS * stats.param_tensors)
    if f.deepspeed:  # DeepSpeed's per-parameter gradient hooks, bucket copies and partition copies (Python)
        ops += DEEPSPEED_PARAM_OPS * stats.param_tensors * f.micro_batches
    overhead = ops * profile.op_latency_s
    if f.tp > 1:  # DTensor's dispatch on every split linear (and its recompute) and on each DTensor parameter's update
        linear = profile.tensor_parallel_linear_s + (
            f.recompute * profile.tensor_parallel_linear_forward_s if f.checkpoint and stats.blocks else 0.0)
        overhead += stats.tp_split_layers / f.pp * f.micro_batches * linear
        adamw = OPTIMIZER_OPS[0] + OPTIMIZER_OPS[1] * 2  # the profile times AdamW's foreach step
        update = (OPTIMIZER_OPS[0] + OPTIMIZER_OPS[1] * optimizer_state_factor) / adamw
        overhead += stats.tp_split_params / f.pp * profile.dtensor_param_step_s * update

    comm = 0.0
    for collective in f.collectives:
        for seconds in _collectives_s(stats, f, profile, collective, gathers, units):
            comm += seconds
    full_grads = f.rank_trainable_bytes * f.scale
    gathered = f.rank_param_bytes * f.scale * f.gather
    comm += _collective_s(profile, "all_reduce", 4, f.sync, 1)  # the step's loss, averaged over the ranks
    if f.split > 1 and stats.blocks:
        # a block's input (its hidden states) at one micro-batch, in the compute dtype (a rank's 1/c of every
        # sequence beside context parallel)
        hidden = sum(b.input_bytes_total for b in stats.blocks) / sum(b.count for b in stats.blocks) * (
            f.micro / stats.batch_size) * (0.5 if f.amp or f.half else 1.0) / f.context
        blocks_here = sum(b.count for b in stats.blocks) / f.pp
        if f.tp > 1:  # two all-reduces of the hidden states per block in forward, two in backward
            count = TP_BLOCK_OPS * blocks_here * f.micro_batches
            comm += _collective_s(profile, "all_reduce", hidden * count, f.tp, count)
        if f.pp > 1:  # a stage sends its output forward and receives its gradient back, per micro-batch
            comm += _p2p_s(profile, hidden * 2 * f.micro_batches, 2 * f.micro_batches)
        comm += _collective_s(profile, "all_reduce", 4, f.split, 1)  # the loss, from the last stage to every rank
    if f.context > 1 and stats.kv_bytes_per_token and stats.seq_len:
        # every attention layer all-gathers the whole sequence's K and V in forward (two collectives) and returns
        # their gradients in backward (reduce-scatter; gloo has none: an all-reduce), in the compute dtype
        # (beside tensor parallel each rank gathers its own 1/t of the K/V heads; a K/V head replicated over tensor
        # ranks because there are fewer than t is counted at 1/t too: an underestimate there)
        kv = stats.kv_bytes_per_token * stats.seq_len * f.micro * (0.5 if f.amp or f.half else 1.0) / f.tp
        count = 2 * _attention_layers(stats) * f.micro_batches
        back = "all_reduce" if profile.device_type == "cpu" else "reduce_scatter"
        comm += _collective_s(profile, "all_gather", kv * f.micro_batches, f.context, count)
        comm += _collective_s(profile, back, kv * f.micro_batches, f.context, count)
    communication = comm * (1.0 - overlap)
    bandwidth = optimizer_bytes_per_s or profile.memory_bytes_per_s or DEFAULT_MEMORY_BYTES_PER_S
    passes = OPTIMIZER_PASSES[0] + OPTIMIZER_PASSES[1] * optimizer_state_factor
    optimizer = passes * f.owned / bandwidth
    # Gradients copied into and out of the communication buffers (DDP buckets, FSDP's reduce-scatter
    # input, gathered parameters copied out) once per step / gather: read and written.
    copies = 2 * (full_grads + gathered * gathers) if f.sharding else 2 * full_grads if f.sync > 1 else 0.0
    optimizer += copies / bandwidth

    return TimePrediction(compute=compute, overhead=overhead, communication=communication, optimizer=optimizer,
                          step=compute + overhead + communication + optimizer, ops=round(ops))


def predict(stats: ModelStats, strategy: Strategy, layout: ParallelLayout, profile: HardwareProfile,
            global_batch: int, micro_batches: int = 1, *, optimizer_state_factor: float = 2.0,
            overlap: float = 0.0, optimizer_bytes_per_s: float | None = None) -> Prediction:
    """Peak memory per rank and step time of ``strategy`` (see the module docstring for every term): the facts
    of the strategy on this model, then the memory and the time they make. A transformer whose shape is known
    (``atorch plan``) is predicted by ``plan_terms.predict_transformer`` instead."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    facts = _facts(stats, strategy, layout, global_batch, micro_batches)
    memory, notes = _memory(stats, facts, profile, optimizer_state_factor)
    time = _time(stats, facts, _compute_dtype(strategy), profile, optimizer_state_factor, overlap,
                 optimizer_bytes_per_s)
    if facts.ep > 1 and ALL_TO_ALL not in profile.collectives:
        notes.append("the profile has no all-to-all figures: the experts' all-to-alls are timed at all-gather's")
    return Prediction(memory=memory, time=time, samples_per_rank=facts.micro, notes=tuple(notes))
