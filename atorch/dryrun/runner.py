"""Dry-runs: apply a candidate strategy to fresh objects, run a few steps, measure, agree, release.

Each trial, on every rank:

0. once per process, before the first trial that needs it, do a method's one-time **preparation**
   (``MethodConfig.preparation``: DeepSpeed's op build), with a log line, outside every trial's clock;
1. **meet** the other ranks (store, bounded by ``rejoin_timeout_s``) and open a fresh process group for
   the trial (coordination.py); agree on preflight problems, so an inapplicable candidate is reported
   by every rank and built by none;
2. build through ``build_context`` (a fresh copy: the user's model is never changed) and run ``warmup``
   then ``steps`` steps of ``train_step``; memory is measured over build and warm-up (the optimizer's
   state appears in the first step; CPU measurement slows operations down, so timed steps run without
   it, except on CUDA where it is free); each timed step starts after a barrier and ends with the loss
   on the host (``cuda.synchronize`` on CUDA);
3. every collective is bounded by the time left until the trial's deadline, and a **watchdog** thread
   publishes "timeout" for its rank at the deadline if the main thread has not reported (with where it
   is stuck), so the other ranks learn of a hung rank within the timeout;
4. a rank whose trial raises its own error **announces it** through the store and frees its trial groups;
   every other rank stops at its next step or in the collective it waits in, within seconds, and
   reports "failed", naming that rank's error (coordination.py: ``AbortWatcher``; gloo and NCCL alike);
5. **agree** on the outcome (store, bounded); close the result and drop the trial's group.

A rank stuck in Python (a sleep, a loop, a C call holding on) cannot be interrupted. The others record
"timeout" at the deadline and wait for it at the next meeting (``rejoin``, or the next trial's): a rank that
overslept rejoins when its step returns (its remaining collectives fail fast, its late report is ignored)
and the next trial runs normally. A rank that does not come back within ``rejoin_timeout_s`` is lost: the
job cannot go on without it, so every rank that still runs raises ``RankLost`` (naming the rank, the
candidate it overran, the timeout and where it was stuck) instead of running or recording anything more.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel

from atorch.build import build_context, build_result, preflight
from atorch.distributed import DistEnv, all_gather_json, collective_timeout
from atorch.dryrun.coordination import AbortWatcher, Coordinator, GaveUp
from atorch.dryrun.memory import PeakMemory, SettledHeap
from atorch.dryrun.numerics import MIN_WARMUP_FOR_CHECK, deterministic_step
from atorch.dryrun.unused_gradients import explain_unused_gradients
from atorch.errors import RankLost, SetupError
from atorch.function_caches import forget_fake_fills
from atorch.lifecycle import import_off_the_stack
from atorch.log import get_logger, say_where_seen
from atorch.model_context import UserSetup
from atorch.strategy import Strategy

logger = get_logger(__name__)

Status = Literal["ok", "oom", "failed", "timeout"]
AGREE_GRACE_S = 10.0  # past the deadline, how long a rank waits for the others' reports
# A rank still stuck in a trial after the others gave it up ends its own process this long after it learns so:
# the others raise first (theirs is the error the user reads), and the launcher then ends the job even where
# nothing else would stop this process (the others caught the error, or it is alone on its node).
SELF_EXIT_DELAY_S = 10.0
GIVEN_UP_POLL_S = 0.5
LOST_EXIT_CODE = 75  # os._exit status of a process that ended itself so (EX_TEMPFAIL: the job may be run again)
MAX_EXTRA_WARMUP = 4  # warm-up steps added while fp16 loss scaling skips every step
LOSS_SCALE_DROP = 2.0**6  # ... each with the scale divided by this: 2^16 reaches 2^-8 within them
# Early stop (``stop_above_s``): timed steps judged after this many, so one disturbed step does not stop a trial
EARLY_STOP_MIN_STEPS = 2
EVAL_STEP_PROBES = 2  # failures in the eval-mode first step tried again in train mode, per session (DryRunSession)


class RankOutcome(BaseModel):
    """What one rank saw in a trial."""

    status: Status
    reason: str | None = None
    root_cause: bool = False  # the rank's own error, not a consequence of another rank's (a failed collective)
    peak_bytes: int | None = None
    step_times_s: list[float] = []
    losses: list[float] = []
    stopped_early: bool = False  # timed steps cut short: already slower than ``stop_above_s`` (the search's bar)


class TrialResult(BaseModel):
    """One candidate's dry-run, the same on every rank."""

    strategy: list[Any]  # Strategy.to_list()
    status: Status
    reason: str | None = None
    step_time_s: float | None = None  # median step time of the slowest rank
    samples_per_s: float | None = None
    peak_bytes: int | None = None  # max over ranks of the bytes the trial added at its peak
    peak_bytes_per_rank: list[int | None] = []
    losses: list[float] = []  # global loss per step (warm-up included), as rank 0 saw it
    ranks: list[RankOutcome | None] = []  # None: the rank did not report in time
    wall_s: float = 0.0
    # the timed steps stopped once every rank's fastest was above ``stop_above_s``: the median is of those steps
    stopped_early: bool = False
    # the first warm-up step ran in eval mode (no dropout), so its loss compares with the user's model's
    # (atorch.dryrun.numerics); False where the session found that the model cannot train a step in eval mode
    first_step_in_eval: bool = True


