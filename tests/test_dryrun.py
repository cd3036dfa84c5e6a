"""Dry-runs: peak live tensor bytes on CPU (exact on known sizes), one trial in this process, and on 2
real ranks the failure, hang, budget, agreement and release cases (tests/workers/dryrun_worker.py)."""

from __future__ import annotations

import gc
import logging
import math
import statistics
import time
import uuid
from typing import Any

import pytest
import torch
from launcher import HERE, run_json
from toy_models import mlp, mlp_dataset, mlp_loss
from workers.dryrun_worker import FAILFAST_PLAN, FAILFAST_TIMEOUT_S, PLAN, SLEEP_S, STRATEGIES, TIMEOUT_S

from atorch.distributed import init_distributed
from atorch.dryrun import PeakMemory, TrialResult, dry_run, dry_run_many
from atorch.dryrun.memory import SettledHeap
from atorch.model_context import UserSetup
from atorch.opt_lib.base import Preparation
from atorch.opt_lib.deepspeed_zero import deepspeed_reason
from atorch.opt_lib.parallel_mode import ParallelModeConfig
from atorch.opt_lib.sharding import Zero2Config
from atorch.opt_lib.zero1 import Zero1Config
from atorch.strategy import Strategy, StrategyItem

WORKER = HERE / "workers" / "dryrun_worker.py"
F32 = 4


# ----- peak live tensor bytes (CPU) -----------------------------------------------------------
def test_peak_of_known_sizes_is_exact() -> None:
    keep = torch.empty(1000)  # 4000 bytes live before the block
    with PeakMemory("cpu") as peak:
        a = torch.empty(250)  # +1000
        b = torch.ones(500)  # +2000 -> 3000 above the baseline
        view = b[100:]  # a view: no new storage
        del a  # -1000 -> 2000
        c = torch.zeros(10, 100)  # +4000 -> 6000: the peak
        del b, c, view
        keep = None  # a baseline tensor freed inside the block counts as freed
        d = torch.empty(100)  # +400 on 0 above the baseline: below the peak
    assert peak.increase == 6000
    assert peak.bytes - peak.baseline_bytes == 6000
    assert peak.baseline_bytes >= 4000  # whatever else this process holds, plus `keep`
    del d, keep


def test_peak_sees_frees_of_baseline_tensors() -> None:
    big = torch.empty(10_000)  # 40000 bytes in the baseline
    with PeakMemory("cpu") as peak:
        big = None  # freed: the block may now allocate as much without raising the peak
        again = torch.empty(10_000)
    assert peak.increase == 0
    del again, big


def test_a_settled_heap_keeps_the_baseline_exact() -> None:
    """With the heap settled (frozen out of the collector's way, as a search's session does), the baseline walk
    still sees the tensors that were frozen: one freed inside the block lowers the live total as before."""
    big = torch.empty(10_000)  # 40000 bytes, frozen below
    heap = SettledHeap().settle()
    try:
        assert heap.settled and gc.get_freeze_count() > 0
        cycle: list[Any] = [torch.empty(20_000)]  # garbage made after settling, in a reference cycle: collected
        cycle.append(cycle)  # at the block's entry, so it is not in the baseline
        del cycle
        with PeakMemory("cpu") as peak:
            big = None  # a frozen baseline tensor freed: the block may allocate as much without raising the peak
            again = torch.empty(10_000)
        assert peak.increase == 0
        settled_baseline = peak.baseline_bytes
    finally:
        heap.release()
    assert gc.get_freeze_count() == 0 and not heap.settled
    with PeakMemory("cpu") as plain:
        pass
    assert plain.baseline_bytes == settled_baseline  # `again` stands where `big` stood: the same walk
    del again, big


def test_a_heap_settled_on_demand_waits_for_the_first_measurement() -> None:
    """A search settles at its first dry-run (a cached pick runs none and pays nothing): ``settle(now=False)``
    freezes nothing until ``settle_if_wanted``; ``release`` undoes either."""
    heap = SettledHeap().settle(now=False)
    try:
        assert not heap.settled and gc.get_freeze_count() == 0
        heap.settle_if_wanted()
        assert heap.settled and gc.get_freeze_count() > 0
    finally:
        heap.release()
    assert gc.get_freeze_count() == 0
    heap.settle_if_wanted()  # released: no longer wanted
    assert not heap.settled


