"""tensor_parallel: Megatron-style tensor parallelism with DTensor ``parallelize_module`` on the 'tensor' dimension.

A plan maps module names to "colwise" or "rowwise". It is derived from the model's structure:
- Llama / Qwen2 / Mistral style attention (q_proj, k_proj, v_proj colwise, o_proj rowwise) and gated
  MLPs (gate_proj, up_proj colwise, down_proj rowwise): each rank holds 1/t of the heads.
- GPT-2 style attention with a fused ``c_attn`` (q|k|v in one layer): its output rows are permuted so
  that each rank's colwise shard holds the q, k and v of its own heads; c_proj rowwise; MLP c_fc
  colwise, c_proj rowwise. Needs ``module_replace`` first (DTensor cannot split transformers' Conv1D).
- BERT, T5 (with its relative attention bias split by head) and BART: see tp_families.py.
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

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field, field_validator
from torch import nn

from atorch.log import get_logger
from atorch.opt_lib.base import Method, MethodConfig, SearchRole, StrategyCheck
from atorch.opt_lib.blocks import block_classes
from atorch.opt_lib.registry import register
from atorch.opt_lib.tp_families import local_widths, match_family, split_dims

logger = get_logger(__name__)

TENSOR = "tensor"
Style = Literal["colwise", "rowwise"]


class TensorParallelConfig(MethodConfig):
    """Needs a 'tensor' dimension in parallel_mode, e.g. ``([("data", -1), ("tensor", 2)], None)``."""

    plan: Literal["auto"] | dict[str, Style] = Field(
        default="auto",
        description="'auto' derives the plan from the model; or a mapping of module-name patterns "
        "(fnmatch, e.g. 'layers.*.fc1') to 'colwise' / 'rowwise'",
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
        return plan


@dataclass
class Plan:
    styles: dict[str, Style] = field(default_factory=dict)  # module name -> style
    fused_qkv: list[str] = field(default_factory=list)  # GPT-2 style attention modules (c_attn fused q|k|v)
    head_modules: list[str] = field(default_factory=list)  # attention modules whose head counts become local
    widths: dict[str, tuple[str, ...]] = field(default_factory=dict)  # [families] attention -> per-rank attributes
    problems: list[str] = field(default_factory=list)


def _dims(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of an nn.Linear or a transformers Conv1D (whose weight is stored in×out)."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return int(module.weight.shape[0]), int(module.nf)
    return None


def _child(module: nn.Module, name: str) -> nn.Module | None:
    child = getattr(module, name, None)
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
            head_dim = getattr(module, "head_dim", None)
            heads = _dims(module.q_proj)[1] // head_dim if head_dim else None
            kv_heads = _dims(module.k_proj)[1] // head_dim if head_dim else None
            for label, count in (("attention heads", heads), ("key/value heads", kv_heads)):
                if count is not None and count % t:
                    plan.problems.append(f"{name}: {count} {label} do not divide over tensor size {t}; "
                                         f"use a tensor size that divides {count}")
            plan.styles.update({_join(name, n): "colwise" for n in ("q_proj", "k_proj", "v_proj")})
            plan.styles[_join(name, "o_proj")] = "rowwise"
            plan.head_modules.append(name)
        elif _has(module, "gate_proj", "up_proj", "down_proj"):  # gated MLP
            plan.styles.update({_join(name, "gate_proj"): "colwise", _join(name, "up_proj"): "colwise",
                                _join(name, "down_proj"): "rowwise"})
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
                    plan.styles[_join(block_name, previous[0])] = "colwise"
                    plan.styles[_join(block_name, name)] = "rowwise"
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


def _explicit_plan(model: nn.Module, patterns: dict[str, Style]) -> Plan:
    plan = Plan()
    names = [n for n, m in model.named_modules() if _dims(m) is not None]
    for pattern, style in patterns.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            plan.problems.append(f"plan pattern {pattern!r} matches no nn.Linear of the model")
        plan.styles.update({n: style for n in hits})
    return plan


def derive_plan(model: nn.Module, config: TensorParallelConfig, t: int) -> Plan:
    """The plan for this model at tensor size t, with every problem found (checked before building)."""
    if isinstance(config.plan, dict):
        plan = _explicit_plan(model, config.plan)
    else:
        plan = _family_plan(model, t)
        if not plan.styles and not plan.problems:
            plan = _paired_plan(model)
        elif plan.styles:
            # A recognised attention with an MLP of other names (transformers ViT: fc1, fc2) gets
            # the rest of its blocks by pairing.
            plan.styles.update(_paired_plan(model, plan.styles).styles)
    modules = dict(model.named_modules())
    for name, style in plan.styles.items():
        d_in, d_out = _dims(modules[name]) or split_dims(modules[name])
        split, what = (d_out, "output") if style == "colwise" else (d_in, "input")
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


def parallelize(ctx: Any, config: TensorParallelConfig, communicate: bool) -> None:
    """Split ctx.model's planned layers over the 'tensor' dimension (DTensor parallelize_module)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from atorch.opt_lib import tp_sequence_vocab
    from atorch.opt_lib.sharding import broadcast_from_first

    mesh = ctx.layout.mesh(ctx.env.device.type)[TENSOR]
    t = mesh.size()
    # [communication] The ranks of a tensor group start from the same whole weights (the layers kept
    # whole must agree, and each shard is cut from the same tensor); the shards are then cut locally.
    if communicate:
        broadcast_from_first(ctx.model, mesh)
    plan = derive_plan(ctx.model, config, t)
    if plan.problems:  # checked before building; seen here only if the model changed in between
        from atorch.errors import StrategyError

        raise StrategyError(plan.problems, what="tensor_parallel")
    modules = dict(ctx.model.named_modules())
    for name in plan.fused_qkv:
        _permute_fused_qkv(modules[name], t)
    for name in plan.head_modules:
        _local_head_counts(modules[name], t)
    for name, widths in plan.widths.items():  # [families] BERT, T5, BART
        local_widths(modules[name], widths, t)
    tied = tp_sequence_vocab.is_tied(ctx.model)
    # [loss_parallel / sequence_parallel] their styles (embeddings, head, norms) and layout hooks (tp_sequence_vocab.py)
    styles = tp_sequence_vocab.styles(ctx.model, config, plan.styles, mesh)
    parallelize_module(ctx.model, mesh, styles, src_data_rank=None)
    tp_sequence_vocab.finish(ctx.model, config, tied, t)
    logger.info("tensor_parallel: %d layers split over %d processes (%d colwise, %d rowwise)%s", len(plan.styles), t,
                sum(s == "colwise" for s in plan.styles.values()), sum(s == "rowwise" for s in plan.styles.values()),
                "".join(f", {k}" for k in ("loss_parallel", "sequence_parallel") if getattr(config, k)))


