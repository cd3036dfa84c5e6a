"""Fully automatic mode across the ranks: rank 0 plans, every rank dry-runs the same candidate, all agree.

1. Every rank: the hardware profile (measured once and cached, or read from a table) and the memory
   budget per rank (``memory_limit``, else the device's memory or the host's RAM per local rank).
2. Rank 0 (the leader): analyses the model on one sample batch (fake tensors), builds the search space
   from the registry, predicts every candidate with the cost model and runs the planner (Optuna study,
   cached by key). Each dry-run the planner asks for is announced to the other ranks through the job's
   store; every rank runs it (atorch.dryrun: failures and hangs on one rank are agreed, never hang the
   search) and every rank gets the same result.
3. The leader announces the pick (or the problems) and every rank returns it: the same strategy and
   micro-batching everywhere.

The followers wait for the leader's next word with a bound, so a leader that died does not hang them.
A rank that does not come back from a trial it overran (stuck in the user's code) within ``rejoin_timeout_s``
stops the search on every other rank with ``RankLost`` before anything more is asked or stored: the study is
kept unfinished (its timed-out trial recorded as such, no candidate recorded that did not run) and the next
call resumes it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from atorch.distributed import DistEnv
from atorch.dryrun.runner import DryRunSession, TrialResult
from atorch.errors import NoStrategyFound, SetupError, StrategyError
from atorch.layer_drop import layer_drop_settings, shown
from atorch.log import get_logger
from atorch.model_context import InputPreparer, UserSetup
from atorch.options import SearchOptions
from atorch.strategy import Strategy
from atorch.strategy_search.search.describe import describe_record
from atorch.strategy_search.search.outcome import Measured, Predicted
from atorch.strategy_search.search.progress import SearchProgress, rejudged

if TYPE_CHECKING:
    from atorch.strategy_search.search.buildable import BuildCheck

logger = get_logger(__name__)

FOLLOWER_WAIT_S = 900.0  # how long a follower waits for the leader's next word, at least
# After a trial that did not end well, rank 0 speaks within moments (it tells the study, then calls every rank back);
# a follower that hears nothing for rejoin_timeout_s plus this takes rank 0 for stuck in that trial.
LEADER_SILENT_S = 30.0
# Memory tracing before the first dry-run, fastest predicted first: 20 rank-seconds, split over the ranks (each
# traces its share at once), so more ranks trace as much in less wall time, at least 10 s (at 2 ranks about
# 14 traces, the favourites' families first: bench/search.py's budget searches spent half their time tracing at 30)
# unless two dry-runs are predicted shorter (TRACE_DRY_RUNS below).
TRACE_RANK_S, TRACE_MIN_S = 20.0, 10.0
# ... and never over TRACE_DRY_RUNS dry-runs' worth of the fastest sure fit (its predicted step times the warm-up and
# the timed steps, plus DRY_RUN_BUILD_S to build it; where nothing surely fits, of the fastest candidate to trace),
# at least TRACE_FLOOR_S: on the held-out bench a dry-run took
# 1-3 s, and a 10 s trace weighed several of them (bench/README.md); the close calls are traced first.
TRACE_DRY_RUNS, TRACE_FLOOR_S, DRY_RUN_BUILD_S = 2.0, 3.0, 1.0
# A trace runs the real build and two steps on fake tensors under a memory tracker: one micro-batch size of one
# candidate took 3.4-5.4x the analysis's one fake step on OLMo 2 and Swin, 6.5-11x on MobileViT (bench/README.md).
# Where the trace's limit cannot hold one at TRACE_END_PER_ANALYSIS x the analysis's seconds, the trace would be
# stopped with nothing traced (MobileViT's budget search spent 3.5 s so): it is not started; the analytical model
# and its band stand.
TRACE_END_PER_ANALYSIS = 4.0
# A started trace may take the time of one family (its two end micro-batch sizes) at that rate, even past the limit
# above: a family cut off at the limit is time spent for nothing (a loaded machine traced 0 candidates of a small
# GPT-2 in a 3.3 s limit that the unloaded estimate said would hold one).
TRACE_ENDS_PER_FAMILY = 2
# A trace settles one candidate's fit, where the dry-run it may spare is one stopped at its warm-up (a candidate that
# fits is dry-run anyway, for its time): so a trace is started only where its wall-time share (one trace at the rate
# above, over the ranks tracing at once) is under TRACE_PER_STOPPED_RUN of such a dry-run (DRY_RUN_BUILD_S and the
# warm-up steps of the fastest candidate to trace). Half: a close call runs out of memory 0.73-0.80 of the time where
# it is predicted over the budget and 0.16-0.20 where under (the memory model's errors over every swept peak), and
# on this machine's small models a trace took 0.8-1.1 s a candidate (2 ranks) against about 1 s for a stopped
# dry-run: with the trace, the bench's nine in-sample budget searches spent 2.4-4.3 s each tracing (GPT-2: 4
# candidates of 68) and ran 8 out-of-memory dry-runs; without it 6, and 17 of 18 budget searches (nine held out) cost
# under half of measuring their top 16 (6 of the nine when repeated), with 17 of 18 picks held (bench/README.md, W).
TRACE_PER_STOPPED_RUN = 0.5
# Tracing refines the memory of candidates whose fit is in doubt: one predicted analytically under half the budget
# fits unless the analytical model is 2x low, and one over 1.5x the budget does not unless it is a third high (its
# worst errors held out: 12% low, 14% high; on the bench's GPT-2 sweep: 14% low, 18% high; bench/README.md), so
# neither is traced (without a memory limit, on a host with RAM to spare, no candidate is).
TRACE_BAND = (0.5, 1.5)
# Past the close calls, a doubtful candidate is traced only when it could still be picked: predicted faster than
# this multiple of the fastest sure fit (the cost model's step-time rank order held at Spearman 0.80-0.97 on the
# held-out bench, so a candidate predicted 20% slower can still measure faster). The held-out bench's budget
# searches spent 10 of their 24 s tracing before this rule.
TRACE_SLOWER_THAN_SURE = 1.2
# The peak-memory errors the cost model is known to make, as a share of its figure: a candidate within that band of
# the budget is dry-run (the measurement settles it), never dropped on the estimate. Analytical: its errors reach
# -15% to +15% on families no fit used (ZeRO-2/FSDP on a decoder and a CNN), but a band that wide spent 3 of 5
# dry-runs of the GPT-2 budget search on out-of-memory runs its figures had rightly put over the budget: 8% until the
# held-out bench (bench/search.py --scenarios held-out) sets it. Traced on fake tensors: the program's own
# allocations, counted as the dry-run counts them (live tensor bytes): only the allocator's slack.
ANALYTICAL_MEMORY_BAND, TRACED_MEMORY_BAND = 0.08, 0.03
# On a CPU the dry-run counts live tensor bytes as the trace does, without an allocator between: the band is only
# for a candidate traced over the budget, and a dry-run measures at least its trace there (tests/test_tracing.py: a
# GPT-2 within 1%; FSDP2 on a CNN up to 2.5% over, from gloo's asynchronous collectives, never under). The held-out
# bench's close calls traced within 8 bytes (FSDP2, ZeRO-2) to 0.3% (ZeRO-1) of their dry-runs, and a 3% band spent
# two dry-runs of its Swin budget search on out-of-memory runs the trace had rightly put over the budget.
TRACED_MEMORY_BAND_CPU = 0.01


@dataclass
class SearchOutcome:
    """The pick, the same on every rank."""

    strategy: Strategy
    micro_batch_size: int  # samples per rank per micro-batch
    micro_batches: int  # micro-batches per optimizer step (gradient accumulation)
    source: str  # "search", "cache" or "cost_model"
    study_name: str = ""
    storage: str = ""
    dry_runs: int = 0
    stop_reason: str = ""
    trials: list[dict[str, Any]] = field(default_factory=list)  # rank 0 only
    # seconds by phase: profile_s, analysis_s, build_check_s, trace_s, dry_runs_s, confirmation_s, total_s (the
    # phases that ran; analysis and trace at the first prediction, inside the planner's start)
    phases: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy.to_list(), "micro_batch_size": self.micro_batch_size,
            "micro_batches": self.micro_batches, "source": self.source, "study_name": self.study_name,
            "storage": self.storage, "dry_runs": self.dry_runs, "stop_reason": self.stop_reason,
            "phases": self.phases,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SearchOutcome:
        return cls(**{**data, "strategy": Strategy.load(data["strategy"])})


def search_strategy(
    setup: UserSetup,
    env: DistEnv,
    *,
    excluded: list[str],
    included: list[str],
    finetune: Strategy | None,
    memory_limit: int | None,
    time_limit: float | None,
    options: SearchOptions,
    strategy_server: str | None = None,
) -> SearchOutcome:
    """Find a strategy for this job; call on every rank. With ``strategy_server`` (a URL; the token
    from $ATORCH_SERVER_TOKEN) the study lives on that server (atorch serve) instead of local storage."""
    from atorch.strategy_search.costing.hardware import load_profile, measure_profile

    start = time.monotonic()
    if options.hardware_profile is not None:
        profile = load_profile(options.hardware_profile)
        if memory_limit is not None:
            profile = profile.model_copy(update={"memory_per_rank": memory_limit, "memory_source": "memory_limit"})
    else:
        profile = measure_profile(memory_limit=memory_limit)  # every rank: collectives; cached on disk
    rejoin = rejoin_timeout(options)
    session = DryRunSession(setup, env, warmup=options.warmup_steps, steps=options.measure_steps,
                            min_measure_s=options.min_measure_s,
                            max_steps=max(options.max_measure_steps, options.measure_steps),
                            memory_budget=profile.memory_per_rank, rejoin_timeout_s=rejoin,
                            more_time=(f"raise search={{'trial_timeout_s': ...}} (now {options.trial_timeout_s:g} "
                                       f"s), or give a process that is slow to come back longer with "
                                       f"search={{'rejoin_timeout_s': ...}} (now {rejoin:g} s)"))
    session.heap.settle(now=False)  # at the first dry-run: a cached pick runs none
    try:
        if env.rank != 0:
            return _follow(session, time_limit)
        try:
            outcome = _Leader(setup, env, session, profile, excluded, included, finetune, time_limit, options,
                              start, strategy_server).plan()
        except BaseException as exc:
            problems = list(getattr(exc, "problems", None) or [f"{type(exc).__name__}: {exc}"])
            session.announce_next({"kind": "error", "problems": problems,
                                   "no_strategy": isinstance(exc, NoStrategyFound)})
            raise
        session.announce_next({"kind": "done", "outcome": outcome.to_json()})
        session.close()
        return outcome
    finally:
        session.heap.release()


def rejoin_timeout(options: SearchOptions) -> float:
    """How long the ranks wait for one still inside a trial past its timeout before giving it up."""
    if options.rejoin_timeout_s is not None:
        return options.rejoin_timeout_s
    return max(60.0, 2 * options.trial_timeout_s)


def _follow(session: DryRunSession, time_limit: float | None) -> SearchOutcome:
    """A follower: run what the leader announces until it announces the pick (or its problems)."""
    wait = max(FOLLOWER_WAIT_S, 2 * (time_limit or 0.0))
    while True:
        if session.unsettled is None:
            word = session.hear_next(wait)
        else:  # rank 0 may be stuck in the trial that just ended: it has as long as any rank to come back
            try:
                word = session.hear_next(session.rejoin_timeout_s + LEADER_SILENT_S)
            except SetupError:
                session.leader_silent(session.rejoin_timeout_s + LEADER_SILENT_S)
                raise
        if word["kind"] == "trace":
            _trace_share(session, word)
        elif word["kind"] == "build_check":
            _build_check_share(session, word)
        elif word["kind"] == "prepare":  # each process prepares for itself, before the first timed dry-run
            from atorch.dryrun.runner import prepare_once

            for strategy in word["strategies"]:
                prepare_once(Strategy.load(strategy), log=False)
        elif word["kind"] == "trial":
            session.run(Strategy.load(word["strategy"]), timeout_s=word["timeout_s"],
                        micro_batches=word["micro_batches"], batch_size=word["batch_size"], label=word.get("label"),
                        stop_above_s=word.get("stop_above_s"), min_measure_s=word.get("min_measure_s"))
        elif word["kind"] == "rejoin":
            session.rejoin()
        elif word["kind"] == "done":
            session.close()
            return SearchOutcome.from_json(word["outcome"])
        elif word.get("no_strategy"):
            raise NoStrategyFound(word["problems"], what="automatic strategy search found no strategy (on rank 0)")
        else:
            raise StrategyError(word["problems"], what="automatic strategy search failed (on rank 0)")


def _my_share(session: DryRunSession, word: dict[str, Any]) -> tuple[list[Any], Any]:
    """A follower's candidates in a shared task's word (``_share_with_followers``) and, where it has any, its
    sample batch."""
    from atorch.strategy_search.search.space import Candidate

    mine = [Candidate.from_json(c) for c in word["shares"].get(str(session.env.rank), [])]
    return mine, sample_batch(session.setup, session.env, word["per_rank"]) if mine else None


def _share_with_followers(session: DryRunSession, word: dict[str, Any], shares: list[list[Any]], key: str,
                          own: Any) -> tuple[Any, dict[int, Any]]:
    """A task shared by the ranks: ``word`` goes to the followers with their ``shares`` of candidates (share r to
    rank r), the leader does its own (``own(shares[0])``), then gathers what each follower with a share sends back
    under ``key/rank`` (JSON through the job's store; None from a rank that sent nothing within the word's
    ``limit_s`` and its start-up: a forked child, the sample batch)."""
    helped = [rank for rank in range(1, session.env.world_size) if shares[rank]]
    if helped:
        session.announce_next({**word, "shares": {str(r): [c.to_json() for c in shares[r]] for r in helped}})
    mine = own(shares[0])
    sent: dict[int, Any] = {}
    for rank in helped:
        try:
            sent[rank] = session.hear(f"{key}/{rank}", word["limit_s"] + 30.0)
        except SetupError:
            sent[rank] = None
    return mine, sent


def _trace_share(session: DryRunSession, word: dict[str, Any]) -> None:
    """A follower's share of the memory traces (``MemoryTracer``): the candidates the leader sent this rank,
    traced within the leader's time limit, sent back as JSON (a failure is sent as the reason)."""
    from atorch.strategy_search.costing.tracing import MemoryTracer

    mine: list[Any] = []
    found: dict[str, Any] = {}
    try:
        mine, batch = _my_share(session, word)
        if mine:
            tracer = MemoryTracer(session.setup, batch, session.env.world_size, session.env.device)
            found = tracer.trace_candidates(mine, time_limit_s=word["limit_s"])
    except Exception as exc:  # noqa: BLE001  (the leader leaves these to the analytical model)
        found = {c.key: f"{type(exc).__name__}: {exc}" for c in mine}
    session.announce(f"trace/{word['index']}/{session.env.rank}",
                     {key: t if isinstance(t, str) else t.to_json() for key, t in found.items()})


