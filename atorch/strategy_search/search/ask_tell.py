"""Ask/tell over an Optuna study and a candidate table: the one place where a search decides what to run.

Both the local planner (``Planner.search``) and the strategy server use it. ``ask()`` returns the next
candidate to measure (a trial number and a point) or a stop reason; on the way it tells, without a dry-run,
candidates the study already knows (``duplicate``), candidates the cost model predicts above the memory
budget (``predicted_oom``, a COMPLETED trial with a violated constraint; the prediction is first scaled by
what its own family measured: ``family_key``), and candidates predicted more than ``HOPELESS_FACTOR`` times
slower than the best measured one (``skipped``, with the factor). ``tell(number, measured)``
judges a measured outcome under the budget and tells it; telling a finished trial again changes nothing.

Everything this object knows is in the study (user attributes, JSON only), so it can be rebuilt from the
storage at any time: after a restart, or in another server process.

The stop rules that belong to one search (time limit, dry-run budget, patience) live in ``StopRules``,
kept by whoever runs the loop.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from atorch.errors import RankLost
from atorch.strategy import Strategy
from atorch.strategy_search.search.buildable import MICRO_BATCH_FAILURES, micro_batch_rule, ruled_out_by
from atorch.strategy_search.search.candidates import CandidateTable, Point, complexity, point_key, splits_the_model
from atorch.strategy_search.search.outcome import Measured

OK_STATUSES = frozenset({"ok", "success", "succeeded", "complete", "completed"})
DEFAULT_TOP_K = 3


@dataclass(frozen=True)
class Proposal:
    number: int | None  # the trial to measure and tell; None when the search should stop
    point: Point | None = None
    key: str = ""
    predicted: dict[str, Any] = field(default_factory=dict)
    stop: str = ""


def measure_safely(measure: Callable[[Any], Any], candidate: Any) -> Measured:
    """Run ``measure``; one that raises is a failed trial with its reason, and the search goes on. Except
    ``RankLost``: a process is gone, nothing more can run, and the candidate did not run (not a failure of it)."""
    try:
        return Measured.of(measure(candidate))
    except RankLost:
        raise
    except Exception as exc:
        return Measured.failure(exc)


def judge(
    measured: dict[str, Any], pred: dict[str, Any], budget: float
) -> tuple[float, dict[str, float], dict[str, Any]]:
    """Value, constraints and status attributes of a measured outcome under ``budget`` (stored outcomes too:
    a budget that changed since they were measured re-judges them)."""
    fallback = pred.get("samples_per_s", 0.0) if "error" not in pred else 0.0
    status, peak, sps, reason = (measured[k] for k in ("status", "peak_memory_bytes", "samples_per_s", "reason"))
    over = (peak - budget) / budget
    if status in OK_STATUSES and over > 0:
        status = "oom"
        reason = f"measured peak {peak / 2**20:.1f} MiB > budget {budget / 2**20:.1f} MiB"
    if status in OK_STATUSES and sps > 0:
        return sps, {"memory_over": over, "failed": 0.0}, {"status": "ok"}
    attrs = {"status": status if status not in OK_STATUSES else "failed", "reason": reason or status}
    if status == "oom":  # over budget by the measured amount (by the whole budget when not measured)
        return fallback, {"memory_over": over if over > 0 else 1.0, "failed": 0.0}, attrs
    return fallback, {"memory_over": over if peak > 0 else 0.0, "failed": 1.0}, attrs


def trial_record(t: Any) -> dict[str, Any]:
    return {"number": t.number, "value": t.value, "constraints": dict(t.constraints), **t.user_attrs}


def make_sampler(sampler: Any, max_trials: int, seed: int) -> Any:
    import optuna

    if not isinstance(sampler, str):
        return sampler
    startup = max(1, max_trials // 2)
    if sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup)
    if sampler == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=startup)
    raise ValueError(f"sampler must be 'tpe', 'gp' or an Optuna sampler, got {sampler!r}")


def set_user_attrs(trial: Any, attrs: dict[str, Any]) -> None:
    """Set a running trial's user attributes, one public ``Trial.set_user_attr`` each.

    One call per attribute is enough: the server's studies live on an ``InMemoryStorage`` (a dict write each;
    the durable record is one event-log row per request, atorch.server.store), and a local search's SQLite study
    pays one commit per attribute, about ten per trial, milliseconds next to a dry-run of seconds. It is not one
    transaction: another process may see a running trial with part of its attributes for a moment, but every
    reader that judges outcomes reads finished trials only, and ``study.tell`` finishes a trial after all of its
    attributes are written."""
    for k, v in attrs.items():
        trial.set_user_attr(k, v)


MAX_MEMORY_CORRECTION = 1.5  # one badly predicted outlier must not rule out its whole family
# A candidate predicted this many times slower than the best measured one is not dry-run (both figures from the
# cost model, so its absolute error cancels; its rank order held at Spearman 0.97 on bench/search.py, where the
# step times of one space span 30x): a dry-run that cannot win is most of a search's time (a demo search spent 73
# of its 100 s on a candidate predicted 340x slower).
HOPELESS_FACTOR = 4.0
# A candidate that has not run is promoted to the next dry-run when its time-corrected prediction beats the best
# measured samples/s by this fraction (see SearchState.promising): below it, one dry-run's noise decides.
PROMOTE_MARGIN = 0.05
# A candidate whose unmeasured figure lies over the budget, within the memory model's band, runs out of memory about
# 3 times in 4 (CandidateTable.fit_chance): its dry-run is worth a slot when its chance times its predicted gain over
# the best measured one still beats PROMOTE_MARGIN. The seeds rank by the same expected samples/s. On the held-out
# DeepSeek-V3 under its budget, 3 of 8 dry-runs had stopped out of memory so (bench/README.md, run W: 11 of 66 over
# the nine held-out budget searches of sets 1-3); with this rule 3 of 63 and 8 of 59 in two launches, 5 of those 8
# on DeepSeek-V3, three of them figures wrongly under the budget (run X).
CONFIRM_RUNS = 2  # a confirmation round re-measures the best and the runner-up once each
CONFIRM_ROUNDS = 3  # rounds at most, while the two stay within the noise of each other (SearchOptions.confirm_rounds)
# The confirmation's band (SearchOptions.confirm_within) doubles, up to this, for a runner-up that the cost model ranked
# first: the measured order contradicts it. On one H200 a RegNet's fp32 dry-run measured 24% slower than its
# fp16 runner-up, though fp32 ran 1.23x faster interleaved in the user's loop (bench/README.md, GPU checks).
DISPUTED_BAND_MAX = 0.5


def disputed_band(within: float) -> float:
    """The confirmation's band for a runner-up that the cost model ranked first: twice ``within``, at most
    DISPUTED_BAND_MAX (never below ``within``)."""
    return max(within, min(2.0 * within, DISPUTED_BAND_MAX))


# A dry-run's failure in a method's build step: "build [tensor_parallel]: NotImplementedError: ..." (dryrun/runner.py)
_BUILD_STEP = re.compile(r"\bbuild \[(\w+)\]: ")
# What a step failure's reason says besides where it happened: "rank 0: warm-up step 0: TypeError: ...; rank 1: ..."
_FAILURE_PLACE = re.compile(r"\brank \d+: |\b(?:warm-up )?step \d+: ")


def failure_signature(reason: str) -> str:
    """A dry-run failure's error, the same for every candidate and rank that failed alike ("" for none)."""
    first = _FAILURE_PLACE.sub("", reason).split("; ")[0].strip()
    return first if ":" in first else ""