def dry_run(setup: UserSetup, env: DistEnv, strategy: Strategy, **kwargs: Any) -> TrialResult:
    """Dry-run one candidate on every rank; see ``dry_run_many`` for the arguments."""
    return dry_run_many(setup, env, [strategy], **kwargs)[0]


def dry_run_many(
    setup: UserSetup,
    env: DistEnv,
    candidates: Sequence[Strategy],
    *,
    warmup: int = 2,
    steps: int = 5,
    timeout_s: float = 300.0,
    memory_budget: int | None = None,
    rejoin_timeout_s: float | None = None,
    micro_batches: int = 1,
    min_measure_s: float = 0.0,
    max_steps: int = 50,
) -> list[TrialResult]:
    """Dry-run each candidate in turn on all ranks; the same list of results on every rank.

    timeout_s bounds one trial (build, warm-up and steps); memory_budget (bytes per rank) turns a
    higher measured peak into "oom"; each step trains on micro_batches batches of the dataloader
    (gradient accumulation), so samples/s counts batch_size * micro_batches per step;
    rejoin_timeout_s (default: twice timeout_s, at least 60 s) is how long ranks wait for one that
    overran a trial before giving it up (then every rank that still runs raises ``RankLost``, with the
    results before it in ``results``); timed steps go on past ``steps`` until they add up to
    min_measure_s, at most max_steps.
    """
    if micro_batches < 1 or timeout_s <= 0:
        raise SetupError("dry-run needs micro_batches >= 1 and timeout_s > 0")
    session = DryRunSession(setup, env, warmup=warmup, steps=steps, memory_budget=memory_budget,
                            min_measure_s=min_measure_s, max_steps=max(max_steps, steps),
                            rejoin_timeout_s=rejoin_timeout_s if rejoin_timeout_s is not None
                            else max(60.0, 2 * timeout_s))
    lists = all_gather_json([_plain(c) for c in candidates], timeout_s)
    if any(other != lists[0] for other in lists):
        raise SetupError("the ranks were given different candidate lists; every rank must dry-run the same ones")
    results: list[TrialResult] = []
    session.heap.settle()
    try:
        for strategy in candidates:
            results.append(session.run(strategy, timeout_s=timeout_s, micro_batches=micro_batches))
        session.close()
    except RankLost as exc:
        exc.results = results
        raise
    finally:
        session.heap.release()
    return results


