"""Fully automatic auto_accelerate on 2 real ranks (launched by tests/test_search.py); rank 0 prints ``RESULT {json}``.

argv: scenario, a scratch directory (the search's SQLite storage and the hardware-profile cache).

- ``auto``: tiny GPT-2, no load_strategy, a time limit; the pick trains; the user's model is unchanged.
  Then the same call again: the cached pick, with no dry-run.
- ``budget``: plain DDP's peak is measured first (a dry-run); then a memory_limit of 70% of it: the
  pick fits (its measured peak is under the limit) and is not plain DDP.
- ``remote``: the same against a strategy server (``atorch serve``, started by the test): a search, then
  the cached pick with no dry-run; an unreachable server is an error on every rank, or, with
  ``server_fallback``, a local search.
- ``nofit``: a memory limit nothing fits under: status False with the reason on every rank.
- ``faults``: a model that raises on rank 1 under autocast and sleeps past the trial timeout on rank 1
  in bf16 (once); a space of 8 candidates, all dry-run: the failure and the hang are recorded with
  their reasons and the search picks a working fp32 candidate.
- ``unbuildable``: a conv classifier whose tensor-parallel build fails: that family is ruled out before the first
  dry-run (never dry-run) and the report names the reason.
- ``hang RANK``: that rank never returns from its second dry-run (an endless sleep in the model's forward): the
  other prints the error it got (``RESULT``) and then lingers; the job must end all the same. ``resume``: the
  same job again, nothing hangs: the search resumes the stored study (``RESULT``: its record and log lines).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ["ATORCH_CACHE_DIR"] = sys.argv[2]

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import toy_models

import atorch
from atorch.distributed import all_gather_json, init_distributed
from atorch.dryrun import dry_run
from atorch.errors import RankLost
from atorch.model_context import UserSetup
from atorch.strategy import Strategy
from atorch.strategy_search.search import automatic
from atorch.strategy_search.search.candidates import family_key
from atorch.training import train_step

SCRATCH = sys.argv[2] if len(sys.argv) > 2 else "."


class _TraceLines(logging.Handler):
    """The search's line on how many candidates' memory it traced, and on why it traced none where it did not."""

    lines: list[str] = []
    untraced: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "candidates traced" in record.getMessage():
            self.lines.append(record.getMessage())
        elif record.getMessage().startswith("cost model: memory not traced"):
            self.untraced.append(record.getMessage())


logging.getLogger("atorch.strategy_search.search.automatic").addHandler(_TraceLines())


class _Events(logging.Handler):
    """The one-time preparations and the dry-runs, in the order the search did them."""

    lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "one-time preparation" in text or text.startswith("dry-run "):
            self.lines.append(text)


STORAGE = f"sqlite:///{SCRATCH}/search.db"
QUICK = {"warmup_steps": 1, "measure_steps": 2, "min_measure_s": 0, "storage": STORAGE}


def gpt2_setup(**extra: Any) -> dict[str, Any]:
    return dict(
        model=toy_models.tiny_gpt2(), optim_func=torch.optim.AdamW, dataset=toy_models.TokenDataset(samples=64),
        loss_func=toy_models.gpt2_loss, model_input_format="unpack_dict", optim_args={"lr": 1e-3},
        dataloader_args={"batch_size": 8}, **extra,
    )


def train(result: Any, steps: int) -> list[float]:
    batches = iter(result.dataloader)
    k = result.args.gradient_accumulation_steps
    return [float(train_step(result, [next(batches) for _ in range(k)])) for _ in range(steps)]


def trials_of(result: Any) -> list[dict[str, Any]]:
    import optuna

    study = optuna.load_study(study_name=result.args.search["study_name"], storage=STORAGE)
    return [{"number": t.number, **t.user_attrs} for t in study.get_trials(deepcopy=False)]


def auto() -> dict[str, Any]:
    setup = gpt2_setup()
    before = {k: v.clone() for k, v in setup["model"].state_dict().items()}
    start = time.monotonic()
    _, result, strategy = atorch.auto_accelerate(**setup, time_limit=240, search=QUICK)
    first_s = time.monotonic() - start
    losses = train(result, 4)
    first = {"strategy": strategy.to_list(), "search": result.args.search, "seconds": first_s, "losses": losses,
             "accumulation": result.args.gradient_accumulation_steps, "global_batch": result.args.global_batch_size,
             "unchanged": all(torch.equal(before[k], v) for k, v in setup["model"].state_dict().items()),
             "trials": [{k: t.get(k) for k in ("status", "reason")} for t in trials_of(result)],
             "trace_lines": list(_TraceLines.lines), "events": list(_Events.lines)}
    result.close()
    start = time.monotonic()
    _, again, strategy2 = atorch.auto_accelerate(**gpt2_setup(), time_limit=240, search=QUICK)
    second = {"strategy": strategy2.to_list(), "search": again.args.search, "seconds": time.monotonic() - start,
              "losses": train(again, 2)}
    again.close()
    return {"first": first, "second": second}


def budget() -> dict[str, Any]:
    setup = gpt2_setup()
    env = init_distributed()
    user = UserSetup(**{k: v for k, v in setup.items()})
    ddp = dry_run(user, env, Strategy.load(["parallel_mode"]), warmup=1, steps=1)
    limit = int(0.7 * ddp.peak_bytes)
    # two warm-up steps: the first runs deterministically and is checked against the user's model (numerics)
    _, result, strategy = atorch.auto_accelerate(**setup, memory_limit=limit,
                                                 search={**QUICK, "max_trials": 6, "warmup_steps": 2})
    trials = trials_of(result)
    best = result.args.search
    picked = [t for t in trials if t.get("status") == "ok" and t["candidate"]["strategy"] == json.loads(
        strategy.to_json(indent=None))]
    losses = train(result, 2)
    result.close()
    return {"ddp_peak": ddp.peak_bytes, "limit": limit, "strategy": strategy.to_list(), "search": best,
            "trace_lines": list(_TraceLines.lines), "untraced_lines": list(_TraceLines.untraced),
            "picked_peak": max(t["measured"]["peak_memory_bytes"] for t in picked) if picked else None,
            "statuses": [t.get("status") for t in trials], "losses": losses,
            # the memory family (layout, sharding, recompute) of each dry-run that ran out of memory
            "oom_families": [family_key(json.loads(t["key"])) for t in trials if t.get("status") == "oom"],
            # the whole points (micro-batch size and precision too) and their figures: what a repeated family was
            "oom_trials": [[t["key"], (t.get("predicted") or {}).get("peak_memory_bytes"),
                            (t.get("measured") or {}).get("peak_memory_bytes")] for t in trials
                           if t.get("status") == "oom"],
            "first_losses": [[t["measured"].get("loss"), t["measured"].get("reference_loss"),
                              t["candidate"]["strategy"]] for t in trials if t.get("status") == "ok"],
            "measured_predicted_peaks": [t["predicted"].get("peak_memory_bytes") for t in trials
                                         if t.get("status") in ("ok", "oom") and t.get("predicted")]}


HUNG = {"done": False}


class FaultyGPT2(torch.nn.Module):
    """Tiny GPT-2 that raises on rank 1 under autocast, and sleeps once on rank 1 in bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = toy_models.tiny_gpt2()

    def forward(self, **batch: Any) -> Any:
        rank = dist.get_rank()
        if rank == 1 and torch.is_autocast_enabled("cpu"):
            raise RuntimeError("injected failure under autocast")
        if rank == 1 and next(self.parameters()).dtype == torch.bfloat16 and not HUNG["done"]:
            HUNG["done"] = True
            time.sleep(12.0)
        return self.inner(**batch)