def _build_check_share(session: DryRunSession, word: dict[str, Any]) -> None:
    """A follower's share of the build check (``check_on_every_rank``): the builds the leader sent this rank,
    checked within the leader's time limit, the findings sent back as JSON (a failure leaves the share unchecked)."""
    from atorch.strategy_search.search.buildable import BuildCheck, check_families

    found = BuildCheck()
    try:
        mine, batch = _my_share(session, word)
        if mine:
            found = check_families(session.setup, batch, session.env.world_size, session.env.device, mine,
                                   word["limit_s"])
    except Exception as exc:  # noqa: BLE001  (the leader leaves these builds to the dry-runs)
        found = BuildCheck(unchecked=[f"the builds checked on rank {session.env.rank}: {type(exc).__name__}: {exc}"])
    session.announce(f"build_check/{session.env.rank}", found.to_wire())


def check_on_every_rank(session: DryRunSession, batch: Any, per_rank: int, cands: list[Any],
                        limit_s: float) -> BuildCheck:
    """The build check (``buildable.check_families``) with every rank's help: its builds are dealt to the ranks
    (``build_shares``), each rank checks its share, the leader gathers the findings. A rank that sends nothing in
    time leaves its share to the dry-runs. Called by the leader; the followers hear the task as a word
    (``_follow``)."""
    from atorch.strategy_search.search.buildable import BuildCheck, build_shares, check_families

    env = session.env
    begin = time.monotonic()
    found, sent = _share_with_followers(
        session, {"kind": "build_check", "limit_s": limit_s, "per_rank": per_rank},
        # one process checks them all: after a failed build it may cover the build's other methods with another
        build_shares(cands, env.world_size, env.world_size) if env.world_size > 1 else [list(cands)], "build_check",
        lambda share: check_families(session.setup, batch, env.world_size, env.device, share, limit_s))
    for rank, findings in sent.items():
        found.merge(BuildCheck.from_wire(findings) if findings is not None else BuildCheck(unchecked=[
            f"the builds of rank {rank}: no build check came back within {limit_s + 30.0:g} s"]))
    found.ranks = 1 + len(sent)
    found.seconds = time.monotonic() - begin
    return found