class DryRunSession:
    """A series of trials that every rank runs together, chosen one at a time.

    Every rank calls ``run`` with the same arguments in the same order (a search carries the leader's
    choice to the others with ``announce``/``hear``, through the store). ``rejoin_timeout_s`` is how
    long ranks wait for one that overran a trial before giving it up; then ``run``, ``rejoin`` and
    ``close`` raise ``RankLost`` on every rank that still runs (``more_time``: how the message tells the
    user to give a slow candidate more time).
    """

    def __init__(self, setup: UserSetup, env: DistEnv, *, warmup: int = 2, steps: int = 5,
                 memory_budget: int | None = None, rejoin_timeout_s: float = 600.0, min_measure_s: float = 0.0,
                 max_steps: int = 50, more_time: str = "") -> None:
        if warmup < 0 or steps < 1 or max_steps < steps or min_measure_s < 0:
            raise SetupError("dry-run needs warmup >= 0, 1 <= steps <= max_steps and min_measure_s >= 0")
        if setup.dataset is None:
            raise SetupError("a dry-run needs a dataset to take batches from")
        self.setup, self.env = setup, env
        self.warmup, self.steps, self.memory_budget = warmup, steps, memory_budget
        # Fast steps are noisy one by one: timed steps go on until they add up to min_measure_s (at most
        # max_steps), so a median of a few milliseconds' steps is taken over enough of them.
        self.min_measure_s, self.max_steps = min_measure_s, max_steps
        self.rejoin_timeout_s = rejoin_timeout_s
        self.more_time = more_time or (f"give it a longer timeout_s, or the others longer to wait for it "
                                       f"(rejoin_timeout_s, now {rejoin_timeout_s:g} s)")
        self.coordinator = Coordinator(env.rank, env.world_size)
        self.lost: RankLost | None = None  # a rank was given up: the session cannot go on
        # The last trial that did not end well, while a rank may still be inside it: (index, label, timeout, result)
        self.unsettled: tuple[int, str, float, TrialResult] | None = None
        self.trials = 0
        self.rejoins = 0
        # A model whose eval mode cannot train (LeViT's attention biases, cached in eval mode for inference: a second
        # micro-batch or a recomputation reads the cached tensor after its graph was freed) fails a candidate's first
        # warm-up step, which runs in eval mode, though the candidate trains. Such a failure is tried again with that
        # step in train mode (at most EVAL_STEP_PROBES times); where that runs, every later trial skips eval mode, and
        # the numerics check compares no loss (``first_step_in_eval``).
        self.eval_step = True
        self.eval_step_probes = EVAL_STEP_PROBES
        self.words = 0  # the leader's words announced (rank 0) or heard (the others), in order
        # One-time costs are not a candidate's: FSDP2 imports torch._dynamo on its first build (seconds).
        import_off_the_stack("torch._dynamo")
        # Imported here, not inside a trial: ZeroRedundancyOptimizer's module binds ``dist.group.WORLD`` as a
        # default argument when imported, which inside a trial is the trial's group; kept alive by it, that
        # group's connections would never close after a failure, and its peers would wait until the deadline.
        import_off_the_stack("torch.distributed.optim.zero_redundancy_optimizer")
        # Each trial's memory measurement collects the cyclic garbage first; a caller that runs many trials settles
        # the heap (``heap.settle()``, or ``heap.settle(now=False)``: at the first trial; then ``heap.release()``
        # however it ends), so that only what was made since is walked (a search and ``dry_run_many`` do; ``close``
        # releases it too).
        self.heap = SettledHeap()

    def announce_next(self, value: Any) -> None:
        """The leader's next word to every rank (a trial, a task, the end); ``hear_next`` reads them in order."""
        self.announce(f"next/{self.words}", value)
        self.words += 1

    def hear_next(self, timeout_s: float) -> Any:
        value = self.hear(f"next/{self.words}", timeout_s)
        self.words += 1
        return value

    def announce(self, name: str, value: Any) -> None:
        """The leader (rank 0) tells every rank ``value``; the others read it with ``hear``."""
        self.coordinator.store.set(f"announce/{name}", json.dumps(value))

    def hear(self, name: str, timeout_s: float) -> Any:
        """What the leader announced under ``name``; SetupError if it says nothing within timeout_s."""
        key = f"announce/{name}"
        try:
            self.coordinator.store.wait([key], timedelta(seconds=max(timeout_s, 0.001)))
        except RuntimeError as exc:  # a DistStoreError on time-out
            raise SetupError(f"rank 0 said nothing about '{name}' within {timeout_s:.0f} s (did it fail?)") from exc
        return json.loads(self.coordinator.store.get(key))

    def run(self, strategy: Strategy, *, timeout_s: float = 300.0, micro_batches: int = 1,
            batch_size: int | None = None, label: str | None = None,
            stop_above_s: float | None = None, min_measure_s: float | None = None) -> TrialResult:
        """Dry-run one candidate on every rank. ``batch_size`` (the global batch of one micro-batch)
        replaces the dataloader's; ``micro_batches`` batches make one step; ``label``: how an error names
        the candidate (default: the strategy). ``stop_above_s`` (the same on every rank): once
        EARLY_STOP_MIN_STEPS steps are timed, the timed steps stop when the slowest rank's fastest step is above it
        (a candidate that cannot win: ``stopped_early``, the median of the steps run). ``min_measure_s``: this run's
        timed seconds (default: the session's). ``RankLost`` when a rank did not come back from the last one."""
        if micro_batches < 1 or timeout_s <= 0:
            raise SetupError("dry-run needs micro_batches >= 1 and timeout_s > 0")
        args = dict(timeout_s=timeout_s, micro_batches=micro_batches, batch_size=batch_size, label=label,
                    stop_above_s=stop_above_s, min_measure_s=min_measure_s)
        result = self._run_once(strategy, eval_step=self.eval_step, **args)
        if not self._failed_in_eval_step(result):
            return result.model_copy(update={"first_step_in_eval": self._checks_first()})
        self.eval_step_probes -= 1
        again = self._run_once(strategy, eval_step=False, **args)
        if self._failed_in_step_0(again):
            return result  # it fails in train mode too: the candidate's own failure
        self.eval_step = False
        if self.env.is_main:
            logger.warning("the model fails a training step in eval mode (%s), and trains in train mode: the "
                           "dry-runs' first step runs in train mode from now on, and their losses are checked for "
                           "being finite only, not against the model's own loss", _first_reason(result))
        return again.model_copy(update={"first_step_in_eval": False})

    def _checks_first(self) -> bool:
        return self.eval_step and self.warmup >= MIN_WARMUP_FOR_CHECK

    def _failed_in_step_0(self, result: TrialResult) -> bool:
        return result.status == "failed" and "warm-up step 0: " in (result.reason or "")

    def _failed_in_eval_step(self, result: TrialResult) -> bool:
        """A failure in the first warm-up step while it ran in eval mode, with a probe left (every rank decides the
        same: the result is agreed)."""
        return self._checks_first() and self.eval_step_probes > 0 and self._failed_in_step_0(result)

    def _run_once(self, strategy: Strategy, *, timeout_s: float, micro_batches: int, batch_size: int | None,
                  label: str | None, stop_above_s: float | None, min_measure_s: float | None,
                  eval_step: bool) -> TrialResult:
        self._check_lost()
        index = self.trials
        self.trials += 1
        self.heap.settle_if_wanted()
        forget_fake_fills(self.setup.model)  # what a fake run (analysis, build check, trace) cached
        # Before the meeting (every rank prepares, so they arrive together) and the trial's clock.
        unprepared = prepare_once(strategy, log=self.env.is_main)
        measure_s = self.min_measure_s if min_measure_s is None else min_measure_s
        candidate = _candidate_card(strategy, micro_batches, batch_size, timeout_s, stop_above_s, measure_s)
        self._meet(f"{index}/meet", f"before candidate {index}", brings=candidate)
        self._check_same_candidate(index, candidate)
        setup = self.setup
        if batch_size is not None:
            setup = replace(setup, dataloader_args={**setup.dataloader_args, "batch_size": batch_size})
        trial = _Trial(self.coordinator, index, setup, self.env, strategy, self.warmup, self.steps, timeout_s,
                       micro_batches)
        trial.unprepared = unprepared
        trial.min_measure_s, trial.max_steps = measure_s, self.max_steps
        trial.stop_above_s = stop_above_s
        trial.eval_step = eval_step
        result = trial.run(self.memory_budget)
        # A trial that did not end well may still hold a rank (stuck past its deadline): the next meeting says.
        self.unsettled = None if result.status == "ok" else (index, label or str(strategy), timeout_s, result)
        return result

    def rejoin(self) -> None:
        """Wait (at most ``rejoin_timeout_s``) until every rank is back from the last trial; ``RankLost`` if one
        is not. A search calls it (on every rank, the leader's word) before it asks for the next candidate or
        stores its end, so a rank that never comes back stops it before anything more is recorded."""
        self._check_lost()
        self.rejoins += 1
        self._meet(f"rejoin/{self.rejoins}", "after the last candidate")
        self.unsettled = None

    def close(self) -> None:
        """Meet a last time (every rank); ``RankLost`` if a rank did not come back."""
        self.heap.release()
        if self.lost is None and (gave_up := self.coordinator.close(self.rejoin_timeout_s)) is not None:
            self._give_up(gave_up, "at the end of the dry-runs")

    def _check_same_candidate(self, index: int, mine: dict[str, str]) -> None:
        """SetupError on every rank (they all read the same cards) if the ranks were asked to run different
        candidates: each would build its own and wait in collectives the others never run (a hang, then
        a crash at the deadline), so this is said before anything is built."""
        cards = [card if isinstance(card, dict) else {} for card in self.coordinator.brought]
        if len({card.get("digest") for card in cards}) <= 1:
            return
        shown = "; ".join(f"rank {r}: {card.get('shown', 'nothing')}" for r, card in enumerate(cards))
        raise SetupError(f"dry-run {index}: the processes were asked to run different candidates ({shown}). Every "
                         "rank must call DryRunSession.run with the same strategy, micro_batches, batch_size, "
                         "timeout_s and stop_above_s, in the same order: make the list of candidates on one rank "
                         "(rank 0) and share it (atorch.distributed.all_gather_json), or derive it from values that "
                         "are equal everywhere")

    # ----- a rank that does not come back --------------------------------------------------------
    def _meet(self, name: str, when: str, brings: Any = None) -> None:
        if (gave_up := self.coordinator.meet(name, self.rejoin_timeout_s, brings)) is not None:
            self._give_up(gave_up, when)

    def _check_lost(self) -> None:
        if self.lost is not None:
            raise RankLost(str(self.lost), self.lost.ranks)

    def leader_silent(self, waited_s: float) -> None:
        """A follower heard nothing from rank 0 for ``waited_s`` after a trial that did not end well: rank 0 is
        stuck in it. ``RankLost``, as for any rank given up."""
        self._give_up(GaveUp([0], f"rank 0 (which leads the search) said nothing within {waited_s:g} s"),
                      "after the last candidate")

    def _give_up(self, gave_up: GaveUp, when: str) -> None:
        if self.unsettled is not None:
            index, label, timeout_s, result = self.unsettled
            # what the ranks given up said of themselves (a stuck rank's watchdog: where it is stuck)
            own = [f"rank {r}: {result.ranks[r].reason}" for r in gave_up.missing  # type: ignore[union-attr]
                   if r < len(result.ranks) and result.ranks[r] is not None]
            what = (f"{gave_up.why} after candidate {index} ({label}) ended '{result.status}' at its {timeout_s:g} s "
                    f"timeout: {'; '.join(own) or result.reason}")
        else:
            what = f"{gave_up.why} ({when})"
        self.lost = RankLost(
            f"{what}. A process stuck in its own code (a loop, a sleep, a call that never returns) cannot be "
            "interrupted by the others, and the job cannot go on without it: every other process stops here. Fix "
            f"what it is stuck on (the reason above says where), or, if the candidate only needs longer, "
            f"{self.more_time}", gave_up.missing)
        logger.error("dry-runs stopped: %s", self.lost)
        with contextlib.suppress(Exception):  # the store is gone: the job is ending anyway
            self.coordinator.mark_given_up(gave_up)
        self._check_lost()