def faults() -> dict[str, Any]:
    setup = gpt2_setup()
    setup["model"] = FaultyGPT2()
    setup["dataloader_args"] = {"batch_size": 4}
    # every one of the 8 candidates is measured: none of max_trials is kept back for a confirmation
    options = {**QUICK, "max_trials": 8, "trial_timeout_s": 6.0, "confirm_within": 0, "skip_slower_than": None,
               "precision": "low"}  # half bf16 is where rank 1 sleeps
    _, result, strategy = atorch.auto_accelerate(
        **setup, excluded=["zero1", "zero2", "fsdp", "checkpoint", "module_replace"], search=options)
    trials = trials_of(result)
    losses = train(result, 2)
    result.close()
    return {"strategy": strategy.to_list(), "search": result.args.search, "losses": losses,
            "trials": [{k: t.get(k) for k in ("status", "reason")} | {"point": t["candidate"]["point"]}
                       for t in trials]}


def remote() -> dict[str, Any]:
    """Against the strategy server in $ATORCH_STRATEGY_SERVER: a search, then the same job again."""
    out: dict[str, Any] = {}
    for label in ("first", "second"):
        _, result, strategy = atorch.auto_accelerate(**gpt2_setup(), search={**QUICK, "max_trials": 3})
        out[label] = {"strategy": strategy.to_list(), "search": result.args.search, "losses": train(result, 2)}
        result.close()
    # A server nobody listens on: a clear error on every rank (after 1 s of retries, not the default 120 s);
    # with server_fallback, a local search.
    os.environ["ATORCH_SERVER_RETRY_S"] = "1"
    try:
        atorch.auto_accelerate(**gpt2_setup(), strategy_server="http://127.0.0.1:9", search=QUICK)
        out["unreachable"] = "no error"
    except atorch.StrategyError as exc:  # rank 1: rank 0's problems
        out["unreachable"] = str(exc)
    except Exception as exc:  # noqa: BLE001  (rank 0: the client's own error)
        out["unreachable"] = f"{type(exc).__name__}: {exc}"
    everyone = all_gather_json(out["unreachable"])
    out["unreachable_everywhere"] = all("127.0.0.1:9" in text for text in everyone)
    _, result, _ = atorch.auto_accelerate(**gpt2_setup(), strategy_server="http://127.0.0.1:9",
                                          search={**QUICK, "max_trials": 1, "server_fallback": True})
    out["fallback"] = result.args.search
    result.close()
    return out


