"""The user's mistakes found by one step on fake tensors before anything is built (loss argument order,
batch structure against model_input_format, shapes), in semi-automatic and automatic mode; and a warning
repeated for many candidates logged once with its count."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from toy_models import TokenDataset, mlp, mlp_dataset, mlp_loss, tiny_gpt2

import atorch
from atorch import StrategyError
from atorch.errors import SetupError
from atorch.log import RepeatedWarnings
from atorch.strategy_search.costing.analyser import analyse
from atorch.strategy_search.costing.diagnosis import StepError, step_problems

X, Y = torch.randn(4, 16), torch.randint(0, 8, (4,))


class NeedsValues(nn.Module):
    """A forward that reads a value (.item()): fake tensors cannot run it, and that is not the user's mistake."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.lin(x) * (2.0 if x.sum().item() > 0 else 1.0)


def only(problems: list[str]) -> str:
    assert len(problems) == 1, problems
    return problems[0]


# ----- the check itself, in this process --------------------------------------------------------------
@pytest.mark.parametrize(("loss", "name"), [
    (F.cross_entropy, "F.cross_entropy"),
    (nn.CrossEntropyLoss(), "nn.CrossEntropyLoss()"),
])
def test_a_loss_in_torchs_input_target_order_is_named_with_the_fix(loss, name) -> None:
    problem = only(step_problems(mlp(), (X, Y), "unpack_sequence", loss))
    assert problem.startswith(f"loss_func ({name}) fails on a sample batch: atorch calls loss_func(data, output)")
    assert "tuple(tensor (4, 16) float32, tensor (4,) int64)" in problem  # the batch, as the loss got it
    assert "output the model's output (tensor (4, 8) float32)" in problem
    assert f"It looks like torch's (input, target) order; wrap it: `loss_func=lambda data, output: {name}(output, " \
           "data[1])`" in problem


def test_a_users_loss_named_like_torchs_and_a_loss_with_a_third_argument() -> None:
    def my_loss(logits, labels):
        return F.cross_entropy(logits, labels)

    problem = only(step_problems(mlp(), (X, Y), "unpack_sequence", my_loss))
    assert "`loss_func=lambda data, output: my_loss(output, data[1])`" in problem
    problem = only(step_problems(mlp(), (X, Y), "unpack_sequence", lambda data, output, extra: output.sum()))
    assert "missing 1 required positional argument: 'extra'" in problem
    assert problem.endswith("Give loss_func exactly two parameters, (data, output), in this order")
    problem = only(step_problems(mlp(), (X, Y), "unpack_sequence", lambda data, output: 0.0))
    assert problem.endswith("it returned a float, not a tensor: return the loss as a scalar tensor (the one "
                            "backward starts from)")
    # A dict batch: the suggested target is its labels.
    batch = TokenDataset(samples=2)[0]
    batch = {k: v.unsqueeze(0) for k, v in batch.items()}
    problem = only(step_problems(tiny_gpt2(), batch, "unpack_dict", F.cross_entropy))
    assert "`loss_func=lambda data, output: F.cross_entropy(output.logits, data['labels'])`" in problem


def test_a_batch_that_does_not_match_model_input_format() -> None:
    seq = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    problem = only(step_problems(seq, (X, Y), None, mlp_loss))  # model((x, y)): forward(input) binds it
    assert problem.startswith(
        "the model's forward fails on a sample batch: model_input_format=None calls model(batch) with the batch, "
        "tuple(tensor (4, 16) float32, tensor (4,) int64), and Sequential.forward raised TypeError: linear(): "
        "argument 'input' (position 1) must be Tensor, not tuple.")
    assert "use model_input_format='input_target' (model(batch[0]), e.g. an nn.Sequential)" in problem
    assert step_problems(seq, (X, Y), "input_target", mlp_loss) == []  # the fix it names works
    problem = only(step_problems(mlp(), {"x": X, "y": Y}, "unpack_sequence", mlp_loss))
    assert "The batch is a dict: use model_input_format='unpack_dict' (model(**batch))" in problem
    problem = only(step_problems(mlp(), (X, Y), "unpack_dict", mlp_loss))
    assert "argument after ** must be a mapping, not tuple" in problem
    assert "model(**batch) needs a dict batch: use model_input_format='unpack_sequence'" in problem


def test_a_shape_mismatch_names_the_shapes_and_forward() -> None:
    problem = only(step_problems(mlp(), (torch.randn(4, 12), Y), "unpack_sequence", mlp_loss))
    assert "tuple(tensor (4, 12) float32, tensor (4,) int64)" in problem
    assert "MLP.forward raised RuntimeError: a and b must have same reduction dim, but got [4, 12] X [16, 32]" \
        in problem
    assert "Make the dataset's samples match MLP.forward(x: 'torch.Tensor', y: 'torch.Tensor | None' = None)" \
        in problem


def test_a_correct_step_and_a_forward_fake_tensors_cannot_run_are_not_reported() -> None:
    assert step_problems(mlp(), (X, Y), "unpack_sequence", mlp_loss) == []
    assert step_problems(NeedsValues(), (X, Y), "unpack_sequence", mlp_loss) == []  # the real run will tell
    # The analyser: the same mistake is a StepError; a gap of the fake run is measured on real tensors instead.
    with pytest.raises(StepError, match="torch's \\(input, target\\) order"):
        analyse(mlp(), (X, Y), "unpack_sequence", F.cross_entropy)
    assert analyse(NeedsValues(), (X, Y), "unpack_sequence", mlp_loss).measured_on == "real"