def _candidate_card(strategy: Strategy, micro_batches: int, batch_size: int | None, timeout_s: float,
                    stop_above_s: float | None, min_measure_s: float) -> dict[str, str]:
    """What a rank is about to dry-run, as it brings it to the meeting: a digest of everything that shapes the
    trial's collectives and verdict (the timed seconds decide how many steps run), and a short form for the message
    when ranks differ."""
    full = json.dumps({"strategy": strategy.to_json(indent=None), "micro_batches": micro_batches,
                       "batch_size": batch_size, "timeout_s": timeout_s, "stop_above_s": stop_above_s,
                       "min_measure_s": min_measure_s}, sort_keys=True)
    extras = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in (
        ("micro_batches", micro_batches), ("batch_size", batch_size), ("timeout_s", timeout_s),
        ("stop_above_s", stop_above_s), ("min_measure_s", min_measure_s)) if v is not None)
    return {"digest": hashlib.sha256(full.encode()).hexdigest()[:32], "shown": f"{strategy} ({extras})"}


_prepared: dict[str, str | None] = {}  # per process: preparation -> None when done, else why it failed


def prepare_once(strategy: Strategy, log: bool) -> list[str]:
    """Do the one-time preparations the strategy's methods declare and this process has not done yet
    (DeepSpeed's op build: up to a minute the first time, which a trial would count as its own);
    the problems of those that failed, now or before."""
    problems = []
    for item in strategy.methods:
        preparation = item.config.preparation()
        if preparation is None:
            continue
        if preparation.what not in _prepared:
            if log:
                logger.info("one-time preparation for %s: %s; not counted in any trial's time", item.name,
                            preparation.what)
            start = time.monotonic()
            try:
                preparation.run()
                _prepared[preparation.what] = None
            except Exception as exc:  # noqa: BLE001  (the candidate fails with it, through the preflight agreement)
                _prepared[preparation.what] = f"{item.name}: one-time preparation failed: {_describe(exc)}"
            if log:
                logger.info("one-time preparation for %s done in %.1f s", item.name, time.monotonic() - start)
        if (problem := _prepared[preparation.what]) is not None:
            problems.append(problem)
    return problems


