"""module_replace: the built-in Conv1D -> nn.Linear pair keeps GPT-2's numbers; user pairs are
applied (registered in atorch's form or ATorch's), skipped where they do not support the run's dtype, and
unknown pair names are refused. The attention and norm pairs: test_module_replace_models.py."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn
from toy_models import TokenDataset, gpt2_loss, tiny_gpt2
from transformers.pytorch_utils import Conv1D

import atorch
from atorch import Strategy, StrategyError
from atorch.model_context import call_model
from atorch.opt_lib import module_replace

FP32_TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def restore_pairs():
    """The pair registry is module-global: leave it as this test found it."""
    before = dict(module_replace._PAIRS)
    yield
    module_replace._PAIRS.clear()
    module_replace._PAIRS.update(before)


def test_builtin_pair_turns_gpt2_conv1d_into_linear_with_equal_numerics():
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    conv_names = [n for n, m in model.named_modules() if isinstance(m, Conv1D)]
    assert len(conv_names) == 8  # c_attn, attn.c_proj, c_fc, mlp.c_proj in each of 2 blocks

    _, result, strategy = atorch.auto_accelerate(
        model, torch.optim.SGD, TokenDataset(samples=4), gpt2_loss, model_input_format="unpack_dict",
        optim_args={"lr": 0.1}, dataloader_args={"batch_size": 4}, load_strategy=["module_replace"],
    )
    accelerated = result.model
    assert not any(isinstance(m, Conv1D) for m in accelerated.modules())
    for name in conv_names:
        assert type(accelerated.get_submodule(name)) is nn.Linear, name
    assert accelerated.transformer.wte.weight is accelerated.lm_head.weight  # weight tying survives

    data = result.prepare_input(next(iter(result.dataloader)))
    out = call_model(accelerated, data, "unpack_dict")
    ref_out = reference(**data)
    torch.testing.assert_close(out.logits, ref_out.logits, **FP32_TOL)
    gpt2_loss(data, out).backward()
    gpt2_loss(data, ref_out).backward()

    got = dict(accelerated.named_parameters())
    assert got.keys() == dict(reference.named_parameters()).keys()
    for name, ref_param in reference.named_parameters():
        module_name = name.rpartition(".")[0]
        grad = got[name].grad
        if module_name in conv_names and name.endswith(".weight"):
            grad = grad.t()  # Conv1D stores (in, out); nn.Linear (out, in)
        torch.testing.assert_close(grad, ref_param.grad, **FP32_TOL, msg=lambda m, n=name: f"{n}: {m}")


class Scale(nn.Module):
    """A user module to be replaced: multiplies by a learned vector."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class FusedScale(nn.Module):
    """Its replacement: same math, made from the old module by from_source."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))

    @classmethod
    def from_source(cls, old: Scale) -> FusedScale:
        new = cls(old.weight.numel())
        with torch.no_grad():
            new.weight.copy_(old.weight)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mul(x, self.weight)


class ScaledNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32)
        self.scales = nn.ModuleList(Scale(32) for _ in range(2))
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        x = self.inp(x)
        for scale in self.scales:
            x = scale(x)
        return self.out(x)


def scaled_result(load_strategy):
    data = torch.utils.data.TensorDataset(torch.randn(8, 16), torch.randint(0, 8, (8,)))
    model = ScaledNet()
    _, result, _ = atorch.auto_accelerate(
        model, torch.optim.SGD, data, lambda d, o: nn.functional.cross_entropy(o.float(), d[1]),
        model_input_format="unpack_sequence", optim_args={"lr": 0.1}, dataloader_args={"batch_size": 8},
        load_strategy=load_strategy,
    )
    return model, result


@pytest.mark.parametrize("pairs", [["user_scale"], None])
def test_user_pair_is_applied(restore_pairs, pairs):
    atorch.register_replace_pair("user_scale", supported_dtypes=(torch.float32,), pair_cls=(Scale, FusedScale))
    model, result = scaled_result([("module_replace", {"pairs": pairs})])
    assert [type(m) for m in result.model.scales] == [FusedScale, FusedScale]
    assert [type(m) for m in model.scales] == [Scale, Scale]  # the user's model keeps its modules
    x = torch.randn(4, 16)
    torch.testing.assert_close(result.model(x), model(x), rtol=0, atol=0)


def test_pair_is_skipped_when_it_does_not_support_the_dtype(restore_pairs, atorch_log):
    atorch.register_replace_pair("user_scale", supported_dtypes=(torch.float32,), pair_cls=(Scale, FusedScale))
    _, result = scaled_result([("half", "bf16"), ("module_replace", {"pairs": ["user_scale"]})])
    assert [type(m) for m in result.model.scales] == [Scale, Scale]
    assert result.model.scales[0].weight.dtype == torch.bfloat16
    messages = [r.getMessage() for r in atorch_log.records if r.levelno == logging.WARNING]
    assert "module_replace: user_scale skipped, it does not support torch.bfloat16" in messages

    # The same run with a pair that declares bf16 support replaces the modules.
    atorch.register_replace_pair("user_scale", supported_dtypes=(torch.bfloat16,), pair_cls=(Scale, FusedScale))
    _, result = scaled_result([("half", "bf16"), ("module_replace", {"pairs": ["user_scale"]})])
    assert [type(m) for m in result.model.scales] == [FusedScale, FusedScale]
    assert result.model.scales[0].weight.dtype == torch.bfloat16


def test_pair_given_by_class_name_and_build_function(restore_pairs):
    built = []

    def build(old: Scale) -> nn.Module:
        built.append(old)
        return FusedScale.from_source(old)

    atorch.register_replace_pair("by_name", pair_cls=("Scale", nn.Module), build=build)
    _, result = scaled_result([("module_replace", {"pairs": ["by_name"]})])
    assert len(built) == 2 and all(type(m) is FusedScale for m in result.model.scales)


def test_unknown_pair_names_are_refused(restore_pairs):
    source = [("module_replace", {"pairs": ["hf_conv1d_to_linear", "no_such_pair"]})]
    assert Strategy.load(source).get("module_replace").pairs == ("hf_conv1d_to_linear", "no_such_pair")
    with pytest.raises(StrategyError) as info:
        Strategy.load(source, world_size=1)
    [problem] = info.value.problems
    assert problem == (
        "'module_replace': unknown replace pair(s) ['no_such_pair']; registered: ['hf_attention_sdpa', "
        "'hf_conv1d_to_linear', 'rms_norm_fused'], and ATorch's names ['HF_BertAttention_FA', 'HF_CLIPAttention_FA', "
        "'HF_GPT2Attention_FA', 'HF_LlamaAttention_FA', 'LayerNorm_Apex', 'MultiheadAttention_FA'] "
        "(see register_replace_pair)"
    )
    with pytest.raises(StrategyError, match="unknown replace pair"):
        scaled_result(source)


def test_register_replace_pair_needs_a_way_to_build(restore_pairs):
    with pytest.raises(ValueError, match="Linear has no from_source.* takes no src_module argument"):
        atorch.register_replace_pair("broken", pair_cls=(Scale, nn.Linear))
    with pytest.raises(ValueError, match=r"unknown kwargs \['bkup_ori'\]; ATorch's replace_module takes"):
        atorch.register_replace_pair("broken", {"bkup_ori": True}, pair_cls=(Scale, FusedScale))
    with pytest.raises(ValueError, match=r"need_src_module, but FusedScale\(\) takes no src_module"):
        atorch.register_replace_pair("broken", {"need_src_module": True}, pair_cls=(Scale, FusedScale))
    with pytest.raises(ValueError, match="names no class to replace; give it a _src_module_cls attribute"):
        atorch.register_replace_pair("broken")(FusedScale)
    assert "broken" not in module_replace.replace_pairs()


# ATorch's forms: the decorator (the target derives from the source, or names it in _src_module_cls), the
# default kwargs {"need_src_module": True} (Target(src_module=old)) and {"init_from_attr": True}.
class ScaleFromSource(Scale):
    def __init__(self, src_module: Scale) -> None:
        super().__init__(src_module.dim)
        with torch.no_grad():
            self.weight.copy_(src_module.weight)


class ScaleFromAttrs(nn.Module):
    _src_module_cls = Scale

    def __init__(self, dim: int, scale: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mul(x, self.weight)


@pytest.mark.parametrize("register", [
    lambda: atorch.register_replace_pair("atorch_form", supported_dtypes={torch.float32})(ScaleFromSource),
    lambda: atorch.register_replace_pair("atorch_form", pair_cls=(Scale, ScaleFromSource)),
    lambda: atorch.register_replace_pair("atorch_form", kwargs={"init_from_attr": True})(ScaleFromAttrs),
], ids=["decorator, derived class", "pair_cls, src_module", "decorator, _src_module_cls, init_from_attr"])
def test_pairs_registered_the_atorch_way_are_applied(restore_pairs, register):
    register()
    model, result = scaled_result([("module_replace", {"pairs": ["atorch_form"]})])
    [new_type] = {type(m) for m in result.model.scales}
    assert new_type in (ScaleFromSource, ScaleFromAttrs)
    x = torch.randn(4, 16)
    torch.testing.assert_close(result.model(x), model(x), rtol=0, atol=0)  # the weights came along
