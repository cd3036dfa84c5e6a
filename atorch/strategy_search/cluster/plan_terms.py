"""The cost model's transformer terms: what ``atorch plan`` predicts a large run with.

``predict_transformer(shape, strategy, layout, profile, global_batch, micro_batches)`` reads a strategy's facts as
``cost_model.predict`` does (``cost_model._facts``: the layout's sizes, the methods that are on) and predicts the
memory and step time of a decoder-only transformer of a known ``TransformerShape`` on its busiest rank from
analytical terms (sources below), in the same ``Prediction`` form. The search's own per-operation terms stay in
``cost_model``; the precision regimes (bytes per parameter, what a ZeRO stage shards) are in ``precision``.
"""

from __future__ import annotations

import math

from atorch.opt_lib.fp8 import FP8
from atorch.opt_lib.mixed_parallel import MixedParallel
from atorch.opt_lib.precision import Half
from atorch.opt_lib.sharding import Zero2
from atorch.opt_lib.tensor_parallel import TensorParallel
from atorch.opt_lib.zero1 import Zero1
from atorch.parallel_layout import ParallelLayout
from atorch.strategy import Strategy
from atorch.strategy_search.cluster.precision import REGIMES, PrecisionRegime, default_regime, rank_bytes
from atorch.strategy_search.costing.analyser import ModelStats
from atorch.strategy_search.costing.cost_model import (
    DDP_BUCKET_BYTES,
    DEFAULT_MEMORY_BYTES_PER_S,
    OPTIMIZER_PASSES,
    OPTIMIZER_TEMP_PER_STATE,
    MemoryPrediction,
    Prediction,
    TimePrediction,
    _compute_dtype,
    _Facts,
    _facts,
    _Frozen,
    _pipeline_config,
)
from atorch.strategy_search.costing.hardware import ALL_TO_ALL, HardwareProfile


def predict_transformer(shape: TransformerShape, stats: ModelStats, strategy: Strategy, layout: ParallelLayout,
                        profile: HardwareProfile, global_batch: int, micro_batches: int = 1, *,
                        optimizer_state_factor: float = 2.0, selective_recompute: bool = False) -> Prediction:
    """Peak memory per rank and step time of ``strategy`` on a transformer of this ``shape`` (``stats``: the
    shape's ``ModelStats``, what the strategy's facts are read from); ``selective_recompute``: Korthikanti et
    al.'s (the attention scores recomputed)."""
    facts = _facts(stats, strategy, layout, global_batch, micro_batches)
    return _transformer_prediction(shape, strategy, facts, profile, _compute_dtype(strategy),
                                   optimizer_state_factor, selective_recompute)


# ----- transformer terms (large runs: `atorch plan`) -------------------------------------------------------
# For a decoder-only transformer of known shape (the planner's built-in architectures, a transformers config,
# or a module with one), the terms a large run lives on are analytical in that shape instead of scaled from the
# analyser's measured step; the strategy, layout and profile are read as ``cost_model.predict`` reads them
# (``_facts``) and the result has the same form. Sources of each term:
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
# * Parameter, gradient and optimizer bytes: the precision regime's (``precision.py``: amp_native, fsdp_mixed,
#   megatron, deepseek_fp8), sharded as the ZeRO stage shards them (ZeRO-1 the optimizer, ZeRO-2 also the
#   gradients, FSDP everything).
# * Mixtures of experts: FLOPs at the active parameters (top-k routed and shared experts, the router), memory at
#   the total; the routed experts split over the expert ranks and ZeRO-sharded over the data ranks that share them;
#   per MoE layer and micro-batch, dispatch and combine all-to-alls in forward and backward (and the recompute), in
#   line with the compute: a rank keeps 1/ep of its tokens' copies, sends the node-local share over NVLink and the
#   rest over its own adapter (capped by node-limited routing).
# * Context parallel (atorch's context_parallel, Llama 3's all-gather form; Dubey et al. 2024, section 3.3.2: CP 16
#   at 131k tokens in the long-context stage of the 405B): a rank runs s/cp of each sequence, so its tokens, FLOPs,
#   activations and logits are 1/cp (a query still attends over all s keys: the score FLOPs per token keep s);
#   each layer all-gathers the K and V of the whole sequence (2·b·s·kv_dim 16-bit values, split with the heads over
#   tensor ranks) in forward, again in a full recompute, and reduce-scatters their gradients in backward, in line
#   with the compute; context ranks sit next to the tensor ranks (Llama 3's order [TP, CP, PP, DP]). The parameters'
#   gradients are reduced (and ZeRO-sharded) over data × context ranks.
# * fp8 (Transformer Engine's linears): the layers' matmuls at the profile's fp8 rate. DualPipe: see
#   ``TransformerShape.dualpipe``.

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
    # the layout's context dimension (context_parallel; set per layout by the planner): each sequence split over that
    # many ranks besides the tensor × pipeline × data ones (see the context parallel terms above)
    context_ranks: int = 1
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
    intra = profile.collective(ALL_TO_ALL)  # all-gather's figures where the profile has no all-to-all ones
    inter = profile.collective(ALL_TO_ALL, inter_node=True) or intra
    intra_bw, latency = (intra.bus_bandwidth, intra.latency_s) if intra else (float("inf"), 0.0)
    inter_bw = inter.bus_bandwidth if inter else float("inf")
    off_node = sent * (ep - local) / ep
    if shape.routing_node_limit:
        off_node = min(off_node, sent / shape.top_k * shape.routing_node_limit)
    one = sent * (local - 1) / ep / intra_bw + off_node / inter_bw + (inter.latency_s if inter else latency)
    return moe_layers * one * (6 if recompute else 4)