def preparations(strategies: Sequence[Strategy]) -> dict[str, Strategy]:
    """The distinct one-time preparations the strategies' methods declare (by ``Preparation.what``), each with
    the first strategy that needs it (``prepare_once`` of it does that one)."""
    found: dict[str, Strategy] = {}
    for strategy in strategies:
        for item in strategy.methods:
            if (preparation := item.config.preparation()) is not None:
                found.setdefault(preparation.what, Strategy(methods=(item,)))
    return found


class _Trial:
    def __init__(self, coordinator: Coordinator, index: int, setup: UserSetup, env: DistEnv, strategy: Strategy,
                 warmup: int, steps: int, timeout_s: float, micro_batches: int) -> None:
        self.coordinator, self.index, self.setup, self.env, self.strategy = coordinator, index, setup, env, strategy
        self.warmup, self.steps, self.timeout_s, self.micro_batches = warmup, steps, timeout_s, micro_batches
        self.min_measure_s, self.max_steps = 0.0, steps
        self.eval_step = True  # the first warm-up step in eval mode (DryRunSession.eval_step)
        self.stop_above_s: float | None = None  # the early-stop bar (DryRunSession.run)
        self.unprepared: list[str] = []  # one-time preparations that failed: problems, as preflight's
        self.deadline = 0.0
        self.phase = "starting"
        self.watcher = AbortWatcher(coordinator, index)
        self.aborted = False  # the trial ended by this rank's failure, or by another's announced one
        self.finished = threading.Event()  # the trial's thread is out of it (the watchdog stops watching)
        self._reported = False
        self._lock = threading.Lock()

    # ----- what every rank does ----------------------------------------------------------------
    def run(self, memory_budget: int | None) -> TrialResult:
        self.memory_budget = memory_budget
        start = time.monotonic()
        self.deadline = start + self.timeout_s
        watchdog = threading.Timer(self.timeout_s, self._on_deadline, args=(threading.get_ident(),))
        watchdog.daemon = True
        watchdog.start()
        try:
            with self.watcher, self.coordinator.trial_world(self.timeout_s):
                outcome = self._outcome()
        except Exception as exc:  # noqa: BLE001  (making the trial's group, or a time-out before the build)
            outcome = self._failed(exc)
        except BaseException as exc:  # never leave the others waiting for this rank's report
            with contextlib.suppress(Exception):
                self.coordinator.announce_abort(self.index, _describe(exc))
            self._report(RankOutcome(status="failed", reason=_describe(exc), root_cause=True))
            raise
        finally:
            watchdog.cancel()
            self.finished.set()
        if self.aborted:
            self.coordinator.drop_finished_groups()  # frees peers still waiting on this rank (gloo)
        self._report(outcome)
        everyone = self.coordinator.collect(f"{self.index}/outcome", self.deadline + AGREE_GRACE_S - time.monotonic())
        ranks = [RankOutcome.model_validate(o) if o is not None else None for o in everyone]
        return _agree(self.strategy, ranks, self._global_batch(), memory_budget, time.monotonic() - start)

    def _report(self, outcome: RankOutcome) -> None:
        with self._lock:  # the first report stands: the watchdog's, or the main thread's
            if not self._reported:
                self._reported = True
                self.coordinator.publish(f"{self.index}/outcome", outcome.model_dump())

    def _on_deadline(self, trial_thread: int) -> None:
        frame = sys._current_frames().get(trial_thread)  # where the trial's thread is now
        where = ""
        if frame is not None:
            last = traceback.extract_stack(frame)[-1]
            where = f" ({self.phase}; at {last.filename}:{last.lineno} in {last.name})"
        self._report(RankOutcome(status="timeout", reason=f"not done within {self.timeout_s:g} s{where}"))
        self._end_if_given_up(where)

    def _end_if_given_up(self, where: str) -> None:
        """While this rank's trial thread is still stuck past the deadline: once the other ranks give it up,
        log why and end the process (``os._exit``; nothing can interrupt the stuck thread), so the launcher
        (torchrun) ends the job instead of keeping it alive for ever."""
        if not self.coordinator.distributed:
            return
        store = self.coordinator.watch_store()
        while not self.finished.wait(GIVEN_UP_POLL_S):
            try:
                gave_up = self.coordinator.given_up(store)
            except Exception:  # noqa: BLE001  (the job's store is gone: the launcher is ending the job)
                return
            if gave_up is None or self.env.rank not in gave_up.missing:
                continue
            _say(f"rank {self.env.rank} is stuck in candidate {self.index} {self.strategy}{where} past its "
                 f"{self.timeout_s:g} s timeout, and the other processes gave it up ({gave_up.why}): ending this "
                 f"process in {SELF_EXIT_DELAY_S:g} s (exit status {LOST_EXIT_CODE}) so that the launcher ends the job")
            if not self.finished.wait(SELF_EXIT_DELAY_S):
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(LOST_EXIT_CODE)
            return

    def _global_batch(self) -> int:
        return int(self.setup.dataloader_args.get("batch_size", 1)) * self.micro_batches

    def _failed(self, exc: BaseException) -> RankOutcome:
        """This rank's outcome for the error that ended its trial.

        Its own error (not a deadline) is announced, so that the other ranks stop now instead of at the
        deadline. An error that follows another rank's announced failure (the watcher's stop, or a
        collective whose peer stopped) is reported as that: "failed", not this rank's cause.
        """
        if isinstance(exc, _Stopped):
            self.aborted = True
            return exc.outcome(self.phase)
        outcome = _classify(exc, self.phase)
        if outcome.root_cause and outcome.status != "timeout":
            self.aborted = True
            with contextlib.suppress(Exception):  # the store is gone: nobody is left to tell
                self.coordinator.announce_abort(self.index, outcome.reason or "")
            return outcome
        first = self.watcher.stopped_by
        if first is None and not outcome.root_cause:
            with contextlib.suppress(Exception):
                first = self.coordinator.abort_announced(self.index)
        if first is not None and first["rank"] != self.env.rank and not outcome.root_cause:
            self.aborted = True
            return _Stopped(first).outcome(self.phase)
        return outcome

    def _check_stopped(self) -> None:
        """Stop here if another rank announced a failure (its step would wait for that rank)."""
        if self.watcher.stopped_by is not None:
            raise _Stopped(self.watcher.stopped_by)

    def _remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"not done within {self.timeout_s:g} s ({self.phase})")
        return left

    # ----- inside the trial's process group ----------------------------------------------------
    def _outcome(self) -> RankOutcome:
        self.phase = "preflight"
        layout = self.strategy.layout(self.env.world_size)
        try:
            problems = self.strategy.problems(self.env.world_size) + self.unprepared
            skipped, found = preflight(self.setup, self.env, self.strategy, layout) if not problems else ({}, [])
            problems += found
        except Exception as exc:  # noqa: BLE001  (reported as a problem, through the agreement)
            skipped, problems = {}, [_describe(exc)]
        seen = self.coordinator.exchange(f"{self.index}/preflight", problems, self._remaining())
        if any(found for found in seen) or None in seen:
            mine = "; ".join(problems) or "another rank found problems"
            return RankOutcome(status="failed", reason=f"not applicable: {mine}", root_cause=bool(problems))
        result, peak = None, PeakMemory(self.env.device)
        losses: list[float] = []
        times: list[float] = []
        try:
            with contextlib.ExitStack() as measuring:
                measuring.enter_context(peak)
                self.phase = "build"
                with collective_timeout(self._remaining()):
                    result = build_result(build_context(self.setup, self.env, self.strategy, skipped), self.setup)
                batches = _cycle(result.dataloader)
                for step in range(self.warmup):
                    self.phase = f"warm-up step {step}"
                    # The first step runs in eval mode (no dropout), so its loss can be compared with the user's
                    # model on the same samples (atorch.dryrun.numerics); the next one brings the train-mode peak.
                    first = self.eval_step and step == 0 and self.warmup >= MIN_WARMUP_FOR_CHECK
                    with deterministic_step(result.model) if first else contextlib.nullcontext():
                        losses.append(self._step(result, batches))
                # fp16 loss scaling skips steps until its scale fits the gradients: warm up until a step was
                # taken and one more ran after it, so the optimizer's state (and the peak it brings: forward and
                # backward with the state there) is in the measured peak, as it is without skipped steps.
                extra = 0
                while self.warmup > 0 and extra < MAX_EXTRA_WARMUP and \
                        0 < getattr(result.optim, "skipped_steps", 0) > self.warmup + extra - 2:
                    self.phase = f"extra warm-up step {extra} (fp16 steps skipped so far)"
                    if getattr(result.optim, "skipped_steps", 0) >= self.warmup + extra:
                        _lower_loss_scale(result.optim)  # nothing got through yet
                    losses.append(self._step(result, batches))
                    extra += 1
                if self.warmup > 0 and getattr(result.optim, "skipped_steps", 0) >= self.warmup + extra:
                    # every rank agrees: the scaler's overflow check is all-reduced
                    scale = float(result.optim.grad_scaler.get_scale())
                    return RankOutcome(status="failed", root_cause=True, reason=(
                        f"fp16 loss scaling skipped every warm-up step, down to a scale of {scale:g}: the "
                        "gradients (or the forward) overflow fp16; use bf16 or fp32"))
                if self.warmup > 0 and self.env.device.type != "cuda":
                    measuring.close()  # CPU tracking costs time per operation: timed steps run without it
                if self.warmup > 0 and (over := self._over_budget(peak.increase)) is not None:
                    return over
                step, planned, early = 0, self.steps, False
                while step < planned:
                    self.phase = f"step {step}"
                    self._check_stopped()
                    with collective_timeout(self._remaining()):
                        dist.barrier()  # the trial's group: every rank starts the step together
                    begin = time.perf_counter()
                    losses.append(self._step(result, batches))
                    times.append(time.perf_counter() - begin)
                    step += 1
                    if step >= EARLY_STOP_MIN_STEPS and step < planned and self._cannot_win(min(times)):
                        early = True
                        break
                    if step == self.steps and self.min_measure_s > 0:
                        planned = self._steps_for(statistics.median(times))
        except Exception as exc:  # noqa: BLE001  (every error becomes this trial's outcome)
            return self._failed(explain_unused_gradients(exc, result.model if result is not None else None))
        finally:
            if result is not None:
                result.close()
            if self.env.device.type == "cuda":
                torch.cuda.empty_cache()  # the next candidate starts from an empty cache, not this one's blocks
        return RankOutcome(status="ok", peak_bytes=peak.increase, step_times_s=times, losses=losses,
                           stopped_early=early)

    def _cannot_win(self, fastest_s: float) -> bool:
        """Whether the slowest rank's fastest timed step is above ``stop_above_s``: one answer on every rank (an
        all-reduce of the fastest steps), so every rank stops at the same step and none waits in the next barrier.
        No bar, no collective."""
        if self.stop_above_s is None:
            return False
        return self._largest(torch.tensor([fastest_s], dtype=torch.float64))[0] > self.stop_above_s

    def _largest(self, mine: torch.Tensor) -> list[float]:
        """Each element's largest value over the ranks (an all-reduce MAX within the trial's time; alone: as is)."""
        if dist.is_initialized() and self.env.world_size > 1:
            with collective_timeout(self._remaining()):
                dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        return [float(x) for x in mine]

    def _steps_for(self, median_s: float) -> int:
        """Timed steps that add up to min_measure_s at the slowest rank's median, never past half of the
        time the trial has left on the rank with least of it: one count, the same on every rank."""
        slowest, least_left = self._largest(torch.tensor([median_s, -self._remaining()], dtype=torch.float64))
        step_s, left_s = max(slowest, 1e-6), -least_left
        wanted = math.ceil(self.min_measure_s / step_s)
        return max(self.steps, min(wanted, self.max_steps, self.steps + int(0.5 * left_s / step_s)))

    def _over_budget(self, mine: int) -> RankOutcome | None:
        """After warm-up (the peak is in): if any rank is over the budget, an OOM on every rank now,
        without the timed steps (an OOM costs its warm-up only)."""
        if self.memory_budget is None:
            return None
        (worst,) = self._largest(torch.tensor([mine], dtype=torch.int64))
        if int(worst) <= self.memory_budget:
            return None
        return RankOutcome(status="oom", root_cause=mine > self.memory_budget, peak_bytes=mine, reason=(
            f"measured peak {mine} bytes is above the budget of {self.memory_budget} (timed steps skipped)"
            if mine > self.memory_budget else "another rank is above the memory budget"))

    def _step(self, result: Any, batches: Iterator[Any]) -> float:
        self._check_stopped()
        with collective_timeout(self._remaining()):
            loss = _train_step(result, [next(batches) for _ in range(self.micro_batches)])
            if self.env.device.type == "cuda":
                torch.cuda.synchronize(self.env.device)
            return float(loss.item())


