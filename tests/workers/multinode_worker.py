"""A two-node job simulated on one machine (launched by tests/test_multinode.py: two torchrun launchers,
``--nnodes 2 --node-rank {0,1} --rdzv-backend c10d``, 2 processes each: global ranks 0–3, local ranks 0–1).

argv: a scratch directory shared by both "nodes" (the checkpoint), each node's own cache directory (the
hardware profile and the search's storage: node-local disks, as on a real cluster), this node's label.

- semi-automatic: GPT-2 under tensor 2 × data 2 (tensor listed first: adjacent ranks), 2 steps, a checkpoint
  saved, 2 more steps (losses A); a fresh build from another seed loads it and runs the same 2 steps (B);
- automatic: the search with tensor parallelism included, a tiny space and two dry-runs; the pick trains;
- the hardware profile the search measured (nodes × processes per node).

Every rank reports its ranks and node; rank 0 prints ``RESULT {json}``.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ["ATORCH_CACHE_DIR"] = sys.argv[2]

import json
import time
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import toy_models

import atorch
from atorch.distributed import all_gather_json, init_distributed
from atorch.training import train_step

SCRATCH, CACHE, NODE = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
TP2 = [("parallel_mode", {"dims": [["tensor", 2], ["data", -1]]}), "tensor_parallel"]


def accelerate(seed: int, **kwargs: Any) -> tuple[Any, Any]:
    _, result, strategy = atorch.auto_accelerate(
        toy_models.tiny_gpt2(seed), torch.optim.AdamW, toy_models.TokenDataset(samples=32), toy_models.gpt2_loss,
        model_input_format="unpack_dict", optim_args={"lr": 1e-3}, dataloader_args={"batch_size": 8}, **kwargs)
    return result, strategy


def tensor_groups(strategy: Any, world: int) -> list[list[int]]:
    """The global ranks of each tensor-parallel group of the strategy's layout ([] without one)."""
    layout = strategy.layout(world)
    if layout.size("tensor") == 1:
        return []
    lines = layout.ranks().movedim(layout.names.index("tensor"), -1).reshape(-1, layout.size("tensor"))
    return [sorted(int(r) for r in line) for line in lines]


def semi_automatic() -> dict[str, Any]:
    a, strategy = accelerate(0, load_strategy=TP2)
    batches = list(islice(a.dataloader, 4))
    first = [float(train_step(a, [b])) for b in batches[:2]]
    atorch.save_checkpoint(SCRATCH / "ckpt", a, step=2)
    losses_a = [float(train_step(a, [b])) for b in batches[2:]]
    a.close()
    b, _ = accelerate(7, load_strategy=TP2)
    b_batches = list(islice(b.dataloader, 4))  # the iterator draws a seed: create it before loading
    info = atorch.load_checkpoint(SCRATCH / "ckpt", b)
    losses_b = [float(train_step(b, [x])) for x in b_batches[2:]]
    b.close()
    return {"strategy": strategy.to_list(), "tensor_groups": tensor_groups(strategy, 4), "first": first,
            "losses_a": losses_a, "losses_b": losses_b, "info": info}


def automatic() -> dict[str, Any]:
    search = {"max_trials": 2, "top_k": 2, "warmup_steps": 1, "measure_steps": 1, "min_measure_s": 0,
              "confirm_within": 0, "precision": "exact"}
    result, strategy = accelerate(0, included=["tensor_parallel"], excluded=["checkpoint", "zero1", "zero2"],
                                  search=search, time_limit=120)
    losses = [float(train_step(result, [b])) for b in islice(result.dataloader, 2)]
    record = result.args.search
    result.close()
    from atorch.strategy_search.costing.hardware import measure_profile

    profile = measure_profile()  # the search's, from this node's cache (rank 0's, sent to every rank)
    return {"strategy": strategy.to_list(), "tensor_groups": tensor_groups(strategy, 4), "losses": losses,
            "search": record, "profile": {"world_size": profile.world_size, "gpus_per_node": profile.gpus_per_node,
                                          "nodes": profile.nodes, "local_world_size": profile.local_world_size}}


def main() -> dict[str, Any]:
    env = init_distributed()
    me = {"rank": env.rank, "local_rank": env.local_rank, "node": NODE, "world": env.world_size,
          "group_rank": int(os.environ["GROUP_RANK"]), "local_world": int(os.environ["LOCAL_WORLD_SIZE"])}
    ranks = all_gather_json(me)
    start = time.monotonic()
    semi = semi_automatic()
    middle = time.monotonic()
    auto = automatic()
    return {"ranks": ranks, "semi": semi, "auto": auto, "seconds": [middle - start, time.monotonic() - middle]}


if __name__ == "__main__":
    out = main()
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(out), flush=True)