def test_settling_leaves_an_application_s_own_frozen_heap_alone() -> None:
    gc.freeze()  # the application's own (a server does this)
    try:
        heap = SettledHeap().settle()
        assert not heap.settled
        heap.release()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_peak_counts_storage_growth() -> None:
    with PeakMemory("cpu") as peak:
        t = torch.empty(10)
        t.resize_(1000)  # the same storage, now 4000 bytes
    assert peak.increase == 4000
    del t


def test_peak_follows_storage_resizes_outside_aten() -> None:
    """FSDP2 frees an unsharded parameter with ``untyped_storage().resize_(0)`` and allocates it again with
    ``resize_(n)``, calls no dispatch mode sees: a freed storage must stop counting, a regrown one count again."""
    gathered = torch.empty(1000)  # 4000 bytes in the baseline
    sharded_out = torch.empty(1000)
    sharded_out.untyped_storage().resize_(0)  # 0 bytes in the baseline
    with PeakMemory("cpu") as peak:
        gathered.untyped_storage().resize_(0)  # "reshard": -4000
        other = torch.empty(2000)  # +8000 on -4000: +4000
        del other  # -4000
        sharded_out.untyped_storage().resize_(4000 * 2)  # "all-gather": +8000 on -4000: +4000
        sharded_out.untyped_storage().resize_(0)
    assert peak.increase == 4000
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_  # nothing is left patched
    del gathered, sharded_out


def test_peak_sees_tensors_kept_only_by_autograd() -> None:
    x = torch.randn(1000, requires_grad=True)
    with PeakMemory("cpu") as peak:
        loss = x.exp().sum()  # exp's output (4000 bytes) lives in the graph only
        loss.backward()  # frees the graph; x.grad (4000) appears
        del loss
    # exp's output, the grad of the sum broadcast to x's shape and x.grad: the peak is at least two
    # 1000-element tensors at once, and only float32 tensors of 1000 elements or scalars are made.
    assert peak.increase >= 2 * 1000 * F32
    assert peak.increase % 4 == 0


def test_peak_of_an_mlp_step_covers_params_grads_and_adam_state() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optim = torch.optim.Adam(model.parameters(), foreach=False)
    params = sum(p.numel() for p in model.parameters()) * F32
    x = torch.randn(32, 256)
    with PeakMemory("cpu") as peak:
        for _ in range(2):
            model(x).square().mean().backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
    # Whole process: parameters (in the baseline), gradients, Adam's exp_avg and exp_avg_sq.
    assert peak.bytes >= 4 * params
    # Inside the block the peak is in the optimizer step, once activations are freed: gradients and
    # the two moments (3x params), four float32 `step` scalars, and a non-foreach step's two
    # temporaries (sqrt, then division) of the largest weight, 256x256. This is the exact figure on
    # torch 2.13; the bounds allow another Adam to order its temporaries differently.
    largest = 256 * 256 * F32
    assert peak.increase >= 3 * params
    assert peak.increase <= 3 * params + 4 * F32 + 3 * largest + 4 * 32 * 256 * F32
    assert peak.baseline_bytes >= params + x.numel() * F32


# ----- one trial in this process ----------------------------------------------------------------
def _setup(model: torch.nn.Module) -> UserSetup:
    return UserSetup(
        model=model, optim_func=torch.optim.SGD, dataset=mlp_dataset(), loss_func=mlp_loss,
        model_input_format="unpack_sequence", optim_args={"lr": 1e-2}, dataloader_args={"batch_size": 8},
    )


def test_dry_run_in_one_process_measures_and_leaves_the_model_alone() -> None:
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = dry_run(_setup(model), init_distributed(), Strategy.load(["parallel_mode"]), warmup=1, steps=3)
    assert result.status == "ok", result.reason
    assert len(result.losses) == 4 and all(torch.isfinite(torch.tensor(result.losses)))
    assert result.step_time_s is not None and result.step_time_s > 0
    assert result.samples_per_s == pytest.approx(8 / result.step_time_s)
    params = sum(p.numel() for p in model.parameters()) * F32
    assert result.peak_bytes is not None and result.peak_bytes >= 2 * params  # the copy and its gradients
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert TrialResult.model_validate_json(result.model_dump_json()) == result  # JSON round trip