def trace_on_every_rank(session: DryRunSession, batch: Any, per_rank: int, cands: list[Any],
                        limit_s: float, index: int = 0) -> dict[str, Any]:
    """Trace ``cands``' memory with every rank's help: whole families (a strategy at its micro-batch sizes) go
    round-robin to the ranks, fastest predicted first, each rank traces its share for ``limit_s``, and the
    leader gathers the results. A rank that sends nothing in time leaves its share to the analytical model.
    Called by the leader; the followers hear the task as a word (``_follow``)."""
    from atorch.strategy_search.costing.tracing import MemoryTracer, TracedMemory, family_of

    env = session.env
    families: dict[str, list[Any]] = {}
    for cand in cands:
        families.setdefault(family_of(cand), []).append(cand)
    shares: list[list[Any]] = [[] for _ in range(env.world_size)]
    for i, members in enumerate(families.values()):
        shares[i % env.world_size].extend(members)
    mine, sent = _share_with_followers(
        session, {"kind": "trace", "index": index, "limit_s": limit_s, "per_rank": per_rank}, shares,
        f"trace/{index}", lambda share: MemoryTracer(session.setup, batch, env.world_size, env.device)
        .trace_candidates(share, time_limit_s=limit_s))
    traced: dict[str, Any] = dict(mine)
    for rank, found in sent.items():
        if found is None:
            found = {c.key: f"rank {rank} sent no trace within {limit_s + 30.0:g} s" for c in shares[rank]}
        traced.update({key: t if isinstance(t, str) else TracedMemory(**t) for key, t in found.items()})
    return traced


