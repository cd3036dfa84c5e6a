"""context_parallel: each sequence split over parallel_mode's 'context' dimension (long-context training).

torch's own ``torch.distributed.tensor.experimental.context_parallel`` replaces only the CUDA SDPA kernels (flash,
efficient, cuDNN: its dispatch table in ``_context_parallel/_attention.py``); on CPU SDPA runs
``_scaled_dot_product_flash_attention_for_cpu`` or the math kernel, which it does not cover, so atorch runs its own,
on every device: Llama 3's all-gather context parallel (Dubey et al. 2024, §3.3.2).

* Sharding: the ``c`` ranks of a context group read the same batch (they are not in the batch split) and each keeps
  ``2/(2c)`` of every sequence, load-balanced for causal attention ("zigzag"): rank ``r`` holds chunks ``r`` and
  ``2c-1-r`` of ``2c``, so every rank attends over the same number of (query, key) pairs.
* Attention: each layer all-gathers K and V over the context group (before GQA's repeat: the fewer heads) and runs
  SDPA for the rank's queries with the causal mask at their global positions; the all-gather's backward sums the
  K/V gradients back to their owners. It is hooked into transformers through its attention registry
  (``AttentionInterface``: the model's ``_attn_implementation`` becomes ``atorch_context_parallel``), so every
  transformers decoder on the attention interface runs it; position ids are the global positions of the rank's
  tokens (rotary and absolute embeddings alike).
* Padding: an ``attention_mask`` with padding (0 = a padded position) is kept whole on every context rank (they
  read the same batch) and applied to the gathered keys: a query attends its causal keys that are not padded, as
  under transformers' own SDPA mask; a padded query with no key left (left padding's first positions) gets SDPA's
  zero row (torch >= 2.5), as in one process (its output still predicts the first real token's label).
* Loss: with ``labels``, they are shifted over the whole sequence before the split (transformers' ``shift_labels``)
  and each rank's loss is its tokens' sum over ``num_items_in_batch`` / c, so the mean of the ranks' losses is the
  token-weighted mean of one process; the loss returned is that mean (the same on every context rank). Without
  labels the logits are gathered whole (in sequence order), so a user's own loss on them trains the same.
* Mixtures of experts: with ``output_router_logits`` each layer's router logits are gathered over the context group
  before the model computes the router's load-balancing loss (a per-batch statistic), so it is the whole sequence's
  (with padding: its real tokens'), as in one process. Beside expert parallel the experts' gradients are averaged
  over data × context too (expert_parallel.py).
* Gradients: DDP/FSDP average every parameter over data × expert × context (``ParallelLayout.replica_size``).
* Beside tensor parallel: a rank's attention holds its tensor rank's heads, and its context group is the ranks at
  the same tensor position, so each gathers its own heads' K/V; nothing else changes (the tensor-parallel replicas
  average over data × context, tensor_data_parallel.py).
* Beside pipeline parallel: every stage's model splits the micro-batch's sequences as the whole model would (the
  stages read the micro-batch; a later stage takes the previous stage's share of the hidden states, which the stages
  exchange as they are); the last stage's loss is its share of the targets, combined as above (``stage_output``),
  and the stages' replicas average over data × context. Padded batches are refused there (a recomputed attention
  would read a later micro-batch's padding).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from atorch.errors import SetupError
from atorch.layer_drop import layer_drop_problems, layer_drop_settings
from atorch.log import get_logger
from atorch.opt_lib.base import Method, MethodConfig, SearchRole, StrategyCheck
from atorch.opt_lib.cost_facts import CostFacts
from atorch.opt_lib.parallel_mode import ParallelMode
from atorch.opt_lib.registry import register
from atorch.parallel_layout import CONTEXT, ParallelLayout

if TYPE_CHECKING:
    from atorch.opt_lib.build_state import Build

logger = get_logger(__name__)

ATTENTION_NAME = "atorch_context_parallel"  # the key in transformers' attention (and no mask) registry
_STATE = "_atorch_context"  # set on every attention module of a context-parallel model: its ContextShard


class ContextParallelConfig(MethodConfig):
    """Needs a 'context' dimension in parallel_mode, e.g. ``([("context", 2), ("data", -1)], None)``."""


@dataclass(eq=False)
class ContextShard:
    """This rank's place in its context group: ``size`` ranks, this one ``rank`` (its group rank: the all-gather's
    order, so a rank_order that permutes the group changes nothing). ``kept_keys``: the current forward's padding
    mask over the whole sequence in the all-gather's order, (batch, sequence) booleans, True where a key is real
    (None: no padding); set by the input hook before each forward, read by every attention layer of it."""

    group: Any
    size: int
    rank: int
    kept_keys: torch.Tensor | None = None
    _masks: dict[tuple[Any, ...], torch.Tensor] = field(default_factory=dict)  # this forward's, shared by its layers

    def start_forward(self, kept_keys: torch.Tensor | None) -> None:
        """A new forward: its padding mask (or None), and no mask made yet."""
        self.kept_keys, self._masks = kept_keys, {}

    def mask(self, local_length: int, device: torch.device, sliding_window: int | None) -> torch.Tensor:
        """Which gathered keys each of this rank's queries attends: causal at their global positions, within the
        sliding window, not padded; (queries, keys), or (batch, 1, queries, keys) with padding. Made once per forward
        and window, and shared by its layers (one tensor saved for backward, not one per layer)."""
        key = (local_length, str(device), sliding_window)
        if key not in self._masks:
            q_pos = self.positions(local_length, device)[:, None]
            k_pos = self.all_positions(local_length, device)[None, :]
            allowed = k_pos <= q_pos
            if sliding_window is not None:  # transformers' convention: a query sees the last ``sliding_window`` keys
                allowed &= q_pos - k_pos < sliding_window
            if self.kept_keys is not None:  # padding: (batch, 1, queries, keys)
                # a query with no key left (a leading padded position) gets SDPA's zero row, as in one process
                allowed = allowed[None, None] & self.kept_keys[:, None, None, :].to(device)
            self._masks[key] = allowed
        return self._masks[key]

    def positions(self, local_length: int, device: torch.device) -> torch.Tensor:
        """The global positions of this rank's ``local_length`` tokens (zigzag: chunks rank and 2c-1-rank)."""
        return zigzag_positions(local_length * self.size, self.size, self.rank, device)

    def all_positions(self, local_length: int, device: torch.device) -> torch.Tensor:
        """The global positions of the gathered sequence, in the all-gather's (group rank) order."""
        return torch.cat([zigzag_positions(local_length * self.size, self.size, r, device) for r in range(self.size)])