class _Stopped(Exception):
    """Another rank announced a failure in this trial: this rank stops too."""

    def __init__(self, first: dict[str, Any]) -> None:
        super().__init__(f"stopped: rank {first['rank']} failed ({first['reason']})")
        self.first = first

    def outcome(self, phase: str) -> RankOutcome:
        return RankOutcome(status="failed", reason=f"{phase}: {self}", root_cause=False)


def _say(message: str) -> None:
    """An error line that must be seen: a process about to end itself says why even where the application
    configured no logging."""
    say_where_seen(logger, logging.ERROR, message, "[atorch]")


def _lower_loss_scale(optim: Any) -> None:
    """Bring an fp16 loss scale that keeps overflowing down fast (the trial's scaler only): training lowers
    it by its backoff factor per skipped step, which can take more steps than a dry-run warms up for, and
    the step that lands is what brings the optimizer's state (and its peak) in."""
    scaler = getattr(optim, "grad_scaler", None)
    if scaler is not None and scaler.is_enabled():
        scaler.update(scaler.get_scale() / LOSS_SCALE_DROP)


def _train_step(result: Any, micro_batches: list[Any]) -> torch.Tensor:
    from atorch.training import train_step

    return train_step(result, micro_batches)


def _cycle(loader: Any) -> Iterator[Any]:
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise SetupError("the dataloader of this candidate yields no batch (dataset smaller than the batch?)")