class _Leader:
    """Rank 0's part: analyse, build the space, plan; measuring runs on every rank."""

    def __init__(self, setup: UserSetup, env: DistEnv, session: DryRunSession, profile: Any, excluded: list[str],
                 included: list[str], finetune: Strategy | None, time_limit: float | None, options: SearchOptions,
                 start: float, strategy_server: str | None) -> None:
        self.setup, self.env, self.session, self.profile = setup, env, session, profile
        self.excluded, self.included, self.finetune = excluded, included, finetune
        self.time_limit, self.options, self.start = time_limit, options, start
        self.strategy_server = strategy_server
        self.global_batch = int(setup.dataloader_args.get("batch_size", 1))
        self.progress = SearchProgress(profile.memory_per_rank, world_size=env.world_size,
                                       max_dry_runs=options.max_trials)
        self.references: dict[tuple[int, int, int], float | None] = {}  # the user's model's first-step losses
        # where the search's wall time went, seconds by phase (the planner adds its own: build check, dry-runs,
        # confirmation); in the outcome (result.args.search["phases"]) and the study (the report)
        self.phases: dict[str, float] = {"profile_s": time.monotonic() - start}
        # (method, layout) pairs the build check ruled out (``_prepare``): never traced either
        self.ruled_out: dict[tuple[str, str], str] = {}

    def _measure_s(self, confirming: bool = False) -> float:
        """Timed seconds of a dry-run: ``screen_measure_s`` while exploring, ``min_measure_s`` when confirming."""
        full = self.options.min_measure_s
        return full if confirming else min(full, self.options.screen_measure_s)

    def _dry_run_s(self, step_s: float) -> float:
        """A full dry-run's predicted wall time at a predicted step of ``step_s``: its build, warm-up and timed steps
        (at least ``measure_steps``, or as many as add up to ``min_measure_s``). The trace's time is counted in
        these, not in exploration's shorter screening runs: with two screening runs' worth, the held-out Swin's
        budget search traced fewer close calls and ran two of them out of memory (bench/README.md, run N)."""
        timed = max(self.options.measure_steps * step_s, min(self.options.min_measure_s,
                                                             self.options.max_measure_steps * step_s))
        return self._stopped_run_s(step_s) + timed

    def _stopped_run_s(self, step_s: float) -> float:
        """A dry-run stopped at its warm-up (out of memory) at a predicted step of ``step_s``: its build and warm-up."""
        return DRY_RUN_BUILD_S + self.options.warmup_steps * step_s

    def plan(self) -> SearchOutcome:
        from atorch.strategy_search.costing.analyser import analyse, batch_shape
        from atorch.strategy_search.costing.diagnosis import StepError
        from atorch.strategy_search.costing.hardware import ranks_per_node
        from atorch.strategy_search.search.planner import Planner, default_storage, study_key
        from atorch.strategy_search.search.space import SearchSpace

        per_rank = self.global_batch // self.env.world_size
        batch = sample_batch(self.setup, self.env, per_rank)  # a dataset that yields no batch is refused here
        self.batch = batch
        # The model's statistics are made at the first prediction (a cached pick needs none: on a 206M-parameter
        # GPT-2 they took 9 of a cached call's 11 s). A failure is kept, so the cost model reports it once per
        # candidate without analysing again.
        analysed: list[Any] = []

        def stats() -> Any:
            if not analysed:
                begin = time.monotonic()
                try:
                    analysed.append(analyse(self.setup.model, batch, self.setup.model_input_format,
                                            self.setup.loss_func))
                    self.phases["analysis_s"] = time.monotonic() - begin
                    logger.info("automatic search: %s analysed in %.1f s (one step on %s tensors)",
                                type(self.setup.model).__name__, time.monotonic() - begin, analysed[0].measured_on)
                except StepError:  # the user's mistake (loss order, batch vs model_input_format): stop with it
                    raise
                except Exception as exc:  # noqa: BLE001  (the planner measures what the cost model cannot predict)
                    logger.warning("automatic search: the model could not be analysed (%s); the cost model has no "
                                   "figures and the dry-runs decide alone", exc)
                    analysed.append(exc)
            if isinstance(analysed[0], Exception):
                raise analysed[0]
            return analysed[0]

        supported = [d for d, name in (("bf16", "bfloat16"), ("fp16", "float16")) if name in self.profile.matmul_tflops]
        try:
            sequence = batch_shape(batch)[1]  # token sequences long enough get context-parallel candidates
        except ValueError:
            sequence = None
        space = SearchSpace(self.setup.model, self.env.world_size, self.global_batch, supported_dtypes=supported,
                            excluded=self.excluded, included=self.included, finetune_strategy=self.finetune,
                            max_micro_batch_size=self.options.max_micro_batch_size,
                            host_offload=self.profile.device_type != "cpu", loop=self.options.loop,
                            precision=self.options.precision, ranks_per_node=ranks_per_node(self.env.world_size),
                            sequence_length=sequence,
                            context_parallel_from=self.options.context_parallel_from)
        state_factor = optimizer_state_factor(self.setup)
        from atorch.strategy_search.costing.tracing import untraced_reason
        from atorch.strategy_search.search.candidates import SiblingErrors, sibling_key

        traced: dict[str, Any] = {}  # candidate key -> traced memory, or why it was not traced
        sibling_errors = SiblingErrors(ANALYTICAL_MEMORY_BAND)  # from the traced, for the untraced
        traced_band = TRACED_MEMORY_BAND_CPU if self.profile.device_type == "cpu" else TRACED_MEMORY_BAND

        analytical_of: dict[str, Any] = {}  # by candidate key: the trace's ordering asks for each several times

        def analytical(cand: Any) -> Any:
            from atorch.strategy_search.costing.cost_model import predict as cost_model

            if cand.key not in analytical_of:
                analytical_of[cand.key] = cost_model(stats(), cand.strategy, cand.strategy.layout(self.env.world_size),
                                                     self.profile, self.global_batch, cand.micro_batches,
                                                     optimizer_state_factor=state_factor)
            return analytical_of[cand.key]

        def traced_peak(cand: Any) -> float | None:
            # Memory from the program: the space's candidates traced once, on the first prediction (tracing.py:
            # the real build and step on fake tensors; a family at its two end micro-batch sizes), fastest
            # predicted first, shared by every rank, for TRACE_RANK_S rank-seconds (at least TRACE_MIN_S, at most
            # TRACE_DRY_RUNS predicted dry-runs and a fifth of what time_limit leaves): the rest stay analytical, as
            # do the candidates whose fit the analytical figure decides by a wide margin (TRACE_BAND).
            if not traced:
                begin = time.monotonic()
                limit = max(TRACE_MIN_S, TRACE_RANK_S / self.env.world_size)
                if self.time_limit is not None:
                    limit = max(0.0, min(limit, 0.2 * (self.time_limit - (begin - self.start))))
                low, high = (share * self.profile.memory_per_rank for share in TRACE_BAND)
                doubtful = [c for c in space.enumerate() if low < analytical(c).memory.peak < high]
                traced["*"] = "fits by a wide margin"  # marks tracing as done, whatever follows
                cands: list[Any] = []
                untraceable = chosen = 0
                try:
                    # the close calls (within the analytical band of the budget: without a trace they would be
                    # dry-run to settle their fit) and the rest of the doubtful that could still be picked:
                    # predicted faster than TRACE_SLOWER_THAN_SURE x the fastest candidate that fits even if the
                    # analytical figure is its band low (a slower one's fit decides nothing); fastest first, where
                    # a fit decides the pick
                    budget = self.profile.memory_per_rank
                    sure = min((analytical(c).time.step for c in space.enumerate()
                                if analytical(c).memory.peak * (1.0 + ANALYTICAL_MEMORY_BAND) <= budget),
                               default=float("inf"))

                    def close(c: Any) -> bool:
                        return abs(analytical(c).memory.peak / budget - 1.0) <= ANALYTICAL_MEMORY_BAND

                    def wanted(c: Any) -> bool:
                        return close(c) or analytical(c).time.step < TRACE_SLOWER_THAN_SURE * sure

                    # a candidate the trace cannot build (DeepSpeed's engine) is stood for by its siblings (the same
                    # computation under another sharding: ``sibling_key``), traced in its place and at its priority:
                    # their error on the activations corrects its analytical figure (``predict``)
                    untraceable_keys = {c.key for c in doubtful
                                        if untraced_reason(c.strategy, self.env.world_size) is not None}
                    stands_in: dict[str, float] = {}
                    for c in doubtful:
                        if wanted(c) and c.key in untraceable_keys:
                            k = sibling_key(dict(c.point))
                            stands_in[k] = min(stands_in.get(k, float("inf")), analytical(c).time.step)

                    def priority(c: Any) -> float:
                        return min(analytical(c).time.step, stands_in.get(sibling_key(dict(c.point)), float("inf")))

                    untraceable = len(untraceable_keys)
                    cands = sorted((c for c in doubtful if c.key not in untraceable_keys and self._builds(c)
                                    and (wanted(c) or sibling_key(dict(c.point)) in stands_in)), key=priority)
                    # each sibling group has one member traced before any has two: the trace's seconds buy the
                    # analytical model's error for as many groups as they can (a trace costs about a dry-run of a
                    # small model: the held-out bench's Swin traced 2 families a rank in 4 s)
                    rounds: dict[str, int] = {}
                    order: dict[str, int] = {}
                    for c in cands:
                        group = sibling_key(dict(c.point))
                        rounds[group] = rounds.get(group, -1) + 1
                        order[c.key] = rounds[group]
                    cands.sort(key=lambda c: order[c.key])  # stable: by priority within a round
                    # proportional to a dry-run: TRACE_DRY_RUNS of the fastest sure fit's, or where nothing surely
                    # fits, of the fastest candidate to trace's (PoolFormer under its budget: every candidate a close
                    # call, dry-runs of 1.5 s, and a 10 s trace made the search cost 1.3x measuring its top 16)
                    reference = sure if sure < float("inf") else min(
                        (analytical(c).time.step for c in cands), default=float("inf"))
                    if reference < float("inf"):
                        limit = min(limit, max(TRACE_FLOOR_S, TRACE_DRY_RUNS * self._dry_run_s(reference)))
                    end_s = TRACE_END_PER_ANALYSIS * self.phases.get("analysis_s", 0.0)
                    chosen = len(cands)  # chosen to trace, before the cost checks below (the summary counts them)
                    if cands and end_s > limit:
                        logger.info("cost model: memory not traced: one trace of this model would take about %.1f s "
                                    "(%g x its analysis), over the %.1f s the trace may take", end_s,
                                    TRACE_END_PER_ANALYSIS, limit)
                        cands = []
                    stopped_s = self._stopped_run_s(min((analytical(c).time.step for c in cands), default=0.0))
                    if cands and end_s / self.env.world_size > TRACE_PER_STOPPED_RUN * stopped_s:
                        logger.info("cost model: memory not traced: a trace would cost about %.1f s a candidate (%g x "
                                    "the analysis's %.2f s, %d at once), over %g of a dry-run stopped at its warm-up "
                                    "(about %.1f s), the most it may spare: the close calls are dry-run instead",
                                    end_s / self.env.world_size, TRACE_END_PER_ANALYSIS,
                                    self.phases.get("analysis_s", 0.0), self.env.world_size, TRACE_PER_STOPPED_RUN,
                                    stopped_s)
                        cands = []
                    if cands:
                        limit = max(limit, TRACE_ENDS_PER_FAMILY * end_s)
                        traced.update(trace_on_every_rank(self.session, batch, per_rank, cands, limit))
                except Exception as exc:  # noqa: BLE001  (the analytical model stands in)
                    traced["*"] = f"{type(exc).__name__}: {exc}"
                for c in space.enumerate():
                    if (found := traced.get(c.key)) is not None and not isinstance(found, str):
                        sibling_errors.add(dict(c.point), float(found.peak), analytical(c).memory.peak)
                done = sum(not isinstance(t, str) for t in traced.values())
                self.phases["trace_s"] = time.monotonic() - begin
                logger.info("cost model: memory of %d of %d candidates traced in %.1f s (%d are under %.0f%% or over "
                            "%.0f%% of the budget by the analytical model, %d predicted slower than a sure fit and %d "
                            "cannot be traced: the analytical model stands for them and for the untraced rest, "
                            "corrected by their traced siblings' error for %d)", done, len(space),
                            time.monotonic() - begin, len(space) - len(doubtful),
                            *(100 * share for share in TRACE_BAND), len(doubtful) - chosen - untraceable,
                            untraceable, sum(sibling_errors.knows(dict(c.point))
                                             and isinstance(traced.get(c.key, ""), str) for c in space.enumerate()))
            found = traced.get(cand.key)
            return None if found is None or isinstance(found, str) else float(found.peak)

        def predict(cand: Any) -> Any:
            pred = analytical(cand)
            peak = traced_peak(cand)
            band = ANALYTICAL_MEMORY_BAND if peak is None else traced_band
            if peak is None:
                # untraced: the analytical peak corrected by the error its traced siblings showed on the same
                # activations (on the held-out Swin, checkpointed DeepSpeed ZeRO was over-predicted by 41%, its
                # siblings by as much; so corrected, by 0-2%); still an estimate: the analytical band stays
                peak = sibling_errors.corrected(dict(cand.point), pred.memory.peak, pred.memory.activations)
            return Predicted.of(pred.memory.peak if peak is None else peak, pred.time.step, space.global_batch,
                                memory_band=band)

        storage = self.options.storage or default_storage()
        identity = self._identity(space, batch)
        key = study_key(identity)

        def make_planner(remote: bool) -> Any:
            # the whole time_limit, with what the profile and the analysis spent of it: the messages name the user's
            args = dict(predict=predict, measure=self._measure, memory_budget=self.profile.memory_per_rank,
                        storage=storage, study_key=key, sampler=self.options.sampler, time_limit_s=self.time_limit,
                        time_spent_s=time.monotonic() - self.start,
                        max_trials=self.options.max_trials, patience=self.options.patience,
                        top_k=self.options.top_k, seed=self.options.seed,
                        skip_slower_than=self.options.skip_slower_than, identity=identity,
                        confirm_within=self.options.confirm_within, confirm_rounds=self.options.confirm_rounds,
                        check=self._all_back,
                        prepare=self._prepare, phases=self.phases)
            if not remote:
                return Planner(space, **args)
            from atorch.strategy_search.search.remote import RemotePlanner

            return RemotePlanner(space, **args, server_url=self.strategy_server)

        logger.info("automatic search: %d candidates, memory budget %.1f MiB per rank (%s), study %s%s",
                    len(space), self.profile.memory_per_rank / 2**20, self.profile.memory_source, key,
                    f" on {self.strategy_server}" if self.strategy_server else "")
        if dropped := layer_drop_settings(self.setup.model):
            logger.info("automatic search: %s skips layers at random, each rank drawing its own: no candidate "
                        "communicates inside the layers (sharding, tensor, expert or context parallel)",
                        shown(dropped))
        with self.progress:
            self.local = self.strategy_server is None
            self.planner = make_planner(remote=not self.local)
            try:
                result = self._plan(self.planner)
            except SetupError as exc:  # the strategy server is unreachable or failing
                if self.strategy_server is None or not self.options.server_fallback:
                    raise
                logger.warning("strategy server %s failed (%s); searching locally (server_fallback)",
                               self.strategy_server, exc)
                self.local = True
                self.planner = make_planner(remote=False)
                result = self._plan(self.planner)
        self.progress.summary(result)
        if result.candidate is None:
            raise NoStrategyFound(_no_pick_problems(result, self.profile.memory_per_rank),
                                  what="automatic strategy search found no strategy")
        cand = result.candidate
        # a cached pick's reason was logged where the study answered (planner): said once
        logger.info("automatic search picked %s (%s, study %s%s)", self.progress.describe(cand), result.source,
                    result.study_name, "" if result.source == "cache" else f"; {result.stop_reason}")
        where = storage if self.local else str(self.strategy_server)
        trials = [rejudged(t, self.profile.memory_per_rank) for t in result.trials]  # under this search's limit
        self.phases["total_s"] = time.monotonic() - self.start
        return SearchOutcome(cand.strategy, cand.micro_batch_size, cand.micro_batches, result.source,
                             result.study_name, where, result.dry_runs, result.stop_reason, trials,
                             {k: round(v, 3) for k, v in self.phases.items()})

    def _identity(self, space: Any, batch: Any) -> Any:
        """What this search is for, all but the memory budget: the study's key (planner.StudyIdentity)."""
        from atorch.strategy_search.search.planner import StudyIdentity

        setup = self.setup
        return StudyIdentity.of(
            space, model=setup.model, hardware=self.profile, sample=batch,
            optimizer={"class": setup.optim_func, "args": setup.optim_args, "param_groups": self._param_groups()},
            loss=setup.loss_func, model_input_format=setup.model_input_format,
            options={"find_unused_parameters": setup.find_unused_parameters})

    def _param_groups(self) -> Any:
        """The user's parameter groups as they change the answer: each group's settings and size (a prebuilt
        optimizer's groups live in a closure, whose name alone would not tell two of them apart)."""
        func = self.setup.optim_param_func
        if func is None:
            return None
        try:
            groups = list(func(self.setup.model))
        except Exception as exc:  # noqa: BLE001  (building the optimizer reports it; the key keeps the name)
            logger.debug("could not list the parameter groups for the search's key: %s", exc)
            return func
        if not all(isinstance(g, dict) for g in groups):  # plain parameters: one group
            return {"params": len(groups)}
        return [{**{k: v for k, v in g.items() if k != "params"}, "numel": sum(p.numel() for p in g["params"])}
                for g in groups]

    def _plan(self, planner: Any) -> Any:
        result = planner.search(force=self.options.force) if self.options.dryrun else planner.plan_without_dryrun()
        if result.candidate is None and self.options.dryrun:
            fallback = planner.plan_without_dryrun()
            if fallback.candidate is not None and result.dry_runs == 0:
                # Nothing was measured (the time limit came first): the cost model's pick is all there is.
                logger.warning("automatic search: no dry-run finished (%s); using the cost model's pick",
                               result.stop_reason)
                result = fallback
        return result

    def _builds(self, cand: Any) -> bool:
        """Whether the build check left ``cand`` in: its methods at its layout, and its micro-batch size."""
        from atorch.strategy_search.search.buildable import ruled_out_by
        from atorch.strategy_search.search.candidates import layout_key

        return not ruled_out_by(self.ruled_out, cand.strategy.names(), layout_key(dict(cand.point)),
                                cand.micro_batch_size)

    def _prepare(self, cands: list[Any]) -> dict[tuple[str, str], str]:
        """Before the first dry-run: the build check of the space's method families (buildable.py: a family that
        does not build on this model leaves the search), then every rank does the one-time preparations of the
        rest (deduplicated by what they do): a DeepSpeed op build (30-70 s the first time) would otherwise land
        inside whichever dry-run first used it, and on a time limit, stop the search in the middle of it."""
        from atorch.dryrun.runner import preparations, prepare_once
        from atorch.strategy_search.costing.analyser import batch_shape
        from atorch.strategy_search.search.buildable import (
            CHECK_TIME_S,
            BuildCheck,
            rule_label,
            too_small_micro_batches,
        )

        limit = CHECK_TIME_S
        if self.time_limit is not None:
            limit = max(1.0, min(limit, 0.2 * (self.time_limit - (time.monotonic() - self.start))))
        try:
            checked = check_on_every_rank(self.session, self.batch, self.global_batch // self.env.world_size,
                                          cands, limit)
        except Exception as exc:  # noqa: BLE001  (the dry-runs rule out what does not build, one failure each)
            logger.warning("automatic search: the build check could not run (%s: %s); the dry-runs decide",
                           type(exc).__name__, exc)
            checked = BuildCheck()
        try:  # micro-batches too small for the model (BatchNorm over one value per channel) leave the space too
            checked.unbuildable.update(too_small_micro_batches(
                self.setup, lambda n: sample_batch(self.setup, self.env, n), batch_shape(self.batch)[0],
                [c.micro_batch_size for c in cands]))
        except Exception as exc:  # noqa: BLE001  (the dry-runs find it instead, one failure rules the size out)
            logger.warning("automatic search: the micro-batch check could not run (%s: %s); the dry-runs decide",
                           type(exc).__name__, exc)
        logger.info("automatic search: build check of the space's method families: %d build%s%s in %.1f s on fake "
                    "tensors; ruled out: %s%s", checked.builds, "" if checked.builds == 1 else "s",
                    f" on {checked.ranks} ranks" if checked.ranks > 1 else "", checked.seconds,
                    "; ".join(rule_label(rule, why) for rule, why in checked.unbuildable.items()) or "none",
                    f"; left to the dry-runs: {'; '.join(checked.unchecked)}" if checked.unchecked else "")
        self.ruled_out = checked.unbuildable
        found = preparations([c.strategy for c in cands if self._builds(c)])
        if not found:
            return self.ruled_out
        begin = time.monotonic()
        if self.env.world_size > 1:
            self.session.announce_next({"kind": "prepare", "strategies": [s.to_list() for s in found.values()]})
        for what, strategy in found.items():
            self.progress.note(f"strategy search: one-time preparation before the dry-runs: {what}")
            problems = prepare_once(strategy, log=False)
            if problems:  # its candidates fail with it in their dry-runs (the preflight agreement)
                self.progress.note(f"strategy search: preparation failed: {'; '.join(problems)}")
        logger.info("automatic search: %d one-time preparation%s done in %.1f s, before the first dry-run",
                    len(found), "" if len(found) == 1 else "s", time.monotonic() - begin)
        return self.ruled_out

    def _measure(self, cand: Any) -> Measured:
        """Every rank dry-runs ``cand``: announce it, run it here too."""
        timeout = self.options.trial_timeout_s
        if self.time_limit is not None:  # a trial never runs past the job's time limit
            timeout = max(1.0, min(timeout, self.time_limit - (time.monotonic() - self.start)))
        batch_size = cand.micro_batch_size * cand.strategy.layout(self.env.world_size).data_size
        label = self.progress.describe(cand)
        # the early-stop bar: a candidate already slower than the best by EARLY_STOP_FACTOR stops timing (planner)
        stop_above = self.planner.early_stop_above_s() if hasattr(self.planner, "early_stop_above_s") else None
        # exploration screens (screen_measure_s of timed steps); the confirmation measures in full (min_measure_s)
        measure_s = self._measure_s(confirming=getattr(self.planner, "confirming", False))
        word = {"kind": "trial", "strategy": cand.strategy.to_list(), "timeout_s": timeout,
                "micro_batches": cand.micro_batches, "batch_size": batch_size, "label": label,
                "stop_above_s": stop_above, "min_measure_s": measure_s}
        prediction = self.planner.predictions().get(cand.key) if hasattr(self.planner, "predictions") else None
        self.progress.started(cand, prediction)
        self.session.announce_next(word)
        trial = self.session.run(cand.strategy, timeout_s=timeout, micro_batches=cand.micro_batches,
                                 batch_size=batch_size, label=label, stop_above_s=stop_above, min_measure_s=measure_s)
        measured = self._check_numerics(cand, trial, batch_size)
        self.progress.finished(cand, prediction, measured)
        return measured

    def _all_back(self) -> None:
        """Before the planner asks for another candidate or stores its end: after a trial that did not end well,
        every rank meets (a rank may still be stuck in it); ``RankLost`` on every rank still running when one
        does not come back, so nothing that did not run is recorded and the search is not stored finished."""
        if self.session.unsettled is not None:
            self.session.announce_next({"kind": "rejoin"})
            self.session.rejoin()

    def _check_numerics(self, cand: Any, trial: TrialResult, batch_size: int) -> Measured:
        """The dry-run's losses against the user's own model on the same samples (atorch.dryrun.numerics):
        a candidate that computes something else is rejected with the reason, whatever its speed."""
        from atorch.dryrun.numerics import MIN_WARMUP_FOR_CHECK, compute_dtype, loss_problem, reference_loss

        measured = Measured.of(trial)
        if trial.status != "ok" or not trial.losses:
            return measured
        data_size = cand.strategy.layout(self.env.world_size).data_size
        key = (batch_size, cand.micro_batches, data_size)
        if key not in self.references:
            try:
                self.references[key] = reference_loss(self.setup, self.env.device, batch_size, cand.micro_batches,
                                                      data_size)
            except Exception as exc:  # noqa: BLE001  (the check is skipped, said once per micro-batching)
                logger.warning("numerics check skipped: the user's model could not compute the reference loss "
                               "(%s: %s)", type(exc).__name__, exc)
                self.references[key] = None
        reference = self.references[key]
        checked_first = self.options.warmup_steps >= MIN_WARMUP_FOR_CHECK and trial.first_step_in_eval
        problem = loss_problem(trial.losses, reference, compute_dtype(cand.strategy), checked_first)
        loss = trial.losses[0]
        if problem is None:
            return measured.model_copy(update={"loss": loss, "reference_loss": reference})
        return measured.model_copy(update={"status": "numerics", "reason": problem, "loss": loss,
                                           "reference_loss": reference})