# Two candidates whose back-to-back confirmation runs are this close are within a shared machine's noise of each
# other (run-to-run noise here: 11-37%; interleaved, the same load falls on both): the simpler one is kept.
CONFIRM_TIE = 0.05
# A dry-run whose timed steps already show it this many times slower than the best measured median step stops timing
# (atorch.dryrun.runner: ``stop_above_s``): its slowest rank's fastest step above it. Past the machine's
# run-to-run noise (11-37% here, what the confirmation's rules read), so a candidate stopped so could not have won
# its confirmation either; it is recorded as measured, its median over the steps it ran.
EARLY_STOP_FACTOR = 1.5
# Exploration stops when nothing left can win (``SearchState.nothing_left``): after NOTHING_LEFT_AFTER dry-runs, every
# candidate not yet measured that is predicted to fit has a time-corrected predicted step more than this fraction
# above the best measured one. The margin is the early stop's (EARLY_STOP_FACTOR): a candidate predicted that far
# behind after its family's (or layout's) measured correction is one whose dry-run would be stopped early anyway;
# the step-time rank order held at Spearman 0.92-0.97 on the held-out bench (bench/README.md).
NOTHING_LEFT_MARGIN = EARLY_STOP_FACTOR - 1.0
NOTHING_LEFT_AFTER = 3