_COMMUNICATION_ERRORS = (dist.DistError,)


def _classify(exc: BaseException, phase: str) -> RankOutcome:
    method = getattr(exc, "atorch_method", None)  # set by apply_strategy: the method whose step raised
    text = f"{phase}{f' [{method}]' if method else ''}: {_describe(exc)}"
    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
        return RankOutcome(status="oom", reason=text, root_cause=True)
    message = str(exc)
    collective = isinstance(exc, _COMMUNICATION_ERRORS) or any(
        word in message for word in ("gloo", "Gloo", "NCCL", "Connection closed", "Timed out", "timed out")
    )
    if isinstance(exc, TimeoutError) or (collective and "imed out" in message):
        return RankOutcome(status="timeout", reason=text, root_cause=not collective)
    return RankOutcome(status="failed", reason=text, root_cause=not collective)


def _plain(strategy: Strategy) -> list[Any]:
    """The strategy as JSON values (lists, not tuples), so a result compares equal after a round trip."""
    return json.loads(json.dumps(strategy.to_list()))


def _first_reason(result: TrialResult) -> str:
    """The first rank's reason of a failed trial, without the rank and step it names."""
    first = (result.reason or "").split("; ")[0]
    return first.split("warm-up step 0: ", 1)[-1][:200]


def _describe(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:500]


