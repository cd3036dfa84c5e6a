"""The router's load-balancing loss across pipeline stages, in one process: the stages run one after the other, each
passing on its hidden states and its routing, and the last stage's loss and the routers' gradients are the whole
model's. The schedule over real processes is tested in test_expert_parallel.py."""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from atorch.opt_lib.pipeline_router import RouterCarry, router_loss_problem, statistics_match
from atorch.opt_lib.pipeline_split import StageModule, build_stage, find_units, plan_stages, split_setup_problems

# Every layer is computed in the same order as in the whole model; only the loss's reduction differs.
ATOL = 1e-6


def mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.1, use_cache=False))


def qwen2_moe_dense_first() -> nn.Module:
    """The first two layers dense: the first of two stages has no router."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
        shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0, 1],
        output_router_logits=True, router_aux_loss_coef=0.1, use_cache=False))


def olmoe() -> nn.Module:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(0)
    return OlmoeForCausalLM(OlmoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.1, use_cache=False, pad_token_id=0, eos_token_id=1, bos_token_id=2))


def gpt_oss() -> nn.Module:
    """Alternating sliding-window layers, a router with a bias, attention sinks."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    return GptOssForCausalLM(GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.1, use_cache=False))


def _batch(padded: bool) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, 4:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _stages(model: nn.Module, count: int, by_statistics: bool) -> list[StageModule]:
    blocks, why = find_units(model)
    assert blocks is not None, why
    stages = []
    for i, names in enumerate(plan_stages(model, blocks, count)):
        first, last = i == 0, i == count - 1
        stage = build_stage(model, blocks, names, first, last)
        stage.atorch_router = RouterCarry(model, stage)
        stage.atorch_router.by_statistics = by_statistics  # both ways are tested, whatever the probe finds
        stages.append(StageModule(stage, i, first, last, None, "unpack_dict"))
    return stages


def _router_grads(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    return {name: p.grad for module in modules for name, p in module.named_parameters()
            if "gate" in name and p.grad is not None}


@pytest.mark.parametrize("make", [mixtral, qwen2_moe_dense_first, olmoe, gpt_oss])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("by_statistics", [True, False])
def test_stages_compute_the_whole_model_s_router_loss(make: Any, padded: bool, by_statistics: bool) -> None:
    model = make()
    batch = _batch(padded)
    whole = model(**batch)
    whole.aux_loss.backward()
    expected = _router_grads([model])
    stages = _stages(model, 3 if make is mixtral else 2, by_statistics)
    assert stages[0].module.atorch_router.by_statistics is by_statistics
    passed: tuple[torch.Tensor, ...] = ()
    for stage in stages:
        passed = stage(*passed, **batch)
    logits, aux = passed
    assert torch.allclose(logits, whole.logits, atol=ATOL)
    assert aux.shape == (1,) and abs(aux.item() - whole.aux_loss.item()) <= ATOL, (aux, whole.aux_loss)
    aux.sum().backward()
    got = _router_grads([s.module for s in stages])
    assert sorted(got) == sorted(expected) and expected, "every router gets a gradient, on whichever stage it is"
    for name, grad in expected.items():
        assert torch.allclose(got[name], grad, atol=ATOL), name


def test_the_statistics_are_carried_where_the_family_s_function_is_that_statistic() -> None:
    """transformers' decoder families' functions are the statistic (2 × experts + 1 values cross each boundary);
    Switch Transformers' counts top-1 routing from its own argmax form: the router logits are carried instead."""
    model = mixtral()
    blocks = find_units(model)[0]
    assert blocks is not None
    stage = build_stage(model, blocks, plan_stages(model, blocks, 2)[0], True, False)
    assert RouterCarry(model, stage).by_statistics
    assert stage.config.output_router_logits is False and model.config.output_router_logits is True
    switch = importlib.import_module("transformers.models.switch_transformers.modeling_switch_transformers")
    assert not statistics_match(switch.load_balancing_loss_func, 4, 2)


def test_a_model_without_transformers_declarations_is_named() -> None:
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = type("Config", (), {"output_router_logits": True, "router_aux_loss_coef": 0.01})()

    why = router_loss_problem(Custom())
    assert why is not None and "Custom" in why and "load_balancing_loss_func" in why


def load_balancing_loss_func(gate_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                             attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The load-balancing function of ``OtherFamily`` (found in its class's module, as transformers' are): the mean
    squared router probability, which no sum of per-expert counts and probabilities gives."""
    probabilities = torch.cat([torch.softmax(layer, dim=-1) for layer in gate_logits])
    return (probabilities ** 2).mean() * num_experts


def other_family() -> nn.Module:
    from transformers import MixtralForCausalLM

    class OtherFamily(MixtralForCausalLM):
        pass

    OtherFamily.__module__ = __name__
    model = mixtral()
    other = OtherFamily(model.config)
    other.load_state_dict(model.state_dict())
    return other


def test_a_family_whose_function_is_another_statistic_passes_its_router_logits_on() -> None:
    model = other_family()
    batch = _batch(padded=True)
    whole = model(**batch)
    expected = load_balancing_loss_func(whole.router_logits, 4, 2, batch["attention_mask"])
    stages = _stages(model, 2, by_statistics=False)
    assert not RouterCarry(model, build_stage(model, find_units(model)[0], plan_stages(
        model, find_units(model)[0], 2)[0], True, False)).by_statistics, "the probe finds another statistic"
    hidden, carried = stages[0](**batch)
    assert carried.shape == (2, 12, 4), "layers so far × tokens × experts"
    _, aux = stages[1](hidden, carried, **batch)
    assert abs(aux.item() - expected.item()) <= ATOL


def _context(model: nn.Module, context: int) -> Any:
    return SimpleNamespace(model=model, setup=SimpleNamespace(loss_func=lambda data, output: output.loss,
                                                              optim_param_func=None),
                           layout=SimpleNamespace(size=lambda name: context if name == "context" else 1))


def test_where_the_router_loss_cannot_be_kept_the_refusal_names_why_and_the_fix() -> None:
    assert split_setup_problems(_context(mixtral(), 2), "pipeline_parallel", True) == []
    assert split_setup_problems(_context(other_family(), 1), "pipeline_parallel", True) == []
    (beside_context,) = split_setup_problems(_context(other_family(), 2), "pipeline_parallel", True)
    assert "OtherFamily's load_balancing_loss_func is not that statistic" in beside_context, beside_context
    (deepspeed,) = split_setup_problems(_context(mixtral(), 1), "ds_3d_parallel")
    for problem in (beside_context, deepspeed):
        assert "load-balancing loss" in problem and "output_router_logits = False" in problem, problem
