"""A model whose code keeps a tensor in a function-level cache (as transformers' BEiT keeps its relative position
index): atorch's runs on fake tensors must not leave a fake tensor there for the real steps to read."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException
from toy_models import mlp_dataset, mlp_loss

import atorch
from atorch.function_caches import forget_fake_fills
from atorch.strategy_search.costing.analyser import analyse


@functools.lru_cache(maxsize=4)
def _feature_order(width: int) -> torch.Tensor:
    """A tensor computed from a plain argument and kept across calls (what BEiT's position index does)."""
    return torch.arange(width).flip(0)


class CachedOrderModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(16, 32)
        self.second = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.first(x))
        return self.second(hidden[:, _feature_order(hidden.shape[1])])


@pytest.fixture(autouse=True)
def _empty_cache() -> None:
    _feature_order.cache_clear()


def test_what_a_fake_run_cached_is_cleared_and_the_real_step_matches() -> None:
    model, x = CachedOrderModel(), torch.randn(4, 16)
    expected = model(x).detach()
    _feature_order.cache_clear()

    analyse(model, (x, torch.zeros(4, dtype=torch.long)), "unpack_sequence", mlp_loss)  # on fake tensors
    assert _feature_order.cache_info().currsize == 1
    with pytest.raises(DataDependentOutputException):  # the hazard: the real step reads a fake tensor
        float(model(x).sum())

    assert forget_fake_fills(model) >= 1
    assert _feature_order.cache_info().currsize == 0
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def test_the_automatic_search_on_such_a_model_runs_its_dry_runs_and_trains(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ATORCH_CACHE_DIR", str(tmp_path))
    status, result, strategy = atorch.auto_accelerate(
        CachedOrderModel(), torch.optim.SGD, dataset=mlp_dataset(), loss_func=mlp_loss,
        model_input_format="unpack_sequence", optim_args={"lr": 0.1}, dataloader_args={"batch_size": 8},
        search={"storage": f"sqlite:///{tmp_path}/s.db", "max_trials": 2, "warmup_steps": 1, "measure_steps": 1})
    assert status, result
    search = result.args.search
    assert search["source"] == "search" and search["dry_runs"] >= 1
    assert all(t.get("status") != "failed" for t in search["trials"]), search["trials"]
    batch = result.prepare_input(next(iter(result.dataloader)), result.args.device)
    loss = result.loss_func(batch, result.model(*batch))
    assert torch.isfinite(torch.as_tensor(float(loss)))
    result.close()
