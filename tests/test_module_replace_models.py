"""module_replace on transformers families: eager attention becomes torch's scaled_dot_product_attention and
Llama-style RMSNorms become nn.RMSNorm, with the original's outputs and gradients; what it cannot replace is
named in the log with the reason; ATorch's pair names and config form are read as atorch's."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from transformers import (
    BertConfig,
    BertModel,
    BloomConfig,
    BloomForCausalLM,
    CLIPConfig,
    CLIPModel,
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    ViTConfig,
    ViTForImageClassification,
)

import atorch
from atorch.opt_lib.module_replace import replace_modules, replace_pairs

EAGER = {"attn_implementation": "eager"}
VOCAB, SEQ, IMAGE = 64, 16, 16
# Tolerance: a multiple of the dtype's machine epsilon, relative to the largest value of the reference output
# (of all the reference gradients, for gradients). Measured: at most 4 eps for these models in fp32 and bf16.
TOL_EPS = 16


def _tokens(g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=g)


def _images(g: torch.Generator) -> torch.Tensor:
    return torch.randn(2, 3, IMAGE, IMAGE, generator=g)


def bert() -> nn.Module:
    return BertModel(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0, **EAGER))


def gpt2() -> nn.Module:
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **EAGER))


def clip() -> nn.Module:
    return CLIPModel(CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=SEQ),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=IMAGE, patch_size=8),
        projection_dim=16, **EAGER))


def vit() -> nn.Module:
    return ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                               intermediate_size=64, image_size=IMAGE, patch_size=8, num_labels=4,
                                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **EAGER))


def llama() -> nn.Module:
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                        **EAGER))


# family: (model, input from a generator, the output compared)
FAMILIES: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], dict], Callable[[Any], Any]]] = {
    # right padding: the attention mask takes sdpa's masked path
    "bert": (bert, lambda g: {"input_ids": _tokens(g), "attention_mask": torch.tensor([[1] * SEQ, [1] * 10 + [0] * 6])},
             lambda out: out.last_hidden_state),
    "gpt2": (gpt2, lambda g: {"input_ids": _tokens(g)}, lambda out: out.logits),
    "clip": (clip, lambda g: {"input_ids": _tokens(g), "pixel_values": _images(g)}, lambda out: out.logits_per_image),
    "vit": (vit, lambda g: {"pixel_values": _images(g)}, lambda out: out.logits),
    "llama": (llama, lambda g: {"input_ids": _tokens(g)}, lambda out: out.logits),
}
FAST_PAIRS = ["hf_attention_sdpa", "rms_norm_fused"]  # GPT-2's Conv1D swap: test_module_replace.py


def _attention(model: nn.Module) -> set[str]:
    return {m.config._attn_implementation for m in model.modules() if isinstance(m, PreTrainedModel)}


def _run(model: nn.Module, data: dict, pick: Callable[[Any], Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = pick(model(**data))
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))  # every output element counts
    (out.float() * weights).sum().backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_attention_and_norms_are_torch_fused_with_the_original_numerics(family: str, dtype: torch.dtype) -> None:
    build, inputs, pick = FAMILIES[family]
    torch.manual_seed(0)
    original = build().to(dtype)
    assert _attention(original) == {"eager"}
    replaced = copy.deepcopy(original)
    rms_norms = [n for n, m in original.named_modules() if type(m).__name__ == "LlamaRMSNorm"]

    counts = replace_modules(replaced, [replace_pairs()[n] for n in FAST_PAIRS], dtype)

    assert _attention(replaced) == {"sdpa"}  # CLIP: its text and vision towers too
    assert counts == {"hf_attention_sdpa": 1, "rms_norm_fused": len(rms_norms)}
    assert len(rms_norms) == (5 if family == "llama" else 0)  # 2 per layer and the final one
    assert all(type(replaced.get_submodule(n)) is nn.RMSNorm for n in rms_norms)
    data = inputs(torch.Generator().manual_seed(1))
    want, want_grads = _run(original, data, pick)
    got, got_grads = _run(replaced, data, pick)

    tol = TOL_EPS * torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=tol * want.float().abs().max().item())
    assert got_grads.keys() == want_grads.keys()
    scale = max(g.float().abs().max().item() for g in want_grads.values())
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name].float(), grad.float(), rtol=0, atol=tol * scale,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_auto_accelerate_replaces_on_its_copy_and_names_every_pair(atorch_log) -> None:
    model = llama()
    _, result, _ = atorch.auto_accelerate(
        model, torch.optim.SGD, [{"input_ids": t} for t in _tokens(torch.Generator().manual_seed(1))],
        lambda data, out: out.logits.float().mean(), model_input_format="unpack_dict", optim_args={"lr": 0.1},
        dataloader_args={"batch_size": 2}, load_strategy=["module_replace"])
    assert _attention(result.model) == {"sdpa"} and _attention(model) == {"eager"}  # the user's model as it was
    assert sum(type(m) is nn.RMSNorm for m in result.model.modules()) == 5
    assert not any(type(m) is nn.RMSNorm for m in model.modules())
    messages = [r.getMessage() for r in atorch_log.records]
    assert "module_replace: hf_attention_sdpa replaced 1 × transformers model(s) with eager attention (-> sdpa)" \
        in messages
    assert "module_replace: rms_norm_fused replaced 5 × RMSNorm module(s) computing torch's rms_norm " \
           "(-> nn.RMSNorm)" in messages
    # the pair with nothing to do here is named too (all pairs by default: for information)
    assert "module_replace: hf_conv1d_to_linear not applied: no transformers.pytorch_utils.Conv1D module in " \
           "the model" in messages


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "module_replace" in r.name]


def test_inapplicable_pairs_are_named_with_the_reason(atorch_log) -> None:
    gemma = GemmaForCausalLM(GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    bloom = BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=2))
    pairs = [replace_pairs()[n] for n in FAST_PAIRS]

    assert replace_modules(gemma, pairs) == {"hf_attention_sdpa": 0, "rms_norm_fused": 0}
    assert replace_modules(bloom, pairs) == {"hf_attention_sdpa": 0, "rms_norm_fused": 0}
    assert replace_modules(nn.Linear(4, 4), pairs[:1]) == {"hf_attention_sdpa": 0}
    assert _warnings(atorch_log) == [
        "module_replace: hf_attention_sdpa not applied: GemmaForCausalLM uses sdpa attention already",
        # Gemma's RMSNorm computes x * (1 + weight): not torch's rms_norm, kept
        "module_replace: rms_norm_fused not applied: GemmaRMSNorm kept: its forward differs from torch's rms_norm "
        "(largest difference 3.14)",
        "module_replace: hf_attention_sdpa not applied: BloomForCausalLM kept eager attention: its family is written "
        "without transformers' attention interface, so transformers cannot switch it",
        "module_replace: rms_norm_fused not applied: no RMSNorm module in the model",
        "module_replace: hf_attention_sdpa not applied: the model holds no transformers model (PreTrainedModel)",
    ]
    assert all(type(m).__name__ == "GemmaRMSNorm" for m in gemma.modules() if "RMSNorm" in type(m).__name__)


@pytest.mark.parametrize("config", [
    {"pairs": ["HF_GPT2Attention_FA", "LayerNorm_Apex"]},
    {"HF_GPT2Attention_FA": None, "LayerNorm_Apex": None, "verbose": True},  # ATorch's own config form
])
def test_atorch_pair_names_are_read_as_atorchs(config, atorch_log) -> None:
    from toy_models import TokenDataset, gpt2_loss

    model = gpt2()
    _, result, strategy = atorch.auto_accelerate(
        model, torch.optim.SGD, TokenDataset(samples=2, vocab=VOCAB, seq_len=SEQ), gpt2_loss,
        model_input_format="unpack_dict", optim_args={"lr": 0.1}, dataloader_args={"batch_size": 2},
        load_strategy=[("module_replace", config)])
    assert strategy.get("module_replace").pairs == ("HF_GPT2Attention_FA", "LayerNorm_Apex")
    assert _attention(result.model) == {"sdpa"}
    messages = [r.getMessage() for r in atorch_log.records]
    assert any(m.startswith("module_replace: ATorch's HF_GPT2Attention_FA is hf_attention_sdpa here") for m in messages)
    assert "module_replace: ATorch's LayerNorm_Apex has nothing to do here: torch's nn.LayerNorm is a fused kernel " \
           "already" in messages


def test_atorch_per_pair_settings_are_refused_with_where_they_go() -> None:
    with pytest.raises(atorch.StrategyError, match=r"register_replace_pair\(kwargs=\.\.\.\)"):
        atorch.Strategy.load([("module_replace", {"HF_GPT2Attention_FA": {"need_src_module": True}})])


def test_the_bench_runs_and_compares_the_same_model(monkeypatch) -> None:
    """bench/module_replace.py at a tiny size: both variants train, from the same loss."""
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    sys.modules.pop("module_replace", None)
    import module_replace as bench

    [result] = bench.main(["--models", "llama", "--seq-len", "16", "--hidden", "32", "--vocab", str(VOCAB),
                           "--repeats", "2", "--warmup", "1", "--device", "cpu"])
    assert result["replaced"] == "hf_attention_sdpa 1, rms_norm_fused 5"
    assert result["original_s"]["count"] == result["replaced_s"]["count"] == 2
    assert result["first_loss_diff"] < 1e-5 * result["first_loss"]


def test_norms_are_checked_on_real_numbers_while_the_cost_model_traces_on_fake_tensors() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):  # as atorch.strategy_search.costing.tracing builds a candidate
        model = llama()
        assert replace_modules(model, [replace_pairs()["rms_norm_fused"]]) == {"rms_norm_fused": 5}


def test_the_search_offers_module_replace_where_a_pair_would_change_the_model() -> None:
    from atorch.opt_lib import get_method

    method = get_method("module_replace")
    sdpa_bert = BertModel(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=64))
    gemma = GemmaForCausalLM(GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    assert method.searchable(bert()) and method.searchable(vit()) and method.searchable(llama())
    assert not method.searchable(sdpa_bert)  # sdpa already, LayerNorm is torch's: nothing to replace
    assert not method.searchable(gemma)  # sdpa already, and its RMSNorm is not torch's
