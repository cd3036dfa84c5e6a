"""tensor_parallel for decoder attention layouts beyond separate q/k/v projections (tensor_parallel.py calls these).

Per-head query/key norms (Qwen3, Gemma3, Cohere with use_qk_norm, OLMo2's whole-width norms): once q_proj / k_proj
are split by head, each rank's norm sees its own heads only. The norm runs on DTensors (``NormOnShards``): its
input is declared sharded over the heads (dim -2) or over the projection's width (dim -1), and its weight is
- ``head_norm``: one weight over head_dim shared by all heads: replicated; its gradient comes out partial (each
  rank's heads) and DTensor sums it over the tensor group (transformers calls this replicated_with_grad_allreduce);
- ``head_norm_split``: one weight row per head (Cohere: [heads, head_dim]): split by head like the projection;
- ``width_norm_split``: one norm over all heads' width (OLMo2): weight split like the projection, and the mean
  over the width is reduced over the group by DTensor (an all-reduce of one value per token).
- ``head_norm_list``: one norm module per head (StableLM's qk_layernorm, heads on dim 1): kept whole; the heads are
  gathered, every head normalised by its own norm, the rank's heads taken back, and the output's gradient summed
  over the group first (each rank's norms then get the gradient of every head, like a replicated layer).

Fused q|k|v projections kept in the user's row order:
- per-head blocks (GPT-BigCode: [q_i k_i v_i] per head; Falcon: the same, or one [q.. k v] block per key/value
  head in its new architecture): a plain colwise split gives each rank whole blocks; the head counts become local.
- one key/value head (multi-query: Falcon multi_query, GPT-BigCode multi_query) or fewer key/value groups than
  ranks: the fused layer stays whole on every rank (like the separate k_proj / v_proj of grouped-query attention)
  and each rank takes its query heads' columns and their key/value head from the output; the output's gradient is
  summed over the group first, so every rank's copy gets the whole layer's gradient.
Falcon with ALiBi keeps its attention whole (ALiBi's slopes are built for all heads outside the attention).

Learned scalars between a block's split layers (Apertus' XIELU activation) see the rank's shard of the hidden
width: replicated, their partial gradient summed over the group (``replicated_with_grad_allreduce``).
With key/value heads replicated over the ranks (fewer than the tensor size), a key norm over all of them (one row
per head, or the whole width) stays whole too, and the rank's head is taken from the norm's output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

NORM_STYLES = ("head_norm", "head_norm_split", "width_norm_split", "head_norm_list", "replicated_with_grad_allreduce")
# Norm children of an attention, by the names transformers gives them.
_Q_NORMS, _K_NORMS = ("q_norm", "q_layernorm", "query_layernorm"), ("k_norm", "k_layernorm", "key_layernorm")


class SumGradOverTensor(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the tensor group (Megatron's copy-to-region). On the
    output of a layer kept whole: each rank's gradient comes from its own heads only."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


@dataclass
class OwnColumns:
    """A fused layer kept whole; each rank uses the output columns ``columns(rank)``; ``attrs``: the attention's
    attributes set to this rank's counts."""

    layer: str
    columns: Callable[[int], list[int]]
    attrs: dict[str, int]


@dataclass
class LayoutMatch:
    styles: dict[str, str] = field(default_factory=dict)
    attention: str | None = None  # its attributes ``widths`` are divided by the tensor size
    widths: tuple[str, ...] = ()
    own_columns: dict[str, OwnColumns] = field(default_factory=dict)  # attention name -> kept-whole fused layer
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _linear(module: nn.Module, name: str) -> nn.Linear | None:
    child = module._modules.get(name)  # the module tree, not getattr (a pipeline stand-in's meta copy)
    return child if isinstance(child, nn.Linear) else None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _sizes(heads: int, kv_heads: int) -> list[int]:
    return [t for t in range(2, heads + 1) if heads % t == 0 and (kv_heads % t == 0 or t % kv_heads == 0)]


def match_layout(name: str, module: nn.Module, t: int) -> LayoutMatch | None:
    """What to split in ``module`` if it is a Falcon or GPT-BigCode attention (fused q|k|v projections)."""
    if _linear(module, "query_key_value") and _linear(module, "dense") and hasattr(module, "new_decoder_architecture"):
        return _falcon(name, module, t)
    if _linear(module, "c_attn") and _linear(module, "c_proj") and hasattr(module, "multi_query"):
        return _bigcode(name, module, t)
    return None


