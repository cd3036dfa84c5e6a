"""Expert parallel's measured cost on 2 real ranks (gloo), for tests/test_expert_parallel_costs.py.

Usage: ``torchrun --nproc_per_node=2 ep_cost_worker.py``. Dry-runs (``atorch.dryrun``: the search's own
measurement, peak increase of live tensor bytes over build and warm-up, max over ranks; median step time) the
tiny Mixtral of ``toy_models.moe`` under plain data parallel and expert parallel at expert 2, each alone and with
fsdp. Rank 0 prints ``RESULT {name: TrialResult}``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import json
from typing import Any

import torch
import torch.distributed as dist
import toy_models

from atorch.distributed import init_distributed
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


def main() -> None:
    env = init_distributed()
    results = dry_run_many(setup(), env, [Strategy.load(s) for s in STRATEGIES.values()], warmup=2, steps=5,
                           timeout_s=120)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({name: r.model_dump() for name, r in zip(STRATEGIES, results, strict=True)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
