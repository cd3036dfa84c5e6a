"""Expert parallel's measured cost on 2 real ranks (gloo), for tests/test_expert_parallel_costs.py.

Usage: ``torchrun --nproc_per_node=2 ep_cost_worker.py GROUP [DIR]``. ``measure``: dry-runs (``atorch.dryrun``:
the search's own measurement, peak increase of live tensor bytes over build and warm-up, max over ranks; median
step time) the tiny Mixtral of ``toy_models.moe`` under plain data parallel and expert parallel at expert 2, each
alone and with fsdp, and counts the aten operations of one step under data and expert parallel; rank 0 prints
``RESULT {name: TrialResult, "ops": {name: count}}``. ``search``: ``auto_accelerate``'s automatic
search on the same model with ``expert_parallel`` included (so every candidate splits the experts), a few trials;
rank 0 prints ``RESULT {"strategy", "trials", "losses"}``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import json
import sys
from typing import Any

import torch
import torch.distributed as dist
import toy_models

import atorch
from atorch.distributed import init_distributed, shutdown
from atorch.dryrun import dry_run_many
from atorch.model_context import UserSetup
from atorch.strategy import Strategy

MICRO_BATCH = 8  # samples per rank (the test predicts at the same)
EP: list[Any] = [("parallel_mode", {"dims": [["expert", 2], ["data", -1]]}), "expert_parallel"]
STRATEGIES: dict[str, list[Any]] = {"ddp": ["parallel_mode"], "ep": EP, "fsdp": ["fsdp"], "ep_fsdp": [*EP, "fsdp"]}


def setup() -> UserSetup:
    torch.manual_seed(0)
    return UserSetup(model=toy_models.moe(), optim_func=torch.optim.AdamW, dataset=toy_models.TokenDataset(),
                     loss_func=toy_models.gpt2_loss, model_input_format="unpack_dict", optim_args={"lr": 1e-3},
                     dataloader_args={"batch_size": MICRO_BATCH * 2})


def _ops_per_step(items: list[Any]) -> int:
    """Aten operations rank 0 dispatches in one training step (after two warm-up steps) under ``items``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from atorch.training import train_step

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    user = setup()
    _, result, _ = atorch.auto_accelerate(
        model=user.model, optim_func=user.optim_func, dataset=user.dataset, loss_func=user.loss_func,
        model_input_format=user.model_input_format, optim_args=user.optim_args,
        dataloader_args=user.dataloader_args, load_strategy=items)
    batches = iter(result.dataloader)
    for _ in range(2):
        train_step(result, [next(batches)])
    with Count():
        train_step(result, [next(batches)])
    result.close()
    return Count.ops


def measure(directory: str) -> dict[str, Any]:
    env = init_distributed()
    results = dry_run_many(setup(), env, [Strategy.load(s) for s in STRATEGIES.values()], warmup=2, steps=5,
                           timeout_s=120)
    report: dict[str, Any] = {name: r.model_dump() for name, r in zip(STRATEGIES, results, strict=True)}
    report["ops"] = {name: _ops_per_step(STRATEGIES[name]) for name in ("ddp", "ep")}
    return report


def search(directory: str) -> dict[str, Any]:
    import optuna

    from atorch.training import train_step

    storage = f"sqlite:///{directory}/search.db"
    user = setup()
    _, result, strategy = atorch.auto_accelerate(
        model=user.model, optim_func=user.optim_func, dataset=user.dataset, loss_func=user.loss_func,
        model_input_format=user.model_input_format, optim_args=user.optim_args,
        dataloader_args=user.dataloader_args, included=[EP[1]], time_limit=240,
        search={"warmup_steps": 1, "measure_steps": 2, "min_measure_s": 0, "max_trials": 3, "storage": storage})
    batches = iter(result.dataloader)
    losses = [float(train_step(result, [next(batches)])) for _ in range(2)]
    study = optuna.load_study(study_name=result.args.search["study_name"], storage=storage)
    trials = [{k: t.user_attrs.get(k) for k in ("status", "reason", "candidate")} for t in study.get_trials()]
    result.close()
    return {"strategy": strategy.to_list(), "trials": trials, "losses": losses}


GROUPS = {"measure": measure, "search": search}


def main() -> None:
    group, directory = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "/tmp"
    report = GROUPS[group](directory)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(report, default=str))
    shutdown()  # ranks meet before gloo closes its connections (a lone teardown can abort a peer)


if __name__ == "__main__":
    main()
