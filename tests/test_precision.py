"""amp_native and half in one process: loss scaling, skipping of non-finite steps, and casting."""

from __future__ import annotations

import pytest
import torch
from toy_models import mlp, mlp_dataset, mlp_loss

import atorch
from atorch.errors import StrategyError
from atorch.training import train_step


class SwitchableLoss:
    """mlp_loss, multiplied by inf while ``poisoned`` is set, so every gradient is inf or nan."""

    def __init__(self) -> None:
        self.poisoned = False

    def __call__(self, data, output) -> torch.Tensor:
        loss = mlp_loss(data, output)
        return loss * float("inf") if self.poisoned else loss


def accelerate(load_strategy, loss_func=mlp_loss, optim=torch.optim.AdamW):
    _, result, _ = atorch.auto_accelerate(
        mlp(), optim, mlp_dataset(), loss_func, model_input_format="unpack_sequence",
        optim_args={"lr": 1e-2}, dataloader_args={"batch_size": 8}, load_strategy=load_strategy,
    )
    return result


def params_of(result) -> list[torch.Tensor]:
    return [p.detach().clone() for p in result.model.parameters()]


def test_fp16_amp_uses_a_grad_scaler():
    result = accelerate([("amp_native", {"dtype": "fp16"})])
    assert result.args.use_optim_backward is True
    assert isinstance(result.optim.grad_scaler, torch.amp.GradScaler)
    assert result.optim.grad_scaler.get_scale() == 2.0**16
    for dtype in ("bf16", torch.bfloat16):
        result = accelerate([("amp_native", {"dtype": dtype})])
        assert result.args.use_optim_backward is False and result.optim.grad_scaler is None


def test_amp_runs_the_forward_under_autocast():
    result = accelerate([("amp_native", {"dtype": "bf16"})])
    x, _ = result.prepare_input(next(iter(result.dataloader)))
    assert result.model(x).dtype == torch.bfloat16  # autocast output...
    assert all(p.dtype == torch.float32 for p in result.model.parameters())  # ...over fp32 weights
    assert repr(result.model.forward) == "autocast(torch.bfloat16)"


@pytest.mark.parametrize(
    "amp_config",
    [{"dtype": "fp16"}, {"dtype": "bf16", "skip_if_nonfinite": True}],
    ids=["fp16_scaler", "bf16_skip_if_nonfinite"],
)
def test_non_finite_step_is_skipped(amp_config):
    loss_func = SwitchableLoss()
    result = accelerate([("amp_native", amp_config)], loss_func=loss_func)
    batch = next(iter(result.dataloader))
    train_step(result, [batch])  # a finite step first: the optimizer has state
    assert result.optim.skipped_steps == 0
    before = params_of(result)

    loss_func.poisoned = True
    train_step(result, [batch])
    assert result.optim.skipped_steps == 1
    for got, want in zip(result.model.parameters(), before, strict=True):
        assert torch.equal(got, want)
    assert all(p.grad is None for p in result.model.parameters())  # zero_grad still ran

    loss_func.poisoned = False
    train_step(result, [batch])  # training goes on from the unchanged weights
    assert result.optim.skipped_steps == 1
    after = list(result.model.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(got, want) for got, want in zip(after, before, strict=True))


def test_without_skip_if_nonfinite_a_bf16_step_is_applied():
    """The control for the test above: the same poisoned step, not skipped, ruins the weights."""
    loss_func = SwitchableLoss()
    result = accelerate([("amp_native", {"dtype": "bf16", "skip_if_nonfinite": False})], loss_func=loss_func)
    batch = next(iter(result.dataloader))
    train_step(result, [batch])
    loss_func.poisoned = True
    train_step(result, [batch])
    assert result.optim.skipped_steps == 0
    assert all(torch.isnan(p).all() for p in result.model.parameters())  # AdamW: inf / sqrt(inf) = nan


def test_half_casts_parameters_and_floating_inputs():
    result = accelerate([("half", "bf16")])
    assert {p.dtype for p in result.model.parameters()} == {torch.bfloat16}
    x, y = result.prepare_input(next(iter(result.dataloader)))
    assert x.dtype == torch.bfloat16 and y.dtype == torch.int64  # labels are not floating: kept
    nested = result.prepare_input({"a": [torch.ones(2)], "b": (torch.zeros(2, dtype=torch.int32),)})
    assert nested["a"][0].dtype == torch.bfloat16 and nested["b"][0].dtype == torch.int32
    assert result.args.use_optim_backward is False

    batch = next(iter(result.dataloader))
    first = float(train_step(result, [batch]))
    for _ in range(3):
        last = float(train_step(result, [batch]))
    assert last < first  # trains in bf16
    assert {p.dtype for p in result.model.parameters()} == {torch.bfloat16}


def test_half_fp16_and_user_prepare_input():
    calls = []

    def prepare_input(data, device):
        calls.append(device)
        return [t.to(device) for t in data]

    _, result, _ = atorch.auto_accelerate(
        mlp(), torch.optim.SGD, mlp_dataset(), mlp_loss, prepare_input=prepare_input,
        model_input_format="unpack_sequence", dataloader_args={"batch_size": 8}, load_strategy=[("half", "fp16")],
    )
    x, y = result.prepare_input(next(iter(result.dataloader)), torch.device("cpu"))
    assert calls == [torch.device("cpu")]  # the user's function runs first, then the cast
    assert x.dtype == torch.float16 and y.dtype == torch.int64
    assert {p.dtype for p in result.model.parameters()} == {torch.float16}


def _half_fp16_adamw_weights(eps: float) -> torch.Tensor:
    """What ('half', 'fp16') did with AdamW before the check: model.half(), AdamW on fp16 state."""
    model = mlp().half()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=eps)
    x, y = mlp_dataset()[:8]
    for _ in range(3):
        mlp_loss((x, y), model(x.half())).backward()
        optim.step()
        optim.zero_grad()
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def test_half_fp16_with_adamw_default_eps_is_refused_early():
    # The reason: eps=1e-8 is 0 in fp16 and v = g*g underflows, so sqrt(v) + eps = 0 and the update
    # is inf/nan: every weight is NaN after three steps (eps=1e-6, a subnormal, fares no better).
    assert torch.tensor(1e-8, dtype=torch.float16).item() == 0.0
    assert not torch.isfinite(_half_fp16_adamw_weights(1e-8)).any()
    assert not torch.isfinite(_half_fp16_adamw_weights(1e-6)).any()
    with pytest.raises(StrategyError) as info:
        accelerate([("half", "fp16")])
    message = str(info.value)
    assert "eps=1e-08" in message and "('half', 'bf16')" in message and "'eps': 1e-4" in message, message
    with pytest.raises(StrategyError, match="eps=1e-10"):  # Adagrad's default, read from its signature
        accelerate([("half", "fp16")], optim=torch.optim.Adagrad)


def test_half_fp16_with_a_representable_eps_trains():
    assert torch.isfinite(_half_fp16_adamw_weights(1e-4)).all()
    _, result, _ = atorch.auto_accelerate(
        mlp(), torch.optim.AdamW, mlp_dataset(), mlp_loss, model_input_format="unpack_sequence",
        optim_args={"lr": 1e-2, "eps": 1e-4}, dataloader_args={"batch_size": 8}, load_strategy=[("half", "fp16")],
    )
    batch = next(iter(result.dataloader))
    first = float(train_step(result, [batch]))
    for _ in range(3):
        last = float(train_step(result, [batch]))
    assert all(torch.isfinite(p).all() for p in result.model.parameters())
    assert last < first