def sample_batch(setup: UserSetup, env: DistEnv, per_rank: int) -> Any:
    """One per-rank batch from the user's dataset, as the model receives it (for the analyser)."""
    from atorch.data import build_dataloader

    args = {**setup.dataloader_args, "batch_size": max(per_rank, 1), "shuffle": False, "num_workers": 0}
    args.pop("sampler", None)
    try:
        batch = next(iter(build_dataloader(setup.dataset, args, 1, 0)))
    except StopIteration:
        raise SetupError(f"the dataset yields no batch of {per_rank} samples; automatic search needs one") from None
    return InputPreparer(setup.prepare_input, env.device, None)(batch)


def optimizer_state_factor(setup: UserSetup) -> float:
    """Optimizer state elements per parameter element (AdamW 2, SGD with momentum 1, plain SGD 0),
    found by stepping the user's optimizer once on a small parameter."""
    param = torch.nn.Parameter(torch.zeros(64))
    try:
        opt = setup.optim_func([param], **setup.optim_args)
        param.grad = torch.ones_like(param)
        opt.step()
        numel = sum(t.numel() for s in opt.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor) and t.numel() > 1)
        return numel / param.numel()
    except Exception as exc:  # noqa: BLE001  (an exotic optimizer: assume Adam's two states)
        logger.debug("could not measure the optimizer's state size (%s); assuming 2 states", exc)
        return 2.0


def _no_pick_problems(result: Any, budget: int) -> list[str]:
    problems = [f"no candidate fitted and ran ({result.stop_reason}); memory budget {budget / 2**20:.1f} MiB per rank"]
    seen: set[str] = set()
    for trial in result.trials:
        status, reason = trial.get("status"), trial.get("reason", "")
        if status in (None, "ok", "duplicate") or reason in seen:
            continue
        seen.add(reason)
        problems.append(f"{status}: {describe_record(trial.get('candidate') or {})} - {reason}")
        if len(problems) > 6:
            break
    problems.append("fixes: raise memory_limit, allow more methods (excluded/included), lower the global batch, "
                    "or raise search={'max_trials': ..., 'trial_timeout_s': ...} or time_limit")
    return problems