def test_fast_steps_are_timed_until_they_add_up_to_min_measure_s() -> None:
    """A step of a few milliseconds is noisy: timed steps go on past ``steps`` until they add up to
    ``min_measure_s`` (the count from the median of the first ones), but never past ``max_steps``."""
    setup, env, plain = _setup(mlp()), init_distributed(), Strategy.load(["parallel_mode"])
    short = dry_run(setup, env, plain, warmup=1, steps=3)
    step_s = short.step_time_s
    assert step_s is not None
    longer = dry_run(setup, env, plain, warmup=1, steps=3, min_measure_s=20 * step_s, max_steps=50)
    timed = len(longer.losses) - 1  # one warm-up step
    # The count comes from this run's own first steps (not from the short run's, which a busy machine may
    # have timed several times faster): ceil(min_measure_s / their median), within [steps, max_steps].
    first = statistics.median(longer.ranks[0].step_times_s[:3])
    assert timed == len(longer.ranks[0].step_times_s) == max(3, min(math.ceil(20 * step_s / first), 50))
    # (about 20 steps on a steady machine, so a count stuck at ``steps`` fails the equality above)
    capped = dry_run(setup, env, plain, warmup=1, steps=3, min_measure_s=60.0, max_steps=7)
    assert len(capped.losses) - 1 == 7


def test_fp16_warm_up_goes_on_while_loss_scaling_skips_steps() -> None:
    """A loss whose scaled gradients overflow fp16 until the scale is far below its start (2^16): warm-up
    goes on (at most MAX_EXTRA_WARMUP more steps, each dividing the trial's scale by LOSS_SCALE_DROP) until
    the optimizer has stepped, so the measured peak holds AdamW's state. With the scaler's own backoff
    (halving per skipped step) no step landed within the warm-up and the peak was ~2.1 x the parameters."""
    from atorch.dryrun.runner import MAX_EXTRA_WARMUP

    model = mlp()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    setup = UserSetup(model=model, optim_func=torch.optim.AdamW, dataset=mlp_dataset(),
                      loss_func=lambda data, output: 1e4 * mlp_loss(data, output),
                      model_input_format="unpack_sequence", optim_args={"lr": 1e-3}, dataloader_args={"batch_size": 8})
    result = dry_run(setup, init_distributed(), Strategy.load([("amp_native", {"dtype": "fp16"})]), warmup=1, steps=1)
    assert result.status == "ok", result.reason
    assert 2 < len(result.losses) <= 1 + MAX_EXTRA_WARMUP + 1, result.losses
    # the trial's model (P), its gradients (P) and AdamW's two states (2P) are all live at the step
    assert result.peak_bytes >= 4 * param_bytes, (result.peak_bytes, param_bytes)


def test_fp16_that_never_lets_a_step_through_is_a_failed_trial_with_the_reason() -> None:
    """Outputs far beyond fp16's range (weights x 300): the loss itself overflows, so no loss scale lets a step
    through. Measuring it would report a peak without the optimizer's state, and training would never step:
    the trial fails, naming bf16 as the way out."""
    model = mlp()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(300.0)
    result = dry_run(_setup(model), init_distributed(), Strategy.load([("amp_native", {"dtype": "fp16"})]),
                     warmup=1, steps=1)
    assert result.status == "failed", result
    assert "fp16 loss scaling skipped every warm-up step" in result.reason and "bf16" in result.reason


PREPARE_S = 3.0  # one-time work longer than the trial's timeout below
_PREPARED_AT: list[float] = []


def _prepare() -> None:
    _PREPARED_AT.append(time.monotonic())
    time.sleep(PREPARE_S)


class _SlowToPrepare(ParallelModeConfig):
    """parallel_mode, declaring PREPARE_S of one-time work, as DeepSpeed's op build does."""

    def preparation(self) -> Preparation | None:
        return Preparation(f"test work {_RUN_ID}", _prepare)


_RUN_ID = uuid.uuid4()  # preparations are done once per process and name: a name no other test uses


