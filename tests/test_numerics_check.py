"""The automatic search's numerics check: each dry-run's first loss against the user's own model."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import atorch
from atorch.dryrun.numerics import LOSS_RTOL, compute_dtype, deterministic_step, loss_problem, reference_loss
from atorch.model_context import UserSetup
from atorch.strategy import Strategy


def test_tolerances_follow_the_dtype_and_name_the_departure() -> None:
    assert LOSS_RTOL["fp32"] < LOSS_RTOL["fp16"] < LOSS_RTOL["bf16"]
    ref = 6.951262
    assert loss_problem([ref * (1 + 1e-6), 5.0], ref, "fp32", checked_first=True) is None
    # A fused projection split twice (a wrong tensor-parallel plan): 1e-4 relative on the first step.
    problem = loss_problem([6.950586], ref, "fp32", checked_first=True)
    assert problem is not None and "departs from the user's model" in problem and "fp32 tolerance" in problem
    assert loss_problem([ref * (1 + 5e-3)], ref, "bf16", checked_first=True) is None  # bf16 rounding
    assert loss_problem([ref * (1 + 5e-3)], ref, "fp16", checked_first=True) is not None
    assert loss_problem([6.0], ref, "fp32", checked_first=False) is None  # no deterministic first step
    assert "nan at step 1" in (loss_problem([ref, math.nan], ref, "bf16", checked_first=False) or "")
    assert "inf at step 0" in (loss_problem([math.inf], None, "fp32", checked_first=True) or "")


def test_compute_dtype_of_a_strategy() -> None:
    assert compute_dtype(Strategy.load(["parallel_mode", "fsdp"])) == "fp32"
    assert compute_dtype(Strategy.load(["parallel_mode", ("amp_native", {"dtype": "fp16"})])) == "fp16"
    assert compute_dtype(Strategy.load(["parallel_mode", ("half", "bf16")])) == "bf16"


def test_deterministic_step_turns_dropout_off_and_restores_each_modules_mode() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 1))
    model[2].eval()  # a module the user keeps in eval mode stays so
    x = torch.ones(8, 4)
    with deterministic_step(model):
        assert torch.equal(model(x), model(x))
    assert model.training and model[1].training and not model[2].training


def _mse(data, output):
    return nn.functional.mse_loss(output, data[1])


def test_reference_loss_is_the_mean_over_ranks_and_micro_batches_of_the_users_model() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    setup = UserSetup(model=_FirstInput(model), optim_func=torch.optim.SGD, dataset=TensorDataset(x, y),
                      loss_func=_mse, model_input_format=None, dataloader_args={"batch_size": 8, "shuffle": False})
    # One rank, two micro-batches of 4: the first 8 samples in order, as train_step averages them.
    got = reference_loss(setup, torch.device("cpu"), batch_size=4, micro_batches=2, data_size=1)
    model.eval()
    with torch.no_grad():
        want = (_mse((x[:4], y[:4]), model(x[:4])) + _mse((x[4:8], y[4:8]), model(x[4:8]))) / 2
    assert got == pytest.approx(float(want), rel=1e-6)
    # It runs on a copy: a forward with side effects (a LightningModule's training_step records its losses,
    # logs through its Trainer) leaves the user's module as it was.
    assert setup.model.calls == 0 and model.training is False


class _FirstInput(nn.Module):
    """model(batch) on a (x, y) batch: the model sees x."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, batch):
        self.calls += 1
        return self.inner(batch[0])


class Cancellation(nn.Module):
    """A loss that subtracts two nearly equal large numbers: bf16 rounding of the matmul outputs (2^-8 of 1e3)
    is the whole loss, so mixed precision computes something else than the fp32 model."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        with torch.no_grad():
            self.a.weight.fill_(100.0)
            self.a.bias.zero_()

    def forward(self, x, y):
        return self.a(x) - (100.0 * x.sum(1, keepdim=True) - 0.5)  # 0.5 in exact arithmetic


def _difference_loss(data, output):
    return output.mean()


def test_a_search_rejects_candidates_whose_numerics_depart_from_the_users_model(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ATORCH_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    dataset = TensorDataset(torch.rand(32, 8) + 1.0, torch.zeros(32, 1))
    # Nothing passes: ATorch's status False, with the reason (atorch/result.py)
    status, failed, picked = atorch.auto_accelerate(
        Cancellation(), torch.optim.SGD, dataset, _difference_loss, model_input_format="unpack_sequence",
        optim_args={"lr": 0.0}, dataloader_args={"batch_size": 8}, included=["amp_native"],
        search={"storage": f"sqlite:///{tmp_path}/s.db", "max_trials": 3, "warmup_steps": 2,
                "measure_steps": 1, "min_measure_s": 0})
    text = failed.reason or ""
    assert status is False and picked is None and failed.model is None, text
    assert "numerics" in text and "departs from the user's model" in text, text
    # The same search in fp32 passes its own check and picks a candidate.
    _, result, strategy = atorch.auto_accelerate(
        Cancellation(), torch.optim.SGD, dataset, _difference_loss, model_input_format="unpack_sequence",
        optim_args={"lr": 0.0}, dataloader_args={"batch_size": 8},
        search={"storage": f"sqlite:///{tmp_path}/s.db", "max_trials": 2, "warmup_steps": 2, "measure_steps": 1,
                "min_measure_s": 0, "precision": "exact"})
    assert strategy.get("amp_native") is None and result.args.search["source"] == "search"
    result.close()
