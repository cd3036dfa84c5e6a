"""What a method does to a step's bytes, compute and communication: the facts the cost model combines.

Each Method states its own facts (``Method.cost_facts(config, layout)``), next to the code that does it, so a
change to a method changes its facts in the same module; the cost model (``strategy_search/costing/cost_model.py``)
reads the combined facts of a strategy's methods and never a method's name. A method with no effect on cost
states the default ``CostFacts()``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

CollectiveKind = Literal["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast"]
# How parameters that are sharded at rest are gathered for compute: "whole": not sharded (nothing to gather);
# "per_use": gathered for forward and again for backward (resharded after forward, ZeRO-3);
# "forward_to_backward": gathered once per micro-batch and kept from its forward until its own backward.
Gathering = Literal["whole", "per_use", "forward_to_backward"]


@dataclass(frozen=True)
class Collective:
    """Collectives a method runs, with their volume as a multiple of parameter bytes.

    ``volume`` × the bytes of ``of`` in ``dtype`` ("storage": as the parameters are kept; "compute": as the forward
    computes them) moves per ``per`` ("step", "micro_batch", or "gather": each time sharded parameters are gathered,
    see ``CostFacts.gathering``), carried by one collective per ``split`` ("whole": one; "unit": per sharding unit;
    "bucket": per 25 MB bucket; "tensor": per parameter tensor; "moe_layer": per mixture-of-experts layer), over the
    mesh dimension ``over`` ("data": the ranks the batch is split over, data × expert; "replicas": the 'data'
    dimension alone, the ranks holding the same experts; "expert", "tensor", "pipeline").

    ``of``: "trainable" parameters the data-parallel sync handles (not the experts split over an expert dimension),
    all "parameters" on the rank besides those experts, the rank's "experts", or "routed_tokens": the hidden states
    a rank's tokens send to their top-k experts in one MoE layer's dispatch at one micro-batch (tokens × top-k ×
    hidden; the combine returns as many), summed over the MoE layers."""

    kind: CollectiveKind
    volume: float = 1.0
    of: Literal["trainable", "parameters", "experts", "routed_tokens"] = "trainable"
    dtype: Literal["storage", "compute"] = "storage"
    per: Literal["step", "micro_batch", "gather"] = "step"
    split: Literal["whole", "unit", "bucket", "tensor", "moe_layer"] = "whole"
    over: str = "data"


@dataclass(frozen=True)
class CostFacts:
    """One method's effect on the cost of a training step (every field's default: no effect).

    Memory: ``parameters`` / ``gradients`` / ``optimizer_state`` name the mesh dimension each is sharded over
    (None: whole on every rank); ``gathering`` says how sharded parameters are gathered for compute;
    ``engine`` "deepspeed": DeepSpeed's engine keeps its own flat buffers (the cost model's DeepSpeed terms);
    ``offload``: the sharded state lives in host memory; ``storage_bytes``: bytes per element of parameters,
    gradients, optimizer state and activations against fp32 (0.5: 16 bits).
    Compute (the dtype itself is the method's ``compute_dtype``, one derivation): ``autocast``: the forward casts
    fp32 weights to the compute dtype (a 16-bit copy of each weight cached through forward; matmul outputs saved in
    16 bits; cast operations); ``recompute``: the fraction of the repeated blocks whose forward runs again in
    backward, keeping only their inputs (more compute, fewer activation bytes).
    Communication: ``collectives``; ``syncs_gradients``: the method reduces the gradients itself, so the data
    parallel all-reduce of the whole gradients (DDP) is not run.
    ``moe_layer_ops``: operations the method adds per mixture-of-experts layer and micro-batch (forward and
    backward: a token dispatch's sorting, indexing and split-size exchange).
    ``routed_saved``: copies of the routed hidden states (tokens × top-k × hidden per MoE layer) the method keeps for
    backward beyond what the model itself saves.
    ``expert_split``: a mixture-of-experts model's expert parameters (``ModelStats.expert_param_count``) are split
    this many ways: a rank keeps 1/n of them whole, with their gradients and optimizer state, outside the data
    parallel sharding and sync (which then handle the other parameters only)."""

    parameters: str | None = None
    gradients: str | None = None
    optimizer_state: str | None = None
    gathering: Gathering = "whole"
    engine: Literal["torch", "deepspeed"] = "torch"
    offload: bool = False
    storage_bytes: float = 1.0
    autocast: bool = False
    recompute: float = 0.0
    collectives: tuple[Collective, ...] = ()
    syncs_gradients: bool = False
    expert_split: int = 1
    moe_layer_ops: int = 0
    routed_saved: float = 0.0
    runs_as: str | None = None  # the method whose program this config runs (zero1 next to a tensor dimension: zero2)
    # the mesh dimension each sequence (and so every activation) is split over (context_parallel: 'context')
    activations: str | None = None


NO_EFFECT = CostFacts()

# Data parallel without a method that syncs the gradients itself: DDP all-reduces them, in 25 MB buckets, once
# per step (atorch turns its sync off for all micro-batches but the last).
DATA_PARALLEL_SYNC = Collective("all_reduce", split="bucket")


@dataclass(frozen=True)
class StrategyFacts:
    """The facts of a strategy's methods together (``combine``), as the cost model reads them: ``sharded_by``
    names the method whose facts shard the gradients (or None) for the terms that quote it."""

    parameters: str | None
    gradients: str | None
    optimizer_state: str | None
    gathering: Gathering
    engine: str
    offload: bool
    storage_bytes: float
    compute_dtype: str
    autocast: bool
    recompute: float
    collectives: tuple[Collective, ...]
    sharded_by: str | None
    activations: str | None = None  # the mesh dimension sequences are split over (CostFacts.activations)
    expert_split: int = 1
    moe_layer_ops: int = 0
    routed_saved: float = 0.0


def combine(facts: Iterable[tuple[str, CostFacts]], compute_dtype: str = "float32") -> StrategyFacts:
    """The facts of (name, facts) pairs in the strategy's order, computing in ``compute_dtype`` (torch's name: the
    strategy's, from its methods' ``compute_dtype``). Methods that can run together state disjoint
    effects (the compatibility rules refuse the others), so the first that states a field decides it; the
    collectives add up, after the data-parallel gradient sync where no method syncs the gradients itself."""
    pairs = list(facts)

    def first(field: str, default: object) -> object:
        return next((getattr(f, field) for _, f in pairs if getattr(f, field) != getattr(NO_EFFECT, field)),
                    default)

    syncs = any(f.syncs_gradients for _, f in pairs)
    collectives = () if syncs else (DATA_PARALLEL_SYNC,)
    for _, f in pairs:
        collectives += f.collectives
    return StrategyFacts(
        parameters=first("parameters", None), gradients=first("gradients", None),  # type: ignore[arg-type]
        optimizer_state=first("optimizer_state", None), gathering=first("gathering", "whole"),  # type: ignore[arg-type]
        engine=str(first("engine", "torch")), offload=bool(first("offload", False)),
        storage_bytes=float(first("storage_bytes", 1.0)),  # type: ignore[arg-type]
        compute_dtype=compute_dtype, autocast=bool(first("autocast", False)),
        recompute=float(first("recompute", 0.0)), collectives=collectives,  # type: ignore[arg-type]
        sharded_by=next((f.runs_as or name for name, f in pairs if f.gradients is not None), None),
        activations=first("activations", None),  # type: ignore[arg-type]
        expert_split=int(first("expert_split", 1)),  # type: ignore[call-overload]
        moe_layer_ops=int(first("moe_layer_ops", 0)),  # type: ignore[call-overload]
        routed_saved=float(first("routed_saved", 0.0)),  # type: ignore[arg-type]
    )
