"""Dry-runs on 2 real ranks (launched by tests/test_dryrun.py); rank 0 prints ``RESULT {json}``.

- ``sequence``: one ``dry_run_many`` over five candidates whose model behaves per trial (see FaultyMLP):
  ok (ddp), raises on rank 1 (ddp), ok (fsdp), sleeps on rank 1 past the timeout (ddp), ok (zero1).
  Reported: every rank's results, and rank 0's wall time per trial.
- ``budget``: a memory budget of 1 byte turns an ok trial into "oom".
- ``mismatch``: different candidate lists on the two ranks are refused on both.
- ``session_mismatch``: one DryRunSession, ``run`` called with a different strategy on each rank, then with a
  different micro-batch count, then with the same candidate: the first two raise SetupError on both ranks before
  anything is built (no hang), the third runs.
- ``release``: live tensor bytes before and after several trials.
- ``unused_later``: a model that leaves a block out from its second step on, under DDP.
- ``inapplicable``: a candidate preflight refuses is reported, not built.
- ``lost``: rank 1 oversleeps the rejoin time too: rank 0 raises RankLost at once, rank 1 when it wakes (before
  its own watchdog would end the process: SELF_EXIT_DELAY_S after it learns it was given up); nothing more runs.
- ``failfast``: with a trial timeout of 120 s, rank 1 raises in its build (making the optimizer), then
  in a step, each followed by a candidate that must run normally. Reported per trial: every rank's
  result and wall-clock end, and when rank 1 raised.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import gc
import json
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import toy_models

from atorch.distributed import all_gather_json, init_distributed
from atorch.dryrun import dry_run, dry_run_many
from atorch.dryrun.memory import live_tensor_bytes
from atorch.dryrun.runner import DryRunSession
from atorch.errors import RankLost
from atorch.model_context import UserSetup
from atorch.strategy import Strategy

TIMEOUT_S = 4.0
SLEEP_S = 9.0  # rank 1 in the hang case: well past the timeout, then it wakes and rejoins
PLAN = ["ok", "raise", "ok", "sleep", "ok"]
STRATEGIES = [["parallel_mode"], ["parallel_mode"], ["fsdp"], ["parallel_mode"], ["zero1"]]
PERMUTED_FSDP: list[Any] = [("parallel_mode", {"dims": [("data", 2)], "rank_order": [1, 0]}), "fsdp"]


class FaultyMLP(toy_models.MLP):
    """The toy MLP; the n-th fresh copy to run forward in this process follows PLAN[n] on rank 1.

    Each trial builds its own deep copy of the user's model, so copies count trials: a real model,
    real faults, no mocks.
    """

    copies_seen = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        if not hasattr(self, "_plan"):
            self._plan = PLAN[FaultyMLP.copies_seen] if FaultyMLP.copies_seen < len(PLAN) else "ok"
            FaultyMLP.copies_seen += 1
        if dist.get_rank() == 1 and self._plan == "raise":
            raise ValueError("injected failure on rank 1")
        if dist.get_rank() == 1 and self._plan == "sleep":
            self._plan = "ok"  # once: the step returns late, then the copy would train normally
            time.sleep(SLEEP_S)
        return super().forward(x, y)


def setup(model: torch.nn.Module | None = None) -> UserSetup:
    torch.manual_seed(0)
    return UserSetup(
        model=model if model is not None else FaultyMLP(), optim_func=torch.optim.AdamW,
        dataset=toy_models.mlp_dataset(), loss_func=toy_models.mlp_loss, model_input_format="unpack_sequence",
        optim_args={"lr": 1e-2}, dataloader_args={"batch_size": 8},
    )


def sequence(env: Any) -> dict[str, Any]:
    candidates = [Strategy.load(s) for s in STRATEGIES]
    start = time.monotonic()
    results = dry_run_many(setup(), env, candidates, warmup=1, steps=3, timeout_s=TIMEOUT_S)
    return {"results": [r.model_dump() for r in results], "total_s": time.monotonic() - start}


def budget(env: Any) -> dict[str, Any]:
    model = toy_models.mlp()
    result = dry_run(setup(model), env, Strategy.load(["parallel_mode"]), warmup=1, steps=1, memory_budget=1)
    return result.model_dump()


def mismatch(env: Any) -> dict[str, Any]:
    mine = [Strategy.load(["parallel_mode"] if env.rank == 0 else ["fsdp"])]
    try:
        dry_run_many(setup(toy_models.mlp()), env, mine, steps=1)
    except Exception as exc:  # noqa: BLE001
        return {"raised": f"{type(exc).__name__}: {exc}"}
    return {"raised": None}


def session_mismatch(env: Any) -> dict[str, Any]:
    session = DryRunSession(setup(toy_models.mlp()), env, warmup=1, steps=1)
    raised = []
    start = time.monotonic()
    for strategy, micro_batches in ((["parallel_mode"] if env.rank == 0 else ["fsdp"], 1),
                                    (["parallel_mode"], 1 + env.rank)):
        try:
            session.run(Strategy.load(strategy), timeout_s=60, micro_batches=micro_batches)
            raised.append(None)
        except Exception as exc:  # noqa: BLE001
            raised.append(f"{type(exc).__name__}: {exc}")
    refused_s = time.monotonic() - start
    after = session.run(Strategy.load(["parallel_mode"]), timeout_s=60)
    session.close()
    return {"raised": raised, "refused_s": refused_s, "after": after.status}


def release(env: Any) -> dict[str, Any]:
    user = setup(toy_models.mlp())
    gc.collect()
    before = live_tensor_bytes()
    after = []
    ddp_fp16 = ["parallel_mode", ["amp_native", {"dtype": "fp16"}]]  # loss scaling skips its first steps
    # fsdp + fp16 after an fsdp trial: DTensor's sharding caches (mesh equality ignores process groups)
    # once handed this trial the previous trial's mesh, whose group was gone
    fsdp_fp16 = ["fsdp", ["amp_native", {"dtype": "fp16"}]]
    for strategy in (["parallel_mode"], ["fsdp"], fsdp_fp16, ["zero1"], ["zero2"], ddp_fp16, ["parallel_mode"]):
        result = dry_run(user, env, Strategy.load(strategy), warmup=1, steps=2)
        assert result.status == "ok", result.reason
        gc.collect()
        after.append(live_tensor_bytes())
    return {"before": before, "after": after}


class SkipsABlockLater(toy_models.MLP):
    """The toy MLP; from its second forward on it skips block 1 (as a layer drawn by LayerDrop would be)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1
        x = self.inp(x)
        for index, block in enumerate(self.blocks):
            if index != 1 or self.calls == 1:
                x = x + block(x)
        return self.head(x)