def fused_kv_layer(module: nn.Module) -> tuple[int, nn.Module] | None:
    """For the cost model: (key/value heads, the fused q|k|v layer) of a Falcon or GPT-BigCode attention; the layer
    stays whole on every rank at a tensor size above that head count (multi-query: any)."""
    if _linear(module, "query_key_value") and _linear(module, "dense") and hasattr(module, "new_decoder_architecture"):
        new, multi_query = bool(module.new_decoder_architecture), bool(module.multi_query)
        return (int(module.num_kv_heads) if (new or not multi_query) else 1), module.query_key_value
    if _linear(module, "c_attn") and _linear(module, "c_proj") and hasattr(module, "multi_query"):
        return (1 if module.multi_query else int(module.num_heads)), module.c_attn
    return None


def _refuse_heads(name: str, heads: int, kv_heads: int, t: int) -> list[str]:
    if heads % t:
        return [f"{name}: {heads} attention heads do not divide over tensor size {t}; use a tensor size that "
                f"divides {heads}"]
    if kv_heads % t and t % kv_heads:
        return [f"{name}: {kv_heads} key/value heads do not divide over tensor size {t}, and {t} is not a multiple of "
                f"{kv_heads}; use a tensor size among {_sizes(heads, kv_heads)} for {heads} query heads"]
    return []


def _falcon(name: str, module: nn.Module, t: int) -> LayoutMatch:
    qkv, dense = _join(name, "query_key_value"), _join(name, "dense")
    config = getattr(module, "config", None)
    if getattr(config, "alibi", False):
        return LayoutMatch(notes=[f"{name}: kept whole (ALiBi's slopes are built for all heads outside the "
                                  "attention)"])
    heads, d = int(module.num_heads), int(module.head_dim)
    new, multi_query = bool(module.new_decoder_architecture), bool(module.multi_query)
    kv = int(module.num_kv_heads) if (new or not multi_query) else 1
    match = LayoutMatch(styles={dense: "rowwise"}, problems=_refuse_heads(name, heads, kv, t))
    if match.problems:
        return match
    if kv % t == 0:  # whole per-head (or per key/value group) blocks on each rank: the user's order, split plainly
        match.styles[qkv] = "colwise"
        match.attention, match.widths = name, ("num_heads", "num_kv_heads")
        return match
    per_rank, group = heads // t, heads // kv
    if new:  # one block [q_0 .. q_{n-1} k v] per key/value head, n = heads / kv
        def columns(rank: int) -> list[int]:
            g = rank // (t // kv)
            base = g * (group + 2) * d
            first = rank * per_rank - g * group  # this rank's first query head within its group
            rows = [base + (first + j) * d + c for j in range(per_rank) for c in range(d)]
            return rows + [base + (group + i) * d + c for i in (0, 1) for c in range(d)]
        attrs = {"num_heads": per_rank, "num_kv_heads": 1}
    else:  # multi-query: [q_0 .. q_{h-1} | k | v]
        def columns(rank: int) -> list[int]:
            return list(range(rank * per_rank * d, (rank + 1) * per_rank * d)) + list(range(heads * d, (heads + 2) * d))
        attrs = {"num_heads": per_rank}
    match.own_columns[name] = OwnColumns(qkv, columns, attrs)
    return match


