"""tensor_parallel plans for transformers encoder and encoder-decoder families (BERT, T5, BART).

Each rule looks at one module and returns what to split in it, or None. tensor_parallel.py calls
``match_family`` from its family plan for the modules no other rule took.

- BERT (BertAttention / BertLayer): self.query, self.key, self.value colwise, output.dense rowwise;
  intermediate.dense colwise, output.dense rowwise. num_attention_heads and all_head_size become per rank.
- T5 (T5Attention, self and cross): q, k, v colwise, o rowwise; the relative attention bias (an
  embedding with one column per head) colwise, so each rank adds the bias of its own heads;
  DenseReluDense wi (or gated wi_0, wi_1) colwise, wo rowwise. n_heads and inner_dim become per rank.
- BART (BartAttention, self and cross): q_proj, k_proj, v_proj colwise, out_proj rowwise; fc1 colwise,
  fc2 rowwise. num_heads and embed_dim become per rank.
Colwise splits a layer's output features in rank order, so rank r holds heads r·h/t ... (r+1)·h/t - 1 of
q, k and v (and of the bias columns) and the matching input rows of the rowwise projection.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


@dataclass
class FamilyMatch:
    styles: dict[str, str] = field(default_factory=dict)  # module name -> "colwise" / "rowwise"
    attention: str | None = None  # the module whose head-count and width attributes become per rank
    widths: tuple[str, ...] = ()  # those attributes (integers divided by the tensor size)
    problems: list[str] = field(default_factory=list)


def _linear(module: nn.Module, path: str) -> nn.Linear | None:
    # Children from the module tree, not getattr: a pipeline stage's StandIn reads missing attributes from its
    # meta copy of the layer it replaces, whose children are no modules of the stage (nothing there to split).
    for part in path.split("."):
        module = module._modules.get(part)
        if not isinstance(module, nn.Module):
            return None
    return module if isinstance(module, nn.Linear) else None


def _all(module: nn.Module, *paths: str) -> bool:
    return all(_linear(module, p) is not None for p in paths)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _heads_problem(name: str, heads: int, t: int) -> list[str]:
    if heads % t == 0:
        return []
    return [f"{name}: {heads} attention heads do not divide over tensor size {t}; "
            f"use a tensor size that divides {heads}"]


def _attention(name: str, module: nn.Module, cols: tuple[str, ...], row: str, head_attr: str,
               widths: tuple[str, ...], t: int, owner: str = "") -> FamilyMatch:
    styles = {_join(name, c): "colwise" for c in cols}
    styles[_join(name, row)] = "rowwise"
    attention = _join(name, owner) if owner else name
    heads = int(getattr(module.get_submodule(owner) if owner else module, head_attr))
    return FamilyMatch(styles, attention, widths, _heads_problem(attention, heads, t))


def _mlp(name: str, cols: tuple[str, ...], row: str) -> FamilyMatch:
    styles = {_join(name, c): "colwise" for c in cols}
    styles[_join(name, row)] = "rowwise"
    return FamilyMatch(styles)


def match_family(name: str, module: nn.Module, t: int) -> FamilyMatch | None:
    """What to split in ``module`` (named ``name``) if it is a BERT, T5 or BART attention or MLP."""
    # BERT: BertAttention holds the projections (self) and the output projection (output.dense).
    if _all(module, "self.query", "self.key", "self.value", "output.dense") \
            and hasattr(module.self, "num_attention_heads"):
        return _attention(name, module, ("self.query", "self.key", "self.value"), "output.dense",
                          "num_attention_heads", ("num_attention_heads", "all_head_size"), t, owner="self")
    if _all(module, "intermediate.dense", "output.dense"):  # BertLayer's MLP
        return _mlp(name, ("intermediate.dense",), "output.dense")
    # T5 attention (self and cross), with the relative attention bias where the layer has one.
    if _all(module, "q", "k", "v", "o") and hasattr(module, "n_heads"):
        match = _attention(name, module, ("q", "k", "v"), "o", "n_heads", ("n_heads", "inner_dim"), t)
        if isinstance(getattr(module, "relative_attention_bias", None), nn.Embedding):
            match.styles[_join(name, "relative_attention_bias")] = "colwise"
        return match
    if _all(module, "wi_0", "wi_1", "wo"):  # T5 gated MLP (T5DenseGatedActDense)
        return _mlp(name, ("wi_0", "wi_1"), "wo")
    if _all(module, "wi", "wo"):  # T5 MLP (T5DenseActDense)
        return _mlp(name, ("wi",), "wo")
    # BART attention (self and cross) and its layers' MLP.
    if _all(module, "q_proj", "k_proj", "v_proj", "out_proj") and hasattr(module, "num_heads"):
        return _attention(name, module, ("q_proj", "k_proj", "v_proj"), "out_proj", "num_heads",
                          ("num_heads", "embed_dim"), t)
    if _all(module, "fc1", "fc2") and module.fc1.out_features == module.fc2.in_features \
            and module.fc1.in_features != module.fc1.out_features:
        return _mlp(name, ("fc1",), "fc2")
    return None


def split_dims(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) as a colwise split sees them for a planned embedding (T5's relative attention bias:
    colwise splits its embedding dimension, one column per head)."""
    if isinstance(module, nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    return None


def local_widths(attention: nn.Module, widths: tuple[str, ...], t: int) -> None:
    """The attention's head count and width attributes become this rank's (T5 builds its zero position bias
    with n_heads; the others reshape with -1 but some code reads them)."""
    for attr in widths:
        value = getattr(attention, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(attention, attr, value // t)