def test_one_time_preparation_runs_once_with_a_log_line_before_the_trials_clock() -> None:
    what = f"test work {_RUN_ID}"
    strategy = Strategy(methods=(StrategyItem(name="parallel_mode", config=_SlowToPrepare()),))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("atorch").addHandler(handler)
    try:
        # A timeout shorter than the preparation: counted in the trial, it would make the first one time out.
        results = dry_run_many(_setup(mlp()), init_distributed(), [strategy, strategy], warmup=1, steps=1,
                               timeout_s=PREPARE_S - 0.5)
    finally:
        logging.getLogger("atorch").removeHandler(handler)
    assert [r.status for r in results] == ["ok", "ok"], [r.reason for r in results]
    assert len(_PREPARED_AT) == 1  # once, for both trials
    # Outside the clock: neither trial's time holds it (and the first did not time out).
    assert all(r.wall_s < PREPARE_S for r in results), [r.wall_s for r in results]
    messages = [r.getMessage() for r in records]
    assert f"one-time preparation for parallel_mode: {what}; not counted in any trial's time" in messages, messages
    assert any(m.startswith("one-time preparation for parallel_mode done in ") for m in messages), messages


@pytest.mark.skipif(deepspeed_reason() is not None, reason="DeepSpeed is not installed")
def test_deepspeed_zero_declares_its_op_build_as_one_time_work() -> None:
    for config in (Zero1Config(implementation="deepspeed"), Zero2Config(implementation="deepspeed")):
        preparation = config.preparation()
        assert preparation is not None and "shm_comm" in preparation.what
    assert Zero1Config().preparation() is None and Zero2Config().preparation() is None


# ----- two real ranks ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return run_json(WORKER, timeout=240)


def _ok(entry: Any) -> Any:
    assert isinstance(entry, list), entry
    for view in entry:
        assert "failed" not in view, view["failed"]
    return entry


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_failure_and_hang_on_one_rank_are_recorded_and_the_next_trial_runs(report: dict[str, Any]) -> None:
    views = _ok(report["sequence"])
    by_rank = [[TrialResult.model_validate(r) for r in view["results"]] for view in views]
    assert [[r.status for r in results] for results in by_rank] == [["ok", "failed", "ok", "timeout", "ok"]] * 2
    assert PLAN == ["ok", "raise", "ok", "sleep", "ok"] and len(STRATEGIES) == 5
    for results in by_rank:  # every rank records the same outcome and reason
        assert [(r.status, r.reason, r.losses) for r in results] == [(r.status, r.reason, r.losses) for r in by_rank[0]]
        failed, hung = results[1], results[3]
        assert "rank 1" in failed.reason and "ValueError: injected failure on rank 1" in failed.reason
        assert "not done within" in hung.reason and "rank 1" in hung.reason
    rank0 = by_rank[0]
    # Rank 0 learns of the hang at the trial's deadline: the timeout plus building and a store round trip.
    assert rank0[3].wall_s <= TIMEOUT_S + 2.0, rank0[3].wall_s
    assert rank0[1].wall_s <= TIMEOUT_S + 2.0, rank0[1].wall_s
    for ok in (rank0[0], rank0[2], rank0[4]):
        assert ok.samples_per_s and ok.peak_bytes and len(ok.losses) == 4
    # The whole series waits for the sleeper once (it rejoins), and not much longer.
    assert views[0]["total_s"] < SLEEP_S + 4 * TIMEOUT_S + 20


@pytest.mark.distributed
def test_peak_above_the_budget_is_an_oom(report: dict[str, Any]) -> None:
    for view in _ok(report["budget"]):
        result = TrialResult.model_validate(view)
        assert result.status == "oom" and "above the budget of 1" in result.reason
        assert len(result.peak_bytes_per_rank) == 2 and result.peak_bytes == max(result.peak_bytes_per_rank)
        # Known to be over the budget after warm-up: the timed steps are not run.
        assert "timed steps skipped" in result.reason and result.step_time_s is None
        assert all(len(rank["step_times_s"]) == 0 for rank in view["ranks"])


@pytest.mark.distributed
def test_different_candidate_lists_are_refused_on_every_rank(report: dict[str, Any]) -> None:
    for view in _ok(report["mismatch"]):
        assert view["raised"] and "different candidate lists" in view["raised"]