def _bigcode(name: str, module: nn.Module, t: int) -> LayoutMatch:
    attn, proj = _join(name, "c_attn"), _join(name, "c_proj")
    if getattr(module, "is_cross_attention", False):
        return LayoutMatch(problems=[f"{name}: cross-attention (q_attn and c_attn) is not split yet; leave "
                                     "tensor_parallel out for this model"])
    heads, d = int(module.num_heads), int(module.head_dim)
    kv = 1 if module.multi_query else heads
    match = LayoutMatch(styles={proj: "rowwise"}, problems=_refuse_heads(name, heads, kv, t))
    if match.problems:
        return match
    if not module.multi_query:  # [q_i k_i v_i] per head
        match.styles[attn] = "colwise"
        match.attention, match.widths = name, ("num_heads",)
        return match
    per_rank, embed = heads // t, int(module.embed_dim)

    def columns(rank: int) -> list[int]:
        return list(range(rank * per_rank * d, (rank + 1) * per_rank * d)) + list(range(embed, embed + 2 * d))

    # embed_dim: the query part's width in its split; num_key_value_groups: query heads per key/value head
    attrs = {"num_heads": per_rank, "embed_dim": embed // t, "num_key_value_groups": per_rank}
    match.own_columns[name] = OwnColumns(attn, columns, attrs)
    return match


def local_inputs(module: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook for a layer kept whole: DTensor inputs (under sequence_parallel the attention's input is
    gathered as a replicated DTensor) handed to it as the local, whole tensor."""
    from torch.distributed.tensor import DTensor

    return tuple(a.to_local() if isinstance(a, DTensor) else a for a in args)


def keep_own_columns(attention: nn.Module, spec: OwnColumns, rank: int, group: Any) -> None:
    """The fused layer stays whole; this rank takes its columns of the output (gradient summed over the group)."""
    layer = attention.get_submodule(spec.layer.rpartition(".")[2])
    index = torch.tensor(spec.columns(rank), dtype=torch.long, device=layer.weight.device)

    def own(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return SumGradOverTensor.apply(output, group).index_select(-1, index)

    layer.register_forward_pre_hook(local_inputs)
    layer.register_forward_hook(own)
    for attr, value in spec.attrs.items():
        setattr(attention, attr, value)


# ----- per-head query/key norms ---------------------------------------------------------------------------
def _norm_child(module: nn.Module, names: tuple[str, ...]) -> tuple[str, nn.Module] | None:
    for name in names:
        child = module._modules.get(name)
        if isinstance(child, nn.Module) and next(child.parameters(), None) is not None:
            return name, child
    return None


def _norm_style(norm: nn.Module, heads: int, head_dim: int, width: int) -> str | None:
    """The style of a query/key norm applied to ``heads`` heads of ``head_dim`` (``width``: the projection's
    output width), from its parameters' shapes; None where they fit none of the layouts."""
    shapes = {tuple(p.shape) for p in norm.parameters(recurse=False)}
    lists = [c for c in norm.children() if isinstance(c, nn.ModuleList)]
    if not shapes and len(lists) == 1 and len(lists[0]) == heads \
            and {tuple(p.shape) for p in lists[0].parameters()} == {(head_dim,)}:
        return "head_norm_list"  # StableLM: one norm module per head
    if not shapes or any(True for _ in norm.children()):
        return None
    if shapes == {(head_dim,)}:
        return "head_norm"
    if shapes == {(heads, head_dim)} and heads > 1:
        return "head_norm_split"
    if shapes == {(width,)}:
        return "width_norm_split"
    return None


def head_norm_styles(model: nn.Module, styles: dict[str, str], replicated_kv: list[str],
                     head_count: Callable[[nn.Module], tuple[int, int] | None],
                     ) -> tuple[dict[str, str], dict[str, tuple[str, str]], list[str]]:
    """Styles for the query/key norms of attentions whose q_proj / k_proj the plan splits by head (plain colwise);
    the key norms kept whole where the key/value heads are replicated (attention -> (norm child, its style): the
    rank's head is taken from the norm's output, not from k_proj's); problems for norms that cannot follow.
    ``head_count(attention)``: (key/value heads, query heads)."""
    found: dict[str, str] = {}
    whole_k: dict[str, tuple[str, str]] = {}
    problems: list[str] = []
    for name, module in model.named_modules():
        counts = head_count(module)
        if counts is None:
            continue
        kv_heads, heads = counts
        head_dim = int(module.head_dim)
        for proj, names, count in (("q_proj", _Q_NORMS, heads), ("k_proj", _K_NORMS, kv_heads)):
            norm = _norm_child(module, names)
            proj_name = _join(name, proj)
            if norm is None:
                continue
            norm_name = _join(name, norm[0])
            if styles.get(proj_name) not in ("colwise", "local_colwise"):
                if proj == "k_proj" and name in replicated_kv:  # one key/value head per rank
                    style = _norm_style(norm[1], count, head_dim, count * head_dim)
                    if style == "head_norm":
                        found[norm_name] = style
                    elif style in ("head_norm_split", "width_norm_split"):  # needs every head: whole, sliced after
                        whole_k[name] = (norm[0], style)
                    else:
                        problems.append(_replicated_norm_problem(norm_name, kv_heads))
                else:
                    styles.pop(norm_name, None)  # the projection is not split by head: its norm sees all heads
                continue
            style = _norm_style(norm[1], count, head_dim, count * head_dim)
            if style is None:
                problems.append(f"{norm_name}: a norm ({type(norm[1]).__name__}) of parameter shapes "
                                f"{sorted({tuple(p.shape) for p in norm[1].parameters()})} on {count} heads of "
                                f"{head_dim} has no known split (per head: ({head_dim},) or ({count}, {head_dim}); "
                                f"whole width: ({count * head_dim},)); leave {proj} out of the plan "
                                f"(e.g. plan {{'*.{proj}': 'colwise_gather_output'}}) or give the norm a style")
                continue
            found[norm_name] = style
    return found, whole_k, problems


def elementwise_styles(model: nn.Module, styles: dict[str, str]) -> dict[str, str]:
    """Parameter-holding activations between a block's column- and row-split layers (Apertus' XIELU: learned
    scalars) see the rank's shard of the hidden width: ``head_norm`` (replicated, the partial gradient summed over
    the group; DTensor applies scalars to any sharded input). Only modules whose parameters are all scalars."""
    found = {}
    for name, module in model.named_modules():
        children = {n: c for n, c in module.named_children()}
        split = [styles.get(_join(name, n)) for n in children]
        if "colwise" not in split or "rowwise" not in split:
            continue
        for child, sub in children.items():
            params = list(sub.parameters(recurse=False))
            if _join(name, child) not in styles and params and all(p.numel() == 1 for p in params) \
                    and not any(True for _ in sub.children()):
                found[_join(name, child)] = "replicated_with_grad_allreduce"
    return found


def _replicated_norm_problem(norm_name: str, kv_heads: int) -> str:
    return (f"{norm_name}: a key norm of no known layout on {kv_heads} key/value heads fewer than the ranks "
            f"(replicated, one per rank): not split yet; use a tensor size that divides {kv_heads}")


class NormOnShards(ParallelStyle):
    """A norm that runs on this rank's part of a tensor: the input is taken as a DTensor sharded on ``dim`` (no
    communication), parameters are split on dim 0 (``shard``) or replicated, the output is handed back local.
    DTensor reduces what crosses ranks: a replicated weight's partial gradient (summed over the group), a mean over
    a sharded width."""

    def __init__(self, dim: int, shard: bool) -> None:
        super().__init__()
        self.dim, self.shard = dim, shard

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

        placement = Shard(0) if self.shard else Replicate()

        def partition(name: str, mod: nn.Module, mesh: Any) -> None:
            for key, param in list(mod.named_parameters(recurse=False)):
                value = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=self.src_data_rank)
                mod.register_parameter(key, nn.Parameter(value, requires_grad=param.requires_grad))
            for key, buffer in list(mod.named_buffers(recurse=False)):  # constants (XIELU's beta): the same everywhere
                if buffer is not None:
                    mod.register_buffer(key, DTensor.from_local(buffer, mesh, [Replicate()], run_check=False))

        def inputs(mod: nn.Module, args: tuple, mesh: Any) -> tuple:
            return tuple(DTensor.from_local(a, mesh, [Shard(self.dim % a.dim())], run_check=False)
                         if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)

        def output(mod: nn.Module, out: Any, mesh: Any) -> Any:
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, partition, inputs, output)


class HeadNormList(ParallelStyle):
    """A module holding one norm per head (see head_norm_list in the module docstring); heads on ``dim``."""

    def __init__(self, dim: int = 1) -> None:
        super().__init__()
        self.dim = dim

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import DTensor, Shard

        group, rank, t = device_mesh.get_group(), device_mesh.get_local_rank(), device_mesh.size()

        def gather(mod: nn.Module, args: tuple) -> tuple:
            local = args[0]
            whole = DTensor.from_local(local, device_mesh, [Shard(self.dim)], run_check=False).full_tensor()
            return (whole, *args[1:])

        def own(mod: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            heads = output.shape[self.dim] // t
            return SumGradOverTensor.apply(output, group).narrow(self.dim, rank * heads, heads)

        module.register_forward_pre_hook(gather)
        module.register_forward_hook(own)
        return module


def norm_style(style: str) -> Any:
    """torch's ParallelStyle for a norm style name (NORM_STYLES)."""
    if style == "head_norm_list":
        return HeadNormList()
    if style in ("head_norm", "replicated_with_grad_allreduce"):
        return NormOnShards(-2, shard=False)
    return NormOnShards(-2 if style == "head_norm_split" else -1, shard=True)