def nofit() -> dict[str, Any]:
    """A memory limit nothing fits under: every rank returns status False with rank 0's reason (ATorch's)."""
    status, result, strategy = atorch.auto_accelerate(**gpt2_setup(), memory_limit=1024,
                                                      search={**QUICK, "dryrun": False})
    mine = {"status": status, "strategy": strategy, "fields": [f is None for f in result], "reason": result.reason}
    return {"ranks": all_gather_json(mine)}


HANG_TIMEOUT_S, HANG_REJOIN_S = 4.0, 3.0
HANG_OPTIONS = {**QUICK, "max_trials": 4, "trial_timeout_s": HANG_TIMEOUT_S, "rejoin_timeout_s": HANG_REJOIN_S,
                "confirm_within": 0, "skip_slower_than": None}
HANG_STARTED = "hang_started"  # rank 1 writes the time its endless sleep began (time.time()) to this file


class HangingMLP(toy_models.MLP):
    """The toy MLP; in ``hang``, the copy that the chosen rank builds for its second dry-run never returns from
    forward. Each trial builds its own deep copy of the user's model, so copies seen inside a trial (where the
    trial's process group stands in for the job's) count trials: a real model, a real hang."""

    copies = 0
    hang: int | None = None  # the rank that hangs
    job_group: Any = None

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        in_trial = dist.distributed_c10d._get_default_group() is not HangingMLP.job_group
        if HangingMLP.hang == dist.get_rank() and in_trial:
            if not hasattr(self, "_copy"):
                self._copy = HangingMLP.copies
                HangingMLP.copies += 1
            if self._copy == 1:
                Path(SCRATCH, HANG_STARTED).write_text(repr(time.time()))
                while True:
                    time.sleep(1.0)
        return super().forward(x, y)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def mlp_setup() -> dict[str, Any]:
    torch.manual_seed(0)
    return dict(model=HangingMLP(), optim_func=torch.optim.AdamW, dataset=toy_models.mlp_dataset(),
                loss_func=toy_models.mlp_loss, model_input_format="unpack_sequence", optim_args={"lr": 1e-3},
                dataloader_args={"batch_size": 8},
                excluded=["zero1", "zero2", "fsdp", "module_replace"])  # quick builds (no DeepSpeed op build)


