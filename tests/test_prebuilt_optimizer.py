"""A built optimizer handed to the engine (the Booster's and Lightning's way) keeps its class, defaults and
parameter groups on the accelerated model; optimizers that cannot be carried over are refused by name."""

from __future__ import annotations

import pytest
import torch
from toy_models import mlp, mlp_dataset, mlp_loss

import atorch
from atorch.errors import SetupError
from atorch.prebuilt_optimizer import factory_from_optimizer


def test_groups_and_hyperparameters_survive_the_rebuild():
    model = mlp()
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0,
                                   "lr": 5e-3}], lr=1e-3, betas=(0.8, 0.9))
    factory = factory_from_optimizer(optimizer, model)
    _, result, _ = atorch.auto_accelerate(model, dataset=mlp_dataset(), loss_func=mlp_loss,
                                          model_input_format="unpack_sequence", load_strategy=["parallel_mode"],
                                          **factory.as_kwargs())
    rebuilt = result.optim
    assert isinstance(getattr(rebuilt, "optimizer", rebuilt), torch.optim.AdamW)
    groups = rebuilt.param_groups
    assert [len(g["params"]) for g in groups] == [len(decay), len(no_decay)]
    assert [(g["lr"], g["weight_decay"], g["betas"]) for g in groups] == [(1e-3, 0.1, (0.8, 0.9)),
                                                                          (5e-3, 0.0, (0.8, 0.9))]
    trained = {id(p) for p in result.model.parameters()}
    assert all(id(p) in trained for g in groups for p in g["params"])  # the accelerated model's, not the user's
    result.close()


def test_a_stepped_optimizer_a_stranger_tensor_and_a_non_optimizer_are_refused():
    model = mlp()
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 16)).sum().backward()
    stepped.step()
    with pytest.raises(SetupError, match="already stepped"):
        factory_from_optimizer(stepped, model)
    with pytest.raises(SetupError, match="not parameters of the model"):
        factory_from_optimizer(torch.optim.SGD(mlp(seed=3).parameters(), lr=0.1), model)
    with pytest.raises(SetupError, match="must be a torch.optim.Optimizer"):
        factory_from_optimizer({"lr": 0.1}, model)
