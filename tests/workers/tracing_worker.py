"""Traced memory (atorch/strategy_search/costing/tracing.py) against the real program on 2 gloo ranks: FSDP2 with
autocast on a small VGG-like CNN (convolutions, GroupNorm, no repeated transformer blocks), whose peak is in
the post-backward reduce-scatter of its largest unit.

Usage: ``torchrun --nproc_per_node=2 tracing_worker.py``. Rank 0 traces each strategy (fake tensors, the
fake process group, while the other rank waits), then the search's dry-run measures it (``DryRunSession``: build
and two warm-up steps of two micro-batches, one sample per rank each; its peak, the maximum over ranks). Rank 0
prints ``RESULT {name: {"traced": bytes, "measured": bytes}}``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import json

import torch
import torch.distributed as dist
from torch import nn
from toy_models import SmallVGG

from atorch.distributed import init_distributed, shutdown
from atorch.dryrun.runner import DryRunSession
from atorch.model_context import UserSetup
from atorch.strategy import Strategy
from atorch.strategy_search.costing.tracing import MemoryTracer
from atorch.strategy_search.search.automatic import _trace_share, sample_batch, trace_on_every_rank
from atorch.strategy_search.search.space import Candidate

MICRO_BATCHES = 2
REPEATS = 5  # the least of them: under a loaded machine (two suites side by side) three all came out 6% high
STRATEGIES = {
    # the post-backward reduce-scatter of the largest block is the peak: gloo's copy of its input counts
    "fsdp amp": ["parallel_mode", ("amp_native", {"dtype": "bf16"}), "fsdp"],
    # with recompute the step came out on top in the trace: DTensor's global-shape metadata tensors were counted
    "zero2 amp ckpt": ["parallel_mode", ("amp_native", {"dtype": "bf16"}), "checkpoint",
                       ("zero2", {"implementation": "fsdp2"})],
}


def main() -> None:
    env = init_distributed()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    images, labels = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
    setup = UserSetup(model=SmallVGG(), optim_func=torch.optim.AdamW, dataset=list(zip(images, labels, strict=True)),
                      loss_func=lambda data, output: nn.functional.cross_entropy(output, data[1]),
                      model_input_format="unpack_sequence", optim_args={"lr": 1e-4},
                      dataloader_args={"batch_size": env.world_size, "shuffle": False})
    session = DryRunSession(setup, env, warmup=2, steps=1)
    out = {}
    for name, items in STRATEGIES.items():
        strategy = Strategy.load(items)
        traced = 0
        if env.rank == 0:  # as the search: rank 0 traces while the other rank waits
            traced = MemoryTracer(setup, sample_batch(setup, env, 1), env.world_size).trace(
                strategy, 1, MICRO_BATCHES).peak
        dist.barrier()
        # FSDP2's collectives run asynchronously on gloo, so a buffer may outlive its step by a little, by timing:
        # the same program's peak moved by up to 130 KB (7%) between runs. Timing only adds bytes: the least
        # of five dry-runs is the program's own peak.
        measured = []
        for _ in range(REPEATS):
            trial = session.run(strategy, timeout_s=200, micro_batches=MICRO_BATCHES, batch_size=env.world_size)
            assert trial.status == "ok", trial.reason
            measured.append(trial.peak_bytes)
        out[name] = {"traced": traced, "measured": min(measured), "runs": measured}
    # The search's tracing shared by the ranks: one family each (round-robin, in order), rank 1's sent back as JSON.
    cands = [Candidate(Strategy.load(items), 1, MICRO_BATCHES, (("name", name),)) for name, items in STRATEGIES.items()]
    if env.rank == 0:
        shared = trace_on_every_rank(session, sample_batch(setup, env, 1), 1, cands, limit_s=120)
        out["shared"] = {name: getattr(shared[c.key], "peak", shared[c.key]) for name, c in zip(
            STRATEGIES, cands, strict=True)}
    else:
        word = session.hear_next(120)
        assert word["kind"] == "trace" and list(word["shares"]) == ["1"], word
        _trace_share(session, word)
    session.close()
    if env.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    shutdown()  # ranks meet before gloo closes its connections (a lone teardown can abort a peer)


if __name__ == "__main__":
    main()