def hang() -> dict[str, Any]:
    HangingMLP.hang = int(sys.argv[3])
    init_distributed()
    HangingMLP.job_group = dist.distributed_c10d._get_default_group()
    # rank 0 speaks within moments of a trial's end; rank 1 takes it for stuck after rejoin_timeout_s and this
    automatic.LEADER_SILENT_S = 2.0
    try:
        atorch.auto_accelerate(**mlp_setup(), search=HANG_OPTIONS)
        out: dict[str, Any] = {"raised": None}
    except RankLost as exc:
        out = {"raised": str(exc), "ranks": exc.ranks, "at": time.time()}
    if dist.get_rank() != HangingMLP.hang:
        print("RESULT " + json.dumps(out), flush=True)
    time.sleep(120.0)  # a process that caught the error and lingers: the job must end all the same
    return out


def resume() -> dict[str, Any]:
    lines = _Lines()
    logging.getLogger("atorch").addHandler(lines)
    _, result, strategy = atorch.auto_accelerate(**mlp_setup(), search=HANG_OPTIONS)
    logging.getLogger("atorch").removeHandler(lines)
    trials = trials_of(result)
    losses = train(result, 2)
    out = {"search": {k: result.args.search[k] for k in ("source", "dry_runs", "stop_reason", "study_name")},
           "lines": lines.lines, "losses": losses,
           "trials": [{k: t.get(k) for k in ("status", "reason", "key")} for t in trials]}
    result.close()
    return out


def unbuildable() -> dict[str, Any]:
    """A convolutional classifier whose tensor-parallel build refuses it (toy_models.ConvClassifier): the build
    check before the search rules that family out; the search runs the rest, and the report says why."""
    from atorch.strategy_search.search.report import write_report

    images = torch.utils.data.TensorDataset(torch.randn(64, 3, 8, 8), torch.randint(0, 10, (64,)))
    _, result, strategy = atorch.auto_accelerate(
        toy_models.ConvClassifier(), torch.optim.SGD, dataset=images, optim_args={"lr": 0.1},
        loss_func=lambda data, out: torch.nn.functional.cross_entropy(out, data[1]),
        model_input_format="unpack_sequence", dataloader_args={"batch_size": 8},
        search={**QUICK, "max_trials": 4, "top_k": 3})
    out: dict[str, Any] = {"strategy": strategy.to_list(), "search": result.args.search["stop_reason"]}
    if int(os.environ.get("RANK", "0")) == 0:
        import optuna

        study = optuna.load_study(study_name=result.args.search["study_name"], storage=STORAGE)
        out["unbuildable"] = study.user_attrs.get("unbuildable")
        out["trials"] = [{k: t.get(k) for k in ("status", "reason", "key")} for t in trials_of(result)]
        out["report"] = write_report(STORAGE, Path(SCRATCH) / "report.html").read_text()
    result.close()
    return out


class SlowUnderAutocastMLP(toy_models.MLP):
    """The toy MLP, made clearly slow (a real sleep in each forward) where it runs under autocast: a candidate that
    cannot win, whose dry-run the search stops early once a faster one has run."""

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        if torch.is_autocast_enabled("cpu"):
            time.sleep(0.2)
        return super().forward(x, y)


def slow() -> dict[str, Any]:
    """Early stop on 2 ranks: every fp32 and autocast candidate of a DDP space is dry-run (no skip, no confirmation),
    5 timed steps each; the autocast ones are several times slower than the fp32 best, so their timed steps stop
    at the second."""
    setup = {**mlp_setup(), "model": SlowUnderAutocastMLP(), "excluded": ["zero1", "zero2", "fsdp", "module_replace",
                                                                         "checkpoint", "half"]}
    _, result, strategy = atorch.auto_accelerate(
        **setup, search={**QUICK, "measure_steps": 5, "max_trials": 8, "confirm_within": 0, "skip_slower_than": None,
                         "top_k": 8})
    out = {"strategy": strategy.to_list(), "stop": result.args.search["stop_reason"],
           "trials": [{"status": t.get("status"), "point": t["candidate"]["point"],
                       "measured": t.get("measured")} for t in trials_of(result) if t.get("measured")]}
    result.close()
    return out


SCENARIOS = {"slow": slow, "auto": auto, "budget": budget, "faults": faults, "remote": remote, "nofit": nofit,
             "hang": hang, "resume": resume, "unbuildable": unbuildable}

if __name__ == "__main__":
    logging.getLogger("atorch").addHandler(_Events())  # in the worker only: an import (test_search) adds nothing
    out = SCENARIOS[sys.argv[1]]()
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(out), flush=True)