def unused_later(env: Any) -> dict[str, Any]:
    # DDP fails the step after the one that left block 1 out: its message names parameters by index only
    result = dry_run(setup(SkipsABlockLater()), env, Strategy.load(["parallel_mode"]), warmup=2, steps=2)
    return result.model_dump()


def inapplicable(env: Any) -> dict[str, Any]:
    # fsdp with a permuted rank order is refused before anything is built (DCP would misplace shards).
    results = dry_run_many(setup(toy_models.mlp()), env,
                           [Strategy.load(PERMUTED_FSDP), Strategy.load(["parallel_mode"])], warmup=1, steps=1)
    return {"results": [r.model_dump() for r in results]}


class SleepOnceMLP(toy_models.MLP):
    """The toy MLP; rank 1 sleeps SLEEP_S in its first forward in this process."""

    slept = False

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        if dist.get_rank() == 1 and not SleepOnceMLP.slept:
            SleepOnceMLP.slept = True
            time.sleep(SLEEP_S)
        return super().forward(x, y)


def lost(env: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    candidates = [Strategy.load(["parallel_mode"])] * 3
    start = time.monotonic()
    try:
        dry_run_many(setup(SleepOnceMLP()), env, candidates, warmup=1, steps=1, timeout_s=2.0, rejoin_timeout_s=1.0)
    except RankLost as exc:
        return {"raised": str(exc), "ranks": exc.ranks, "results": [r.model_dump() for r in exc.results],
                "total_s": time.monotonic() - start}
    return {"raised": None, "total_s": time.monotonic() - start}


FAILFAST_TIMEOUT_S = 120.0  # a failure must cost seconds, not this
FAILFAST_PLAN = ["raise_build", "ok", "raise_step", "ok"]
_failfast: dict[str, Any] = {"plan": "ok", "raised_at": None}


def _fail_on_rank_1(where: str) -> None:
    if dist.get_rank() == 1 and _failfast["plan"] == f"raise_{where}":
        _failfast["raised_at"] = time.time()
        raise ValueError(f"injected {where} failure on rank 1")


class FailFastMLP(toy_models.MLP):
    """The toy MLP; rank 1 raises in forward (warm-up step 0) in a "raise_step" trial."""

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        _fail_on_rank_1("step")
        return super().forward(x, y)


def failfast_adamw(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    """AdamW; rank 1 raises making it in a "raise_build" trial (rank 0 goes on into DDP's first collective)."""
    _fail_on_rank_1("build")
    return torch.optim.AdamW(params, **kwargs)


def failfast(env: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    user = UserSetup(model=FailFastMLP(), optim_func=failfast_adamw, dataset=toy_models.mlp_dataset(),
                     loss_func=toy_models.mlp_loss, model_input_format="unpack_sequence", optim_args={"lr": 1e-2},
                     dataloader_args={"batch_size": 8})
    session = DryRunSession(user, env, warmup=1, steps=2, rejoin_timeout_s=FAILFAST_TIMEOUT_S)
    trials = []
    for plan in FAILFAST_PLAN:
        _failfast.update(plan=plan, raised_at=None)
        result = session.run(Strategy.load(["parallel_mode"]), timeout_s=FAILFAST_TIMEOUT_S)
        trials.append({"result": result.model_dump(), "end": time.time(), "raised_at": _failfast["raised_at"]})
    session.close()
    return {"trials": trials}


SCENARIOS = [sequence, budget, mismatch, session_mismatch, release, unused_later, inapplicable, lost, failfast]


def main() -> None:
    env = init_distributed()
    report: dict[str, Any] = {}
    chosen = sys.argv[1:]  # scenario names to run (all by default)
    for scenario in [s for s in SCENARIOS if not chosen or s.__name__ in chosen]:
        try:
            entry = scenario(env)
        except Exception as exc:  # reported per scenario; the others still run
            entry = {"failed": "".join(traceback.format_exception_only(exc)).strip()[-2000:]}
            print(f"[rank {env.rank}] {scenario.__name__} failed:\n{traceback.format_exc()}", file=sys.stderr)
        report[scenario.__name__] = all_gather_json(entry, timeout_s=120)  # every rank's view
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