def zigzag_positions(length: int, size: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Positions of the tokens rank ``rank`` of ``size`` holds of a sequence of ``length``: chunks ``rank`` and
    ``2·size-1-rank`` of ``2·size`` equal chunks (each rank then sees the same causal work)."""
    chunk = length // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = 2 * size - 1 - rank
    return torch.cat([first, torch.arange(last * chunk, (last + 1) * chunk, device=device)])


# ----- the collectives, with autograd ----------------------------------------------------------------------
class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 2 (B, heads, S/c, D) -> (B, heads, S, D) in group rank order; backward: the sum of every
    rank's gradient of this rank's part (a reduce-scatter; gloo has none, so all-reduce and keep the part)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, shard: ContextShard, dim: int) -> torch.Tensor:
        ctx.shard, ctx.dim = shard, dim
        parts = [torch.empty_like(tensor) for _ in range(shard.size)]
        dist.all_gather(parts, tensor.contiguous(), group=shard.group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        shard, dim = ctx.shard, ctx.dim
        grad = grad.contiguous()
        if dist.get_backend(shard.group) == dist.Backend.GLOO:
            dist.all_reduce(grad, group=shard.group)
            return grad.chunk(shard.size, dim=dim)[shard.rank].contiguous(), None, None
        parts = [p.contiguous() for p in grad.chunk(shard.size, dim=dim)]
        out = torch.empty_like(parts[shard.rank])
        dist.reduce_scatter(out, parts, group=shard.group)
        return out, None, None


class _MeanOverGroup(torch.autograd.Function):
    """The mean of the context ranks' losses (the global loss, the same on every rank). Backward passes the
    gradient through unscaled: every rank backpropagates its own share of the objective (its loss is already
    scaled by c/N), and the K/V all-gathers and DDP/FSDP's average over the context ranks combine the shares."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, shard: ContextShard) -> torch.Tensor:
        total = loss.detach().clone()
        dist.all_reduce(total, group=shard.group)
        return total / shard.size

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


# ----- attention -------------------------------------------------------------------------------------------
def context_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature (query (B, H, S/c, D), key/value (B, H_kv, S/c, D)); returns
    (B, S/c, H, D) as sdpa_attention_forward does. Causal over global positions, with the model's sliding window."""
    shard: ContextShard | None = getattr(module, _STATE, None)
    if shard is None:
        raise RuntimeError(f"{type(module).__name__} runs the '{ATTENTION_NAME}' attention but was not set up by "
                           "context_parallel (atorch sets it on every attention module of the model it applies to)")
    for unsupported in ("s_aux", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"context_parallel's attention does not support '{unsupported}' "
                                      f"({type(module).__name__}); drop context_parallel for this model")
    local = query.shape[2]
    key = _GatherSequence.apply(key, shard, 2)
    value = _GatherSequence.apply(value, shard, 2)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # after the gather: the K/V heads travel, not their copies
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    allowed = shard.mask(local, query.device, sliding_window)
    softcap = kwargs.get("softcap")
    if softcap is None:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed,
                                                               dropout_p=dropout, scale=scaling)
    else:  # Gemma 2's capped scores (sdpa has no cap): transformers' eager attention, over the gathered keys
        scores = query @ key.transpose(2, 3) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
        out = weights @ value
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, context_attention)  # no mask function: the model builds no mask


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules of a transformers decoder on the attention interface (those with ``is_causal``)."""
    return [m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "config")]


def not_supported_reason(model: nn.Module) -> str | None:
    """Why context_parallel cannot split this model's sequences, or None."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency of this method only
        return "context_parallel needs transformers (it hooks into transformers' attention interface)"
    if not isinstance(model, PreTrainedModel):
        return (f"context_parallel splits the sequence of a transformers decoder (a PreTrainedModel on the attention "
                f"interface), not a {type(model).__name__}; drop context_parallel or use a transformers causal LM")
    if not getattr(model, "_supports_attention_backend", False):
        return (f"{type(model).__name__} does not run its attention through transformers' attention interface "
                "(_supports_attention_backend), so atorch cannot replace it; drop context_parallel for this model")
    modules = attention_modules(model)
    if not modules or not all(bool(m.is_causal) for m in modules):
        return (f"{type(model).__name__} has no causal self-attention on every attention module (an encoder or "
                "encoder-decoder model); context_parallel splits causal decoders only")
    return None


