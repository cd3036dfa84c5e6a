"""Code written for ATorch runs unchanged: its import paths, its result and status, its config keys."""

from __future__ import annotations

import logging

import pytest
import torch
from toy_models import mlp, mlp_dataset, mlp_loss

import atorch
from atorch.result import AccelerateResult

MLP_ARGS = dict(dataset=mlp_dataset(), loss_func=mlp_loss, model_input_format="unpack_sequence",
                optim_args={"lr": 0.1}, dataloader_args={"batch_size": 8})


def test_atorch_import_paths_are_the_same_objects() -> None:
    from atorch.auto import auto_accelerate
    from atorch.auto.accelerate import auto_accelerate as from_accelerate
    from atorch.auto.opt_lib.module_replace_optimization import register_replace_pair
    from atorch.auto.strategy import Strategy

    assert auto_accelerate is from_accelerate is atorch.auto_accelerate
    assert Strategy is atorch.Strategy
    assert register_replace_pair is atorch.register_replace_pair


def test_atorch_only_names_say_what_to_write_instead() -> None:
    with pytest.raises(ImportError, match=r"ds_3d_parallel takes a plain config.*'ds_3d_parallel', \{"):
        from atorch.auto.opt_lib.ds_3d_parallel_optimization import DeepSpeed3DParallelConfig  # noqa: F401


def test_result_unpacks_six_ways_with_the_scheduler_by_name() -> None:
    status, result, strategy = atorch.auto_accelerate(
        mlp(), torch.optim.SGD, **MLP_ARGS, load_strategy=["parallel_mode"],
        lr_scheduler_cls=torch.optim.lr_scheduler.StepLR, lr_scheduler_args={"step_size": 1})
    with result:
        model, optim, dataloader, loss_func, prepare_input, args = result  # ATorch's documented line
        assert status is True and strategy.names() == ["parallel_mode"]
        assert result._fields == ("model", "optim", "dataloader", "loss_func", "prepare_input", "args")
        assert (model, optim, args) == (result.model, result.optim, result.args) and loss_func is mlp_loss
        assert isinstance(result.lr_scheduler, torch.optim.lr_scheduler.StepLR)
        assert result.lr_scheduler.optimizer is optim and result.reason is None
        # namedtuple's own helpers keep the scheduler
        assert result._replace(loss_func=None).lr_scheduler is result.lr_scheduler


def test_no_lr_scheduler_is_none() -> None:
    result = AccelerateResult(*range(6))
    assert result.lr_scheduler is None and result.problems == () and tuple(result) == tuple(range(6))


def test_a_search_that_finds_nothing_returns_status_false(tmp_path, atorch_log) -> None:
    status, result, strategy = atorch.auto_accelerate(
        mlp(), torch.optim.SGD, **MLP_ARGS, memory_limit=1024,
        search={"storage": f"sqlite:///{tmp_path}/s.db", "dryrun": False})
    assert status is False and strategy is None
    assert tuple(result) == (None,) * 6 and result.lr_scheduler is None
    assert "no candidate fitted and ran" in result.reason and "raise memory_limit" in result.reason
    assert any(r.levelno == logging.ERROR and "found no strategy" in r.getMessage() for r in atorch_log.records)
    result.close()  # nothing to release, and no error


def test_invalid_input_still_raises_with_every_problem() -> None:
    with pytest.raises(atorch.StrategyError) as err:
        atorch.auto_accelerate(mlp(), torch.optim.SGD, **MLP_ARGS, load_strategy=["nope"], time_limit=-1)
    assert len(err.value.problems) >= 2
