"""The transformer shape ``atorch plan`` plans for: a built-in architecture, a transformers config, or a module.

``resolve_model(spec, seq)`` takes what the user typed:

* a built-in name (``BUILTIN``: GPT-3 175B and Llama-2 / Llama-3 with their published sizes; spaces, dashes,
  dots and case do not matter: ``"Llama-2 70B"`` is ``llama2-70b``);
* a path to a transformers ``config.json`` (GPT-2 and Llama-style keys);
* ``module:function`` returning an ``nn.Module`` (built on the meta device: nothing is allocated): its
  transformers ``config`` where it has one, else sizes read off its modules (the repeated blocks, the
  largest embedding, the blocks' linear layers).

and returns the ``TransformerShape`` the cost model's transformer terms read, plus the ``ModelStats`` that
``plan_terms.predict_transformer`` takes with it (parameter bytes and FLOPs of the same shape).
"""

from __future__ import annotations

import functools
import importlib
import json
import re
from pathlib import Path
from typing import Any

from atorch.errors import SetupError
from atorch.strategy_search.cluster.plan_terms import TransformerShape
from atorch.strategy_search.costing.analyser import BlockStats, ModelStats

# Published sizes: GPT-3 (Brown et al. 2020, Table 2.1), Llama 2 (Touvron et al. 2023, and the released
# config.json files), Llama 3 / 3.1 (Meta's model cards and config.json files).
_LLAMA2 = {"vocab": 32000, "gated_mlp": True}
_LLAMA3 = {"vocab": 128256, "gated_mlp": True, "kv_heads": 8}
BUILTIN: dict[str, dict[str, Any]] = {
    "gpt3-175b": {"layers": 96, "hidden": 12288, "heads": 96, "kv_heads": 96, "ffn": 4 * 12288, "vocab": 50257,
                  "position_embeddings": 2048, "tied_embeddings": True, "biases": True},
    "llama2-7b": {**_LLAMA2, "layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 32, "ffn": 11008},
    "llama2-13b": {**_LLAMA2, "layers": 40, "hidden": 5120, "heads": 40, "kv_heads": 40, "ffn": 13824},
    "llama2-70b": {**_LLAMA2, "layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672},
    "llama3-8b": {**_LLAMA3, "layers": 32, "hidden": 4096, "heads": 32, "ffn": 14336},
    "llama3-70b": {**_LLAMA3, "layers": 80, "hidden": 8192, "heads": 64, "ffn": 28672},
    "llama3-405b": {**_LLAMA3, "layers": 126, "hidden": 16384, "heads": 128, "ffn": 53248},
    # Mixture of experts: Mixtral 8x7B (its released config.json) and DeepSeek-V3 (DeepSeek-AI 2024, arXiv
    # 2412.19437, section 4.2, and its config.json; MLA's projections: q 1536, kv 512 ranks, head sizes 192 / 128;
    # the multi-token-prediction module is left out)
    "mixtral-8x7b": {**_LLAMA2, "layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336,
                     "experts": 8, "top_k": 2, "expert_ffn": 14336},
    # Qwen3-30B-A3B (its released config.json: head size 128 with 32 query and 4 key-value heads)
    "qwen3-30b-a3b": {"vocab": 151936, "gated_mlp": True, "layers": 48, "hidden": 2048, "heads": 32, "kv_heads": 4,
                      "ffn": 6144, "experts": 128, "top_k": 8, "expert_ffn": 768, "qk_head_dim": 128,
                      "v_head_dim": 128, "attention_params": 2 * 2048 * 32 * 128 + 2 * 2048 * 4 * 128},
    "deepseek-v3": {"vocab": 129280, "gated_mlp": True, "layers": 61, "hidden": 7168, "heads": 128, "kv_heads": 128,
                    "ffn": 18432, "experts": 256, "top_k": 8, "expert_ffn": 2048, "shared_experts": 1,
                    "dense_layers": 3, "routing_node_limit": 4, "recompute_norms": True, "qk_head_dim": 192,
                    "v_head_dim": 128,
                    "attention_params": 7168 * 1536 + 1536 * 128 * 192 + 7168 * (512 + 64) + 512 * 128 * (128 + 128)
                    + 128 * 128 * 7168},
}


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def builtin_names() -> list[str]:
    return list(BUILTIN)


def shape_from_config(config: dict[str, Any], seq: int) -> TransformerShape:
    """A transformers config (as a dict) -> its shape. GPT-2 keys (n_embd, n_layer, n_head, n_inner) and
    Llama / Mistral / Qwen keys (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
    intermediate_size) are read."""
    def get(*names: str, default: Any = None) -> Any:
        for name in names:
            if config.get(name) is not None:
                return config[name]
        return default

    hidden, layers = get("hidden_size", "n_embd", "d_model"), get("num_hidden_layers", "n_layer", "num_layers")
    heads = get("num_attention_heads", "n_head", "num_heads")
    missing = [n for n, v in (("hidden_size", hidden), ("num_hidden_layers", layers),
                              ("num_attention_heads", heads), ("vocab_size", config.get("vocab_size"))) if v is None]
    if missing:
        raise SetupError([f"the config has no {', '.join(missing)}: a decoder-only transformer config is needed "
                          "(GPT-2 or Llama-style keys)"])
    gpt2 = "n_embd" in config or config.get("model_type") in ("gpt2", "gpt_neo", "gptj")
    act = str(get("hidden_act", "activation_function", default="gelu"))
    return TransformerShape(**_moe_fields(config, int(hidden), int(heads)),
        layers=int(layers), hidden=int(hidden), heads=int(heads),
        kv_heads=int(get("num_key_value_heads", default=heads)),
        ffn=int(get("intermediate_size", "n_inner", "ffn_dim", default=None) or 4 * hidden),
        vocab=int(config["vocab_size"]), seq=seq,
        gated_mlp=not gpt2 and act in ("silu", "swiglu", "swish"),
        tied_embeddings=bool(get("tie_word_embeddings", default=gpt2)),
        position_embeddings=int(get("n_positions", default=0)) if gpt2 else 0,
        biases=gpt2,
    )


def _moe_fields(config: dict[str, Any], hidden: int, heads: int) -> dict[str, Any]:
    """A mixture-of-experts config's fields (Mixtral / Qwen-MoE: num_local_experts or num_experts; DeepSeek:
    n_routed_experts, n_shared_experts, first_k_dense_replace and MLA's ranks and head sizes); {} for a dense one."""
    experts = config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts")
    fields: dict[str, Any] = {}
    if config.get("kv_lora_rank"):  # MLA: low-rank query and key-value projections
        nope, rope, v = (int(config.get(k) or 0) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        q_rank, kv_rank = int(config.get("q_lora_rank") or 0), int(config["kv_lora_rank"])
        q = hidden * q_rank + q_rank * heads * (nope + rope) if q_rank else hidden * heads * (nope + rope)
        kv = hidden * (kv_rank + rope) + kv_rank * heads * (nope + v)
        fields.update(qk_head_dim=nope + rope, v_head_dim=v, attention_params=q + kv + heads * v * hidden)
    head = int(config.get("head_dim") or 0)
    if head and head * heads != hidden and "attention_params" not in fields:  # heads wider than hidden / heads
        kv = int(config.get("num_key_value_heads") or heads)
        fields.update(qk_head_dim=head, v_head_dim=head,
                      attention_params=2 * hidden * heads * head + 2 * hidden * kv * head)
    if not experts:
        return fields
    top_k = config.get("num_experts_per_tok") or config.get("moe_topk") or config.get("top_k")
    if not top_k:
        raise SetupError(["the config names experts but not how many each token uses (num_experts_per_tok)"])
    width = config.get("moe_intermediate_size") or config.get("intermediate_size") or 4 * hidden
    fields.update(experts=int(experts), top_k=int(top_k), expert_ffn=int(width),
                  shared_experts=int(config.get("n_shared_experts") or 0),
                  dense_layers=int(config.get("first_k_dense_replace") or 0))
    return fields


def _shape_from_module(module: Any, seq: int) -> TransformerShape:
    """Sizes read off a module without a config: the repeated blocks, the largest embedding (vocabulary ×
    hidden), the blocks' linear layers (the widest output that is not the hidden size is the MLP's)."""
    from torch import nn

    from atorch.opt_lib.pipeline_split import find_blocks

    blocks, why = find_blocks(module)
    if blocks is None:
        raise SetupError([f"cannot plan this module: {why}"])
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise SetupError(["cannot plan this module: it has no nn.Embedding (the token embedding gives the "
                          "vocabulary and hidden sizes); give a transformers config instead"])
    token = max(embeddings, key=lambda m: m.num_embeddings)
    hidden = token.embedding_dim
    first = module.get_submodule(f"{blocks.container}.{blocks.names[0]}" if blocks.container else blocks.names[0])
    widths = [m.out_features for m in first.modules() if isinstance(m, nn.Linear)]
    ffn = max((w for w in widths if w != hidden), default=4 * hidden)
    heads = next((int(getattr(m, a)) for m in first.modules() for a in ("num_heads", "n_head", "num_attention_heads")
                  if isinstance(getattr(m, a, None), int)), max(1, hidden // 64))
    gated = sum(1 for w in widths if w == ffn) >= 2
    return TransformerShape(layers=len(blocks.names), hidden=hidden, heads=heads, kv_heads=heads, ffn=ffn,
                            vocab=token.num_embeddings, seq=seq, gated_mlp=gated)


@functools.lru_cache(maxsize=4)  # resolve_model and analysed_stats both need it: the user's factory runs once
def _call_factory(spec: str) -> Any:
    module_name, _, function = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as exc:
        raise SetupError([f"cannot load {spec!r} ({exc}): give module:function, importable from here"]) from exc
    model = factory()
    params = list(model.parameters())
    if any(not p.is_meta for p in params):
        raise SetupError([f"{spec} returned a module with real parameters: build it on the meta device "
                          "(`with torch.device('meta'): ...`) so a large model costs no memory"])
    return model


def resolve_model(spec: str, seq: int) -> tuple[str, TransformerShape]:
    """(a display name, the shape) of what the user named; SetupError naming the choices otherwise."""
    if _key(spec) in {_key(n) for n in BUILTIN}:
        name = next(n for n in BUILTIN if _key(n) == _key(spec))
        return name, TransformerShape(seq=seq, **{"kv_heads": BUILTIN[name]["heads"], **BUILTIN[name]})
    path = Path(spec)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise SetupError([f"no config file {spec}"])
        return path.name, shape_from_config(json.loads(path.read_text()), seq)
    if re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", spec):
        model = _call_factory(spec)
        config = getattr(model, "config", None)
        if config is not None and callable(getattr(config, "to_dict", None)):
            return spec, shape_from_config(config.to_dict(), seq)
        return spec, _shape_from_module(model, seq)
    raise SetupError([f"unknown model {spec!r}: give a config.json path, module:function, or one of "
                      f"{builtin_names()}"])


def _transformers_model(spec: str) -> Any:
    """The transformers model ``spec`` names (a config.json, or module:function returning one), built on the meta
    device; None for a built-in architecture or a module without a transformers config."""
    import torch

    path = Path(spec)
    if path.suffix == ".json" or path.is_file():
        import transformers

        config = json.loads(path.read_text())
        model_type = config.pop("model_type", None)
        if model_type is None:
            return None
        try:
            cfg = transformers.AutoConfig.for_model(model_type, **config)
            with torch.device("meta"):
                return transformers.AutoModelForCausalLM.from_config(cfg)
        except (ValueError, KeyError, TypeError):  # a type transformers cannot build as a causal LM
            return None
    if re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", spec):
        model = _call_factory(spec)
        return model if callable(getattr(getattr(model, "config", None), "to_dict", None)) else None
    return None


def analysed_stats(spec: str, seq: int) -> ModelStats | None:
    """The analyser's statistics of the model ``spec`` names (built on the meta device, one sequence of ``seq``
    tokens as input and labels, the model's own loss): what the automatic search's cost model predicts from.
    None where there is no transformers model to build (a built-in architecture, a plain module)."""
    import torch

    from atorch.strategy_search.costing.analyser import analyse

    model = _transformers_model(spec)
    if model is None:
        return None
    tokens = torch.zeros(1, seq, dtype=torch.long)
    return analyse(model, {"input_ids": tokens, "labels": tokens}, "unpack_dict",
                   lambda data, output: output.loss)


def stats_of(shape: TransformerShape) -> ModelStats:
    """The ``ModelStats`` of a shape (fp32 as built, one sample of ``seq`` tokens): what ``predict`` reads
    besides the shape itself (parameter bytes, the repeated blocks)."""
    params = shape.params()
    layer = shape.layer_params()
    fwd = shape.seq * (shape.layers * shape.layer_fwd_flops() + shape.vocab_fwd_flops())
    block = BlockStats(class_path="transformer layer", count=shape.layers, param_bytes=4 * layer,
                       activation_bytes=0, param_bytes_total=4 * layer * shape.layers, activation_bytes_total=0,
                       attention=True)
    return ModelStats(
        fingerprint=f"shape:{shape.model_dump_json()}", batch_size=1, seq_len=shape.seq, param_count=params,
        trainable_param_count=params, param_bytes=4 * params, trainable_param_bytes=4 * params,
        frozen_param_bytes=0, grad_bytes=4 * params, buffer_bytes=0, fwd_flops_per_sample=fwd,
        fwd_bwd_flops_per_sample=3 * fwd, param_tensors=shape.layers * (9 if shape.gated_mlp else 8) + 3,
        activation_bytes=0, activation_bytes_outside_blocks=0, blocks=(block,), largest_layer=None,
        largest_activation=None,
        head_param_bytes=4 * (shape.vocab * shape.hidden + shape.hidden),  # the head (tied: the embedding), its norm
    )
