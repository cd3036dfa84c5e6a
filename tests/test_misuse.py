"""The misuse battery: realistic mistakes in a user's training setup, each refused before anything is built with
one clear message (the problem named, and the fix), in semi-automatic mode (load_strategy) and automatic mode (no
search starts: the checks run first). Options that only the automatic search reads are named in a warning when a
load_strategy is given. A few mistakes need two processes (the same message on every rank): one launch.

Each case is (id, what the user wrote, the key phrases its message must hold). docs/tests.md lists them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from launcher import run_json
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset
from toy_models import MLP, SmallVGG, TokenDataset, mlp, mlp_dataset, mlp_loss, tiny_gpt2

import atorch
from atorch import StrategyError
from atorch.errors import SearchOptionIgnored
from atorch.input_checks import input_problems
from atorch.model_context import UserSetup

HERE = Path(__file__).resolve().parent
SEMI = ["parallel_mode"]
# The automatic mode's search, were it to start, is the cost model alone (no dry-run): a mistake the checks miss
# fails its case quickly instead of searching.
QUICK_SEARCH = {"dryrun": False, "max_trials": 1, "progress": False}


# ----- the users' objects -------------------------------------------------------------------------------------
def frozen_mlp() -> nn.Module:
    return mlp().requires_grad_(False)


class ListLayers(nn.Module):
    """Layers kept in a plain Python list: torch does not see them (no parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = [nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)]

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class NoGradForward(MLP):
    @torch.no_grad()
    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x, y)


class NumpySamples(Dataset):
    """Features read with numpy (float64 by default), as from a .npy file or a pandas frame."""

    def __init__(self, n: int = 32) -> None:
        rng = np.random.default_rng(0)
        self.x, self.y = rng.standard_normal((n, 16)), rng.integers(0, 8, n)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.x[i], int(self.y[i])


class TextSamples(Dataset):
    """Raw strings where token ids were meant: the tokenizer was never applied."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, str]:
        return {"input_ids": f"sample text {i}", "labels": f"sample text {i}"}


class Stream(IterableDataset):
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(0)
        return ((torch.randn(16, generator=g), torch.tensor(i % 8)) for i in range(32))


class RenamedKeys(TokenDataset):
    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_id": self.tokens[index], "labels": self.tokens[index]}


def pairs(x: torch.Tensor, y: torch.Tensor) -> TensorDataset:
    return TensorDataset(x, y)


def float64_dataset() -> Dataset:
    g = torch.Generator().manual_seed(1)
    return pairs(torch.randn(32, 16, generator=g, dtype=torch.float64), torch.randint(0, 8, (32,), generator=g))


def regression_dataset(target_dtype: torch.dtype = torch.float32) -> Dataset:
    g = torch.Generator().manual_seed(1)
    return pairs(torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g).to(target_dtype))


class NoReturnForward(MLP):
    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        super().forward(x, y)  # the return was forgotten


class CudaInForward(MLP):
    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x.cuda(), y)  # written for a GPU box


class Sentences(Dataset):
    """Token sequences of different lengths, collated without padding."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.arange(5 + i) % 100
        return {"input_ids": ids, "labels": ids}


