"""tensor_parallel's plan styles: transformers' style names mapped onto DTensor, and the model's own plan.

transformers ships tensor-parallel plans for many families (``config.base_model_tp_plan``; with the task
head, the model's ``_tp_plan``): module-name patterns mapped to style names. Each style name it uses is
mapped here onto torch's DTensor styles, with the layouts transformers gives it
(transformers/distributed/tensor_parallel.py):

- ``colwise`` / ``local_colwise``: output features split, output left sharded (feeds a ``rowwise``).
- ``rowwise``: input features split, input taken sharded, output all-reduced.
- ``colwise_gather_output`` / ``colwise_rep``: output features split, output gathered whole. For fused
  layers the model splits again after the call (Phi-3's ``qkv_proj`` and ``gate_up_proj``).
- ``rowwise_split_input`` / ``rowwise_rep``: the whole input is sliced here, output all-reduced.
- ``embedding_rowwise`` / ``embedding_colwise``: an embedding split over the vocabulary / the hidden size.
- ``replicate``: kept whole.
- ``replicated_with_grad_allreduce`` (query/key norms on the rank's heads) and atorch's ``head_norm``,
  ``head_norm_split``, ``width_norm_split``: norms running on the rank's heads (tp_layouts.py).
Others (expert-parallel, packed, sequence-parallel and local-output styles, whose communication happens
in another module of the plan) have no mapping and are refused by name.
"""

from __future__ import annotations

import fnmatch
import functools
from typing import Any

import torch
from torch import nn

from atorch.opt_lib.tp_layouts import NORM_STYLES, norm_style

COLWISE = ("colwise", "local_colwise", "colwise_gather_output", "colwise_rep", "embedding_colwise")
ROWWISE = ("rowwise", "rowwise_split_input", "rowwise_rep", "embedding_rowwise")
KEPT_WHOLE = ("replicate",)
KNOWN = COLWISE + ROWWISE + KEPT_WHOLE + NORM_STYLES
# A plain style and the gather-output style transformers uses where the model splits the output again.
GATHERED = {"colwise": "colwise_gather_output", "rowwise": "rowwise_split_input"}


def unknown_style(style: str) -> str | None:
    """Why ``style`` cannot be used, or None."""
    if style in KNOWN:
        return None
    return (f"tensor-parallel style {style!r} has no DTensor mapping in atorch (it is known: {', '.join(KNOWN)}); "
            "give an explicit plan with those styles, or leave the layer out")


def splits_output(style: str) -> bool:
    """A colwise style: the layer's output features are split (else its input features)."""
    return style in COLWISE


def parallel_style(style: str, sequence_parallel: bool) -> Any:
    """torch's ParallelStyle for a style name (``sequence_parallel``: row-wise outputs become sequence shards)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    if style in NORM_STYLES:
        return norm_style(style)
    if style in ("colwise", "local_colwise"):
        return ColwiseParallel()
    if style in ("colwise_gather_output", "colwise_rep", "embedding_colwise"):
        return ColwiseParallel(output_layouts=Replicate())
    whole_input = style in ("rowwise_split_input", "rowwise_rep", "embedding_rowwise")
    if sequence_parallel:
        return _rowwise()(input_layouts=Replicate() if whole_input else Shard(-1),
                          output_layouts=Shard(1), use_local_output=False)
    return _rowwise()(input_layouts=Replicate()) if whole_input else _rowwise()()


@functools.cache
def _rowwise() -> type:
    """RowwiseParallel whose local output is a tensor of its own, not a view of the DTensor's local tensor: models
    add into it in place (Falcon's parallel attention: ``mlp_output += attention_output``), which autograd refuses
    on a view made inside DTensor's to_local. One copy of the layer's output per call."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import RowwiseParallel

    class OwnOutputRowwise(RowwiseParallel):
        @staticmethod
        def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any,
                               device_mesh: Any) -> Any:
            out = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
            return out.clone() if isinstance(out, torch.Tensor) and not isinstance(out, DTensor) else out

    return OwnOutputRowwise


def _own_plan(model: nn.Module) -> dict[str, str]:
    """The plan transformers ships for this very module (names relative to it), or {}."""
    plan = getattr(model, "_tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if not isinstance(base, dict) or not base:
        return {}
    prefix = getattr(model, "base_model_prefix", "")
    inner = prefix and isinstance(getattr(model, prefix, None), nn.Module)
    return {f"{prefix}.{k}" if inner else k: v for k, v in base.items()}


def _carriers(model: nn.Module) -> list[tuple[str, nn.Module, dict[str, str]]]:
    """The outermost modules carrying a shipped plan: the model itself, or the transformers models held by
    its pipeline stages (each stage is a copy of the model)."""
    found: list[tuple[str, nn.Module, dict[str, str]]] = []
    for name, module in model.named_modules():
        if any(name == n or name.startswith(n + ".") for n, _, _ in found if n) or (found and not found[0][0]):
            continue
        plan = _own_plan(module)
        if plan:
            found.append((name, module, plan))
    return found


def model_plan(model: nn.Module) -> dict[str, str]:
    """The plan transformers ships for this model (full module-name patterns), or {} where there is none."""
    return {f"{name}.{k}" if name else k: v for name, _, plan in _carriers(model) for k, v in plan.items()}


def match(names: list[str], pattern: str) -> list[str]:
    """Module names a plan pattern names (fnmatch; transformers writes layer numbers as ``*``)."""
    return [n for n in names if fnmatch.fnmatchcase(n, pattern)]


def model_layer(model: nn.Module, getter: str) -> nn.Module | None:
    """What a transformers-style getter (``get_input_embeddings``...) returns, or None where the model has none:
    no such method, or one that refuses (transformers' vision models raise NotImplementedError)."""
    get = getattr(model, getter, None)
    if not callable(get):
        return None
    try:
        layer = get()
    except (NotImplementedError, AttributeError):
        return None
    return layer if isinstance(layer, nn.Module) else None


def vocabulary_layers(model: nn.Module) -> set[str]:
    """The token embedding and LM head by name: kept whole from a model's own plan (they are split over the
    vocabulary by the ``loss_parallel`` option, and a tied pair must stay one parameter)."""
    layers = []
    for carrier in [model] + [module for _, module, _ in _carriers(model)]:
        for getter in ("get_input_embeddings", "get_output_embeddings"):
            layers.append(model_layer(carrier, getter))
    return {n for n, m in model.named_modules() if any(m is layer for layer in layers if layer is not None)}


def gathered_where_model_says(styles: dict[str, str], shipped: dict[str, str]) -> dict[str, str]:
    """Layers the model's own plan gives a gather-output style (fused layers the model splits again) and the
    given plan the plain style: name -> the model's style (the plain style would give wrong numbers)."""
    names = list(styles)
    rewrite = {}
    for pattern, theirs in shipped.items():
        for name in match(names, pattern):
            if GATHERED.get(styles[name]) == theirs:
                rewrite[name] = theirs
    return rewrite