_PRIORITY: dict[str, int] = {"oom": 0, "failed": 1, "timeout": 2}


def _agree(strategy: Strategy, ranks: list[RankOutcome | None], global_batch: int, memory_budget: int | None,
           wall_s: float) -> TrialResult:
    """One result from every rank's outcome (a pure function of them: the same on every rank)."""
    peaks = [o.peak_bytes if o is not None else None for o in ranks]
    base = {"strategy": _plain(strategy), "ranks": ranks, "peak_bytes_per_rank": peaks, "wall_s": wall_s}
    bad = [(r, o) for r, o in enumerate(ranks) if o is None or o.status != "ok"]
    if bad:
        silent = [r for r, o in bad if o is None]
        reported = [(r, o) for r, o in bad if o is not None]
        # The cause first: a rank's own error explains the others' failed collectives.
        causes = [(r, o) for r, o in reported if o.root_cause] or reported
        status: Status = "timeout" if not causes else min((o.status for _, o in causes), key=_PRIORITY.__getitem__)
        lines = [f"rank {r}: {o.reason}" for r, o in causes if o.status == status]
        if silent:
            lines.append(f"rank(s) {', '.join(map(str, silent))} did not report within the trial's time")
        known = [p for p in peaks if p is not None]
        return TrialResult(status=status, reason="; ".join(lines), peak_bytes=max(known) if known else None, **base)
    outcomes = [o for o in ranks if o is not None]
    step_time = max(statistics.median(o.step_times_s) for o in outcomes)
    peak = max(p for p in peaks if p is not None) if any(p is not None for p in peaks) else None
    status, reason = "ok", None
    if memory_budget is not None and peak is not None and peak > memory_budget:
        worst = peaks.index(peak)
        status, reason = "oom", f"measured peak {peak} bytes on rank {worst} is above the budget of {memory_budget}"
    return TrialResult(status=status, reason=reason, step_time_s=step_time, samples_per_s=global_batch / step_time,
                       peak_bytes=peak, losses=outcomes[0].losses, stopped_early=any(o.stopped_early for o in outcomes),
                       **base)