def test_a_large_model_on_the_meta_device_is_checked_without_memory() -> None:
    with torch.device("meta"):  # 4 x 40 GB in fp32, were it real
        big = nn.Sequential(nn.Linear(16, 100_000), nn.Linear(100_000, 100_000), nn.Linear(100_000, 8))
    start = time.monotonic()
    problem = only(step_problems(big, (X, Y), None, mlp_loss))
    assert time.monotonic() - start < 10 and "model_input_format=None calls model(batch)" in problem
    assert all(p.is_meta for p in big.parameters())  # the user's model is not touched


class NeedsTheGroup(nn.Module):
    """A forward that reads the process group (which the check runs before): not the user's mistake."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        import torch.distributed as dist

        return self.lin(x) * (dist.get_rank() + 1)


def test_a_forward_that_needs_the_process_group_is_not_reported() -> None:
    import torch.distributed as dist

    if dist.is_initialized():  # another test made the one-process group: nothing fails then
        pytest.skip("the process group exists")
    assert step_problems(NeedsTheGroup(), (X, Y), "unpack_sequence", mlp_loss) == []


# ----- through auto_accelerate: one error, before anything is built --------------------------------------
def refused(**kwargs) -> list[str]:
    built = []

    def optim(params, **args):
        built.append(True)
        return torch.optim.SGD(params, **args)

    args = dict(dataset=mlp_dataset(), loss_func=mlp_loss, model_input_format="unpack_sequence",
                optim_args={"lr": 0.1}, dataloader_args={"batch_size": 8})
    args.update(kwargs)
    start = time.monotonic()
    with pytest.raises(StrategyError) as info:
        atorch.auto_accelerate(args.pop("model", None) or mlp(), optim, **args)
    assert not built, "the optimizer was built before the problem was reported"
    assert time.monotonic() - start < 30  # no search, no dry-run
    return info.value.problems


@pytest.mark.parametrize("load_strategy", [["parallel_mode"], None], ids=["semi-automatic", "automatic"])
def test_auto_accelerate_names_the_mistake_in_both_modes(load_strategy) -> None:
    problem = only(refused(loss_func=F.cross_entropy, load_strategy=load_strategy))
    assert "`loss_func=lambda data, output: F.cross_entropy(output, data[1])`" in problem
    seq = nn.Sequential(nn.Linear(16, 8))
    problem = only(refused(model=seq, model_input_format=None, load_strategy=load_strategy))
    assert problem.startswith("the model's forward fails on a sample batch: model_input_format=None calls "
                              "model(batch) with the batch, list(tensor (2, 16) float32, tensor (2,) int64)")
    problem = only(refused(model=tiny_gpt2(), dataset=TokenDataset(8), loss_func=F.cross_entropy,
                           model_input_format="unpack_dict", load_strategy=load_strategy))
    assert "dict('input_ids': tensor (2, 32) int64, 'labels': tensor (2, 32) int64)" in problem
    assert "`loss_func=lambda data, output: F.cross_entropy(output.logits, data['labels'])`" in problem


@contextlib.contextmanager
def captured(name: str) -> Iterator[list[logging.LogRecord]]:
    """The records a logger emits in the block."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger(name).addHandler(handler)
    try:
        yield records
    finally:
        logging.getLogger(name).removeHandler(handler)


# ----- the search: a user's mistake stops it; a cost-model gap is measured, warned once ------------------
def test_the_planner_stops_on_a_users_mistake_and_warns_once_for_a_gap(tmp_path) -> None:
    from atorch.strategy_search.search.planner import Planner
    from atorch.strategy_search.search.space import SearchSpace

    space = SearchSpace(mlp(), 2, 8, excluded=["tensor_parallel", "pipeline_parallel", "mixed_parallel"])
    assert len(space) > 10

    def planner(predict):
        return Planner(space, storage=f"sqlite:///{tmp_path / 'search.db'}", study_key="k", predict=predict,
                       measure=lambda cand: None, memory_budget=2**30, max_trials=2)

    def mistake(cand):
        raise StepError("loss_func (F.cross_entropy) fails on a sample batch")

    with pytest.raises(StepError, match="F.cross_entropy"):
        planner(mistake).predictions()

    def gap(cand):
        warnings.warn("a per-candidate warning", UserWarning, stacklevel=1)
        raise SetupError("analyse: one training step could not run on fake tensors")

    with captured("atorch") as records:
        predictions = planner(gap).predictions()
    assert all(p.error == "SetupError: analyse: one training step could not run on fake tensors"
               for p in predictions.values())  # every candidate left to measuring
    lines = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(lines) == 2, lines
    assert lines[0].startswith("cost model could not predict ") and \
        lines[0].endswith(f"could not run on fake tensors (repeated for {len(space)} candidates)")
    assert lines[1] == f"UserWarning: a per-candidate warning (repeated for {len(space)} candidates)"


def test_repeated_warnings_counts_by_key() -> None:
    logger = logging.getLogger("atorch.test_repeated")
    with captured(logger.name) as records, RepeatedWarnings(logger, "items") as warn:
        for i in range(3):
            warn("a", f"first kind, item {i}")
        warn("b", "second kind")
        assert records == []  # nothing until the end
    assert [r.getMessage() for r in records] == ["first kind, item 0 (repeated for 3 items)", "second kind"]


def test_the_step_checks_load_no_search() -> None:
    """Semi-automatic mode's checks of the user's step (``costing.diagnosis``) load neither the search nor the
    cluster planner, nor Optuna: only the costing they are part of."""
    code = ("import sys; import atorch.input_checks; "
            "from atorch.strategy_search.costing.diagnosis import step_problems, unused_parameters; "
            "print(sorted(m for m in sys.modules if m == 'optuna' or m.startswith(('atorch.strategy_search.search', "
            "'atorch.strategy_search.cluster'))))")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.stdout.strip() == "[]", out.stdout