@pytest.mark.distributed
def test_a_session_asked_to_run_different_candidates_refuses_on_every_rank_before_building(
        report: dict[str, Any]) -> None:
    """Ranks given different candidates would each build their own and wait in collectives the others never
    run (seen: one rank's FSDP all-gather against the other's reduce-scatter, until the deadline crashed gloo)."""
    for view in _ok(report["session_mismatch"]):
        strategy, micro_batches = view["raised"]
        assert strategy and strategy.startswith("SetupError") and "different candidates" in strategy
        assert "rank 0: [parallel_mode]" in strategy and "rank 1: [fsdp]" in strategy
        assert micro_batches and "micro_batches 1" in micro_batches and "micro_batches 2" in micro_batches
        assert "same order" in micro_batches
        assert view["refused_s"] < 10  # at the meeting, not at a collective's timeout (60 s)
        assert view["after"] == "ok"  # the session goes on with candidates that agree


@pytest.mark.distributed
def test_memory_returns_to_the_baseline_between_trials(report: dict[str, Any]) -> None:
    for view in _ok(report["release"]):
        # A few small tensors may be cached between trials (a dataloader's generator state, the
        # process group's scalars); a leaked model copy would be its ~16 kB of parameters and more each time.
        # One-sided against the baseline: what the scenarios before left reachable (CI once had 2 kB more at the
        # baseline than after every trial) may be freed during the first trial; that is not a leak. Trial to
        # trial, the total must hold still both ways.
        assert all(after - view["before"] <= 1024 for after in view["after"]), view
        assert max(view["after"]) - min(view["after"]) <= 1024, view


@pytest.mark.distributed
def test_ddps_unused_parameter_failure_names_the_parameters_and_the_fix(report: dict[str, Any]) -> None:
    """DDP says "Parameter indices which did not receive grad for rank 0: 2 3" in a message of four paragraphs; the
    dry-run's reason names them and the fix, in its first 500 characters."""
    for view in _ok(report["unused_later"]):
        result = TrialResult.model_validate(view)
        assert result.status == "failed", result
        assert "UnusedGradientError" in result.reason and "pass find_unused_parameters=True" in result.reason, \
            result.reason
        assert result.reason.endswith("'blocks.1.0.weight', 'blocks.1.0.bias'"), result.reason
        assert "Parameter indices" not in result.reason


@pytest.mark.distributed
def test_inapplicable_candidate_is_reported_not_built(report: dict[str, Any]) -> None:
    for view in _ok(report["inapplicable"]):
        refused, ok = (TrialResult.model_validate(r) for r in view["results"])
        assert refused.status == "failed" and refused.reason.startswith("rank 0: not applicable"), refused.reason
        assert ok.status == "ok"


@pytest.mark.distributed
def test_a_rank_that_does_not_come_back_stops_the_series_with_a_clear_error(report: dict[str, Any]) -> None:
    """Rank 1 sleeps past the trial's 2 s and the 1 s rejoin time: rank 0 raises RankLost right after the rejoin
    time, naming the rank, the candidate, the timeout, where rank 1 was stuck and the options to raise; the
    timed-out trial is kept as "timeout" and nothing after it runs (no candidate recorded as failed). Rank 1,
    back later, raises the same verdict instead of going on alone."""
    views = _ok(report["lost"])
    for view in views:
        assert view["raised"] is not None, view
        assert view["ranks"] == [1]
        assert "rank(s) 1 did not come back within 1 s after candidate 0 ([parallel_mode]) ended 'timeout' at its " \
               "2 s timeout: rank 1: not done within 2 s" in view["raised"], view["raised"]
        assert "in forward" in view["raised"]  # where rank 1 was stuck
        assert "timeout_s" in view["raised"] and "rejoin_timeout_s" in view["raised"]
    rank0 = views[0]
    assert [TrialResult.model_validate(r).status for r in rank0["results"]] == ["timeout"]
    # Rank 0: the trial's 2 s, the 1 s wait for rank 1, then the error.
    assert rank0["total_s"] < 2.0 + 1.0 + 3.0, rank0["total_s"]


FAILURE_COST_S = 10.0  # issue 18: a failure on one rank ends the trial on every rank within this


