"""Processes that disagree: every rank raises the same error naming the difference, before anything is built.

Usage: ``torchrun --nproc_per_node=2 agree_worker.py``. Each scenario gives rank 1 something different from
rank 0 (the strategy, the model, an argument) and records, per rank, what was raised and how long it took;
rank 0 prints every rank's records. A scenario that hung would never print: the test's time-out catches it.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import json
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import toy_models

import atorch
from atorch.build import agreed_preflight
from atorch.distributed import all_gather_json, init_distributed
from atorch.model_context import UserSetup
from atorch.options import SearchOptions
from atorch.strategy import Strategy


def _accelerate(rank_one: Callable[[], dict[str, Any]], **common: Any) -> Callable[[], Any]:
    """auto_accelerate on the MLP, with ``rank_one()``'s arguments replacing the common ones on rank 1."""

    def run() -> Any:
        args: dict[str, Any] = {
            "model": toy_models.mlp(), "optim_func": torch.optim.SGD, "dataset": toy_models.mlp_dataset(),
            "loss_func": toy_models.mlp_loss, "model_input_format": "unpack_sequence", "optim_args": {"lr": 0.1},
            "dataloader_args": {"batch_size": 8}, "load_strategy": ["parallel_mode"], **common,
        }
        if dist.get_rank() == 1:
            args.update(rank_one())
        return atorch.auto_accelerate(**args)

    return run


def _search_entry() -> Any:
    """The automatic search's entry, as the Lightning strategy starts it: rank 1's model has one block more."""
    from atorch.strategy_search.search.entry import search_and_check

    torch.manual_seed(0)
    model = toy_models.MLP(depth=4 if dist.get_rank() == 1 else 3)
    setup = UserSetup(model=model, optim_func=torch.optim.SGD, dataset=toy_models.mlp_dataset(),
                      loss_func=toy_models.mlp_loss, model_input_format="unpack_sequence",
                      dataloader_args={"batch_size": 8})
    return search_and_check(setup, init_distributed(), [], [], None, None, None, SearchOptions(max_trials=1), None)


def _preflight() -> Any:
    """The check every build path shares (the Lightning strategy's), given rank-dependent strategies."""
    setup = UserSetup(model=toy_models.mlp(), optim_func=torch.optim.SGD)
    strategy = Strategy.load(["zero2"] if dist.get_rank() == 1 else ["zero1"])
    return agreed_preflight(setup, init_distributed(), strategy, what="cannot apply")


SCENARIOS: dict[str, Callable[[], Any]] = {
    "strategy": _accelerate(lambda: {"load_strategy": ["parallel_mode"]}, load_strategy=["fsdp"]),
    "model": _accelerate(lambda: {"model": toy_models.MLP(dim=48)}),
    "batch_size": _accelerate(lambda: {"dataloader_args": {"batch_size": 16}}),
    "automatic": _accelerate(lambda: {"model": toy_models.MLP(dim=48)}, load_strategy=None),
    "search_entry": _search_entry,
    "preflight": _preflight,
    "agreeing": _accelerate(dict),  # the control: equal everywhere, built as before
}


def main() -> None:
    init_distributed()
    report = {}
    for name, scenario in SCENARIOS.items():
        start = time.monotonic()
        try:
            out = scenario()
            entry: dict[str, Any] = {"raised": None, "status": out[0] if isinstance(out, tuple) else None}
            if isinstance(out, tuple) and len(out) == 3 and hasattr(out[1], "close"):
                out[1].close()
        except Exception as exc:  # noqa: BLE001  (recorded: the test asserts on it)
            entry = {"raised": type(exc).__name__, "message": str(exc)}
        entry["seconds"] = time.monotonic() - start
        report[name] = all_gather_json(entry, timeout_s=120)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
