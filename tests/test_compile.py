"""The opt-in ``compile`` method: the model compiled in place at its first call, computing what the plain model
computes; refused beside a pipeline schedule and with an unknown backend."""

from __future__ import annotations

import pytest
import torch
from toy_models import mlp, mlp_dataset, mlp_loss

import atorch
from atorch import Strategy, StrategyError
from atorch.dryrun.numerics import LOSS_RTOL

MLP_ARGS = dict(dataset=mlp_dataset(), loss_func=mlp_loss, model_input_format="unpack_sequence",
                optim_args={"lr": 0.1}, dataloader_args={"batch_size": 8, "shuffle": False})
STEPS = 3
# "aot_eager" runs the traced aten graph eagerly (cheap on CPU); its decompositions may only reorder fp32 sums,
# the same tolerance as the dry-runs' numerics check for strategies that keep the user's numbers (2**-14).
BACKEND = {"backend": "aot_eager"}


def _losses(strategy: list) -> tuple[list[float], torch.nn.Module]:
    _, result, _ = atorch.auto_accelerate(mlp(), torch.optim.SGD, load_strategy=strategy, **MLP_ARGS)
    batches = iter(result.dataloader)
    losses = [atorch.train_step(result, [next(batches)]).item() for _ in range(STEPS)]
    return losses, result.model


def test_compiled_training_matches_the_plain_model() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled, model = _losses([("compile", BACKEND)])
    assert counters["stats"]["unique_graphs"] >= 1  # compiled at the first call
    plain, _ = _losses(["parallel_mode"])
    assert model._compiled_call_impl is not None  # compiled in place: the user's class and names stay
    assert set(model.state_dict()) == set(mlp().state_dict())
    torch.testing.assert_close(compiled, plain, rtol=LOSS_RTOL["fp32"], atol=0)


def test_compile_is_refused_beside_a_pipeline_schedule_and_with_an_unknown_backend() -> None:
    pipeline = Strategy.load([("parallel_mode", {"dims": [["pipeline", 2]]}), "pipeline_parallel", "compile"])
    assert any("'compile' cannot be combined with 'pipeline_parallel'" in p for p in pipeline.problems(2))
    with pytest.raises(StrategyError, match="backend 'no_such_backend' is not a torch.compile backend"):
        atorch.auto_accelerate(mlp(), torch.optim.SGD, load_strategy=[("compile", {"backend": "no_such_backend"})],
                               **MLP_ARGS)


def test_compile_is_opt_in_and_not_traced() -> None:
    from atorch.opt_lib.registry import apply_order, get_method
    from atorch.strategy_search.costing.tracing import untraced_reason

    order = apply_order()
    assert order.index("checkpoint") < order.index("compile") < order.index("fsdp")
    assert get_method("compile").search_role is None
    assert untraced_reason(Strategy.load(["compile"]), 1) == "compiled models are not traced"