class BuggyDataset(Dataset):
    def __init__(self) -> None:
        self.rows = [{"features": torch.randn(16), "label": i % 8} for i in range(16)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.rows[i]["feature"], self.rows[i]["label"]  # the key is 'features'


def _backward_and_return(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()  # "to be sure the gradients are there"
    return loss


def no_return_loss(data: Any, output: torch.Tensor) -> None:
    F.cross_entropy(output, data[1])  # the return was forgotten


def one_arg_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def gpt2_args(**extra: Any) -> dict[str, Any]:
    return {**dict(model=tiny_gpt2(), dataset=TokenDataset(16), model_input_format="unpack_dict",
                   loss_func=lambda data, output: output.loss), **extra}


# ----- the battery ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mistake:
    id: str
    args: Callable[[], dict[str, Any]]  # what differs from a correct MLP setup
    phrases: tuple[str, ...]  # the problem and the fix, in the message
    modes: tuple[str, ...] = ("semi", "auto")
    warning: bool = False  # named in a SearchOptionIgnored warning; the build goes on


def m(id: str, args: Callable[[], dict[str, Any]], *phrases: str, modes: tuple[str, ...] = ("semi", "auto"),
      warning: bool = False) -> Mistake:
    return Mistake(id, args, phrases, modes, warning)


MISTAKES = [
    # --- the loss ---
    m("loss-reduction-none", lambda: dict(loss_func=lambda d, o: F.cross_entropy(o, d[1], reduction="none")),
      "returned a tensor of shape (2,), not a scalar", ".mean()"),
    m("loss-item", lambda: dict(loss_func=lambda d, o: F.cross_entropy(o, d[1]).item()),
      "returned a float, not a tensor", "return the loss as a scalar tensor"),
    m("loss-tensor-of-item", lambda: dict(loss_func=lambda d, o: torch.tensor(F.cross_entropy(o, d[1]).item())),
      "does not require grad", "cut off from the model", "Compute it from `output` with torch operations"),
    m("loss-detached", lambda: dict(loss_func=lambda d, o: F.cross_entropy(o, d[1]).detach()),
      "does not require grad", "Compute it from `output`"),
    m("loss-through-numpy", lambda: dict(
        loss_func=lambda d, o: torch.tensor(float(np.mean((o.detach().numpy() - 1) ** 2)))),
      "does not require grad", "numpy"),
    m("loss-is-accuracy", lambda: dict(loss_func=lambda d, o: (o.argmax(1) == d[1]).float().mean()),
      "does not require grad", "Compute it from `output`"),
    m("loss-no-return", lambda: dict(loss_func=no_return_loss), "returned None", "missing return"),
    m("loss-returns-tuple", lambda: dict(loss_func=lambda d, o: (F.cross_entropy(o, d[1]), {"n": len(d[1])})),
      "returned a tuple, not a tensor", "scalar tensor"),
    m("loss-torch-order-function", lambda: dict(loss_func=F.cross_entropy),
      "torch's (input, target) order", "`loss_func=lambda data, output: F.cross_entropy(output, data[1])`"),
    m("loss-torch-order-module", lambda: dict(loss_func=nn.CrossEntropyLoss()),
      "torch's (input, target) order", "nn.CrossEntropyLoss()(output, data[1])"),
    m("loss-one-parameter", lambda: dict(loss_func=lambda output: output.sum()),
      "cannot be called as loss_func(data, output)", "two required positional parameters"),
    m("labels-float", lambda: dict(dataset=pairs(torch.randn(32, 16), torch.randint(0, 8, (32,)).float())),
      "Expected dtype int32/int64", "class-index targets must be int64 (.long())"),
    m("labels-out-of-range", lambda: dict(dataset=pairs(torch.randn(32, 16), torch.arange(32) % 2 + 9)),
      "out of bounds", "number of classes (8"),
    m("gpt2-per-token-loss", lambda: gpt2_args(loss_func=lambda d, o: F.cross_entropy(
        o.logits.transpose(1, 2), d["labels"], reduction="none")), "not a scalar", ".mean()"),
    m("gpt2-loss-item", lambda: gpt2_args(loss_func=lambda d, o: o.loss.item()), "returned a float, not a tensor"),
    # --- the model ---
    m("all-parameters-frozen", lambda: dict(model=frozen_mlp()), "every parameter of the model (10 tensors) is frozen",
      "requires_grad_(True)"),
    m("layers-in-a-python-list", lambda: dict(model=ListLayers()), "has no parameters", "nn.ModuleList"),
    m("forward-under-no-grad", lambda: dict(model=NoGradForward()), "output does not require grad",
      "@torch.no_grad() decorator"),
    m("model-is-a-class", lambda: dict(model=MLP), "model must be a torch.nn.Module, got type"),
    m("model-is-a-state-dict", lambda: dict(model=mlp().state_dict()), "model must be a torch.nn.Module"),
    m("model-already-compiled", lambda: dict(model=torch.compile(mlp())), "torch.compile()d module",
      "model._orig_mod"),
    m("model-in-dataparallel", lambda: dict(model=nn.DataParallel(mlp())), "already wrapped in DataParallel",
      "pass the plain nn.Module"),
    m("model-double-data-float", lambda: dict(model=mlp().double()), "dtype mismatch",
      "the model's parameters are float64", "cast the data"),
    m("model-bf16-data-float", lambda: dict(model=mlp().to(torch.bfloat16)), "dtype mismatch",
      "the model's parameters are bfloat16", "amp_native"),
    # --- the data ---
    m("float64-features", lambda: dict(dataset=float64_dataset()), "dtype mismatch",
      "The batch holds float64 tensors, the model's parameters are float32", "x.to(torch.float32)"),
    m("numpy-float64-samples", lambda: dict(dataset=NumpySamples()), "dtype mismatch",
      "torch.from_numpy(a).float()"),
    m("dataloader-as-dataset", lambda: dict(dataset=DataLoader(mlp_dataset(), batch_size=8)),
      "dataset is a torch DataLoader", "dataset=loader.dataset"),
    m("sampler-in-dataloader-args", lambda: dict(dataloader_args={"batch_size": 8, "sampler": None}),
      "dataloader_args['sampler'] cannot be used", "distributed_sampler_cls"),
    m("drop-last-dataset-smaller-than-batch", lambda: dict(
        dataset=mlp_dataset(4), dataloader_args={"batch_size": 8, "drop_last": True}),
      "yields no batch", "lower batch_size to at most 4"),
    m("empty-dataset", lambda: dict(dataset=pairs(torch.randn(0, 16), torch.zeros(0, dtype=torch.long))),
      "dataset is empty"),
    m("generator-as-dataset", lambda: dict(dataset=(s for s in mlp_dataset())), "one-pass iterator",
      "IterableDataset whose __iter__ starts the stream anew"),
    m("stream-with-shuffle", lambda: dict(dataset=Stream(), dataloader_args={"batch_size": 8, "shuffle": True}),
      "shuffle", "IterableDataset", "shuffle inside the dataset"),
    m("dataloader-args-batchsize-typo", lambda: dict(dataloader_args={"batchsize": 8}),
      "dataloader_args['batchsize'] is not an argument of torch's DataLoader", "did you mean 'batch_size'?"),
    m("dataloader-args-num-worker-typo", lambda: dict(dataloader_args={"batch_size": 8, "num_worker": 2}),
      "did you mean 'num_workers'?"),
    m("batch-size-as-string", lambda: dict(dataloader_args={"batch_size": "8"}), "must be a positive int"),
    m("collate-fn-not-callable", lambda: dict(dataloader_args={"batch_size": 8, "collate_fn": "default"}),
      "collate_fn'] must be callable"),
    m("unpack-dict-with-tuples", lambda: dict(model_input_format="unpack_dict"),
      "model_input_format='unpack_dict' calls model(**batch)", "use model_input_format='unpack_sequence'"),
    m("sequential-given-input-and-target", lambda: dict(
        model=nn.Sequential(nn.Linear(16, 8)), model_input_format=None),
      "model_input_format=None calls model(batch)", "model_input_format='input_target'"),
    m("input-format-typo", lambda: dict(model_input_format="unpack_dicts"), "'unpack_dicts' is not one of"),
    m("feature-count-mismatch", lambda: dict(dataset=pairs(torch.randn(32, 12), torch.randint(0, 8, (32,)))),
      "tensor (2, 12) float32", "Make the dataset's samples match MLP.forward"),
    m("dict-batches-unpacked-as-sequence", lambda: dict(
        dataset=[{"x": torch.randn(16), "y": torch.tensor(1)} for _ in range(16)]),
      "a batch is a dict with keys ['x', 'y']", "use model_input_format='unpack_dict' (model(**batch))"),
    m("gpt2-renamed-batch-key", lambda: gpt2_args(dataset=RenamedKeys(16)), "'input_id'",
      "You have to specify either input_ids", "The batch's key(s) 'input_id' (did you mean 'input_ids'?) name no "
      "parameter of forward", "Make the dataset's samples match GPT2LMHeadModel.forward"),
    m("gpt2-untokenized-text", lambda: gpt2_args(dataset=TextSamples()), "the model's forward fails on a sample batch",
      "list(str"),
    m("regression-target-broadcasts", lambda: dict(
        model=nn.Sequential(nn.Linear(16, 1)), model_input_format="input_target",
        dataset=pairs(torch.randn(32, 16), torch.randn(32)), loss_func=lambda d, o: F.mse_loss(o, d[1])),
      "broadcasts the target against the output", "output.squeeze(-1)"),
    m("token-ids-beyond-vocabulary", lambda: gpt2_args(dataset=TokenDataset(16, vocab=50257)),
      "token id", "'transformer.wte' has 128 rows", "resize_token_embeddings"),
    m("gpt2-without-labels", lambda: gpt2_args(dataset=[{"input_ids": torch.arange(32) % 100}] * 16),
      "returned None", "only when the batch has 'labels'"),
    m("forward-without-return", lambda: dict(model=NoReturnForward()), "forward returned None",
      "return the model's output from forward"),
    m("integer-features", lambda: dict(dataset=pairs(torch.randint(0, 5, (32, 16)), torch.randint(0, 8, (32,)))),
      "Integer tensors reach a matmul", "x.float()"),
    m("uint8-images-into-conv", lambda: dict(model=SmallVGG(), dataset=pairs(
        torch.randint(0, 255, (16, 3, 32, 32), dtype=torch.uint8), torch.randint(0, 10, (16,)))),
      "dtype mismatch", "tensor (2, 3, 32, 32) uint8", "x.float()"),
    m("dataset-without-target", lambda: dict(dataset=TensorDataset(torch.randn(16, 16))),
      "IndexError: list index out of range", "make the dataset yield what loss_func reads"),
    m("cuda-inside-forward", lambda: dict(model=CudaInForward()), "needs a CUDA GPU",
      "create new tensors on an input's device"),
    m("variable-length-without-padding", lambda: gpt2_args(dataset=Sentences()), "collating two samples",
      "a collate_fn that pads them"),
    m("dataset-getitem-bug", lambda: dict(dataset=BuggyDataset()), "reading dataset[0] and dataset[1]",
      "KeyError", "fix the dataset's __getitem__"),
    m("bce-with-integer-targets", lambda: dict(
        loss_func=lambda d, o: F.binary_cross_entropy_with_logits(o, F.one_hot(d[1], 8))),
      "dtype", "floating targets the output's dtype"),
    m("negative-num-workers", lambda: dict(dataloader_args={"batch_size": 8, "num_workers": -1}),
      "refused by torch's DataLoader", "num_workers option should be non-negative"),
    # --- the optimizer and scheduler ---
    m("one-cycle-without-total-steps", lambda: dict(lr_scheduler_cls=torch.optim.lr_scheduler.OneCycleLR,
                                                    lr_scheduler_args={"max_lr": 0.1}),
      "refused by OneCycleLR", "total_steps"),
    m("optim-param-func-without-parameter", lambda: dict(optim_param_func=lambda: []),
      "cannot be called as optim_param_func(model)"),
    m("optim-args-learning-rate", lambda: dict(optim_args={"learning_rate": 0.1}),
      "optim_args['learning_rate'] is not an argument of SGD", "did you mean 'lr'?"),
    m("optim-args-typo", lambda: dict(optim_func=torch.optim.AdamW, optim_args={"lr": 1e-3, "weight_decy": 0.1}),
      "optim_args['weight_decy'] is not an argument of AdamW", "did you mean 'weight_decay'?"),
    m("negative-learning-rate", lambda: dict(optim_args={"lr": -0.1}), "refused by SGD", "Invalid learning rate"),
    m("adam-betas-not-a-pair", lambda: dict(optim_func=torch.optim.Adam, optim_args={"lr": 1e-3, "betas": 0.9}),
      "refused by Adam", "fix the value in optim_args"),
    m("parameters-in-optim-args", lambda: dict(optim_args={"params": mlp().parameters(), "lr": 0.1}),
      "optim_args['params'] cannot be given", "remove 'params' from optim_args"),
    m("loss-calls-backward", lambda: dict(loss_func=lambda d, o: _backward_and_return(F.cross_entropy(o, d[1]))),
      "runs backward itself", "return the loss without calling backward"),
    m("sequence-logits-not-flattened", lambda: gpt2_args(
        loss_func=lambda d, o: F.cross_entropy(o.logits, d["labels"])),
      "Expected target size", "logits.view(-1, C), labels.view(-1)"),
    m("loss-as-a-new-leaf", lambda: dict(
        loss_func=lambda d, o: torch.tensor(F.cross_entropy(o, d[1]).item(), requires_grad=True)),
      "does not depend on the model's parameters", "torch.tensor(value, requires_grad=True)"),
    m("loss-func-as-a-name", lambda: dict(loss_func="cross_entropy"), "loss_func must be callable"),
    m("optimizer-instance-as-optim-func", lambda: dict(optim_func=torch.optim.SGD(mlp().parameters(), lr=0.1)),
      "optim_func must be an optimizer class or a function"),
    m("optim-args-to-a-function-without-them", lambda: dict(optim_func=one_arg_optimizer),
      "optim_args['lr'] is not an argument of one_arg_optimizer"),
    m("scheduler-missing-step-size", lambda: dict(lr_scheduler_cls=torch.optim.lr_scheduler.StepLR),
      "misses required argument(s) ['step_size']", "add 'step_size' to lr_scheduler_args"),
    m("scheduler-args-typo", lambda: dict(lr_scheduler_cls=torch.optim.lr_scheduler.StepLR,
                                          lr_scheduler_args={"steps": 10}), "did you mean 'step_size'?"),
    m("scheduler-without-optimizer", lambda: dict(optim_func=None, lr_scheduler_cls=torch.optim.lr_scheduler.StepLR,
                                                  lr_scheduler_args={"step_size": 10}),
      "lr_scheduler_cls needs an optimizer", "give optim_func", modes=("semi",)),
    # --- other arguments ---
    m("prepare-input-one-parameter", lambda: dict(prepare_input=lambda batch: batch),
      "cannot be called as prepare_input(data, device)"),
    m("sampler-instance", lambda: dict(distributed_sampler_cls=torch.utils.data.SequentialSampler(range(4))),
      "distributed_sampler_cls must be a sampler class", "pass the class"),
    m("keyword-typo", lambda: dict(memory_limits="4GiB"), "unknown keyword argument(s) ['memory_limits']",
      "did you mean memory_limit for 'memory_limits'?"),
    m("search-option-at-top-level", lambda: dict(max_trials=4), "search={'max_trials': ...}"),
    m("unknown-method", lambda: dict(load_strategy=["parallel_mode", "fsdp2"]), "fsdp2", modes=("semi",)),
    m("excluded-unknown-method", lambda: dict(excluded=["zero3"]), "excluded names unknown method 'zero3'"),
    m("finetune-without-strategy", lambda: dict(finetune_strategy=True),
      "finetune_strategy=True searches around load_strategy", modes=("auto",)),
    m("save-path-missing-directory", lambda: dict(save_strategy_to_file="/nonexistent-dir/strategy.json"),
      "does not exist; create it first"),
    m("memory-limit-unit", lambda: dict(memory_limit="6 parsecs"), "unknown unit 'parsecs'"),
    m("time-limit-negative", lambda: dict(time_limit=-5), "time_limit must be a positive number of seconds"),
    # --- options of the automatic search given with a load_strategy: warned by name, the build goes on ---
    m("memory-limit-with-load-strategy", lambda: dict(memory_limit="4GiB"),
      "memory_limit applies only to the automatic search", "leave out load_strategy", modes=("semi",), warning=True),
    m("strategy-server-with-load-strategy", lambda: dict(strategy_server="http://127.0.0.1:1"),
      "strategy_server applies only to the automatic search", modes=("semi",), warning=True),
    m("time-limit-with-load-strategy", lambda: dict(time_limit=600), "time_limit applies only to the automatic search",
      modes=("semi",), warning=True),
    m("search-options-with-load-strategy", lambda: dict(search={"max_trials": 20}),
      "search applies only to the automatic search", modes=("semi",), warning=True),
]
CASES = [pytest.param(mistake, mode, id=f"{mistake.id}-{mode}") for mistake in MISTAKES for mode in mistake.modes]


def test_the_battery_is_large_and_covers_both_modes() -> None:
    assert len({mistake.id for mistake in MISTAKES}) == len(MISTAKES) >= 40
    assert sum("auto" in mistake.modes for mistake in MISTAKES) >= 40
    listed = (HERE.parent / "docs" / "tests.md").read_text()
    missing = [mistake.id for mistake in MISTAKES if f"`{mistake.id}`" not in listed]
    assert not missing, f"not listed in docs/tests.md: {missing}"


def call(mistake: Mistake, mode: str) -> tuple[list[str], list[str]]:
    """auto_accelerate with the mistake: (problems raised, SearchOptionIgnored warnings); a problem is raised before
    anything is built ("cannot start", not "could not build")."""
    args: dict[str, Any] = dict(model=mlp(), optim_func=torch.optim.SGD, dataset=mlp_dataset(), loss_func=mlp_loss,
                                model_input_format="unpack_sequence", optim_args={"lr": 0.1},
                                dataloader_args={"batch_size": 8})
    if mode == "semi":
        args["load_strategy"] = SEMI
    else:
        args["search"] = QUICK_SEARCH
    args.update(mistake.args())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SearchOptionIgnored)
        try:
            atorch.auto_accelerate(**args)
            problems: list[str] = []
        except StrategyError as exc:
            problems = exc.problems
            assert str(exc).startswith("auto_accelerate cannot start"), f"refused after a build began: {exc}"
    return problems, [str(w.message) for w in caught if issubclass(w.category, SearchOptionIgnored)]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(("mistake", "mode"), CASES)
def test_a_mistake_is_named_with_its_fix(mistake: Mistake, mode: str) -> None:
    if mistake.id == "cuda-inside-forward" and torch.cuda.is_available():
        pytest.skip("a machine with a GPU runs .cuda() inside forward")
    problems, warned = call(mistake, mode)
    if mistake.warning:
        assert not problems, problems
        assert len(warned) == 1, warned
        text = warned[0]
    else:
        assert len(problems) == 1, problems  # one mistake, one sentence: no follow-on noise
        text = problems[0]
    missing = [phrase for phrase in mistake.phrases if phrase not in text]
    assert not missing, f"{missing} not in: {text}"


# ----- what is not a mistake: accepted as it is ---------------------------------------------------------------
def setup_of(**kwargs: Any) -> UserSetup:
    args: dict[str, Any] = dict(model=mlp(), optim_func=torch.optim.SGD, dataset=mlp_dataset(), loss_func=mlp_loss,
                                model_input_format="unpack_sequence", optim_args={"lr": 0.1},
                                dataloader_args={"batch_size": 8})
    args.update(kwargs)
    return UserSetup(**args)


def test_legitimate_setups_are_not_refused() -> None:
    partly_frozen = mlp()
    partly_frozen.inp.requires_grad_(False)
    with torch.device("meta"):
        on_meta = mlp()
    legit = {
        "scalar of shape (1,)": setup_of(loss_func=lambda d, o: F.cross_entropy(o, d[1]).reshape(1)),
        "some parameters frozen": setup_of(model=partly_frozen),
        "a model on the meta device": setup_of(model=on_meta),
        "a stream without len": setup_of(dataset=Stream()),
        "a stream without len, drop_last": setup_of(dataset=Stream(), dataloader_args={"batch_size": 8,
                                                                                       "drop_last": True}),
        "integer tokens, float parameters": setup_of(**gpt2_args()),
        "no optimizer, every parameter frozen": setup_of(model=frozen_mlp(), optim_func=None),
        "an optimizer function taking **kwargs": setup_of(
            optim_func=lambda params, **kw: torch.optim.SGD(params, **kw)),
        "a float64 regression target": setup_of(
            model=nn.Sequential(nn.Linear(16, 1)), model_input_format="input_target",
            dataset=regression_dataset(torch.float64), loss_func=lambda d, o: F.mse_loss(o, d[1])),
        "a dataset smaller than the batch, no drop_last": setup_of(dataset=mlp_dataset(4)),
    }
    found = {name: input_problems(setup) for name, setup in legit.items()}
    assert all(not p for p in found.values()), {k: v for k, v in found.items() if v}
    # A bf16 model given float32 data runs under a strategy that casts (autocast): not refused there.
    with pytest.warns(UserWarning, match="fewer than one global batch"):
        atorch.auto_accelerate(mlp(), torch.optim.SGD, mlp_dataset(4), mlp_loss, model_input_format="unpack_sequence",
                               optim_args={"lr": 0.1}, dataloader_args={"batch_size": 8}, load_strategy=SEMI)
    assert input_problems(setup_of(model=mlp().to(torch.bfloat16)), casts=True) == []


def test_legitimate_setups_build_in_both_modes_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", SearchOptionIgnored)
        status, result, _ = atorch.auto_accelerate(
            mlp(), torch.optim.SGD, mlp_dataset(), lambda d, o: F.cross_entropy(o, d[1]).reshape(1),
            model_input_format="unpack_sequence", optim_args={"lr": 0.1}, dataloader_args={"batch_size": 8},
            load_strategy=SEMI)
        assert status and len(result.dataloader) == 8
        status, result, _ = atorch.auto_accelerate(  # the search's options apply: no warning
            mlp(), torch.optim.SGD, mlp_dataset(), mlp_loss, model_input_format="unpack_sequence",
            optim_args={"lr": 0.1}, dataloader_args={"batch_size": 8}, memory_limit="1GiB", time_limit=600,
            search=QUICK_SEARCH)
        assert status


# ----- two processes: the same message on every rank ----------------------------------------------------------
def test_mistakes_at_two_processes_are_named_on_every_rank() -> None:
    out = run_json(HERE / "workers" / "misuse_worker.py", nproc=2, timeout=240)
    expected = {
        "batch-not-dividing-over-ranks": "global batch_size 3 does not divide over 2 data-parallel processes",
        "drop-last-no-batch-per-rank": "each of 2 data-parallel ranks 2 sample(s) per batch but only 1 sample(s)",
        "float64-on-one-rank-only": "The batch holds float64 tensors",
        "non-scalar-loss-both-ranks": "not a scalar",
        "unused-parameters-under-ddp": "('aux_head.weight', 'aux_head.bias': not used by forward or the loss)",
        "unused-parameters-in-automatic-mode": "('aux_head.weight', 'aux_head.bias': not used by forward or the loss)",
        "layer-drop-under-ddp": "model.config.layerdrop = 0.1 skips whole layers at random in training",
        "layer-drop-in-automatic-mode": "pass find_unused_parameters=True, or set model.config.layerdrop = 0",
        "layer-drop-under-fsdp": "'fsdp': model.config.layerdrop = 0.1 skips whole layers at random in training, each "
                                 "process drawing its own, and sharding gathers each layer's parameters",
    }
    legitimate = ("unused-parameters-with-find-unused", "layer-drop-with-find-unused")
    assert set(out) == {*expected, *legitimate}
    for name, phrase in expected.items():
        ranks = out[name]
        assert len(ranks) == 2 and ranks[0] == ranks[1], (name, ranks)  # the same error on every rank
        assert ranks[0]["type"] == "StrategyError" and phrase in ranks[0]["message"], (name, ranks[0])
    for name in legitimate:
        assert out[name] == [{"type": "none", "message": ""}] * 2, (name, out[name])
