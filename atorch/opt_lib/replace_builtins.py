"""The replacements module_replace ships, as plain functions over a model (registered in module_replace.py).

- ``conv1d_to_linear``: transformers' ``Conv1D`` (GPT-2 family) as an ``nn.Linear``, the same math.
- ``switch_to_sdpa``: transformers models built with eager attention switched to torch's
  ``scaled_dot_product_attention`` through transformers' own ``set_attn_implementation`` (every family that
  supports sdpa; on a GPU torch picks its flash or memory-efficient kernel).
- ``rms_norms_to_torch``: RMSNorm modules (Llama, Mistral, Qwen2, T5, ...) whose forward is torch's
  ``rms_norm`` (checked on numbers, once per class) as ``nn.RMSNorm``, sharing the old weight.

Each model-wide function returns ``Replaced``: how many it changed, and why not where it changed nothing.
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import torch
from torch import nn

SDPA = "sdpa"
_EPS_ATTRS = ("variance_epsilon", "eps")  # transformers' RMSNorms name it one way or the other


class Replaced(NamedTuple):
    count: int
    why_not: str | None = None  # with count 0: what made the pair inapplicable, for the log


def conv1d_to_linear(old: nn.Module) -> nn.Module:
    """transformers Conv1D stores weight as (in, out); nn.Linear as (out, in)."""
    in_features, out_features = old.weight.shape
    new = nn.Linear(in_features, out_features, bias=old.bias is not None,
                    device=old.weight.device, dtype=old.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(old.weight.t())
        if old.bias is not None:
            new.bias.copy_(old.bias)
    return new


# ----- attention: eager -> torch's scaled_dot_product_attention ---------------------------------------------------
def _hf_roots(model: nn.Module) -> list[Any]:
    """The outermost transformers models in ``model`` (the model itself, or ones the user's module wraps)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return []
    roots: list[Any] = []

    def visit(module: nn.Module) -> None:
        if isinstance(module, PreTrainedModel):
            roots.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return roots


def _implementations(root: Any) -> set[str]:
    """The attention implementations of a transformers model and of every sub-model in it (CLIP's text and
    vision towers have configs of their own)."""
    from transformers import PreTrainedModel

    return {m.config._attn_implementation for m in root.modules() if isinstance(m, PreTrainedModel)}


def switch_to_sdpa(model: nn.Module) -> Replaced:
    """Switch every transformers model in ``model`` that runs eager attention to sdpa, in place."""
    roots = _hf_roots(model)
    if not roots:
        return Replaced(0, "the model holds no transformers model (PreTrainedModel)")
    switched, why_not = 0, []
    for root in roots:
        name = type(root).__name__
        before = _implementations(root)
        if "eager" not in before:
            why_not.append(f"{name} uses {', '.join(sorted(before))} attention already")
            continue
        try:
            root.set_attn_implementation(SDPA)
        except (ValueError, ImportError) as err:  # transformers' own reason: the family has no sdpa path
            why_not.append(f"{name} cannot use sdpa: {str(err).split('. ')[0]}")
            continue
        if "eager" in _implementations(root):  # transformers warned and kept it: no attention interface
            why_not.append(f"{name} kept eager attention: its family is written without transformers' "
                           "attention interface, so transformers cannot switch it")
            continue
        switched += 1
    return Replaced(switched, "; ".join(why_not) or None)


# ----- RMSNorm -> torch's rms_norm -------------------------------------------------------------------------------
def _rms_norm_eps(module: nn.Module) -> float | None:
    for attr in _EPS_ATTRS:
        eps = getattr(module, attr, None)
        if isinstance(eps, float):
            return eps
    return None


def _rms_norm_candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules named like an RMSNorm, other than torch's own (the root is never replaced)."""
    return [(n, m) for n, m in model.named_modules()
            if n and type(m).__name__.endswith("RMSNorm") and not isinstance(m, nn.RMSNorm)]


def rms_norm_mismatch(module: nn.Module) -> str | None:
    """None if ``module`` computes torch's ``rms_norm(x, weight, eps)``, else why not. Checked on numbers in
    fp32 with a random weight, so a different formula (Gemma's ``x * (1 + weight)``) is caught; on real
    tensors even while the cost model traces the build on fake ones."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily  # torch has no public way out of fake mode

    with unset_fake_temporarily():
        return _probe(module)


def _probe(module: nn.Module) -> str | None:
    eps = _rms_norm_eps(module)
    params = dict(module.named_parameters())
    if eps is None:
        return f"no float {' or '.join(_EPS_ATTRS)} attribute"
    if set(params) != {"weight"} or params["weight"].dim() != 1 or list(module.buffers()):
        return "it holds tensors other than one weight vector"
    width = params["weight"].numel()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, width, generator=g)
    weight = torch.rand(width, generator=g) + 0.5
    probe = copy.copy(module)  # the module's own code and attributes, with a real weight of its own
    probe._parameters = {}  # (a shallow copy shares the parameter dict)
    probe.weight = nn.Parameter(weight)
    try:
        got = type(module).forward(probe, x)  # not through __call__: no hooks (the cost model's tracker has some)
    except Exception as err:  # the module's forward cannot run on the probe: it is not a plain RMSNorm
        return f"its forward failed on a probe ({type(err).__name__}: {err})"
    want = nn.functional.rms_norm(x, (width,), weight, eps)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return "its output is not a tensor of the input's shape"
    diff = (got.float() - want).abs().max().item()
    if diff > 1e-5 * want.abs().max().item():
        return f"its forward differs from torch's rms_norm (largest difference {diff:.3g})"
    return None


def rms_norms_to_torch(model: nn.Module) -> Replaced:
    """Replace, in place, every RMSNorm module whose forward is torch's rms_norm by ``nn.RMSNorm``."""
    candidates = _rms_norm_candidates(model)
    if not candidates:
        return Replaced(0, "no RMSNorm module in the model")
    verdicts: dict[type, str | None] = {}  # one probe per class
    for name, old in candidates:
        cls = type(old)
        if cls not in verdicts:
            verdicts[cls] = rms_norm_mismatch(old)
        if verdicts[cls] is not None:
            continue
        weight = old.weight
        new = nn.RMSNorm(weight.numel(), eps=_rms_norm_eps(old), device="meta")
        new.weight = weight  # the same parameter: names, sharing and the optimizer's view are unchanged
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    replaced = sum(1 for _, old in candidates if verdicts[type(old)] is None)
    kept = "; ".join(f"{cls.__name__} kept: {why}" for cls, why in verdicts.items() if why is not None)
    return Replaced(replaced, kept or None)


def holds_replaceable_rms_norm(model: nn.Module) -> bool:
    one_of_each_class = {type(m): m for _, m in _rms_norm_candidates(model)}
    return any(rms_norm_mismatch(m) is None for m in one_of_each_class.values())


def holds_eager_attention(model: nn.Module) -> bool:
    """Whether switch_to_sdpa would switch something (``_supports_sdpa``: transformers' per-family flag)."""
    return any("eager" in _implementations(root) and getattr(type(root), "_supports_sdpa", False)
               for root in _hf_roots(model))
