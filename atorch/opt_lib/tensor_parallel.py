"""tensor_parallel: Megatron-style tensor parallelism with DTensor ``parallelize_module`` on the 'tensor' dimension.

A plan maps module names to "colwise" or "rowwise". It is derived from the model's structure:
- Llama / Qwen2 / Mistral style attention (q_proj, k_proj, v_proj colwise, o_proj rowwise) and gated
  MLPs (gate_proj, up_proj colwise, down_proj rowwise): each rank holds 1/t of the heads.
- GPT-2 style attention with a fused ``c_attn`` (q|k|v in one layer): its output rows are permuted so
  that each rank's colwise shard holds the q, k and v of its own heads; c_proj rowwise; MLP c_fc
  colwise, c_proj rowwise. Needs ``module_replace`` first (DTensor cannot split transformers' Conv1D).
- BERT, T5 (with its relative attention bias split by head) and BART: see tp_families.py.
- Falcon and GPT-BigCode fused q|k|v (per-head blocks split, multi-query kept whole) and the query/key norms of
  attentions split by head (Qwen3, Cohere, StableLM, OLMo2, ...): see tp_layouts.py.
- Any other model, and the layers of a recognised model's blocks left out by the above (transformers
  ViT: Llama-named attention, MLP fc1/fc2): Megatron pairing inside the repeated blocks: a Linear that
  changes the width, followed in module order by a Linear taking that width with no parameter-holding
  module between them, becomes colwise then rowwise (the elementwise activation between them runs on
  the shards).
Layers outside the plan (embeddings, norms, heads) stay whole on every rank; their gradients agree
across the tensor group because every rank computes them from the same (all-reduced) activations.
The options ``loss_parallel`` (embedding and head split over the vocabulary, cross-entropy on the shards)
and ``sequence_parallel`` (norms and dropout on sequence shards) live in tp_sequence_vocab.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field, field_validator
from torch import nn

from atorch.layer_drop import layer_drop_problems, layer_drop_settings
from atorch.log import get_logger
from atorch.opt_lib.base import Method, MethodConfig, SearchRole, StrategyCheck
from atorch.opt_lib.blocks import block_classes
from atorch.opt_lib.parallel_mode import ParallelMode
from atorch.opt_lib.registry import register
from atorch.opt_lib.tp_families import local_widths, match_family, split_dims
from atorch.opt_lib.tp_layouts import (
    NORM_STYLES,
    OwnColumns,
    SumGradOverTensor,
    elementwise_styles,
    fused_kv_layer,
    head_norm_styles,
    keep_own_columns,
    local_inputs,
    match_layout,
)
from atorch.opt_lib.tp_styles import (
    KEPT_WHOLE,
    gathered_where_model_says,
    match,
    model_plan,
    splits_output,
    unknown_style,
    vocabulary_layers,
)
from atorch.state_names import StagedModel

if TYPE_CHECKING:
    from atorch.opt_lib.build_state import Build

logger = get_logger(__name__)

TENSOR = "tensor"
Style = str  # a style name of tp_styles.py: "colwise", "rowwise", "colwise_gather_output", ...


class TensorParallelConfig(MethodConfig):
    """Needs a 'tensor' dimension in parallel_mode, e.g. ``([("tensor", 2), ("data", -1)], None)``."""

    plan: Literal["auto"] | dict[str, Style] = Field(
        default="auto",
        description="'auto': the model's own plan where transformers ships one (base_model_tp_plan), else one "
        "derived from the model; or a mapping of module-name patterns (fnmatch, e.g. 'layers.*.fc1') to "
        "'colwise' / 'rowwise' or another transformers style name ('colwise_gather_output', "
        "'rowwise_split_input', 'embedding_rowwise', ...; 'replicated_with_grad_allreduce' for query/key norms)",
    )
    sequence_parallel: bool = Field(default=False, description="norms and dropout run on sequence shards (dim 1) "
                                    "between the split layers (sequence length must divide over the tensor size)")
    loss_parallel: bool = Field(default=False, description="token embedding and LM head split over the vocabulary; "
                                "cross-entropy on the vocabulary shards inside torch's loss_parallel()")

    @field_validator("plan")
    @classmethod
    def _plan_not_empty(cls, plan: Any) -> Any:
        if isinstance(plan, dict) and not plan:
            raise ValueError("an explicit plan needs at least one entry, e.g. {'blocks.*.fc1': 'colwise', ...}")
        if isinstance(plan, dict):
            unknown = [why for style in plan.values() if (why := unknown_style(style))]
            if unknown:
                raise ValueError(unknown[0])
        return plan


@dataclass
class Plan:
    styles: dict[str, Style] = field(default_factory=dict)  # module name -> style
    fused_qkv: list[str] = field(default_factory=list)  # GPT-2 style attention modules (c_attn fused q|k|v)
    head_modules: list[str] = field(default_factory=list)  # attention modules whose head counts become local
    widths: dict[str, tuple[str, ...]] = field(default_factory=dict)  # [families] attention -> per-rank attributes
    replicated_kv: list[str] = field(default_factory=list)  # attentions with fewer key/value heads than ranks
    own_columns: dict[str, OwnColumns] = field(default_factory=dict)  # [layouts] attention -> fused layer kept whole
    whole_k_norms: dict[str, tuple[str, str]] = field(default_factory=dict)  # [layouts] replicated_kv -> (norm, style)
    source: str = "derived"  # "explicit" (the user's), "model" (transformers' shipped plan) or "derived"
    notes: list[str] = field(default_factory=list)  # rewrites and additions, said in the log
    problems: list[str] = field(default_factory=list)
    pairs: dict[str, str] = field(default_factory=dict)  # [pairing] each layer paired by module order -> its partner


def _dims(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of an nn.Linear or a transformers Conv1D (whose weight is stored in×out)."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return int(module.weight.shape[0]), int(module.nf)
    return None


def _child(module: nn.Module, name: str) -> nn.Module | None:
    # From the module tree, not getattr: a pipeline stage's StandIn would give its meta copy's children (see
    # tp_families._linear), naming layers the stage does not hold.
    child = module._modules.get(name)
    return child if isinstance(child, nn.Module) and _dims(child) is not None else None


def _has(module: nn.Module, *names: str) -> bool:
    return all(_child(module, n) is not None for n in names)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _family_plan(model: nn.Module, t: int) -> Plan:
    """Plans for the transformers families recognised by their layer names."""
    plan = Plan()
    for name, module in model.named_modules():
        if _has(module, "q_proj", "k_proj", "v_proj", "o_proj"):  # Llama / Qwen2 / Mistral attention
            # head counts: _uneven_heads, for every plan source
            plan.styles.update({_join(name, n): "colwise" for n in ("q_proj", "k_proj", "v_proj")})
            plan.styles[_join(name, "o_proj")] = "rowwise"
            plan.head_modules.append(name)
        elif _has(module, "gate_proj", "up_proj", "down_proj"):  # gated MLP
            plan.styles.update({_join(name, "gate_proj"): "colwise", _join(name, "up_proj"): "colwise",
                                _join(name, "down_proj"): "rowwise"})
        elif (layout := match_layout(name, module, t)) is not None:  # [layouts] Falcon, GPT-BigCode: tp_layouts.py
            plan.styles.update(layout.styles)
            plan.problems.extend(layout.problems)
            plan.notes.extend(layout.notes)
            plan.own_columns.update(layout.own_columns)
            if layout.attention is not None:
                plan.widths[layout.attention] = layout.widths
        elif _has(module, "c_attn", "c_proj") and hasattr(module, "split_size"):  # GPT-2 attention
            if getattr(module, "is_cross_attention", False):
                plan.problems.append(f"{name}: cross-attention (q_attn and c_attn) is not split yet; "
                                     "leave tensor_parallel out for encoder-decoder GPT-2")
                continue
            heads = int(module.num_heads)
            if heads % t:
                plan.problems.append(f"{name}: {heads} attention heads do not divide over tensor size {t}; "
                                     f"use a tensor size that divides {heads}")
            plan.styles[_join(name, "c_attn")] = "colwise"
            plan.styles[_join(name, "c_proj")] = "rowwise"
            plan.fused_qkv.append(name)
            plan.head_modules.append(name)
        elif _has(module, "c_fc", "c_proj"):  # GPT-2 MLP
            plan.styles.update({_join(name, "c_fc"): "colwise", _join(name, "c_proj"): "rowwise"})
        elif (match := match_family(name, module, t)) is not None:  # [families] BERT, T5, BART: tp_families.py
            plan.styles.update(match.styles)
            plan.problems.extend(match.problems)
            if match.attention is not None:
                plan.widths[match.attention] = match.widths
    return plan


def _paired_plan(model: nn.Module, planned: dict[str, Style] | None = None) -> Plan:
    """Megatron pairing inside the repeated blocks (see the module docstring for the rule); layers already
    in ``planned`` (by a family plan) are left alone and break a pair like any parameter-holding layer."""
    from atorch.class_ref import matches

    planned = planned or {}
    plan = Plan()
    classes = block_classes(model)
    for block_name, block in model.named_modules():
        if not classes or not matches(block, classes):
            continue
        previous: tuple[str, nn.Module] | None = None
        for name, module in block.named_modules():
            dims = _dims(module)
            if _join(block_name, name) in planned:
                previous = None
                continue
            if dims is None:
                if next(module.parameters(recurse=False), None) is not None:
                    previous = None  # a parameter-holding layer between two Linears: the data flow is unknown
                continue
            if previous is not None:
                first = _dims(previous[1])
                # The first must change the width, so that only its output can feed the second.
                if first[1] == dims[0] and first[0] != first[1]:
                    col, row = _join(block_name, previous[0]), _join(block_name, name)
                    plan.styles[col], plan.styles[row] = "colwise", "rowwise"
                    plan.pairs.update({col: row, row: col})
                    previous = None
                    continue
            previous = (name, module)
    if not plan.styles:
        plan.problems.append(
            "no layers to split found: no known attention/MLP layout and no Linear pairs (width-changing Linear "
            "followed by the Linear that takes that width) inside repeated blocks; give an explicit "
            "plan, e.g. {'plan': {'blocks.*.fc1': 'colwise', 'blocks.*.fc2': 'rowwise'}}"
        )
    return plan


def kv_projection_bytes(model: nn.Module) -> tuple[tuple[int, int], ...]:
    """For the cost model: (key/value heads, parameter bytes of their k_proj / v_proj) for the attentions with
    fewer key/value heads than query heads (GQA), one pair per head count. At a tensor size above the head count
    those projections stay whole on every rank of the group (see _uneven_heads); so do Falcon's and GPT-BigCode's
    fused q|k|v layers (their whole bytes, under their key/value head count: tp_layouts.py)."""
    by_heads: dict[int, int] = {}
    for module in model.modules():
        kv_heads, heads = _head_counts(module) or (0, 0)
        if kv_heads < heads:
            by_heads[kv_heads] = by_heads.get(kv_heads, 0) + sum(
                p.numel() * p.element_size() for n in ("k_proj", "v_proj") for p in getattr(module, n).parameters())
        elif (fused := fused_kv_layer(module)) is not None:  # [layouts] Falcon / GPT-BigCode: the fused layer whole
            kv_heads, layer = fused
            by_heads[kv_heads] = by_heads.get(kv_heads, 0) + sum(p.numel() * p.element_size()
                                                                 for p in layer.parameters())
    return tuple(sorted(by_heads.items()))


def automatic_plan(model: nn.Module) -> Plan | None:
    """For the cost model: the automatic plan's styles at any tensor size (derived once per analysis), or None
    where the model has none (a model the planner cannot read is one tensor parallel is not offered for)."""
    try:
        plan = derive_plan(model, TensorParallelConfig(), 1)
    except Exception:  # noqa: BLE001 - see above
        return None
    return None if plan.problems else plan


def split_layer_counts(model: nn.Module, plan: Plan | None) -> tuple[int, int]:
    """For the cost model: (layers, trainable parameter tensors) the automatic ``plan`` splits. Under tensor parallel
    each such layer runs as DTensor operations in every micro-batch and each such parameter is a DTensor in the
    optimizer's step: DTensor's dispatch costs far more than a plain operation (the hardware profile measures
    it). (0, 0) where the model has nothing the automatic plan splits."""
    if plan is None:
        return 0, 0
    modules = dict(model.named_modules())
    params = sum(p.requires_grad for name in plan.styles if name in modules
                 for p in modules[name].parameters(recurse=False))
    return len(plan.styles), params


def bytes_left_whole(model: nn.Module, modules: list[nn.Module], plan: Plan | None) -> int:
    """For the cost model: the parameter bytes of ``modules`` (a MoE layer's expert banks) that the automatic
    ``plan`` does not split; all of them where the model has no plan."""
    planned = set() if plan is None else {id(m) for name, m in model.named_modules() if name in plan.styles}
    return sum(p.numel() * p.element_size() for module in modules for sub in module.modules() if id(sub) not in planned
               for p in sub.parameters(recurse=False))


def replicated_kv_bytes(model: nn.Module, t: int) -> int:
    """Parameter bytes tensor parallel keeps whole on every rank at tensor size t: the k_proj / v_proj of the
    attentions with fewer key/value heads than t."""
    return sum(size for kv_heads, size in kv_projection_bytes(model) if kv_heads < t)


def _head_counts(module: nn.Module) -> tuple[int, int] | None:
    """(key/value heads, query heads) of an attention with q_proj, k_proj, v_proj and a head_dim; else None."""
    head_dim = getattr(module, "head_dim", None)
    if not _has(module, "q_proj", "k_proj", "v_proj") or not isinstance(head_dim, int) or not head_dim:
        return None
    return _dims(module.k_proj)[1] // head_dim, _dims(module.q_proj)[1] // head_dim


def kv_head_of_rank(rank: int, t: int, kv_heads: int) -> int:
    """The key/value head the query heads of tensor rank ``rank`` read when ``kv_heads`` (fewer than t, dividing
    it) are replicated over the group. A colwise q_proj gives rank r query heads [r·h/t, (r+1)·h/t); grouped-query
    attention gives query head j the key/value head j // (h/kv); a group of h/kv query heads spans t/kv ranks."""
    return rank // (t // kv_heads)


def valid_tensor_sizes(heads: int, kv_heads: int) -> list[int]:
    """Tensor sizes (above 1) an attention of ``heads`` query and ``kv_heads`` key/value heads splits over: the
    query heads divide, and the key/value heads either divide too or are each replicated over t/kv ranks."""
    return [t for t in range(2, heads + 1) if heads % t == 0 and (kv_heads % t == 0 or t % kv_heads == 0)]


def _explicit_plan(model: nn.Module, patterns: dict[str, Style], source: str = "explicit") -> Plan:
    plan = Plan(source=source)
    names = [n for n, m in model.named_modules() if _dims(m) is not None or isinstance(m, nn.Embedding)]
    # A pipeline stage holds some of the layers only: the patterns were checked on the whole model.
    staged = isinstance(model, StagedModel)
    norms = [n for n, m in model.named_modules() if next(m.parameters(recurse=False), None) is not None]
    for pattern, style in patterns.items():
        hits = match(norms if style in NORM_STYLES else names, pattern)
        if not hits and source == "explicit" and not staged:
            plan.problems.append(f"plan pattern {pattern!r} matches no nn.Linear of the model")
        plan.styles.update({n: style for n in hits})
    return plan


def _shipped_plan(model: nn.Module) -> Plan | None:
    """transformers' own plan for this model (base_model_tp_plan), or None where it ships none. The token
    embedding and LM head stay whole (see tp_styles.vocabulary_layers); patterns naming no layer are skipped."""
    shipped = model_plan(model)
    if not shipped:
        return None
    plan = _explicit_plan(model, shipped, source="model")
    kept = sorted(vocabulary_layers(model) & set(plan.styles))
    for name in kept:
        del plan.styles[name]
    if kept:
        plan.notes.append(f"kept whole: {', '.join(kept)} (vocabulary layers; split them with loss_parallel)")
    unknown = sorted({why for style in plan.styles.values() if (why := unknown_style(style))})
    plan.problems += [f"the model's own plan: {why}" for why in unknown]
    plan.head_modules = sorted({name.rpartition(".")[0] for name, style in plan.styles.items() if style == "colwise"
                                and _head_attrs(model.get_submodule(name.rpartition(".")[0]))})
    return plan


def _head_attrs(module: nn.Module) -> bool:
    return any(isinstance(getattr(module, a, None), int) for a in ("num_heads", "num_attention_heads"))


def _uneven_heads(model: nn.Module, plan: Plan, t: int) -> None:
    """Attentions (q_proj, k_proj, v_proj and a head_dim) split by head: query heads must divide over the ranks.
    With fewer key/value heads than ranks (Gemma-2B: one; GQA models at a large tensor size) and t a multiple of
    their count, k_proj / v_proj stay whole on every rank and each rank uses the head its query heads read (as
    Megatron and torchtitan replicate them: each head over t/kv ranks); other counts are refused with the tensor
    sizes that work."""
    replicated: dict[int, int] = {}  # key/value heads -> attentions
    for name, module in model.named_modules():
        counts = _head_counts(module)
        if counts is None:
            continue
        kv_heads, heads = counts
        k_name, q_name = _join(name, "k_proj"), _join(name, "q_proj")
        if plan.styles.get(q_name) in ("colwise", "local_colwise") and heads % t:
            plan.problems.append(f"{name}: {heads} attention heads do not divide over tensor size {t}; "
                                 f"use a tensor size that divides {heads}")
            continue
        if plan.styles.get(k_name) not in ("colwise", "local_colwise") or kv_heads % t == 0:
            continue
        if t % kv_heads == 0 and heads % t == 0 and plan.styles.get(q_name) == plan.styles[k_name]:
            del plan.styles[k_name], plan.styles[_join(name, "v_proj")]
            plan.replicated_kv.append(name)
            replicated[kv_heads] = replicated.get(kv_heads, 0) + 1
            continue
        plan.problems.append(
            f"{name}: {kv_heads} key/value heads do not divide over tensor size {t}, and {t} is not a multiple of "
            f"{kv_heads} (fewer key/value heads than ranks are replicated, each over t/{kv_heads} ranks); use a "
            f"tensor size among {valid_tensor_sizes(heads, kv_heads)} for {heads} query heads")
    for kv_heads, count in sorted(replicated.items()):
        plan.notes.append(f"{kv_heads} key/value head{'s' if kv_heads > 1 else ''} replicated (each over "
                          f"{t // kv_heads} ranks) in {count} attention layers")


def _head_norms(model: nn.Module, plan: Plan) -> None:
    """[layouts] Query/key norms of attentions split by head get the style their weights need (tp_layouts.py)."""
    found, plan.whole_k_norms, problems = head_norm_styles(model, plan.styles, plan.replicated_kv, _head_counts)
    plan.styles.update(found)
    scalars = elementwise_styles(model, plan.styles) if plan.source != "explicit" else {}
    plan.styles.update(scalars)
    if scalars:
        plan.notes.append(f"learned scalars on the rank's shard (gradient summed over the group): {len(scalars)} "
                          "modules")
    plan.problems.extend(problems)
    if found:
        kinds = sorted(set(found.values()))
        plan.notes.append(f"query/key norms on the rank's heads ({', '.join(kinds)}) in {len(found)} layers")
    if plan.whole_k_norms:
        plan.notes.append(f"key norms kept whole with their replicated heads in {len(plan.whole_k_norms)} attention "
                          "layers")


def _fused_rewrites(model: nn.Module, plan: Plan) -> None:
    """Layers the model's own plan gathers (fused projections the model splits again, Phi-3's qkv_proj and
    gate_up_proj) given the plain style: rewritten to the model's gather-output style (plain would compute
    wrong numbers without an error)."""
    rewrite = gathered_where_model_says(plan.styles, model_plan(model))
    plan.styles.update(rewrite)
    if rewrite:
        plan.notes.append("rewritten to the model's gather-output styles (fused layers it splits again): "
                          + ", ".join(f"{n}: {s}" for n, s in sorted(rewrite.items())))


def derive_plan(model: nn.Module, config: TensorParallelConfig, t: int) -> Plan:
    """The plan for this model at tensor size t, with every problem found (checked before building). Sources, in
    order: the user's explicit plan, the model's own (transformers ships one for many families), atorch's."""
    shipped = None if isinstance(config.plan, dict) else _shipped_plan(model)
    if isinstance(config.plan, dict):
        plan = _explicit_plan(model, config.plan)
        _fused_rewrites(model, plan)
    elif shipped is not None and shipped.styles:
        plan = shipped
    else:
        plan = _family_plan(model, t)
        if not plan.styles and not plan.problems:
            plan = _paired_plan(model) if not plan.notes else replace(_paired_plan(model), notes=plan.notes)
        elif plan.styles:
            # A recognised attention with an MLP of other names (transformers ViT: fc1, fc2) gets
            # the rest of its blocks by pairing.
            kept = {spec.layer: "replicate" for spec in plan.own_columns.values()}  # not paired either
            paired = _paired_plan(model, {**plan.styles, **kept})
            plan.styles.update(paired.styles)
            plan.pairs.update(paired.pairs)
    for name in [n for n, s in plan.styles.items() if s in KEPT_WHOLE]:
        del plan.styles[name]
    _uneven_heads(model, plan, t)
    _head_norms(model, plan)
    modules = dict(model.named_modules())
    for name, style in plan.styles.items():
        if style in NORM_STYLES:  # split with their projections' heads (checked there)
            continue
        d_in, d_out = _dims(modules[name]) or split_dims(modules[name])
        split, what = (d_out, "output") if splits_output(style) else (d_in, "input")
        if split % t:
            plan.problems.append(f"{name} ({style}): its {split} {what} features do not divide over tensor size {t}; "
                                 f"use a tensor size that divides {split}")
    return plan


def _permute_fused_qkv(attention: nn.Module, t: int) -> None:
    """Reorder c_attn's output rows from [q | k | v] to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (rank r's heads),
    so that a colwise shard gives rank r the q, k and v of its own heads; then make the head counts local."""
    layer = attention.c_attn
    width = layer.out_features // 3
    chunk = width // t
    index = torch.cat([
        torch.arange(part * width + rank * chunk, part * width + (rank + 1) * chunk)
        for rank in range(t) for part in range(3)
    ]).to(layer.weight.device)
    with torch.no_grad():
        layer.weight.copy_(layer.weight[index])
        if layer.bias is not None:
            layer.bias.copy_(layer.bias[index])
    attention.split_size = chunk
    if hasattr(attention, "embed_dim"):
        attention.embed_dim = chunk


def _local_head_counts(attention: nn.Module, t: int) -> None:
    """Head-count attributes become per-rank counts (transformers reshapes with -1, but some code reads them)."""
    for attr in ("num_heads", "num_key_value_heads", "num_attention_heads"):
        value = getattr(attention, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(attention, attr, value // t)


_SumGradOverTensor = SumGradOverTensor  # [layouts] shared with the fused layers kept whole


def _replicate_kv(attention: nn.Module, t: int, rank: int, group: Any, k_norm: tuple[str, str] | None = None) -> None:
    """k_proj / v_proj stay whole on every rank; each rank uses the key/value head its h/t query heads read
    (kv_head_of_rank). The output gradient is summed over the group before the head is taken, so every rank
    gets the whole projections' gradient, each head's from the ranks that use it. ``k_norm``: a key norm over all
    key/value heads (its child name and style: one weight row per head, or one norm over the width), kept whole
    too: the head is taken from its output instead of k_proj's."""
    kv_heads, heads = _head_counts(attention)  # type: ignore[misc]
    width = attention.head_dim
    head = kv_head_of_rank(rank, t, kv_heads)
    start = head * width

    def own_head(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return _SumGradOverTensor.apply(output, group)[..., start:start + width]

    def own_head_row(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:  # [..., heads, head_dim]
        return _SumGradOverTensor.apply(output, group).narrow(-2, head, 1)

    for name in ("k_proj", "v_proj"):
        getattr(attention, name).register_forward_pre_hook(local_inputs)
    attention.v_proj.register_forward_hook(own_head)
    if k_norm is None:
        attention.k_proj.register_forward_hook(own_head)
    else:
        norm, style = k_norm
        getattr(attention, norm).register_forward_hook(own_head if style == "width_norm_split" else own_head_row)
    if isinstance(getattr(attention, "num_key_value_groups", None), int):
        attention.num_key_value_groups = heads // t  # the rank's query heads share its one key/value head
    if isinstance(getattr(attention, "num_key_value_heads", None), int):
        attention.num_key_value_heads = 1
    for attr in ("num_heads", "num_attention_heads"):
        if isinstance(getattr(attention, attr, None), int):
            setattr(attention, attr, getattr(attention, attr) // t)


def _add_module_replace(ctx: Any) -> None:
    """GPT-2's Conv1D becomes nn.Linear (DTensor cannot split Conv1D): module_replace, added for the user."""
    from atorch.opt_lib.module_replace import replace_modules, replace_pairs

    dtype = next(ctx.model.parameters()).dtype
    counts = replace_modules(ctx.model, [replace_pairs()["hf_conv1d_to_linear"]], dtype)
    logger.info("tensor_parallel: module_replace added (Conv1D -> nn.Linear, %d layers): DTensor cannot split "
                "transformers' Conv1D", sum(counts.values()))


def _check_problems(ctx: Any, config: TensorParallelConfig) -> str | None:
    """Why the one-block check cannot run on this build, or None."""
    if config.sequence_parallel:
        return "under sequence_parallel the block's input is a sequence shard"
    return None


def parallelize(ctx: Any, config: TensorParallelConfig, communicate: bool, runs_check: bool = False) -> None:
    """Split ctx.model's planned layers over the 'tensor' dimension (DTensor parallelize_module). Without
    ``communicate``, ``runs_check``: the split block still runs the one sample (a split that cannot compute it
    raises), its numbers not compared."""
    from torch.distributed.tensor.parallel import parallelize_module

    from atorch.errors import StrategyError
    from atorch.opt_lib import tp_sequence_vocab
    from atorch.opt_lib.sharding import broadcast_from_first
    from atorch.opt_lib.tp_check import BlockCheck

    mesh = ctx.layout.mesh(ctx.env.device.type)[TENSOR]
    t = mesh.size()
    # [communication] The ranks of a tensor group start from the same whole weights (the layers kept
    # whole must agree, and each shard is cut from the same tensor); the shards are then cut locally.
    if communicate:
        broadcast_from_first(ctx.model, mesh)
    if has_conv1d(ctx.model):
        _add_module_replace(ctx)
    plan = derive_plan(ctx.model, config, t)
    if plan.problems:  # checked before building; seen here only if the model changed in between
        raise StrategyError(plan.problems, what="tensor_parallel")
    skip_check = _check_problems(ctx, config) if communicate or runs_check else "no communication in this build"
    checks = BlockCheck.prepare(ctx, list(plan.styles)) if skip_check is None else []
    if skip_check is not None:
        logger.info("tensor_parallel: build not checked against the unsplit model (%s)", skip_check)
    _unpair_uncalled(ctx.model, plan, checks)
    if not plan.styles:
        raise StrategyError(["no layers left to split: each pair found by module order is computed with its "
                             "weights directly by the model's code; give an explicit plan of layers the model calls, "
                             "e.g. ('tensor_parallel', {'plan': {'*.mlp.up_proj': 'colwise', "
                             "'*.mlp.down_proj': 'rowwise'}}), or leave tensor_parallel out"], what="tensor_parallel")
    checks = [c for c in checks if not c.name or any(n.startswith(c.name + ".") for n in plan.styles)]
    modules = dict(ctx.model.named_modules())
    for name in plan.fused_qkv:
        _permute_fused_qkv(modules[name], t)
    for name in set(plan.head_modules) - set(plan.replicated_kv):  # those: _replicate_kv
        _local_head_counts(modules[name], t)
    for name, widths in plan.widths.items():  # [families] BERT, T5, BART
        local_widths(modules[name], widths, t)
    for name in plan.replicated_kv:
        _replicate_kv(modules[name], t, mesh.get_local_rank(), mesh.get_group(), plan.whole_k_norms.get(name))
    for name, spec in plan.own_columns.items():  # [layouts] multi-query fused layers kept whole
        keep_own_columns(modules[name], spec, mesh.get_local_rank(), mesh.get_group())
    tied = tp_sequence_vocab.is_tied(ctx.model)
    # [loss_parallel / sequence_parallel] their styles (embeddings, head, norms) and layout hooks (tp_sequence_vocab.py)
    styles = tp_sequence_vocab.styles(ctx.model, config, plan.styles, mesh)
    parallelize_module(ctx.model, mesh, styles, src_data_rank=None)
    tp_sequence_vocab.finish(ctx.model, config, tied, t)
    logger.info("tensor_parallel: %s plan, %d layers split over %d processes (%d colwise, %d rowwise)%s%s",
                {"explicit": "the user's", "model": "the model's own (transformers)", "derived": "atorch's derived"}[
                    plan.source], len(plan.styles), t, sum(splits_output(s) for s in plan.styles.values()),
                sum(not splits_output(s) and s not in NORM_STYLES for s in plan.styles.values()),
                "".join(f", {k}" for k in ("loss_parallel", "sequence_parallel") if getattr(config, k)),
                "".join(f"; {note}" for note in plan.notes))
    for check in checks:  # every rank checks the same blocks (the same model and sample): collectives pair up
        prefix = check.name + "." if check.name else ""
        fused = tuple(_join(n, "c_attn").removeprefix(prefix) for n in plan.fused_qkv if n.startswith(prefix))
        problems = check.run(ctx.model, mesh.get_group(), skip=fused) if communicate else check.runs(ctx.model)
        if problems:
            raise StrategyError(problems, what="tensor_parallel")


def _unpair_uncalled(model: nn.Module, plan: Plan, checks: list[Any]) -> None:
    """Leave out of the plan each pair (paired by module order) one of whose layers the checked block's forward
    does not call on the sample: its owner computes with the weight itself (Jamba's Mamba mixer reads
    ``dt_proj.weight``), where a split weight would meet whole tensors. Applied to every block of the class."""
    for check in checks:
        prefix = check.name + "." if check.name else ""
        paired = {n.removeprefix(prefix) for n in plan.pairs if n.startswith(prefix)}
        if not paired:
            continue
        uncalled = paired - check.called_modules()
        if not uncalled:
            continue
        owner = type(model.get_submodule(check.name))
        dropped = 0
        for block, module in model.named_modules():
            if type(module) is not owner:
                continue
            for rel in uncalled:
                for name in (_join(block, rel), plan.pairs.get(_join(block, rel))):
                    if name is not None and plan.styles.pop(name, None) is not None:
                        dropped += 1
        plan.notes.append(f"kept whole: {dropped} layers of {owner.__name__} paired by module order that its forward "
                          f"computes with itself, not as layers ({', '.join(sorted(uncalled))})")


def tp_sequence_vocab_problems(model: nn.Module, config: TensorParallelConfig, t: int) -> list[str]:
    from atorch.opt_lib.tp_sequence_vocab import problems

    return problems(model, config, t)


def has_conv1d(model: nn.Module) -> bool:
    return any(type(m).__name__ == "Conv1D" for m in model.modules())


@register
class TensorParallel(Method):
    name = "tensor_parallel"
    group = "parallel"
    summary = ("Megatron-style tensor parallel (DTensor) on the 'tensor' dimension: the user's plan, transformers' "
               "own or one derived from the model, checked on one block.")
    search_role = SearchRole("layout", "tensor", off=1)
    Config = TensorParallelConfig
    mesh_dims = (TENSOR,)

    def searchable(self, model: Any) -> bool:
        return not layer_drop_settings(model)  # a layer one rank skips holds collectives the others run

    def keeps_replicas_without_ddp(self, config: MethodConfig) -> bool:
        return True  # tensor-parallel replicas

    def requires_train_step(self, config: TensorParallelConfig) -> bool:  # type: ignore[override]
        return config.loss_parallel  # the loss must run inside torch's loss_parallel(): train_step enters it

    def check(self, config: TensorParallelConfig, check: StrategyCheck) -> list[str]:  # type: ignore[override]
        problems = []
        mode = check.configs.get(ParallelMode.name)
        if mode is None or TENSOR not in dict(mode.dims):
            problems.append("needs a 'tensor' dimension: add ('parallel_mode', ([('tensor', 2), ('data', -1)], None))")
        # (sequence_parallel runs there: the stages exchange sequence shards, tp_sequence_vocab.py)
        if config.loss_parallel and mode is not None and "pipeline" in dict(mode.dims):
            problems.append("loss_parallel is not available with a pipeline dimension yet (the vocabulary split of "
                            "the embedding and head is not carried onto the stages' copies); set loss_parallel to "
                            "false")
        return problems

    def model_problems(self, ctx: Any, config: TensorParallelConfig) -> list[str]:  # type: ignore[override]
        from atorch.meta_init import is_meta

        problems = []
        if is_meta(ctx.model):
            problems.append("a model on the meta device is not supported with tensor_parallel yet; build it on CPU")
        t = ctx.layout.size(TENSOR)
        problems += layer_drop_problems(ctx.model, "tensor parallel reduces each split layer's partial sums inside it")
        # [loss_parallel / sequence_parallel] vocabulary divisibility, embedding and head found (tp_sequence_vocab.py)
        return problems + derive_plan(ctx.model, config, t).problems + tp_sequence_vocab_problems(ctx.model, config, t)

    # ----- behaviour (atorch.apply.apply_strategy) -----------------------------------------------------------
    def apply(self, build: Build, config: TensorParallelConfig) -> None:  # type: ignore[override]
        parallelize(build.ctx, config, build.communicate, build.runs_checks)

    def replicate(self, build: Build, config: TensorParallelConfig) -> bool:  # type: ignore[override]
        # replicas of DTensor shards, which DDP refuses (tensor_data_parallel.py); pipeline stages replicate their way
        if build.ctx.replica_size <= 1 or build.per_stage is not None:  # (context ranks are replicas too)
            return False
        from atorch.opt_lib.tensor_data_parallel import replicate_tensor_parallel

        replicate_tensor_parallel(build.ctx)
        return True