def merge_runs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two dry-runs of one candidate as one outcome, with the higher peak; a run that failed decides. The first
    confirmation run replaces the first run's speed: it runs interleaved with its contender's, so the two are
    measured under the same load and compare; first runs, made minutes apart under whatever load there was, do not
    (on a loaded machine a candidate's lucky first run ranked it first though it ran 2x slower side by side).
    Later confirmation rounds are pooled: samples/s is the median of the confirmation runs' (``confirmed``), and
    their measured step times are kept together (``step_times_s``: their spread is the noise ``decided`` reads)."""
    if str(first["status"]).lower() not in OK_STATUSES:
        return first
    if str(second["status"]).lower() not in OK_STATUSES:
        return second
    runs = int(first.get("runs", 1))
    merged = {**second, "peak_memory_bytes": max(first["peak_memory_bytes"], second["peak_memory_bytes"]),
              "runs": runs + int(second.get("runs", 1))}
    if runs < 2:  # the first confirmation: it alone compares with its contender's
        return {**merged, "confirmed": [second["samples_per_s"]], "step_times_s": list(second.get("step_times_s", []))}
    confirmed = [*first.get("confirmed", [first["samples_per_s"]]), second["samples_per_s"]]
    steps = [*first.get("step_times_s", []), *second.get("step_times_s", [])]
    merged.update(confirmed=confirmed, samples_per_s=statistics.median(confirmed), step_times_s=steps)
    if steps:
        merged["step_time_s"] = statistics.median(steps)
    return merged


def _spread(times: list[float]) -> float:
    """A candidate's noise: the median absolute deviation of its measured step times."""
    middle = statistics.median(times)
    return statistics.median(abs(t - middle) for t in times)


def decided(best: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether two candidates' confirmation runs (merged outcomes, ``merge_runs``) tell them apart: with step times
    for both, every step of one faster than every step of the other, or medians further apart than the two spreads
    together (the machine's noise, as measured); without them, samples/s more than CONFIRM_TIE apart."""
    a, b = list(best.get("step_times_s") or []), list(other.get("step_times_s") or [])
    if len(a) >= 2 and len(b) >= 2:
        if max(a) < min(b) or max(b) < min(a):
            return True
        return abs(statistics.median(a) - statistics.median(b)) > _spread(a) + _spread(b)
    high, low = sorted((float(best["samples_per_s"]), float(other["samples_per_s"])), reverse=True)
    return low < (1 - CONFIRM_TIE) * high


def best_of(entries: list[tuple[float, str, int, dict[str, Any]]]) -> tuple[float, str] | tuple[None, None]:
    """The best of (samples/s, key, runs, merged measured) entries: the fastest, except that when the two fastest
    were both confirmed (run more than once) and their confirmation runs do not tell them apart (``decided``), the
    simpler (``complexity``) wins: the difference is the machine's noise, and the simpler strategy has less to go
    wrong."""
    ranked = sorted(entries, key=lambda e: (e[0], e[1]), reverse=True)
    if not ranked:
        return None, None
    if len(ranked) > 1 and ranked[0][2] > 1 and ranked[1][2] > 1 and not decided(ranked[0][3], ranked[1][3]):
        top = min(ranked[:2], key=lambda e: complexity(json.loads(e[1])))
        return top[0], top[1]
    return ranked[0][0], ranked[0][1]


class StopRules:
    """One search's stop rules: time limit (checked before each ask), dry-run budget, patience."""

    def __init__(self, time_limit_s: float | None, max_trials: int, patience: int | None,
                 clock: Callable[[], float] = time.monotonic, reserved: int = 0, spent: float = 0.0) -> None:
        self.time_limit_s, self.max_trials, self.patience, self.clock = time_limit_s, max_trials, patience, clock
        self.reserved = reserved  # dry-runs of max_trials kept for after exploration (the confirmation)
        self.start = clock() - spent  # ``spent``: seconds of the time limit used before these rules started
        self.dry_runs = 0
        self.since_best = 0
        self.found = False  # patience counts only once something fits and runs
        self.stopped = ""  # the kind of the last stop reason given: "time_limit", "max_trials" or "patience"
        self.walls: list[float] = []  # each dry-run's wall time (``timed``): what the next one is predicted to take

    def next_dry_run_s(self) -> float:
        """What the next dry-run is predicted to take: the median wall time of those that ran (start-up, warm-up and
        measured steps together; 0 before the first)."""
        return statistics.median(self.walls) if self.walls else 0.0

    def timed(self, seconds: float) -> None:
        self.walls.append(max(0.0, float(seconds)))

    def out_of_time(self) -> str:
        """Why no dry-run may start now: the time limit is reached, or what is left of it is shorter than the next
        dry-run is predicted to take (the search ends within its limit instead of one dry-run past it)."""
        elapsed = self.clock() - self.start
        if self.time_limit_s is None:
            return ""
        if elapsed >= self.time_limit_s:
            self.stopped = "time_limit"
            return f"time_limit {self.time_limit_s:g} s reached ({elapsed:.1f} s)"
        left, need = self.time_limit_s - elapsed, self.next_dry_run_s()
        if need > left:
            self.stopped = "time_limit"
            return (f"time_limit {self.time_limit_s:g} s: {left:.1f} s left, a dry-run takes {need:.1f} s "
                    f"(the median of the {len(self.walls)} that ran)")
        return ""

    def reason(self) -> str:
        """Which rule stops exploring now ("" while none does). It names the rule only: how many dry-runs ran
        and whether a confirmation followed is said by ``ended``."""
        if late := self.out_of_time():
            return late
        if self.dry_runs >= self.max_trials - self.reserved:
            self.stopped = "max_trials"
            if self.reserved:  # said so that a search that needed no confirmation does not seem to count wrong
                return (f"its {self.dry_runs} dry-runs done (max_trials {self.max_trials}, {self.reserved} of them "
                        "kept for a confirmation)")
            return f"max_trials {self.max_trials} reached"
        if self.patience is not None and self.found and self.since_best >= self.patience:
            self.stopped = "patience"
            return f"patience {self.patience} reached: no improvement in the last {self.since_best} dry-runs"
        return ""

    def ended(self, stop: str, confirmation: str = "") -> str:
        """The whole stop message: how many dry-runs ran, the rule that stopped exploring, and what the
        confirmation did (``confirmation``: "" where the loop has none)."""
        runs = f"{self.dry_runs} dry-run{'' if self.dry_runs == 1 else 's'}"
        if self.stopped == "time_limit" and self.dry_runs < self.max_trials:  # what ran, and the budget not used
            said = f"{runs}; max_trials {self.max_trials} not reached: {stop}"
        else:
            said = f"{runs}; exploration stopped: {stop}"
        return said + (f"; {confirmation}" if confirmation else "")

    def record(self, improved: bool) -> None:
        self.dry_runs += 1
        self.found = self.found or improved
        self.since_best = 0 if improved else self.since_best + 1


class SearchState:
    """Ask/tell on one study. ``on_trial(record)`` is called after every told trial.

    ``storage``: the study's Optuna storage (what ``optuna.storages.get_storage`` returned for it, or the storage
    object the study was created on). A trial told by number (after a restart, or by another server request) is
    found through it: Optuna's public API names a trial by its number only there."""

    def __init__(self, study: Any, table: CandidateTable, memory_budget: float, *, storage: Any,
                 on_trial: Callable[[dict[str, Any]], None] | None = None, max_asks: int = 50,
                 trials: list[Any] | None = None, skip_slower_than: float | None = HOPELESS_FACTOR,
                 correct_time: bool = True, unbuildable: dict[tuple[str, str], str] | None = None,
                 stop_when_nothing_left: bool = True) -> None:
        from optuna.trial import TrialState

        if memory_budget <= 0:
            raise ValueError(f"memory_budget must be positive bytes, got {memory_budget}")
        self.study, self.table, self.budget = study, table, float(memory_budget)
        self.storage, self.study_id = storage, storage.get_study_id_from_name(study.study_name)
        self.on_trial = on_trial
        self.max_asks = max_asks
        self.skip_slower_than = skip_slower_than  # None: dry-run whatever the sampler proposes
        self.stop_when_nothing_left = stop_when_nothing_left and skip_slower_than is not None  # ``nothing_left``
        self.asks = 0
        # Measured outcomes already in the study (an earlier or interrupted search): never measured again,
        # judged under this budget. Predicted OOMs are not reused: the budget may have changed.
        self.done: dict[str, tuple[float, dict[str, float], dict[str, Any]]] = {}
        self.best_value: float | None = None
        self.best_key: str | None = None
        # Measured / predicted peak memory per family (the same layout, sharding and recompute), the largest seen
        # (at least 1: a family measured under its figure is not scaled down, a look-alike at another micro-batch
        # may still peak higher): a candidate's predicted peak is scaled by its own family's, without the cost
        # model's error band (the family was measured: CandidateTable.fits), before it is judged to fit, so after
        # one OOM, or one run that measured its figure right, its look-alikes predicted over the budget are not run
        # too; one family's error does not rule out another.
        self.memory_correction: dict[str, float] = {}
        # Measured / predicted samples/s of each family's measured candidates (``correct_time``): the cost model's
        # time is off by a factor that depends on the family (on the bench, tensor parallel's per-layer collectives
        # run 0.5x their prediction under load while data-parallel FSDP runs 1.4x), so a measurement re-ranks its
        # own family's candidates only (``time_correction``).
        self.correct_time = correct_time
        self.time_ratios: dict[str, list[float]] = {}  # time family (CandidateTable.time_family) -> measured/predicted
        self.time_families: dict[str, tuple[str, str]] = {}  # time family -> its layout and compute precision
        self.family_layouts: dict[str, str] = {}  # family -> its layout (CandidateTable.layout)
        self.queued: set[str] = set()  # keys enqueued by ``seed`` and ``promote`` (not promoted again)
        self.promoted: list[str] = []  # candidates enqueued because their corrected prediction beat the best
        self.promotes = False  # set by ``seed``: a search that enqueues the cost model's favourites promotes too
        # (method, layout) -> why: a dry-run failed in that method's build step at that layout (``unbuildable``)
        # ``unbuildable``: the families the build check before the search ruled out (search.buildable)
        self.unbuildable_at: dict[tuple[str, str], str] = dict(unbuildable or {})
        self.step_failures: list[tuple[str, str]] = []  # (key, failure_signature) of the dry-runs failed in a step
        # per-candidate corrections, read for every candidate at every ask (the sampler's proposals that need no
        # dry-run, a dozen or more between two dry-runs): computed once per measurement (``_measured``)
        self._measured, self._corrections_of = 0, -1
        self._corrections: dict[tuple[str, str], Any] = {}
        if trials is None:  # ``trials``: the study's trials when the caller has just read them
            trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        for old in trials:
            attrs = old.user_attrs
            if old.state == TrialState.COMPLETE and "measured" in attrs and attrs.get("status") != "duplicate":
                self._remember(old.user_attrs["key"], old.number, old.user_attrs["measured"])
        for again in study.user_attrs.get("confirmations", []) if self.done else []:
            if again["key"] in self.done:
                self._merge(again["key"], again["measured"])

    def _corrected(self, what: str, key: str, compute: Callable[[str], Any]) -> Any:
        if self._corrections_of != self._measured:
            self._corrections, self._corrections_of = {}, self._measured
        if (what, key) not in self._corrections:
            self._corrections[what, key] = compute(key)
        return self._corrections[what, key]

    def _remember(self, key: str, number: int, measured: dict[str, Any]) -> tuple[float, dict[str, float], dict]:
        self._measured += 1
        pred = self.table.prediction(key)
        value, constraints, attrs = judge(measured, pred, self.budget)
        if measured.get("peak_memory_bytes") and pred.get("peak_memory_bytes") and key in self.table.by_key:
            family = self.table.family(key)
            ratio = measured["peak_memory_bytes"] / pred["peak_memory_bytes"]
            self.memory_correction[family] = min(MAX_MEMORY_CORRECTION,
                                                 max(self.memory_correction.get(family, 1.0), ratio))
            self.family_layouts[family] = self.table.layout(key)
        if (measured.get("status") in OK_STATUSES and measured.get("samples_per_s") and pred.get("samples_per_s")
                and key in self.table.by_key):
            self.family_layouts[self.table.family(key)] = self.table.layout(key)
            timed = self.table.time_family(key)
            self.time_families[timed] = (self.table.layout(key), self.table.precision(key))
            self.time_ratios.setdefault(timed, []).append(measured["samples_per_s"] / pred["samples_per_s"])
        reason = str(measured.get("reason") or "")
        if attrs["status"] == "failed" and key in self.table.by_key and (found := _BUILD_STEP.search(reason)):
            self.unbuildable_at.setdefault((found.group(1), self.table.layout(key)), (
                f"{found.group(1)} could not be applied to this model at this layout (trial {number}: "
                f"{reason[:300]}); its other settings would not change that"))
        elif attrs["status"] == "failed" and key in self.table.by_key and MICRO_BATCH_FAILURES.search(reason) and \
                (size := self.table.points[self.table.by_key[key]].get("micro_batch_size")):
            rule, why = micro_batch_rule(int(size), f"trial {number}: {reason[:300]}")
            self.unbuildable_at.setdefault(rule, why)
        elif attrs["status"] == "failed" and key in self.table.by_key:
            self._rule_out_a_repeated_failure(key, number, reason)
        verdict = {"number": number, "measured": measured, **attrs}
        self.done[key] = (value, constraints, verdict)
        improved = attrs["status"] == "ok" and (self.best_value is None or value > self.best_value)
        if improved:
            self.best_value, self.best_key = value, key
        return value, constraints, {**attrs, "improved": improved}

    def correction(self, key: str) -> float | None:
        """The factor a point's predicted peak is scaled by: its family's largest measured / predicted (at least 1).
        A family not measured: None (its figure keeps the cost model's error band, CandidateTable.fits), unless its
        layout splits the model (tensor, pipeline, expert, context) and every family of that layout that was measured
        came out above its figure: then the smallest of their ratios, with the band's optimism kept (ratio × (1 −
        band)). A split layout's memory terms (replicated activations, gathered shards, stage buffers) are shared by
        its families, and so are their errors: on the held-out MobileViT every tensor-parallel family measured
        17-30% over its figure, and under a budget each was dry-run out of memory in turn while the first one's
        ratio was known. Over the data ranks alone the families differ by how they shard (DDP, ZeRO, FSDP), each
        with its own terms and errors: one family's ratio says nothing of another's there."""
        return self._corrected("memory", key, self._memory_correction)

    def _memory_correction(self, key: str) -> float | None:
        if key not in self.table.by_key:
            return None
        family = self.table.family(key)
        if family in self.memory_correction:
            return self.memory_correction[family]
        if not splits_the_model(self.table.points[self.table.by_key[key]]):
            return None
        layout = self.table.layout(key)
        ratios = [r for fam, r in self.memory_correction.items() if self.family_layouts.get(fam) == layout]
        if not ratios or min(ratios) <= 1.0:
            return None
        return min(ratios) * (1.0 - float(self.table.prediction(key).get("memory_band", 0.0)))

    def time_correction(self, key: str) -> float:
        """The factor a point's predicted samples/s is scaled by (1 without ``correct_time`` or a measurement).

        A time family (the memory family and the compute precision) that ran: its median measured / predicted. One
        that has not: the best factor among its layout's time families of the same precision that ran (the same
        tensor / pipeline sizes): on the bench's GPT-2, tensor parallel ran at a fifth of its prediction whatever the
        sharding, so a layout that ran slow is not promoted family by family, and the skip rule keeps the sampler's
        proposals there from costing dry-runs. Without one, the best factor of a precision of the same width (fp16
        for bf16: over the bench's 15 families with both, fp16's measured / predicted step was 0.54-1.06x bf16's,
        fp32's 0.39-1.23x over 18). A width not yet run in that layout is not judged by another's error: the cost
        model knows the 16-bit kernels' speed least (on the bench's five convolution models bf16 ran 1.6-2.6x
        further from its prediction than fp32, on the transformers 0.8-1.4x; an EfficientNet's fp32 candidates,
        judged by its amp ones' 4.6x, were never tried though one was the best), so it keeps its prediction, or the
        layout's best factor where that is above 1. In a layout that has not run, the best candidate's factor where
        that is above 1, else 1: a family the cost model favours there keeps its prediction, and the skip rule is no
        harsher on it than comparing two predictions."""
        return self._corrected("time", key, self._time_correction)

    def _time_correction(self, key: str) -> float:
        if not self.correct_time or not self.time_ratios or key not in self.table.by_key:
            return 1.0
        if (timed := self.table.time_family(key)) in self.time_ratios:
            return statistics.median(self.time_ratios[timed])
        layout, precision = self.table.layout(key), self.table.precision(key)
        in_layout = {fam: statistics.median(r) for fam, r in self.time_ratios.items()
                     if self.time_families[fam][0] == layout}
        for alike in (lambda other: other == precision,  # the same precision, else one of the same width
                      lambda other: self.table.reduced(other) == self.table.reduced(precision)):
            if same := [factor for fam, factor in in_layout.items() if alike(self.time_families[fam][1])]:
                return max(same)
        if in_layout:
            return max(1.0, *in_layout.values())
        best = self.table.time_family(self.best_key) if self.best_key in self.table.by_key else None
        return max(1.0, statistics.median(self.time_ratios[best])) if best in self.time_ratios else 1.0

    def corrected_samples_per_s(self, key: str) -> float:
        pred = self.table.prediction(key)
        return 0.0 if "error" in pred else float(pred["samples_per_s"]) * self.time_correction(key)

    def fit_chance(self, key: str) -> float:
        """The chance that the candidate fits (CandidateTable.fit_chance), with its family's measured correction."""
        return self.table.fit_chance(self.table.prediction(key), self.budget, self.correction(key))

    def expected_gain(self, key: str) -> float:
        """The samples/s a dry-run of the candidate is expected to add to the best measured one: its chance to fit
        times its time-corrected lead (none before a measurement: its expected samples/s)."""
        lead = self.corrected_samples_per_s(key) - float(self.best_value or 0.0)
        return self.fit_chance(key) * max(0.0, lead)

    def long_shot(self, key: str) -> str:
        """Why a candidate is not worth its dry-run though it may fit ("" when it is): its figure is over the budget
        (within the band, so it runs out of memory more often than not) and its expected gain over the best measured
        one is under PROMOTE_MARGIN of it. Only once something ran, and not where the sampler decides alone."""
        if self.best_value is None or self.skip_slower_than is None:
            return ""
        chance = self.fit_chance(key)
        if chance >= 0.5 or self.expected_gain(key) > PROMOTE_MARGIN * float(self.best_value):
            return ""
        pred = self.table.prediction(key)
        over = pred["peak_memory_bytes"] / self.budget - 1.0
        lead = self.corrected_samples_per_s(key) / float(self.best_value)
        return (f"predicted peak {pred['peak_memory_bytes'] / 2**20:.1f} MiB, {100 * over:.0f}% over the budget "
                f"{self.budget / 2**20:.1f} MiB, within the cost model's known error: it fits about {chance:.0%} of "
                f"the time, and at {lead:.2f}x the best measured samples/s{self._basis(key)}, its expected gain is "
                f"under {PROMOTE_MARGIN:.0%}; not dry-run")

    def promising(self) -> str | None:
        """The unmeasured candidate, predicted to fit, whose expected gain (``expected_gain``: its chance to fit
        times its time-corrected lead) over the best measured one is PROMOTE_MARGIN of it or more (the largest such),
        if any: after a family measures slower than predicted, the cost model's next favourite may be in another
        family that neither the seeds nor the sampler reach."""
        if not self.correct_time or self.best_value is None:
            return None
        bar = self.best_value * PROMOTE_MARGIN
        # a family with a queued candidate still to run is judged after that run, not on the benefit of the doubt
        pending = {self.table.family(key) for key in self.queued if key not in self.done and key in self.table.by_key}
        found = [(self.expected_gain(key), key) for key, pred in zip(self.table.keys, self.table.predictions,
                                                                    strict=True)
                 if key not in self.done and key not in self.queued and "error" not in pred
                 and self.table.family(key) not in pending and not self.unbuildable(key)
                 and self.table.fits(pred, self.budget, self.correction(key))]
        gain, key = max(found, default=(0.0, None))
        return key if key is not None and gain > bar else None

    def promote(self) -> str | None:
        """Enqueue ``promising()`` when nothing else is queued (the seeds run first), at the moment of an ask, so a
        search that stops leaves nothing queued behind it (a queued trial would mark it unfinished)."""
        from optuna.trial import TrialState

        if not self.promotes or self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            return None
        key = self.promising()
        if key is not None:
            self.promoted.append(key)
            self.queued.add(key)
            self.study.enqueue_trial(self.table.to_params(self.table.points[self.table.by_key[key]]),
                                     skip_if_exists=True)
        return key

    def nothing_left(self) -> str:
        """Why exploring further cannot find a better candidate ("" while it can): NOTHING_LEFT_AFTER dry-runs
        measured, one ran ok, and every candidate not yet measured that is predicted to fit (its family's memory
        correction), is no ``long_shot`` and builds is predicted, once time-corrected by the measurements
        (``corrected_samples_per_s``), more than NOTHING_LEFT_MARGIN slower than the best measured one; a candidate
        the cost model could not predict can always win."""
        if not self.stop_when_nothing_left or self.best_value is None:
            return ""
        if sum(1 for v in self.done.values() if "measured" in v[2]) < NOTHING_LEFT_AFTER:
            return ""
        fastest, left = 0.0, 0
        for key, pred in zip(self.table.keys, self.table.predictions, strict=True):
            if key in self.done or self.unbuildable(key):
                continue
            if "error" in pred:
                return ""
            if not self.table.fits(pred, self.budget, self.correction(key)) or self.long_shot(key):
                continue
            left += 1
            fastest = max(fastest, self.corrected_samples_per_s(key))
        if fastest * (1.0 + NOTHING_LEFT_MARGIN) >= float(self.best_value):
            return ""
        said = (f"the fastest of them is predicted {float(self.best_value) / fastest:.2f}x slower" if left else
                "none is left")
        return (f"nothing left can win: every candidate not yet measured that is predicted to fit ({left}) is "
                f"predicted more than {NOTHING_LEFT_MARGIN:.0%} slower than the best measured one once corrected by "
                f"the measurements ({said})")

    # ----- seeding -----------------------------------------------------------------------------
    def seed(self, top_k: int = DEFAULT_TOP_K) -> list[str]:
        """Enqueue the cost model's top-k predicted-feasible candidates (with ``correct_time``, spread over the
        parallel layouts: ``spread``) and the DDP baseline."""
        self.promotes = top_k > 0  # top_k=0: the sampler alone (and the DDP baseline) decides
        ranked = [key for key in self.table.ranked(self.budget, self.correction) if not self.unbuildable(key)]
        # by expected samples/s: a figure over the budget (within the band) runs out of memory 3 times in 4
        ranked.sort(key=lambda key: -self.expected_gain(key))
        seeds = self.spread(ranked, top_k) if self.correct_time else ranked[:top_k]
        base = self.table.baseline(self.budget, self.correction)
        base = None if base is not None and self.unbuildable(base) else base
        order = seeds
        if base is not None and base not in seeds:
            # A baseline predicted not to fit goes first: it costs no dry-run and shows the sampler
            # where the infeasible region is; one that fits is measured after the cost model's picks.
            fits = self.table.fits(self.table.prediction(base), self.budget, self.correction(base))
            order = [*seeds, base] if fits else [base, *seeds]
        self.queued.update(order)
        for key in order:
            self.study.enqueue_trial(self.table.to_params(self.table.points[self.table.by_key[key]]),
                                     skip_if_exists=True)
        return order

    def spread(self, ranked: list[str], k: int) -> list[str]:
        """The k favourites, the best of each parallel layout first (tensor / pipeline sizes; then by rank): the
        cost model's time errors differ most between layouts (on the bench's GPT-2 its top three were all tensor
        parallel, which ran at a fifth of their prediction), so a measurement of each layout early lets the
        per-family corrections re-rank the rest. In the cost model's order."""
        picks: list[str] = []
        layouts: set[str] = set()
        for key in ranked:
            if len(picks) < k and (layout := self.table.layout(key)) not in layouts:
                layouts.add(layout)
                picks.append(key)
        picks += [key for key in ranked if key not in picks][:k - len(picks)]
        return sorted(picks, key=ranked.index)

    # ----- ask / tell --------------------------------------------------------------------------
    def exhausted(self) -> bool:
        return self.asks >= self.max_asks or len(self.done) >= len(self.table.points)

    def ask(self, stop: Callable[[], str] | None = None, in_flight: Callable[[], set[str]] | None = None,
            lease_attrs: dict[str, Any] | None = None) -> Proposal:
        """The next candidate to measure. Known candidates and predicted OOMs are told on the way.
        ``stop()``: a search's stop rules, checked before each ask of the study (a reason stops it).
        ``in_flight()``: keys being measured elsewhere (a server's other clients); one proposed again is
        marked failed (never measured twice at once)."""
        from optuna.trial import TrialState

        while True:
            if stop is not None and (reason := stop()):
                return Proposal(None, stop=reason)
            if self.exhausted():
                return Proposal(None, stop="every candidate the sampler proposes is already known")
            if why := self.nothing_left():
                return Proposal(None, stop=why)
            self.asks += 1
            self.promote()
            trial = self.study.ask()
            point = self.table.suggest(trial)
            key = point_key(point)
            pred = self.table.prediction(key)
            attrs: dict[str, Any] = {"key": key, "candidate": self.table.describe(key), "predicted": pred}
            if key in self.done:  # asked again: reuse the stored outcome, no dry-run
                value, constraints, verdict = self.done[key]
                attrs.update(status="duplicate", duplicate_of=verdict["number"], outcome=verdict["status"])
                self._tell(trial, value, constraints, attrs)
                continue
            if in_flight is not None and key in in_flight():
                attrs.update(status="in_flight", reason="being measured by another client")
                self._tell(trial, None, None, attrs, state=TrialState.FAIL)
                continue
            if why := self.unbuildable(key):  # a family that cannot build: not dry-run again
                attrs.update(status="skipped", reason=why)
                constraints = {"memory_over": 0.0, "failed": 1.0}
                value = float(pred.get("samples_per_s") or 0.0)
                self._tell(trial, value, constraints, attrs)
                self.done[key] = (value, constraints, {"number": trial.number, **attrs})
                continue
            measured = self.correction(key)
            scale = measured or 1.0
            if not self.table.fits(pred, self.budget, measured) and "error" not in pred:
                corrected = (f" (x{scale:.2f}, its family's or its layout's measured / predicted)"
                             if measured is not None else
                             f" (even {100 * pred['memory_band']:.0f}% lower, the cost model's known error)"
                             if pred.get("memory_band") else "")
                attrs.update(status="predicted_oom", reason=(
                    f"predicted peak {pred['peak_memory_bytes'] * scale / 2**20:.1f} MiB{corrected} "
                    f"> budget {self.budget / 2**20:.1f} MiB"
                ))
                self._tell_over_budget(trial, key, pred, scale, attrs)
                continue
            if why := self.long_shot(key):  # more likely out of memory than not, for too little gain
                attrs.update(status="skipped", reason=why)
                self._tell_over_budget(trial, key, pred, scale, attrs)
                continue
            slower = self.slower_than_best(pred, key)
            if self.skip_slower_than is not None and slower > self.skip_slower_than:
                best = self.done[self.best_key][2]["number"]  # type: ignore[index]
                attrs.update(status="skipped", reason=(
                    f"predicted {slower:.1f}x slower than the best measured candidate (trial {best}){self._basis(key)}"
                    f"; not dry-run past {self.skip_slower_than:g}x"))
                # Told on the measured scale (the best's measured value over the predicted factor), feasible: the
                # sampler learns the region is slow, and the best is always a measured candidate.
                value = float(self.best_value or 0.0) / slower
                constraints = {"memory_over": min(0.0, (pred["peak_memory_bytes"] * scale - self.budget)
                                                  / self.budget), "failed": 0.0}
                self._tell(trial, value, constraints, attrs)
                self.done[key] = (value, constraints, {"number": trial.number, **attrs})
                continue
            set_user_attrs(trial, {**attrs, "status": "running", **(lease_attrs or {})})
            return Proposal(trial.number, point, key, pred)

    def _tell_over_budget(self, trial: Any, key: str, pred: dict[str, Any], scale: float,
                          attrs: dict[str, Any]) -> None:
        """Tell a candidate left out for its memory, without a dry-run: at its predicted samples/s, infeasible by how
        far its (scaled) figure is over the budget, so the sampler learns where the budget ends."""
        over = (pred["peak_memory_bytes"] * scale - self.budget) / self.budget
        constraints = {"memory_over": over, "failed": 0.0}
        self._tell(trial, pred["samples_per_s"], constraints, attrs)
        self.done[key] = (pred["samples_per_s"], constraints, {"number": trial.number, **attrs})

    def unbuildable(self, key: str) -> str:
        """Why a candidate is left out without a dry-run because a method it uses failed in its build step at the
        same layout ("" when none did): a transformation that refuses the model refuses it whatever the
        micro-batch, precision or other methods (the conv model's 72 tensor-parallel candidates failed alike)."""
        if not self.unbuildable_at or self.table.details is None or key not in self.table.by_key:
            return ""
        return ruled_out_by(self.unbuildable_at, self._names(key), self.table.layout(key),
                            self.table.points[self.table.by_key[key]].get("micro_batch_size"))

    def _names(self, key: str) -> set[str]:
        assert self.table.details is not None
        return set(Strategy.load(self.table.details[self.table.by_key[key]]["strategy"]).applied_names())

    def _rule_out_a_repeated_failure(self, key: str, number: int, reason: str) -> None:
        """A step failure that an earlier candidate at the same layout failed with word for word (JetMoE's experts
        under expert parallel: four candidates, one TypeError) rules out, at that layout, the methods the two share,
        but not a precision (a setting of the candidate's own: DBRX's experts fail under autocast alone and run
        under bf16 ZeRO-2), a method that every candidate has, or one that ran in a dry-run that did not fail."""
        signature = failure_signature(reason)
        if not signature or self.table.details is None:
            return
        layout = self.table.layout(key)
        earlier = next((k for k, s in self.step_failures if s == signature and self.table.layout(k) == layout), None)
        self.step_failures.append((key, signature))
        if earlier is None:
            return
        from atorch.opt_lib.registry import methods_in_group

        ran = [k for k, (_, _, verdict) in self.done.items()
               if verdict.get("status") in OK_STATUSES and k in self.table.by_key]
        in_every = set.intersection(*(set(Strategy.load(d["strategy"]).applied_names()) for d in self.table.details))
        blameless = set(methods_in_group("precision")) | in_every | set().union(*(self._names(k) for k in ran))
        for method in sorted(self._names(key) & self._names(earlier) - blameless):
            self.unbuildable_at.setdefault((method, layout), (
                f"{method} failed alike in two dry-runs at this layout (trials with its other settings differing; "
                f"trial {number}: {reason[:300]}); its other settings would not change that"))

    def _basis(self, key: str) -> str:
        """What a skip's factor compares, where it is not the two raw predictions (the table's "pred. s" column):
        the time corrected by what the measurements showed of the cost model's error, against the best's measured
        time."""
        if not (self.correct_time and self.time_ratios and self.best_value):
            return ""
        factor = self.time_correction(key)
        per_step = self.table.global_batch / (float(self.table.prediction(key)["samples_per_s"]) * factor)
        return (f": {per_step:.3g} s/step once corrected by the measurements (x{1 / factor:.2f} its raw prediction) "
                f"against {self.table.global_batch / float(self.best_value):.3g} s/step measured")

    def slower_than_best(self, pred: dict[str, Any], key: str | None = None) -> float:
        """How many times slower than the best measured candidate the cost model predicts ``pred`` (0 without a
        best, or without a prediction of either). With ``correct_time`` and the point's ``key``: the best's measured
        samples/s over the point's time-corrected prediction (its family's factor, else the machine's); without,
        both predicted (the cost model's absolute error cancels, its family errors do not)."""
        if self.best_key is None or "error" in pred or not pred.get("samples_per_s"):
            return 0.0
        if self.correct_time and key is not None and self.time_ratios and self.best_value:
            return float(self.best_value) / (float(pred["samples_per_s"]) * self.time_correction(key))
        best = self.table.prediction(self.best_key)
        return float(best.get("samples_per_s") or 0.0) / float(pred["samples_per_s"])

    def tell(self, number: int, measured: Measured | dict[str, Any]) -> dict[str, Any]:
        """Judge and tell a measured outcome (a ``Measured``, or its JSON as a server receives it); returns the
        trial's record plus ``improved``. Telling a finished trial again returns its record and changes nothing."""
        import optuna
        from optuna.trial import TrialState

        measured = measured.to_json() if isinstance(measured, Measured) else measured
        trial_id, frozen = self._trial(number)
        if frozen.state != TrialState.RUNNING:
            return {**trial_record(frozen), "improved": False, "already_told": True}
        key = frozen.user_attrs["key"]
        value, constraints, attrs = self._remember(key, number, measured)
        improved = attrs.pop("improved")
        trial = optuna.trial.Trial(self.study, trial_id)
        record = self._tell(trial, value, constraints, {"measured": measured, **attrs})
        return {**record, "improved": improved}

    def fail(self, number: int, reason: str, status: str = "expired") -> dict[str, Any] | None:
        """Mark a running trial FAILED (its lease expired): the candidate may be asked again."""
        import optuna
        from optuna.trial import TrialState

        trial_id, frozen = self._trial(number)
        if frozen.state != TrialState.RUNNING:
            return None
        trial = optuna.trial.Trial(self.study, trial_id)
        return self._tell(trial, None, None, {"status": status, "reason": reason}, state=TrialState.FAIL)

    def _trial(self, number: int) -> tuple[int, Any]:
        """A trial's id and its frozen state, by number (public storage API; ``optuna.trial.Trial(study, id)``
        then gives the object that constraints and attributes are set on, as ``study.ask()`` would)."""
        trial_id = self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number)
        return trial_id, self.storage.get_trial(trial_id)

    def _tell(self, trial: Any, value: float | None, constraints: dict[str, float] | None, attrs: dict[str, Any],
              state: Any = None) -> dict[str, Any]:
        for k, v in (constraints or {}).items():
            trial.set_constraint(k, float(v))
        set_user_attrs(trial, attrs)
        tell = {"state": state} if state is not None else {"values": float(value)}  # type: ignore[arg-type]
        # skip_if_finished: a trial that another process on the same storage told first is left as it was told
        frozen = self.study.tell(trial, **tell, skip_if_finished=True)
        record = trial_record(frozen)
        if self.on_trial is not None:
            self.on_trial(record)
        return record

    # ----- confirmation ------------------------------------------------------------------------
    def contenders(self, within: float) -> tuple[list[dict[str, Any]], int]:
        """The best measured candidate and the runner-up (``key``, ``point``, first-run ``samples_per_s``), when
        the runner-up measured within ``within`` (a fraction) of the best: one dry-run each cannot tell them apart
        on a noisy machine; else none. And how many candidates ran ok. Where the cost model ranked the runner-up
        first, the measured order contradicts it: the band widens (``disputed_band``), since one run of a short,
        launch-bound step can be off by more than the usual noise."""
        ranked = sorted(((v[0], k) for k, v in self.done.items() if v[2]["status"] == "ok"), reverse=True)
        if len(ranked) < 2:
            return [], len(ranked)
        (best_value, best), (runner_value, runner_up) = ranked[:2]
        predicted = [float(self.table.prediction(key).get("samples_per_s") or 0.0) for key in (best, runner_up)]
        band = disputed_band(within) if predicted[1] > predicted[0] > 0 else within
        if runner_value < (1.0 - band) * best_value:
            return [], len(ranked)
        found = [{"key": k, "point": json.loads(k), "samples_per_s": self.done[k][2]["measured"]["samples_per_s"]}
                 for _, k in ranked[:2]]
        return found, len(ranked)

    def confirm(self, key: str, measured: Measured | dict[str, Any]) -> dict[str, Any]:
        """Record a re-measurement of a measured candidate (``merge_runs`` with its first run; the best is chosen
        again). Kept in the study's ``confirmations`` attribute, so a rebuilt state knows it."""
        measured = measured.to_json() if isinstance(measured, Measured) else measured
        self._merge(key, measured)
        record = {"key": key, "measured": measured, "status": self.done[key][2]["status"]}
        self.study.set_user_attr("confirmations", [*self.study.user_attrs.get("confirmations", []), record])
        return record

    def _merge(self, key: str, measured: dict[str, Any]) -> None:
        self._measured += 1
        verdict = self.done[key][2]
        merged = merge_runs(verdict["measured"], measured)
        value, constraints, attrs = judge(merged, self.table.prediction(key), self.budget)
        self.done[key] = (value, constraints, {"number": verdict["number"], "measured": merged, **attrs})
        ok = [(v[0], k, int(v[2]["measured"].get("runs", 1)), v[2]["measured"]) for k, v in self.done.items()
              if v[2]["status"] == "ok"]
        self.best_value, self.best_key = best_of(ok)

    # ----- the result --------------------------------------------------------------------------
    def best(self) -> dict[str, Any] | None:
        """The best measured feasible outcome of this study under this budget."""
        if self.best_key is None:
            return None
        verdict = self.done[self.best_key][2]
        return {"key": self.best_key, "point": json.loads(self.best_key), "samples_per_s": self.best_value,
                "trial": verdict["number"], "peak_memory_bytes": verdict["measured"]["peak_memory_bytes"]}

    def store_best(self, extra: dict[str, Any] | None = None) -> dict[str, Any] | None:
        best = self.best()
        if best is not None:
            stored = {k: best[k] for k in ("point", "samples_per_s", "trial", "peak_memory_bytes")}
            self.study.set_user_attr("best", {**stored, **(extra or {})})
        return best


# ----- the cache: how a search ended, and what a later call may reuse --------------------------------------

FINISHING_STOPS = ("max_trials", "patience", "exhausted")
SEARCH_ATTR = "searches"  # the study attribute: one SearchRecord per memory budget searched under, latest last
KEPT_RECORDS = 16


class SearchRecord(BaseModel):
    """How a search of a study under one memory budget ended. ``finished``: it stopped by ``max_trials``,
    ``patience`` (with no cost-model favourite left untried) or because the sampler had nothing new to
    propose, and something measured fits. A time limit, an interruption or an error leave it unfinished
    (``stop``: "time_limit", "interrupted", "error"; "running" while a search runs, and after one that was
    killed), and the next search resumes it instead of serving its best."""

    model_config = ConfigDict(extra="ignore")

    finished: bool
    stop: str
    stop_reason: str = ""
    memory_budget: float
    # The smallest peak (predicted, corrected; or measured) of a candidate this budget ruled out; a budget at or
    # above it might admit that candidate, so the search does not answer for it. None: nothing ruled out.
    fits_below: float | None = None
    max_trials: int = 0
    best_key: str | None = None
    measured: int = 0  # candidates measured in the study when it ended
    at: str = ""  # when it was stored (UTC, ISO 8601)

    @classmethod
    def stored(cls, study: Any) -> list[SearchRecord]:
        """The study's records, latest last (one written by another version is left out: it answers nothing)."""
        records = []
        for data in study.user_attrs.get(SEARCH_ATTR, []):
            try:
                records.append(cls.model_validate(data))
            except ValueError:
                continue
        return records

    def store(self, study: Any) -> None:
        """Keep this record as the latest, replacing the one of the same budget."""
        kept = [r for r in self.stored(study) if r.memory_budget != self.memory_budget][-(KEPT_RECORDS - 1):]
        study.set_user_attr(SEARCH_ATTR, [r.model_dump(mode="json") for r in (*kept, self)])

    def answers(self, memory_budget: float, best_fits: bool) -> str:
        """Why this record does not answer a call under ``memory_budget`` ("" when it does). ``best_fits``:
        its best is measured to fit ``memory_budget``."""
        mib = 2**20
        if not self.finished:
            return (f"the search under {self.memory_budget / mib:.1f} MiB did not finish "
                    f"({self.stop_reason or self.stop})")
        if self.fits_below is not None and memory_budget >= self.fits_below:
            return (f"this budget admits candidates that the search's ({self.memory_budget / mib:.1f} MiB) ruled out "
                    f"(from {self.fits_below / mib:.1f} MiB)")
        if not best_fits:
            return f"the best of the search under {self.memory_budget / mib:.1f} MiB does not fit this budget"
        return ""


def reselect(study: Any, memory_budget: float) -> dict[str, dict[str, Any]]:
    """The study's measured candidates judged under ``memory_budget`` (not the budget they were measured under:
    their stored peaks are compared with this one), by key: trial number, value, status, peak. Reads only the
    study (no cost model): a stored outcome keeps the prediction it was judged with."""
    from optuna.trial import TrialState

    outcomes: dict[str, tuple[int, dict[str, Any], dict[str, Any]]] = {}  # key -> (trial, measured, predicted)
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        attrs = t.user_attrs
        if "measured" in attrs and "key" in attrs and attrs.get("status") != "duplicate":
            outcomes[attrs["key"]] = (t.number, attrs["measured"], attrs.get("predicted") or {})
    for again in study.user_attrs.get("confirmations", []):  # re-measurements count as in SearchState
        if again["key"] in outcomes:
            number, measured, pred = outcomes[again["key"]]
            outcomes[again["key"]] = (number, merge_runs(measured, again["measured"]), pred)
    judged = {}
    for key, (number, measured, pred) in outcomes.items():
        value, _, attrs = judge(measured, pred, memory_budget)
        judged[key] = {"key": key, "point": json.loads(key), "samples_per_s": value, "trial": number,
                       "status": attrs["status"], "peak_memory_bytes": measured["peak_memory_bytes"],
                       "runs": int(measured.get("runs", 1)), "measured": measured}
    return judged


@dataclass(frozen=True)
class CacheVerdict:
    """Whether a study answers a call: ``best`` (re-selected under the call's budget) when it does, else None
    and ``reason`` says why the search must go on."""

    best: dict[str, Any] | None
    reason: str
    measured: int
    record: SearchRecord | None


def cached_best(study: Any, memory_budget: float) -> CacheVerdict:
    """Serve a study only where a finished search answers for ``memory_budget``: its best measured fits this
    budget, and the budget admits nothing that search ruled out. The answer is then the best of every measured
    candidate under this budget (the finished search's best, or one measured since that is better and fits).
    A smaller budget the best does not fit, a larger one that admits a candidate the search ruled out, or a
    search cut short are not served: the search is resumed. A search that stopped at its ``max_trials`` is
    finished whatever a later call's ``max_trials`` (``force=True`` searches more)."""
    judged = reselect(study, memory_budget)
    ok = [j for j in judged.values() if j["status"] == "ok"]
    records = SearchRecord.stored(study)
    if not records:
        return CacheVerdict(None, "no search stored", len(judged), None)
    why = ""
    for record in reversed(records):  # the latest first
        fits = record.best_key in judged and judged[record.best_key]["status"] == "ok"
        if not (why_not := record.answers(memory_budget, fits)):
            _, best_key = best_of([(j["samples_per_s"], j["key"], j["runs"], j["measured"]) for j in ok])
            best = judged[best_key]
            mib = 2**20
            return CacheVerdict(best, (
                f"finished search ({record.stop_reason or record.stop}), {len(judged)} measured trials, best "
                f"re-selected under this limit ({memory_budget / mib:.1f} MiB; searched under "
                f"{record.memory_budget / mib:.1f} MiB)"), len(judged), record)
        why = why or why_not
    return CacheVerdict(None, why, len(judged), records[-1])