def context_kv_bytes(shape: TransformerShape, micro: float, tp: int) -> float:
    """Bytes of one layer's K and V for a micro-batch's whole sequences on one tensor rank, in 16 bits: what each
    context-parallel all-gather assembles (and each reduce-scatter of their gradients takes apart)."""
    return 2.0 * 2.0 * micro * shape.seq * shape.kv_dim / tp


def context_kv_s(shape: TransformerShape, profile: HardwareProfile, micro: float, stage_layers: int, cp: int, tp: int,
                 recompute: bool) -> float:
    """A micro-batch's context-parallel K/V collectives on a stage: per layer an all-gather in forward (again in a
    full recompute) and a reduce-scatter of their gradients in backward, over the cp ranks next to the tensor
    ranks (stride tp)."""
    if cp <= 1:
        return 0.0
    nbytes = context_kv_bytes(shape, micro, tp)
    gathers = stage_layers * (2 if recompute else 1)
    return (_group_collective_s(profile, "all_gather", nbytes * gathers, cp, tp, gathers)
            + _group_collective_s(profile, "reduce_scatter", nbytes * stage_layers, cp, tp, stage_layers))


def _regime(shape: TransformerShape, sharding: str, half: bool) -> PrecisionRegime:
    """The precision regime the transformer terms count bytes with (``precision``; see TransformerShape)."""
    if half:  # everything in 16 bits, no master weights
        return PrecisionRegime(Half.name, 2.0, 2.0, 2.0, 0.0, 2.0, autocast=False, fsdp2=True, summary="16 bits only")
    if shape.precision is not None:
        if shape.precision not in REGIMES:
            raise ValueError(f"unknown precision regime {shape.precision!r}: one of {list(REGIMES)}")
        return REGIMES[shape.precision]
    return REGIMES["megatron" if not shape.autocast else default_regime(sharding, 1)]


def _transformer_prediction(shape: TransformerShape, strategy: Strategy, f: _Facts, profile: HardwareProfile,
                            dtype: str, optimizer_state_factor: float, selective_recompute: bool) -> Prediction:
    """Memory and step time of a transformer on its busiest rank (see the transformer terms above)."""
    tp, pp, dp = f.tp, f.pp, f.dp
    tensor = strategy.get(TensorParallel.name) or getattr(strategy.get(MixedParallel.name), "tensor", None)
    sp = bool(getattr(tensor, "sequence_parallel", False)) and tp > 1
    vocab_split = tp if getattr(tensor, "loss_parallel", False) else 1  # atorch's loss_parallel splits it
    pipe = _pipeline_config(strategy)
    v = pipe.stages_per_rank() if pipe is not None and pp > 1 else 1
    recompute = "full" if f.checkpoint else "selective" if selective_recompute else "none"
    sharding = f.sharding or (Zero1.name if f.zero1 else "none")
    regime = _regime(shape, sharding, f.half)
    if regime.name == "megatron" and Zero1.name in strategy:
        # Megatron-LM's distributed optimizer keeps whole gradients (atorch runs zero1 across a tensor dimension as
        # zero2, cost_model._facts: counted so in atorch's own regimes)
        sharding = Zero1.name
    if regime.autocast != shape.autocast:
        shape = shape.model_copy(update={"autocast": regime.autocast})
    b, s, h, m = f.micro, shape.seq, shape.hidden, f.micro_batches
    cp = max(1, shape.context_ranks)
    tokens = b * s / cp  # per micro-batch and rank (context parallel: its share of each sequence)
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
    replicas = dp * cp  # the ranks a parameter's gradient is reduced over (and ZeRO-sharded over)
    owned = n_dense / replicas + n_experts / expert_dp if sharding != "none" else n_rank
    held = [rank_bytes(regime, sharding, n, layer_n, d, grads=grad_el, states=optimizer_state_factor)
            for n, layer_n, d in ((n_dense, layer_dense, replicas), (n_experts, layer_experts / ep, expert_dp))]
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
    if FP8.name in strategy and profile.matmul_tflops.get("float8"):
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
    mb_tp += context_kv_s(shape, profile, b, stage_layers, cp, tp, recompute == "full")
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
    if cp > 1:  # data × context: the context ranks next to the tensor ranks, the data ranks beyond the pipeline
        dp, stride = replicas, tp
    dp_comm, hidden_by = 0.0, 0.0
    if dp > 1:
        last_backward = mb_compute * 2 / 3
        if f.sharding:
            gathers = (1 if f.sharding == Zero2.name else m) if pp > 1 else m * (1 if f.sharding == Zero2.name else 2)
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
    notes = (f"transformer terms: tensor {tp}, pipeline {pp} (x{v} virtual), data {f.dp}"
             f"{f', context {cp}' if cp > 1 else ''}, sharding {f.sharding or 'none'}"
             f"{' zero1' if f.zero1 else ''}, precision {regime.name}, recompute {recompute}, sequence parallel {sp}, "
             f"bubble {bubble:.4g} s",)
    return Prediction(memory=memory, time=time, samples_per_rank=f.micro, notes=notes)
