"""fp8: which Linear layers it would take, its config, and the skip (with the reason) off CUDA."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from toy_models import mlp, mlp_dataset, mlp_loss, tiny_gpt2

import atorch
from atorch import Strategy, StrategyError
from atorch.opt_lib.fp8 import FP8Config, fp8_linear_names, fp8_unavailable_reason
from atorch.opt_lib.module_replace import replace_modules, replace_pairs
from atorch.training import train_step


class Mixed(nn.Module):
    """Linear layers with and without fp8-friendly shapes, plus modules fp8 must leave alone."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 64)  # eligible
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))  # eligible
        self.narrow_out = nn.Linear(64, 10)  # 10 outputs: not a multiple of 16
        self.narrow_in = nn.Linear(24, 64)  # 24 inputs: not a multiple of 16
        self.attn = nn.MultiheadAttention(64, 4)  # out_proj is a Linear subclass MHA reads directly
        self.conv = nn.Conv1d(16, 16, 1)
        self.head = nn.Linear(64, 128, bias=False)  # eligible


ELIGIBLE = ["embed", "blocks.0", "blocks.1", "head"]


@pytest.mark.parametrize(
    "include, exclude, expected",
    [
        (None, None, ELIGIBLE),
        (("blocks",), None, ["blocks.0", "blocks.1"]),
        (None, ("head",), ["embed", "blocks.0", "blocks.1"]),
        (("blocks", "head"), ("blocks.1",), ["blocks.0", "head"]),
        (("narrow",), None, []),  # named, but the shapes do not qualify
        (("attn",), None, []),  # MultiheadAttention's out_proj is not a plain nn.Linear
        (None, ("",), []),  # the empty substring is in every name
    ],
)
def test_fp8_linear_names(include, exclude, expected):
    assert fp8_linear_names(Mixed(), include, exclude) == expected


def test_fp8_takes_gpt2_projections_once_they_are_linear():
    model = tiny_gpt2()
    assert fp8_linear_names(model) == ["lm_head"]  # GPT-2's projections are Conv1D
    replace_modules(model, [replace_pairs()["hf_conv1d_to_linear"]])
    names = fp8_linear_names(model, exclude=("lm_head",))
    assert len(names) == 8 and all(n.startswith("transformer.h.") for n in names)


def test_reason_off_cuda():
    reason = fp8_unavailable_reason(torch.device("cpu"))
    assert reason == "fp8 needs a CUDA GPU with compute capability >= 8.9; this process runs on cpu"


def test_config_accepts_atorch_keys():
    config = Strategy.load([("fp8", {
        "include": ["attn", "mlp"], "exclude": ["lm_head"], "margin": 2, "interval": 4, "fp8_format": "E4M3",
        "amax_history_len": 16, "amax_compute_algo": "most_recent",
    })]).get("fp8")
    assert config == FP8Config(include=("attn", "mlp"), exclude=("lm_head",), margin=2, interval=4,
                               fp8_format="E4M3", amax_history_len=16, amax_compute_algo="most_recent")
    assert Strategy.load(["fp8"]).get("fp8") == FP8Config()


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({"margin": -1}, "config key 'margin'"),
        ({"interval": 0}, "config key 'interval'"),
        ({"fp8_format": "E5M2"}, "config key 'fp8_format'"),
        ({"amax_history_len": 0}, "config key 'amax_history_len'"),
        ({"amax_compute_algo": "mean"}, "config key 'amax_compute_algo'"),
        ({"include": "attn"}, "config key 'include'"),
        ({"recipe": "delayed"}, "unknown config key 'recipe' (allowed keys: include, exclude, margin,"),
    ],
)
def test_config_rejects_bad_values(config, fragment):
    with pytest.raises(StrategyError) as info:
        Strategy.load([("fp8", config)])
    [problem] = info.value.problems
    assert problem.startswith("'fp8': ") and fragment in problem


def train_losses(load_strategy, steps: int = 3) -> tuple[list[float], object]:
    _, result, _ = atorch.auto_accelerate(
        mlp(), torch.optim.SGD, mlp_dataset(), mlp_loss, model_input_format="unpack_sequence",
        optim_args={"lr": 0.1}, dataloader_args={"batch_size": 16}, load_strategy=load_strategy,
    )
    batch = next(iter(result.dataloader))  # the same batch each step, so the loss must fall
    return [float(train_step(result, [batch])) for _ in range(steps)], result


def test_fp8_is_skipped_on_cpu_with_the_reason(atorch_log):
    losses, result = train_losses(["parallel_mode", ("fp8", {"include": ["blocks"]})])
    reason = fp8_unavailable_reason(torch.device("cpu"))
    assert result.args.skipped == {"fp8": reason}
    warnings = [r for r in atorch_log.records if r.levelno == logging.WARNING and r.name.startswith("atorch")]
    assert [r.getMessage() for r in warnings] == [f"fp8 skipped: {reason}"]
    assert "forward" not in result.model.__dict__  # no fp8 autocast around the forward
    assert all(type(m).__module__.startswith("torch.nn.") for m in result.model.modules() if m is not result.model)
    # The rest of the strategy trains exactly as it would without fp8.
    plain, _ = train_losses(["parallel_mode"])
    assert losses == plain
    assert losses[-1] < losses[0]