def tp_sequence_vocab_problems(model: nn.Module, config: TensorParallelConfig, t: int) -> list[str]:
    from atorch.opt_lib.tp_sequence_vocab import problems

    return problems(model, config, t)


def has_conv1d(model: nn.Module) -> bool:
    return any(type(m).__name__ == "Conv1D" for m in model.modules())


@register
class TensorParallel(Method):
    name = "tensor_parallel"
    group = "parallel"
    summary = "Megatron-style tensor parallel (DTensor) on the 'tensor' dimension: plans derived from the model."
    search_role = SearchRole("layout", "tensor", off=1)
    Config = TensorParallelConfig
    mesh_dims = (TENSOR,)

    def requires_train_step(self, config: TensorParallelConfig) -> bool:  # type: ignore[override]
        return config.loss_parallel  # the loss must run inside torch's loss_parallel(): train_step enters it

    def check(self, config: TensorParallelConfig, check: StrategyCheck) -> list[str]:  # type: ignore[override]
        problems = []
        mode = check.configs.get("parallel_mode")
        if mode is None or TENSOR not in dict(mode.dims):
            problems.append("needs a 'tensor' dimension: add ('parallel_mode', ([('data', -1), ('tensor', 2)], None))")
        for key in ("sequence_parallel", "loss_parallel"):
            if getattr(config, key) and (mode is not None and "pipeline" in dict(mode.dims)):
                problems.append(f"{key} is not available with a pipeline dimension yet (the stages exchange whole "
                                f"activations); set {key} to false")
        return problems

    def model_problems(self, ctx: Any, config: TensorParallelConfig) -> list[str]:  # type: ignore[override]
        from atorch.meta_init import is_meta

        problems = []
        strategy = getattr(ctx, "strategy", None)
        if has_conv1d(ctx.model) and (strategy is None or strategy.get("module_replace") is None):
            problems.append("the model uses transformers' Conv1D (GPT-2 family), which DTensor cannot split; "
                            "add 'module_replace' to the strategy (it turns Conv1D into nn.Linear)")
        if is_meta(ctx.model):
            problems.append("a model on the meta device is not supported with tensor_parallel yet; build it on CPU")
        t = ctx.layout.size(TENSOR)
        # [loss_parallel / sequence_parallel] vocabulary divisibility, embedding and head found (tp_sequence_vocab.py)
        return problems + derive_plan(ctx.model, config, t).problems + tp_sequence_vocab_problems(ctx.model, config, t)