@pytest.mark.distributed
def test_a_failure_on_one_rank_ends_the_trial_on_every_rank_in_seconds(report: dict[str, Any]) -> None:
    """Rank 1 raises in its build, then in a step, with a trial timeout of 120 s: every rank stops within
    seconds (rank 1 announces the failure through the store and frees its trial groups; rank 0, waiting
    in DDP's collective, gets an error at once), both record rank 1's error as the cause, and the next
    candidate runs normally on the same ranks."""
    views = _ok(report["failfast"])
    assert FAILFAST_PLAN == ["raise_build", "ok", "raise_step", "ok"] and FAILFAST_TIMEOUT_S >= 100
    results = [[TrialResult.model_validate(t["result"]) for t in view["trials"]] for view in views]
    assert [[r.status for r in by_rank] for by_rank in results] == [["failed", "ok", "failed", "ok"]] * 2, results
    for index, where in ((0, "build"), (2, "step")):
        raised_at = views[1]["trials"][index]["raised_at"]
        assert views[0]["trials"][index]["raised_at"] is None and raised_at is not None
        stopped_after = max(view["trials"][index]["end"] for view in views) - raised_at
        assert stopped_after < FAILURE_COST_S, (where, stopped_after)
        for by_rank in results:
            failed = by_rank[index]
            assert failed.reason == f"rank 1: {failed.ranks[1].reason}", failed.reason
            assert f"ValueError: injected {where} failure on rank 1" in failed.reason
            assert failed.wall_s < FAILURE_COST_S, failed.wall_s
            # rank 0's own outcome: stopped by rank 1's failure, not a cause of its own
            rank0 = failed.ranks[0]
            assert rank0 is not None and rank0.status == "failed" and not rank0.root_cause, rank0
            assert "stopped: rank 1 failed (" in rank0.reason and f"injected {where} failure" in rank0.reason
    for by_rank in results:  # the trial's groups were dropped early: the next candidate is untouched
        for ok in (by_rank[1], by_rank[3]):
            assert ok.samples_per_s and ok.peak_bytes and len(ok.losses) == 3, ok
        assert by_rank[1].losses == by_rank[3].losses == results[0][1].losses  # same seed, same steps


class EvalCacheModel(torch.nn.Module):
    """Caches a tensor computed from a parameter in eval mode, for inference, as LeViT caches its attention biases:
    a training step in eval mode with two micro-batches reads it after the first backward freed its graph."""

    def __init__(self, fails_in_train_mode: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = mlp()
        self.bias = torch.nn.Parameter(torch.zeros(8))
        self.cache: dict[str, torch.Tensor] = {}
        self.fails_in_train_mode = fails_in_train_mode

    def train(self, mode: bool = True) -> EvalCacheModel:
        super().train(mode)
        if mode:
            self.cache = {}
        return self

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        if self.fails_in_train_mode:
            raise TypeError("forward() missing 1 required positional argument: 'w'")
        bias = self.bias * 2 if self.training else self.cache.setdefault("bias", self.bias * 2)
        return self.net(x) + bias


def test_a_model_that_cannot_train_in_eval_mode_is_dry_run_in_train_mode_after_one_probe() -> None:
    """The dry-run's first warm-up step runs in eval mode (its loss compares with the model's own). A model that
    caches a tensor in eval mode (LeViT) fails that step under two micro-batches, though it trains: the session
    runs the candidate again with the step in train mode, and every later trial too; their first loss is not
    compared (``first_step_in_eval``). A model that fails in train mode as well keeps its failure."""
    env = init_distributed()
    plain = Strategy.load(["parallel_mode"])
    session_results = dry_run_many(_setup(EvalCacheModel()), env, [plain, plain], warmup=2, steps=1, micro_batches=2)
    assert [r.status for r in session_results] == ["ok", "ok"], [r.reason for r in session_results]
    assert [r.first_step_in_eval for r in session_results] == [False, False]
    assert all(math.isfinite(x) for r in session_results for x in r.losses)

    (alone,) = dry_run_many(_setup(EvalCacheModel()), env, [plain], warmup=2, steps=1, micro_batches=1)
    assert alone.status == "ok" and alone.first_step_in_eval  # one micro-batch: eval mode trains, checked

    (broken,) = dry_run_many(_setup(EvalCacheModel(fails_in_train_mode=True)), env, [plain], warmup=2, steps=1)
    assert broken.status == "failed" and "missing 1 required positional argument" in (broken.reason or "")