# ----- the inputs: split before the model, the loss combined after ---------------------------------------
def _bound(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    if not args:
        return dict(kwargs)
    signature = inspect.signature(type(model).forward)
    bound = signature.bind_partial(model, *args, **kwargs)
    found = dict(bound.arguments)
    found.pop("self", None)
    found.update(found.pop("kwargs", {}))
    return found


def checked_source(shard: ContextShard, inputs: dict[str, Any]) -> torch.Tensor:
    """The tensor whose sequence is split (input_ids, else inputs_embeds), once the inputs are known to split
    exactly: refuses, naming the fix, what it cannot split."""
    source = inputs.get("input_ids")
    if source is None:
        source = inputs.get("inputs_embeds")
    if source is None:
        raise SetupError("context_parallel splits input_ids (or inputs_embeds) along the sequence; the model was "
                          f"called with {sorted(inputs)}")
    batch, length = source.shape[0], source.shape[1]
    if length % (2 * shard.size):
        raise SetupError(f"context_parallel over {shard.size} ranks splits each sequence into {2 * shard.size} "
                          f"equal chunks, but the sequence length is {length}; pad or cut sequences to a multiple of "
                          f"{2 * shard.size}")
    mask = inputs.get("attention_mask")
    if mask is not None and tuple(mask.shape) != (batch, length):
        raise SetupError(f"context_parallel takes a padding attention_mask of shape (batch, sequence) = "
                          f"{(batch, length)}, got {tuple(mask.shape)}; pass the tokenizer's 2-D attention_mask (a "
                          "4-D or packed-sequence mask is not supported)")
    if inputs.get("past_key_values") is not None:
        raise SetupError("context_parallel trains on whole sequences: past_key_values (a KV cache) is not supported")
    return source


def split_inputs(shard: ContextShard, inputs: dict[str, Any]) -> dict[str, Any]:
    """The model's keyword inputs for this rank: its zigzag share of every sequence, global positions, labels
    shifted over the whole sequence. Refuses what it cannot split exactly (``checked_source``)."""
    source = checked_source(shard, inputs)
    batch, length = source.shape[0], source.shape[1]
    mask = inputs.pop("attention_mask", None)
    padded = mask is not None and not bool((mask != 0).all())
    shard.start_forward((mask != 0)[:, shard.all_positions(length // shard.size, mask.device)] if padded else None)
    index = shard.positions(length // shard.size, source.device)
    out = dict(inputs, use_cache=False)
    for name in ("input_ids", "inputs_embeds", "token_type_ids"):
        if out.get(name) is not None:
            out[name] = out[name][:, index]
    positions = inputs.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=source.device).expand(batch, length)
    out["position_ids"] = positions[..., index]
    if inputs.get("labels") is not None:
        out.update(local_targets(shard, inputs, index))
        out["labels"] = out["shift_labels"]  # transformers computes a loss only with labels given
    return out


def local_targets(shard: ContextShard, inputs: dict[str, Any], index: torch.Tensor) -> dict[str, torch.Tensor]:
    """This rank's share of the loss's targets: the labels shifted over the whole sequence (transformers'
    ForCausalLMLoss shift, or the batch's own ``shift_labels``) at the rank's positions ``index``, and the batch's
    count of real targets over c, so that each rank's loss is its tokens' sum over N/c and the mean of the c ranks'
    losses the sum over all tokens / N, as in one process."""
    labels = inputs["labels"]
    shifted = inputs.get("shift_labels")
    if shifted is None:
        shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    items = inputs.get("num_items_in_batch")
    if items is None:
        items = (shifted != -100).sum()
    return {"num_items_in_batch": torch.as_tensor(items, device=labels.device) / shard.size,
            "shift_labels": shifted[:, index].contiguous()}


def whole_sequence_logits(shard: ContextShard, logits: torch.Tensor) -> torch.Tensor:
    """Every rank's logits gathered over the context group, in sequence order (the gather's backward returns each
    rank's share of the gradient to its owner)."""
    gathered = _GatherSequence.apply(logits, shard, 1)
    return gathered[:, torch.argsort(shard.all_positions(logits.shape[1], gathered.device))]


def stage_output(shard: ContextShard, model: nn.Module) -> Any:
    """The last pipeline stage's output as one process's model would give it (pipeline_parallel's
    ``STAGE_OUTPUT``): given labels, the loss over the whole sequence (each rank's share, the mean over the context
    group) with this rank's logits; without, the logits whole, in sequence order (a user's loss on them trains the
    same)."""
    from transformers.modeling_outputs import CausalLMOutput

    def output(data: Any, logits: torch.Tensor) -> Any:
        labels = data.get("labels") if isinstance(data, dict) else None
        if labels is None:
            return CausalLMOutput(loss=None, logits=whole_sequence_logits(shard, logits))
        targets = local_targets(shard, data, shard.positions(logits.shape[1], logits.device))
        loss = model.loss_function(logits=logits, labels=None, vocab_size=model.config.vocab_size, **targets)
        return CausalLMOutput(loss=_MeanOverGroup.apply(loss, shard), logits=logits)

    return output


def _gather_router_logits(shard: ContextShard) -> Any:
    """A forward hook for a mixture-of-experts decoder's base model: each layer's router logits (tokens, experts)
    gathered over the context group, so that the router's load-balancing loss is the whole sequence's, as in one
    process (a per-batch statistic: over each rank's tokens alone it would differ). The gather's backward returns
    every rank's share of the loss's gradient to the logits' owner."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        logits = getattr(output, "router_logits", None)
        hidden = getattr(output, "last_hidden_state", None)
        if not logits or hidden is None:
            return output
        batch, local = int(hidden.shape[0]), int(hidden.shape[1])
        gathered = []
        for layer in logits:
            if layer is None or layer.dim() != 2 or layer.shape[0] != batch * local:
                raise NotImplementedError(
                    f"context_parallel gathers the router logits of {type(module).__name__} as (tokens, experts) "
                    f"of the rank's {batch} x {local} tokens, got shape {tuple(getattr(layer, 'shape', ()))}; set "
                    "output_router_logits=False or drop context_parallel for this model")
            whole = _GatherSequence.apply(layer.view(batch, local, -1), shard, 1)
            gathered.append(whole.reshape(batch * local * shard.size, -1))
        output.router_logits = tuple(gathered)
        return output

    return hook


def _masked_router_loss(model: nn.Module, output: Any, shard: ContextShard) -> None:
    """With padding, the load-balancing loss over the gathered router logits counts only real tokens (the padding
    mask in the gather's order), as the model counts them in one process; the loss is corrected by the difference."""
    import sys

    balance = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    if balance is None or not hasattr(model, "router_aux_loss_coef"):
        raise NotImplementedError(f"context_parallel cannot apply the padding mask to {type(model).__name__}'s router "
                                  "load-balancing loss; pass unpadded batches or set output_router_logits=False")
    masked = balance(output.router_logits, model.num_experts, model.num_experts_per_tok, shard.kept_keys.long())
    if getattr(output, "loss", None) is not None:
        output.loss = output.loss + model.router_aux_loss_coef * (masked - output.aux_loss)
    output.aux_loss = masked


def _install_hooks(model: nn.Module, shard: ContextShard) -> None:
    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict]:
        inputs = _bound(module, args, kwargs)
        module._atorch_cp_labels = inputs.get("labels") is not None  # type: ignore[assignment]
        return (), split_inputs(shard, inputs)

    def after(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if shard.kept_keys is not None and getattr(output, "aux_loss", None) is not None:
            _masked_router_loss(module, output, shard)
        if module._atorch_cp_labels:
            if getattr(output, "loss", None) is not None:
                output.loss = _MeanOverGroup.apply(output.loss, shard)
        elif getattr(output, "logits", None) is not None:  # whole logits, in sequence order
            output.logits = whole_sequence_logits(shard, output.logits)
        return output

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True)
    base = getattr(model, "base_model", model)
    if base is not model:  # a mixture of experts' router logits come out of the base model (with output_router_logits)
        base.register_forward_hook(_gather_router_logits(shard), with_kwargs=True)


def _install_stage_hooks(model: nn.Module, shard: ContextShard) -> None:
    """On a pipeline stage's model: the inputs split as on the whole model (every stage reads the micro-batch, so
    each computes the same positions; a later stage's first block takes the previous stage's share of the hidden
    states in place of its own), the loss left to the schedule's (``stage_output``: the stage strips the labels)."""

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict]:
        return (), split_inputs(shard, _bound(module, args, kwargs))

    model.register_forward_pre_hook(before, with_kwargs=True)


def pipeline_batch_check(shard: ContextShard) -> Any:
    """The check of a batch before the schedule runs it (pipeline_parallel's ``batch_checks``: a refusal inside a
    stage's forward would leave the next stage waiting for its activations). Padded batches are refused too: the
    stages run several micro-batches' forwards before their backwards, and a recomputed attention would read the
    padding of the latest forward."""

    def check(data: Any) -> None:
        if not isinstance(data, dict):
            raise SetupError("context_parallel beside pipeline_parallel takes a dict batch with input_ids (use "
                             f"model_input_format='unpack_dict'), got {type(data).__name__}")
        checked_source(shard, data)
        mask = data.get("attention_mask")
        if mask is not None and not bool((mask != 0).all()):
            raise SetupError("context_parallel beside pipeline_parallel takes unpadded sequences (the stages run "
                             "several micro-batches' forwards before their backwards); pack the sequences or pad "
                             "them with real tokens and -100 labels, or drop one of the two methods")

    return check


def split_sequences(ctx: Any, communicate: bool) -> None:
    """context_parallel's apply step: the attention through atorch's all-gather, the inputs split by hooks (on the
    whole model, or on each pipeline stage's model with the loss made by the schedule: ``stage_output``)."""
    if not communicate:  # a model of fake tensors for the cost model: whole sequences (cost_facts divides)
        return
    from atorch.opt_lib.pipeline_parallel import STAGE_LOGITS, STAGE_OUTPUT
    from atorch.state_names import StagedModel, state_roots

    layout = ctx.layout
    group = layout.mesh(ctx.env.device.type)[CONTEXT].get_group()
    shard = ContextShard(group, dist.get_world_size(group), dist.get_rank(group))
    _register_attention()
    staged = isinstance(ctx.model, StagedModel)
    for model in state_roots(ctx.model) if staged else [ctx.model]:
        for module in attention_modules(model):
            object.__setattr__(module, _STATE, shard)  # not a submodule or buffer: plain state, out of state_dict
        model.config._attn_implementation = ATTENTION_NAME
        for sub in model.modules():  # sub-models keep their own config objects (a text model inside a VLM)
            config = getattr(sub, "config", None)
            if config is not None and hasattr(config, "_attn_implementation"):
                config._attn_implementation = ATTENTION_NAME
        if staged:
            _install_stage_hooks(model, shard)
            router = getattr(model, "atorch_router", None)  # the routing statistics summed over the group
            if router is not None:
                router.context = shard
            setattr(model, STAGE_OUTPUT, stage_output(shard, model))
            setattr(model, STAGE_LOGITS, lambda logits: whole_sequence_logits(shard, logits))
        else:
            _install_hooks(model, shard)
    if staged:
        ctx.model.batch_checks.append(pipeline_batch_check(shard))
    logger.info("context_parallel: sequences split over %d ranks (zigzag)%s, gradients averaged over %d "
                "(data × expert × context)", shard.size, " on every pipeline stage" if staged else "",
                layout.replica_size)


# ----- the method ------------------------------------------------------------------------------------------
@register
class ContextParallel(Method):
    name = "context_parallel"
    group = "parallel"
    summary = ("Context parallel: each sequence split over the 'context' dimension (load-balanced zigzag); "
               "attention all-gathers K/V over it (Llama 3's); transformers decoders.")
    mesh_dims = (CONTEXT,)
    Config = ContextParallelConfig
    # the search offers a 'context' size beside data, tensor, pipeline and expert sizes for long sequences (space.py,
    # CONTEXT_PARALLEL_FROM)
    search_role = SearchRole("layout", CONTEXT, off=1)

    def searchable(self, model: Any) -> bool:
        return not_supported_reason(model) is None and not layer_drop_settings(model)

    def trace_problem(self, config: MethodConfig, layout: Any) -> str | None:
        # the split is installed only where the build communicates: a fake build runs whole sequences
        return "the sequence split is set up with the context group's collectives (a communicating step)"

    def check(self, config: Any, check: StrategyCheck) -> list[str]:
        if ParallelMode.name not in check.configs:  # with one: the compatibility table's rule
            return [f"{self.name} splits each sequence over parallel_mode's 'context' dimension; add one, e.g. "
                    "('parallel_mode', {'dims': [['context', 2], ['data', -1]]})"]
        return []

    def applicable(self, ctx: Any) -> str | None:
        return not_supported_reason(ctx.model)

    def model_problems(self, ctx: Any, config: MethodConfig) -> list[str]:
        from atorch.meta_init import is_meta

        if is_meta(ctx.model):
            return [f"a model on the meta device is not supported with {self.name} yet; build it on CPU"]
        return layer_drop_problems(ctx.model, "context parallel exchanges each attention layer's keys and values")

    def apply(self, build: Build, config: MethodConfig) -> None:
        split_sequences(build.ctx, build.communicate)

    def cost_facts(self, config: MethodConfig, layout: ParallelLayout) -> CostFacts:
        """Activations per rank: 1/c of the sequence (``activations`` over 'context'); per layer, K and V of the
        whole sequence are all-gathered in forward and their gradients reduce-scattered in backward: per rank
        2 · (c-1)/c · S · kv_heads · head_dim · bytes each way (``context_kv_traffic``). The parameter gradients are
        averaged over data × context by DDP/FSDP (the data-parallel sync, over ``replica_size`` ranks)."""
        return CostFacts(activations=CONTEXT if layout.size(CONTEXT) > 1 else None)


def context_kv_traffic(sequence: int, kv_heads: int, head_dim: int, layers: int, size: int,
                       bytes_per_element: float = 2.0) -> float:
    """Bytes one rank sends and receives per micro-batch sample for context parallel over ``size`` ranks: per
    layer the K/V all-gather in forward and the reduce-scatter of their gradients in backward."""
    if size <= 1:
        return 0.0
    per_layer = 2 * sequence * kv_heads * head_dim * bytes_per_element * (size - 1) / size  # K and V
    return 2 * per_layer * layers  # forward all-gather + backward reduce-scatter
