"""Precision regimes of a training job: the bytes a parameter costs on a rank, and which of them a ZeRO stage shards.

Three regimes (and DeepSeek-V3's, for its published run), each a way large jobs are run (bytes per parameter;
Adam's two states; ``d`` the data ranks):

* ``amp_native`` — atorch's ``amp_native`` without sharding: fp32 weights and gradients, torch autocast casting
  the weights to bf16 in every forward (its cache holds a 16-bit copy through forward and backward): 4 + 4 + 8,
  plus the 2-byte copies as a temporary. Under ZeRO-2/FSDP (FSDP2 without a mixed-precision policy) the gathered
  weights are fp32.
* ``fsdp_mixed`` — FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (what atorch's
  ``zero2`` / ``fsdp`` run under ``amp_native``): the sharded fp32 weights are the master, the unsharded weights are
  bf16 copies made at each all-gather, gradients are reduce-scattered in fp32 and kept sharded: 4/d + 2 (gathered)
  + 4/d + 8/d; the model computes in bf16 throughout.
* ``megatron`` — Megatron-LM's mixed precision: bf16 weights, gradients accumulated and reduced in an fp32 buffer
  (``main_grad``; 16 bits under 2021's ``--fp16``), fp32 master weights and Adam states in the optimizer: 2 + 4 +
  12, and 2 + 4 + 12/d with the distributed optimizer (ZeRO-1; Megatron-LM docs, "Distributed Optimizer").

What each sharding keeps whole: none keeps everything; ZeRO-1 shards the optimizer (master weights and states);
ZeRO-2 also the gradients, and keeps the stage's whole 16-bit (or gathered) weights through forward and
backward; FSDP (ZeRO-3) shards everything, gathering about two layers at a time (one running, one prefetched).
"""

from __future__ import annotations

from dataclasses import dataclass

from atorch.opt_lib.precision import AmpNative
from atorch.opt_lib.sharding import FSDP, Zero2
from atorch.opt_lib.zero1 import Zero1

ADAM_STATES = 2


@dataclass(frozen=True)
class PrecisionRegime:
    name: str
    weights: float  # bytes per parameter of the weights as stored (the sharded storage under ZeRO-2/FSDP2)
    gathered: float  # bytes per parameter of the weights the layers compute with (the all-gather's dtype)
    grads: float  # bytes per parameter of the gradients as accumulated and reduced
    master: float  # separate fp32 master weights in the optimizer (0: the stored weights are the master)
    state: float  # bytes per parameter of one optimizer state
    autocast: bool  # torch autocast: fp32 weights cast in every forward, fp32 residual stream and norms
    fsdp2: bool  # ZeRO-2/FSDP keep sharded storage apart from the gathered weights (FSDP2), not one 16-bit copy
    summary: str


REGIMES: dict[str, PrecisionRegime] = {
    AmpNative.name: PrecisionRegime(
        AmpNative.name, weights=4.0, gathered=4.0, grads=4.0, master=0.0, state=4.0, autocast=True, fsdp2=True,
        summary="fp32 weights and gradients, autocast to bf16 in every forward (atorch's amp_native)"),
    "fsdp_mixed": PrecisionRegime(
        "fsdp_mixed", weights=4.0, gathered=2.0, grads=4.0, master=0.0, state=4.0, autocast=False, fsdp2=True,
        summary="FSDP2 MixedPrecisionPolicy: fp32 sharded master weights, bf16 gathered weights, fp32 gradient "
                "reduction"),
    "megatron": PrecisionRegime(
        "megatron", weights=2.0, gathered=2.0, grads=4.0, master=4.0, state=4.0, autocast=False, fsdp2=False,
        summary="Megatron-LM: bf16 weights, fp32 gradient buffer, fp32 master weights and Adam states in the "
                "(distributed) optimizer"),
    # DeepSeek-V3's FP8 training (arXiv 2412.19437, section 3.3.3): bf16 weights (fp8 copies made per GEMM), fp32
    # gradients and master weights, AdamW's moments in bf16
    "deepseek_fp8": PrecisionRegime(
        "deepseek_fp8", weights=2.0, gathered=2.0, grads=4.0, master=4.0, state=2.0, autocast=False, fsdp2=False,
        summary="DeepSeek-V3: bf16 weights, fp32 gradients and master weights, bf16 AdamW moments"),
}
REGIME_NAMES = tuple(REGIMES)


def default_regime(sharding: str, tensor: int, runnable: bool = True) -> str:
    """The regime a layout runs under unless told: atorch's own where atorch runs it (``zero2``/``fsdp`` under
    ``amp_native`` apply FSDP2's mixed-precision policy); Megatron-LM's where only Megatron-style stacks run it
    (DDP across a tensor dimension). atorch runs ``zero1`` across a tensor dimension as ``zero2`` (FSDP2:
    ZeroRedundancyOptimizer cannot partition DTensors), so under FSDP2's policy too."""
    if sharding in (Zero2.name, FSDP.name) or (sharding == Zero1.name and tensor > 1 and runnable):
        return "fsdp_mixed"
    if tensor > 1 and not runnable:
        return "megatron"
    return AmpNative.name


@dataclass(frozen=True)
class RankBytes:
    parameters: float
    gradients: float
    optimizer_state: float
    temporary: float  # held through forward and backward: autocast's copies, FSDP's gathered layers


def rank_bytes(regime: PrecisionRegime, sharding: str, n: float, layer_n: float, dp: int, grads: float | None = None,
               states: float = ADAM_STATES) -> RankBytes:
    """Bytes on one rank for ``n`` parameters (its stage's share; ``layer_n`` in its largest layer) under ``sharding``
    (none / zero1 / zero2 / fsdp) over ``dp`` data ranks. ``grads`` overrides the regime's gradient bytes."""
    g = regime.grads if grads is None else grads
    optimizer = (regime.master + states * regime.state) * n
    cast = 2.0 * n if regime.autocast else 0.0  # autocast's cache of 16-bit weights
    if sharding in ("none", Zero1.name):
        return RankBytes(regime.weights * n, g * n, optimizer / (dp if sharding == Zero1.name else 1), cast)
    if sharding == Zero2.name:
        # FSDP2: sharded storage + the whole stage gathered from its forward to its backward; else one 16-bit copy
        params = regime.weights * n / dp + regime.gathered * n if regime.fsdp2 else regime.weights * n
        return RankBytes(params, g * n / dp, optimizer / dp, cast)
    if sharding == FSDP.name:
        gathered = 2 * layer_n * regime.gathered  # one layer running, the next prefetched
        cast_layers = 2 * layer_n * 2.0 if regime.autocast else 0.0
        return RankBytes(regime.weights * n / dp, g * n / dp, optimizer / dp, gathered + cast_layers)
    raise ValueError(f"unknown sharding {sharding!r}: one of none, zero1, zero2, fsdp")
