"""The planner on a real Optuna study (SQLite in tmp_path) with a synthetic, deterministic landscape.

predict/measure are pure functions of the candidate's point: memory and speed follow simple rules
(sharding and checkpointing save memory and cost time, a bigger micro-batch is faster and larger), and
the cost model is the truth distorted by up to +-8% per candidate, so its ranking is close but not exact.
"""

from __future__ import annotations

import hashlib
import json
import time

import optuna
import pytest
import toy_models
from search_doubles import Pred, Run

from atorch.strategy_search.search.ask_tell import HOPELESS_FACTOR, SearchState
from atorch.strategy_search.search.candidates import CandidateTable, family_key
from atorch.strategy_search.search.outcome import Predicted
from atorch.strategy_search.search.planner import Planner, StudyIdentity, study_key
from atorch.strategy_search.search.space import Candidate, SearchSpace

WORLD, GLOBAL_BATCH = 2, 8
MiB = 2**20


def true_memory(p: dict) -> float:
    states = {"ddp": 400, "zero1": 300, "zero2": 250, "fsdp": 150}[p["sharding"]]
    if p.get("fsdp.cpu_offload"):
        states -= 100
    states *= {"fp32": 1.0, "amp_bf16": 1.0, "amp_fp16": 1.0, "half_bf16": 0.5}[p["precision"]]
    acts = p["micro_batch_size"] * (30 if p["checkpoint"] else 120)
    return (states + acts) * MiB


def true_speed(p: dict) -> float:
    """samples/s: a unique best somewhere in the middle of the space."""
    s = 100.0 * {"ddp": 1.0, "zero1": 0.97, "zero2": 0.93, "fsdp": 0.85}[p["sharding"]]
    s *= {"fp32": 1.0, "amp_bf16": 1.3, "amp_fp16": 1.25, "half_bf16": 1.4}[p["precision"]]
    s *= 0.75 if p["checkpoint"] else 1.0
    s *= 0.6 if p.get("fsdp.cpu_offload") else 1.0
    s *= 0.98 if p.get("fsdp.reshard_after_forward") else 1.0
    s *= 1.05 if p.get("module_replace") else 1.0
    s *= 1.0 + 0.1 * p["micro_batch_size"]
    s *= 0.99 if "deepspeed" in (p.get("zero1.implementation"), p.get("zero2.implementation")) else 1.0
    return s


def wobble(cand: Candidate) -> float:
    """A deterministic factor in [0.92, 1.08] per candidate: the cost model's error."""
    h = int(hashlib.sha256(cand.key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return 0.92 + 0.16 * h


def predict(cand: Candidate) -> Pred:
    p = dict(cand.point)
    return Pred(true_memory(p) * wobble(cand), GLOBAL_BATCH / (true_speed(p) * wobble(cand)))


class Measure:
    def __init__(self, fail_keys: set[str] = frozenset(), sleep_s: float = 0.0) -> None:
        self.calls: list[Candidate] = []
        self.fail_keys = fail_keys
        self.sleep_s = sleep_s

    def __call__(self, cand: Candidate) -> Run:
        self.calls.append(cand)
        time.sleep(self.sleep_s)
        p = dict(cand.point)
        if cand.key in self.fail_keys:
            return Run("failed", 0.0, 0.0, "RuntimeError: boom on rank 1")
        return Run("ok", true_speed(p), true_memory(p))


def landscape_space() -> SearchSpace:
    """The space the synthetic landscape is defined on: its data-parallel points (the model-parallel layouts
    are left out; true_memory and true_speed do not read them)."""
    return SearchSpace(toy_models.tiny_gpt2(), WORLD, GLOBAL_BATCH,
                       excluded=["tensor_parallel", "pipeline_parallel", "mixed_parallel"], precision="low")


@pytest.fixture(scope="module")
def space() -> SearchSpace:
    return landscape_space()


def storage(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'search.db'}"


BUDGET = 610 * MiB  # DDP fp32 needs 400 MiB + 120 MiB per sample of micro-batch: only mbs 1 fits


def exhaustive_best(space: SearchSpace, budget: float) -> tuple[Candidate, float]:
    fits = [c for c in space.enumerate() if true_memory(dict(c.point)) <= budget]
    best = max(fits, key=lambda c: true_speed(dict(c.point)))
    return best, true_speed(dict(best.point))


def test_planner_finds_the_best_of_the_landscape_within_the_trial_budget(space, tmp_path) -> None:
    measure = Measure()
    planner = Planner(space, storage=storage(tmp_path), study_key="k", predict=predict, measure=measure,
                      memory_budget=BUDGET, max_trials=8)
    # The cost model alone is close, not exact (its error reorders the top), so the search has to measure.
    truth, truth_sps = exhaustive_best(space, BUDGET)
    assert planner.plan_without_dryrun().candidate != truth
    result = planner.search()
    assert result.source == "search" and 1 <= result.dry_runs == len(measure.calls) <= 8
    assert result.candidate == truth and result.samples_per_s == pytest.approx(truth_sps)
    # No dry-run was spent on a candidate that does not fit.
    assert all(true_memory(dict(c.point)) <= BUDGET for c in measure.calls)
    # Everything stored is JSON.
    json.dumps(result.trials)
    assert len(space.enumerate()) >= 50


def test_cost_model_alone_keeps_a_margin_under_the_budget(space, tmp_path) -> None:
    """Nothing measures the cost model's own pick, so it must be predicted to fit with COST_MODEL_ONLY_MARGIN to
    spare: a candidate predicted just under the budget (and fastest) is passed over for one clear of it."""
    from atorch.strategy_search.search.planner import COST_MODEL_ONLY_MARGIN

    def plain(cand: Candidate) -> Pred:  # the landscape without the wobble: the truth, predicted
        p = dict(cand.point)
        return Pred(true_memory(p), GLOBAL_BATCH / true_speed(p))

    truth, _ = exhaustive_best(space, BUDGET)
    edge = true_memory(dict(truth.point))
    assert edge > BUDGET * (1 - COST_MODEL_ONLY_MARGIN), "the landscape's best must sit near the budget"
    planner = Planner(space, storage=storage(tmp_path), study_key="m", predict=plain, measure=Measure(),
                      memory_budget=BUDGET)
    pick = planner.plan_without_dryrun().candidate
    assert pick is not None and pick != truth
    assert true_memory(dict(pick.point)) <= BUDGET * (1 - COST_MODEL_ONLY_MARGIN)
    # With a budget that leaves the margin over it, the best is the pick.
    roomy = Planner(space, storage=storage(tmp_path), study_key="m2", predict=plain, measure=Measure(),
                    memory_budget=edge / (1 - COST_MODEL_ONLY_MARGIN) + 1)
    assert roomy.plan_without_dryrun().candidate == truth


def test_predicted_oom_is_a_completed_trial_with_a_violated_constraint_and_never_measured(space, tmp_path) -> None:
    budget = 350 * MiB  # most of the space is predicted not to fit (DDP never does)
    measure = Measure()
    planner = Planner(space, storage=storage(tmp_path), study_key="k", predict=predict, measure=measure,
                      memory_budget=budget, max_trials=8)
    result = planner.search()
    predicted_oom = {c.key for c in space.enumerate() if predict(c).peak_memory_bytes > budget}
    assert not predicted_oom & {c.key for c in measure.calls}
    study = optuna.load_study(study_name="k", storage=storage(tmp_path))
    ooms = [t for t in study.trials if t.user_attrs.get("status") == "predicted_oom"]
    assert ooms, [t.user_attrs.get("status") for t in study.trials]
    for t in ooms:
        assert t.state == optuna.trial.TrialState.COMPLETE
        assert t.constraints["memory_over"] > 0 and t.constraints["failed"] == 0
        assert "predicted peak" in t.user_attrs["reason"] and "measured" not in t.user_attrs
        assert t.user_attrs["key"] in predicted_oom
    assert result.dry_runs == len(measure.calls) == 8  # predicted OOMs do not use up the dry-run budget
    assert true_memory(dict(result.candidate.point)) <= budget


def test_under_a_budget_ddp_cannot_meet_the_baseline_is_the_fastest_fp32_that_fits(space, tmp_path) -> None:
    """Plain DDP predicted out of memory: the baseline is the fastest candidate predicted to fit at the user's
    numbers (fp32, no tensor or pipeline split), measured, so a search under a budget checks the cost model's
    16-bit speed-ups against one fp32 measurement; DDP itself costs no dry-run."""
    tight = 300 * MiB  # below DDP's 400 MiB of states: every DDP candidate is predicted out of memory
    measure = Measure()
    planner = Planner(space, storage=storage(tmp_path), study_key="k", predict=predict, measure=measure,
                      memory_budget=tight, max_trials=4)
    base = dict(planner.baseline().point)
    assert base["sharding"] != "ddp" and base["precision"] == "fp32"
    assert predict(planner.baseline()).peak_memory_bytes <= tight
    fp32_fitting = [c for c in space.enumerate() if dict(c.point)["precision"] == "fp32"
                    and dict(c.point)["sharding"] != "ddp" and predict(c).peak_memory_bytes <= tight]
    assert planner.baseline().key == min(fp32_fitting, key=lambda c: predict(c).step_time_s).key
    result = planner.search()
    assert planner.baseline().key in {c.key for c in measure.calls}
    assert all(dict(c.point)["sharding"] != "ddp" for c in measure.calls)
    assert result.candidate is not None and true_memory(dict(result.candidate.point)) <= tight


def test_ddp_baseline_predicted_oom_costs_no_dry_run(space, tmp_path) -> None:
    """Nothing fits at fp32 (only 16-bit weights do): the baseline is plain DDP, predicted out of memory and
    told without a dry-run."""
    fp32 = [c for c in space.enumerate() if dict(c.point)["precision"] == "fp32"]
    tight = 0.85 * min(predict(c).peak_memory_bytes for c in fp32)  # out of the 8% band of every fp32 candidate
    measure = Measure()
    planner = Planner(space, storage=storage(tmp_path), study_key="k", predict=predict, measure=measure,
                      memory_budget=tight, max_trials=3)
    assert dict(planner.baseline().point)["sharding"] == "ddp"
    result = planner.search()
    study = optuna.load_study(study_name="k", storage=storage(tmp_path))
    base = [t for t in study.trials if t.user_attrs["key"] == planner.baseline().key]
    assert base and base[0].user_attrs["status"] == "predicted_oom" and base[0].constraints["memory_over"] > 0
    assert all(dict(c.point)["sharding"] != "ddp" for c in measure.calls)
    assert result.candidate is None or true_memory(dict(result.candidate.point)) <= tight


def test_measured_failure_is_recorded_with_its_reason_and_the_search_goes_on(space, tmp_path) -> None:
    ranked = Planner(space, storage=storage(tmp_path), study_key="probe", predict=predict, measure=Measure(),
                     memory_budget=BUDGET).ranked_by_cost_model()
    first = ranked[0]  # the cost model's favourite: enqueued first, and it fails
    measure = Measure(fail_keys={first.key})
    planner = Planner(space, storage=storage(tmp_path), study_key="k", predict=predict, measure=measure,
                      memory_budget=BUDGET, max_trials=5)
    result = planner.search()
    assert measure.calls[0] == first and len(measure.calls) == 5
    study = optuna.load_study(study_name="k", storage=storage(tmp_path))
    failed = [t for t in study.trials if t.user_attrs.get("key") == first.key]
    assert failed[0].state == optuna.trial.TrialState.COMPLETE
    assert failed[0].user_attrs["status"] == "failed"
    assert failed[0].user_attrs["reason"] == "RuntimeError: boom on rank 1"
    assert failed[0].constraints["failed"] > 0
    assert failed[0].value > 0  # not told as "throughput 0": the constraint marks it infeasible
    assert result.candidate is not None and result.candidate != first


def test_measure_that_raises_or_exceeds_the_budget_is_infeasible(space, tmp_path) -> None:
    calls = []

    def measure(cand: Candidate) -> Run:
        calls.append(cand)
        if len(calls) == 1:
            raise RuntimeError("worker died")
        if len(calls) == 2:
            return Run("ok", 1e6, BUDGET * 2)  # fastest ever, but over the budget: an OOM
        return Run("ok", true_speed(dict(cand.point)), true_memory(dict(cand.point)))

    planner = Planner(space, storage=storage(tmp_path), study_key="k", predict=predict, measure=measure,
                      memory_budget=BUDGET, max_trials=4)
    result = planner.search()
    statuses = [r["status"] for r in result.trials if r["status"] != "duplicate"]
    assert statuses[:2] == ["failed", "oom"]
    assert result.trials[0]["reason"] == "RuntimeError: worker died"
    assert result.trials[1]["constraints"]["memory_over"] == pytest.approx(1.0)
    assert result.samples_per_s < 1e6 and result.candidate not in calls[:2]


def test_time_limit_is_checked_before_each_trial(space, tmp_path) -> None:
    now = [0.0]  # a clock that only a dry-run moves: 1 s per dry-run, limit 3.5 s

    class Tick(Measure):
        def __call__(self, cand: Candidate) -> Run:
            now[0] += 1.0
            return super().__call__(cand)

    measure = Tick()
    result = Planner(space, storage=storage(tmp_path), study_key="k", predict=predict, measure=measure,
                     memory_budget=BUDGET, max_trials=50, time_limit_s=3.5, clock=lambda: now[0]).search()
    # checks at 0, 1, 2 s pass; at 3 s the 0.5 s left is shorter than a dry-run (1 s, the median of those that ran)
    assert len(measure.calls) == 3, result.stop_reason
    assert result.stop_reason.startswith("3 dry-runs; max_trials 50 not reached: time_limit 3.5 s: 0.5 s left, a "
                                         "dry-run takes 1.0 s"), result.stop_reason


def test_time_limit_is_enforced_in_real_time(space, tmp_path) -> None:
    sleep, limit = 0.5, 1.5
    measure = Measure(sleep_s=sleep)
    planner = Planner(space, storage=storage(tmp_path), study_key="k", predict=predict, measure=measure,
                      memory_budget=BUDGET, max_trials=50, time_limit_s=limit)
    start = time.monotonic()
    result = planner.search()
    elapsed = time.monotonic() - start
    assert "max_trials 50 not reached: time_limit 1.5 s" in result.stop_reason and len(measure.calls) < 50
    # A dry-run starts only when the time left holds one (the median of those that ran), so the search ends within
    # its limit, past it only by the study's bookkeeping (SQLite writes, a sampler step; seconds on a loaded box).
    assert elapsed <= limit + 2.0, elapsed


def test_cached_second_run_does_no_dry_run_and_force_searches_again(space, tmp_path) -> None:
    key = study_key(StudyIdentity.of(space, hardware="cpu-test"))
    first = Planner(space, storage=storage(tmp_path), study_key=key, predict=predict, measure=Measure(),
                    memory_budget=BUDGET, max_trials=4).search()
    measure = Measure()
    again = Planner(space, storage=storage(tmp_path), study_key=key, predict=predict, measure=measure,
                    memory_budget=BUDGET, max_trials=4)
    cached = again.search()
    assert len(measure.calls) == 0 and cached.source == "cache"
    assert cached.candidate == first.candidate and cached.samples_per_s == first.samples_per_s
    forced = again.search(force=True)
    assert forced.source == "search" and len(measure.calls) > 0
    # The stored trials are reused: nothing measured before is measured again.
    assert not {c.key for c in measure.calls} & {r["key"] for r in first.trials if r["status"] == "ok"}
    # A budget the stored best does not fit is not answered from the cache.
    small_measure = Measure()
    small = Planner(space, storage=storage(tmp_path), study_key=key, predict=predict, measure=small_measure,
                    memory_budget=int(true_memory(dict(first.candidate.point))) - 1, max_trials=2)
    assert small.cached() is None
    # Searching under it re-judges the stored measurements: the old best is now over the budget.
    smaller = small.search()
    assert smaller.candidate != first.candidate and len(small_measure.calls) <= 2
    assert true_memory(dict(smaller.candidate.point)) <= small.memory_budget


def test_study_key_depends_on_everything_a_plan_depends_on(space) -> None:
    import torch

    base = StudyIdentity.of(space, hardware="hw", sample={"input_ids": torch.zeros(4, 16, dtype=torch.long)},
                            optimizer={"class": torch.optim.AdamW, "args": {"lr": 1e-3}}, loss=torch.nn.MSELoss(),
                            model_input_format="unpack_dict")
    changes = {"model": "fp2", "sample": StudyIdentity.of(space, sample={"input_ids": torch.zeros(4, 32)}).sample,
               "optimizer": "x", "loss": "y", "model_input_format": None, "global_batch": 16, "world_size": 4,
               "hardware": "hw2", "space": "sig2", "options": {"excluded": ["fsdp"]}, "versions": {"torch": "0"}}
    assert set(changes) == set(StudyIdentity.model_fields) - {"model_class"}  # every part is covered below
    keys = {study_key(base)} | {study_key(base.model_copy(update={k: v})) for k, v in changes.items()}
    assert len(keys) == len(changes) + 1
    # Stable: built again from equal (not identical) objects, the key is the same.
    again = StudyIdentity.of(space, hardware="hw", sample={"input_ids": torch.ones(4, 16, dtype=torch.long)},
                             optimizer={"class": torch.optim.AdamW, "args": {"lr": 1e-3}}, loss=torch.nn.MSELoss(),
                             model_input_format="unpack_dict")
    assert study_key(again) == study_key(base)


def test_patience_stops_after_dry_runs_without_improvement(space, tmp_path) -> None:
    calls = []

    def flat(cand: Candidate) -> Run:  # every candidate equally fast: only the first is an improvement
        calls.append(cand)
        return Run("ok", 10.0, true_memory(dict(cand.point)))

    result = Planner(space, storage=storage(tmp_path), study_key="k", predict=predict, measure=flat,
                     memory_budget=BUDGET, max_trials=8, patience=2).search()
    assert len(calls) == 3 and "patience" in result.stop_reason
    assert result.candidate == calls[0]


def test_gp_sampler_learns_from_constraints(space, tmp_path) -> None:
    budget = 350 * MiB
    measure = Measure()
    result = Planner(space, storage=storage(tmp_path), study_key="gp", predict=predict, measure=measure,
                     memory_budget=budget, max_trials=4, sampler="gp", top_k=1).search()
    assert result.candidate is not None and true_memory(dict(result.candidate.point)) <= budget
    assert all(predict(c).peak_memory_bytes <= budget for c in measure.calls)
    assert all(set(r["constraints"]) == {"memory_over", "failed"} for r in result.trials)


def test_default_storage_is_sqlite_in_the_cache_dir(space, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ATORCH_CACHE_DIR", str(tmp_path / "cache"))
    planner = Planner(space, predict=predict, measure=Measure(), memory_budget=BUDGET, max_trials=1)
    assert planner.storage == f"sqlite:///{tmp_path / 'cache' / 'search.db'}"
    planner.search()
    assert (tmp_path / "cache" / "search.db").exists()


def test_patience_counts_only_after_something_fits_and_runs(space, tmp_path) -> None:
    # The cost model's five favourites all fail when measured: patience 2 must not end the search
    # before a candidate has run (it would return nothing).
    favourites = Planner(space, storage=storage(tmp_path), study_key="probe", predict=predict, measure=Measure(),
                         memory_budget=BUDGET).ranked_by_cost_model()[:5]
    measure = Measure(fail_keys={c.key for c in favourites})
    planner = Planner(space, storage=storage(tmp_path), study_key="k", predict=predict, measure=measure,
                      memory_budget=BUDGET, max_trials=12, patience=2, top_k=5)
    result = planner.search()
    assert result.candidate is not None, result.stop_reason
    assert len(measure.calls) > 5


def test_a_measured_oom_turns_its_look_alikes_into_predicted_ooms(space, tmp_path) -> None:
    # A cost model that under-predicts memory by 15% everywhere: after a family's first measured OOM the
    # planner scales that family's predictions by measured / predicted, so it does not run its next look-alike.
    def low(cand: Candidate) -> Pred:
        p = dict(cand.point)
        return Pred(0.85 * true_memory(p), GLOBAL_BATCH / true_speed(p))

    measure = Measure()
    planner = Planner(space, storage=storage(tmp_path), study_key="k", predict=low, measure=measure,
                      memory_budget=BUDGET, max_trials=8, top_k=5)
    result = planner.search()
    over = [family_key(dict(c.point)) for c in measure.calls if true_memory(dict(c.point)) > BUDGET]
    assert len(over) == len(set(over)), over  # at most one OOM per family
    assert result.candidate is not None and true_memory(dict(result.candidate.point)) <= BUDGET
    study = optuna.load_study(study_name="k", storage=storage(tmp_path))
    if over:
        said = "its family's or its layout's measured / predicted"
        assert any(said in t.user_attrs.get("reason", "") for t in study.trials)


def test_a_memory_correction_stays_in_its_family(space) -> None:
    """One family measured 1.5x its prediction: its members are scaled, every other family is predicted as is
    (a badly predicted pipeline trial must not rule out FSDP with checkpointing unrun)."""
    table = CandidateTable.from_space(space, lambda c: Predicted.estimate(predict(c), GLOBAL_BATCH).to_json())
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, direction="maximize")
    state = SearchState(study, table, BUDGET, storage=storage)
    ddp = [k for k, p in zip(table.keys, table.points, strict=True)
           if p["sharding"] == "ddp" and not p["checkpoint"] and not p.get("module_replace")]
    fsdp = [k for k, p in zip(table.keys, table.points, strict=True) if p["sharding"] == "fsdp" and p["checkpoint"]]
    pred = table.prediction(ddp[0])
    state._remember(ddp[0], 0, {"status": "ok", "samples_per_s": 1.0, "reason": "", "step_time_s": 1.0,
                                "peak_memory_bytes": 1.5 * pred["peak_memory_bytes"]})
    same_family = [k for k in ddp if table.family(k) == table.family(ddp[0])]
    assert len(same_family) > 1 and all(state.correction(k) == 1.5 for k in same_family)
    assert all(state.correction(k) is None for k in fsdp)  # not measured: keeps the error band
    assert all(state.correction(k) is None for k in table.keys if table.family(k) != table.family(ddp[0]))


def test_a_family_measured_at_its_prediction_loses_the_error_band_but_is_not_scaled_down(space) -> None:
    """A close call ran out of memory at its predicted peak (measured / predicted 0.99): the cost model's figure is
    right for that family, so a look-alike predicted 3% over the budget is no longer given the benefit of the 15%
    band (it would run out of memory too); its figure is not scaled down either (a look-alike at another micro-batch
    may peak above its figure); another family keeps the band."""
    table = CandidateTable.from_space(space, lambda c: Predicted.estimate(predict(c), GLOBAL_BATCH).to_json())
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, direction="maximize")
    state = SearchState(study, table, BUDGET, storage=storage)
    first = table.keys[0]
    peer = next(k for k in table.keys[1:] if table.family(k) == table.family(first))
    other = next(k for k in table.keys if table.family(k) != table.family(first))
    state._remember(first, 0, {"status": "oom", "samples_per_s": 0.0, "reason": "over", "step_time_s": 0.0,
                               "peak_memory_bytes": 0.99 * table.prediction(first)["peak_memory_bytes"]})
    close_call = {"peak_memory_bytes": 1.03 * BUDGET, "memory_band": 0.15}
    assert state.correction(peer) == 1.0
    assert not table.fits(close_call, BUDGET, state.correction(peer))
    assert table.fits({"peak_memory_bytes": BUDGET, "memory_band": 0.15}, BUDGET, state.correction(peer))
    assert state.correction(other) is None and table.fits(close_call, BUDGET, state.correction(other))


def test_a_candidate_predicted_far_slower_than_the_best_measured_is_skipped(space) -> None:
    """Past HOPELESS_FACTOR times slower than the best measured candidate (its measured samples/s over the
    candidate's time-corrected prediction), a candidate is told 'skipped' with the factor, on the measured scale,
    and never measured."""
    table = CandidateTable.from_space(space, lambda c: Predicted.estimate(predict(c), GLOBAL_BATCH).to_json())
    ranked = table.ranked(BUDGET)
    storage = optuna.storages.InMemoryStorage()
    best, study = ranked[0], optuna.create_study(storage=storage, direction="maximize")
    state = SearchState(study, table, BUDGET, storage=storage)
    slow = min((k for k in ranked if table.family(k) != table.family(best)),
               key=lambda k: table.prediction(k)["samples_per_s"])
    # The best runs 5 x HOPELESS_FACTOR x faster than the slow one is predicted: the slow one cannot win.
    fast = 5 * HOPELESS_FACTOR * table.prediction(slow)["samples_per_s"]
    state._remember(best, 0, {"status": "ok", "samples_per_s": fast, "reason": "", "step_time_s": 1.0,
                              "peak_memory_bytes": table.prediction(best)["peak_memory_bytes"]})
    factor = state.slower_than_best(table.prediction(slow), slow)
    assert factor > HOPELESS_FACTOR
    study.enqueue_trial(table.to_params(table.points[table.by_key[slow]]))
    proposal = state.ask(stop=lambda: "" if state.asks < 1 else "one ask")
    assert proposal.number is None
    told = [t for t in study.trials if t.user_attrs.get("status") == "skipped"]
    assert len(told) == 1 and told[0].user_attrs["key"] == slow
    assert "x slower than the best measured candidate (trial 0)" in told[0].user_attrs["reason"]
    assert told[0].value == pytest.approx(fast / factor)


class SlowFirstRun(Measure):
    """The landscape, except that the first run of ``slowed`` is 10% slow (a neighbour's burst of work)."""

    def __init__(self, slowed: str) -> None:
        super().__init__()
        self.slowed = slowed

    def __call__(self, cand: Candidate) -> Run:
        run = super().__call__(cand)
        if cand.key == self.slowed and sum(c.key == cand.key for c in self.calls) == 1:
            run.samples_per_s *= 0.9
        return run


def test_confirmation_measures_a_close_runner_up_again_and_keeps_the_faster_run(space, tmp_path) -> None:
    def fastest_measured(measure: Measure) -> Candidate:
        return max(measure.calls, key=lambda c: true_speed(dict(c.point)))

    # The cost model's favourites are measured first; the fastest of them has one slow run.
    seeds = Planner(space, storage=storage(tmp_path), study_key="probe", predict=predict, measure=Measure(),
                    memory_budget=BUDGET).ranked_by_cost_model()[:3]
    slowed = max(seeds, key=lambda c: true_speed(dict(c.point)))
    # Without confirmation, that one slow run hands the pick to a slower candidate.
    plain_measure = SlowFirstRun(slowed.key)
    plain = Planner(space, storage=storage(tmp_path), study_key="a", predict=predict, measure=plain_measure,
                    memory_budget=BUDGET, max_trials=8).search()
    assert fastest_measured(plain_measure) == slowed and plain.candidate != slowed
    # With it, the best and the runner-up run once more (the runner-up first), within the same max_trials,
    # and the pick is the truly fastest of what was measured.
    measure = SlowFirstRun(slowed.key)
    result = Planner(space, storage=storage(tmp_path), study_key="b", predict=predict, measure=measure,
                     memory_budget=BUDGET, max_trials=8, confirm_within=0.3).search()
    best = fastest_measured(measure)
    assert result.candidate == best and result.samples_per_s == pytest.approx(true_speed(dict(best.point)))
    assert result.dry_runs == len(measure.calls) == 8
    study = optuna.load_study(study_name="b", storage=storage(tmp_path))
    confirmed = [c["key"] for c in study.user_attrs["confirmations"]]
    assert len(confirmed) == 2 and best.key in confirmed and [c.key for c in measure.calls[-2:]] == confirmed
    assert study.user_attrs["best"]["point"] == dict(best.point)
    # A runner-up further behind than confirm_within is not measured again.
    far = Planner(space, storage=storage(tmp_path), study_key="c", predict=predict, measure=Measure(),
                  memory_budget=BUDGET, max_trials=8, confirm_within=0.01).search()
    assert "confirmations" not in optuna.load_study(study_name="c", storage=storage(tmp_path)).user_attrs
    assert far.dry_runs == 6  # exploration stopped two early all the same


def test_merged_runs_keep_the_faster_and_the_higher_peak_and_a_failure_decides() -> None:
    from atorch.strategy_search.search.ask_tell import merge_runs

    ok = {"status": "ok", "samples_per_s": 10.0, "peak_memory_bytes": 5.0, "step_time_s": 0.8, "reason": ""}
    faster = {**ok, "samples_per_s": 12.0, "peak_memory_bytes": 4.0, "step_time_s": 0.66}
    merged = merge_runs(ok, faster)
    assert merged["samples_per_s"] == 12.0 and merged["step_time_s"] == 0.66 and merged["peak_memory_bytes"] == 5.0
    assert merged["runs"] == 2
    failed = {**ok, "status": "failed", "reason": "RuntimeError: boom"}
    assert merge_runs(ok, failed) == failed and merge_runs(failed, ok) == failed


def test_a_close_call_on_memory_is_measured_not_dropped(space, tmp_path) -> None:
    """The cost model over-predicts the best candidate's memory by 10% (a held-out family's error) and rates it its
    favourite by far (1.5x its true speed): with the model's known memory band, the search dry-runs it (it fits)
    instead of ruling it out on the estimate; without the band, the estimate alone drops it. Its chance to fit is
    about a fifth (CandidateTable.fit_chance): predicted only as fast as it runs (9% ahead of the fastest sure fit),
    it is a long shot and is not dry-run. A candidate far over (beyond the band) is never measured."""
    truth, truth_sps = exhaustive_best(space, BUDGET)

    def over(cand: Candidate, lead: float) -> Predicted:  # the truth, with the best candidate's memory 10% high
        p = dict(cand.point)
        memory = true_memory(p) * (1.10 if cand == truth else 1.0)
        speed = true_speed(p) * (lead if cand == truth else 1.0)
        return Predicted.of(memory, GLOBAL_BATCH / speed, GLOBAL_BATCH, memory_band=band)

    outcomes = {}
    for band, lead in ((0.15, 1.5), (0.0, 1.5), (0.15, 1.0)):
        measure = Measure()
        result = Planner(space, storage=storage(tmp_path), study_key=f"band{band}-{lead}",
                         predict=lambda c, lead=lead: over(c, lead), measure=measure,
                         memory_budget=BUDGET, max_trials=6).search()
        outcomes[band, lead] = (result.candidate, {c.key for c in measure.calls})
        assert all(true_memory(dict(c.point)) * (1 - band) <= BUDGET * 1.0001 for c in measure.calls), \
            "a candidate beyond the band was measured"
    assert true_memory(dict(truth.point)) * 1.10 > BUDGET, "the over-prediction must put the best over the budget"
    assert outcomes[0.15, 1.5][0] == truth and truth.key in outcomes[0.15, 1.5][1]
    assert outcomes[0.0, 1.5][0] != truth and truth.key not in outcomes[0.0, 1.5][1]
    assert truth.key not in outcomes[0.15, 1.0][1]  # a long shot: its expected gain is under PROMOTE_MARGIN
    assert CandidateTable.fits({"peak_memory_bytes": 110.0, "memory_band": 0.15}, 100.0)
    assert not CandidateTable.fits({"peak_memory_bytes": 110.0, "memory_band": 0.15}, 100.0, banded=False)
    assert not CandidateTable.fits({"peak_memory_bytes": 120.0, "memory_band": 0.15}, 100.0)
    # a family's measured correction replaces the band: the peak is then measured
    assert not CandidateTable.fits({"peak_memory_bytes": 110.0, "memory_band": 0.15}, 100.0, correction=1.01)
    assert not CandidateTable.fits({"peak_memory_bytes": 101.0, "memory_band": 0.15}, 100.0, correction=1.0)


def _two_favourites(tmp_path, key: str, runs: dict[int, list[float]], max_trials: int = 8,
                    patience: int | None = None, stop_when_nothing_left: bool = True) -> tuple[Planner, list, list]:
    """A search whose cost model ranks two candidates first (the first, then the second); ``runs[i]``: the
    samples/s of candidate i's successive dry-runs; everything else runs at 10."""
    mlp_space = SearchSpace(toy_models.mlp(), WORLD, GLOBAL_BATCH, excluded=["tensor_parallel", "pipeline_parallel"])
    ddp = next(c for c in mlp_space.enumerate() if dict(c.point)["sharding"] == "ddp"
               and dict(c.point)["precision"] == "fp32" and not dict(c.point)["checkpoint"])
    fsdp = next(c for c in mlp_space.enumerate() if dict(c.point)["sharding"] == "fsdp"
                and dict(c.point)["checkpoint"] and c.micro_batch_size == ddp.micro_batch_size)
    order = [fsdp, ddp]  # the more complex one is the cost model's favourite

    def predict(cand: Candidate) -> Predicted:
        rank = {c.key: i for i, c in enumerate(order)}.get(cand.key)
        return Predicted.of(MiB, GLOBAL_BATCH / (200.0 - 10 * rank if rank is not None else 120.0), GLOBAL_BATCH)

    calls: list = []

    def measure(cand: Candidate) -> Run:
        calls.append(cand)
        index = next((i for i, c in enumerate(order) if c.key == cand.key), None)
        if index is None:
            return Run("ok", 10.0, MiB)
        seen = sum(c.key == cand.key for c in calls) - 1
        return Run("ok", runs[index][min(seen, len(runs[index]) - 1)], MiB)

    planner = Planner(mlp_space, storage=storage(tmp_path), study_key=key, predict=predict, measure=measure,
                      memory_budget=100 * MiB, max_trials=max_trials, patience=patience, top_k=2, confirm_within=0.3,
                      stop_when_nothing_left=stop_when_nothing_left)
    return planner, calls, order


def test_a_lucky_first_run_does_not_win_what_side_by_side_runs_lose(tmp_path) -> None:
    """The favourite's first run caught a quiet moment (100 samples/s against the other's 80); run back to back
    in the confirmation it makes 50 against 80: the side-by-side runs decide, not the faster of each one's runs."""
    planner, calls, (fsdp, ddp) = _two_favourites(tmp_path, "lucky", {0: [100.0, 50.0], 1: [80.0, 80.0]})
    result = planner.search()
    assert [c.key for c in calls[-2:]] == [ddp.key, fsdp.key]  # the confirmation: runner-up, then best
    assert result.candidate == ddp and result.samples_per_s == pytest.approx(80.0)


def test_within_noise_side_by_side_the_simpler_strategy_is_kept(tmp_path) -> None:
    """FSDP + checkpointing and plain DDP run within 3% of each other back to back: the simpler (DDP) is kept,
    though the other measured a little faster, and the stop message says why; 10% apart, the faster is kept."""
    # exploration ends early (patience), leaving max_trials room for every round
    planner, calls, (fsdp, ddp) = _two_favourites(tmp_path, "tie", {0: [100.0, 100.0], 1: [97.0, 97.0]},
                                                  max_trials=12, patience=2)
    result = planner.search()
    # within noise after each round: re-measured interleaved (runner-up, best) for the 3 rounds, then a tie
    assert [c.key for c in calls[-6:]] == [ddp.key, fsdp.key] * 3 and len(calls) <= 12
    assert result.candidate == ddp and "tie within noise over 3 rounds: the simpler strategy wins" in result.stop_reason
    verdict = optuna.load_study(study_name="tie", storage=storage(tmp_path)).user_attrs["confirmation_verdict"]
    assert verdict["rounds"] == 3 and verdict["rule"].startswith("tie within noise")
    planner, calls, (fsdp, ddp) = _two_favourites(tmp_path, "apart", {0: [100.0, 100.0], 1: [90.0, 90.0]})
    result = planner.search()
    assert result.candidate == fsdp and "simpler" not in result.stop_reason
    # clear at once: one round; exploration stopped when the rest (predicted at 10, corrected) could not win
    assert "measured faster over 1 round" in result.stop_reason and "nothing left can win" in result.stop_reason
    assert len(calls) == 5
    # exploration used all of max_trials but the first round's two: no further round, the budget holds
    planner, calls, (fsdp, ddp) = _two_favourites(tmp_path, "capped", {0: [100.0, 100.0], 1: [97.0, 97.0]},
                                                  stop_when_nothing_left=False)
    result = planner.search()
    assert len(calls) == 8 and "tie within noise over 1 round: the simpler strategy wins" in result.stop_reason
    assert result.candidate == ddp


def test_the_measured_noise_decides_how_many_rounds_and_who_wins() -> None:
    """Step times whose spreads overlap are a tie, however the medians fall; every step of one faster than every
    step of the other, or medians further apart than both spreads, is a decision."""
    from atorch.strategy_search.search.ask_tell import best_of, decided, merge_runs

    def run(sps: float, steps: list[float]) -> dict:
        return {"status": "ok", "samples_per_s": sps, "peak_memory_bytes": 1.0, "step_time_s": steps[0],
                "step_times_s": steps}

    noisy_a, noisy_b = run(100.0, [0.10, 0.13, 0.08, 0.12]), run(97.0, [0.11, 0.09, 0.12, 0.10])
    assert not decided(noisy_a, noisy_b)  # 3% apart, within each one's spread
    clear_a, clear_b = run(100.0, [0.100, 0.101, 0.099]), run(97.0, [0.103, 0.104, 0.1035])
    assert decided(clear_a, clear_b)  # 3% apart too, but every step of one is faster
    # rounds pool: the first confirmation replaces the first run, later ones add their steps and samples/s
    first = run(150.0, [0.05, 0.05])
    once = merge_runs(first, noisy_a)
    twice = merge_runs(once, run(90.0, [0.11, 0.12]))
    assert once["runs"] == 2 and once["samples_per_s"] == 100.0 and once["step_times_s"] == noisy_a["step_times_s"]
    assert twice["runs"] == 3 and twice["samples_per_s"] == 95.0 and len(twice["step_times_s"]) == 6
    simple, complex_ = json.dumps({"sharding": "ddp"}), json.dumps({"sharding": "fsdp", "checkpoint": True})
    confirmed = {**noisy_a, "runs": 2}
    assert best_of([(100.0, complex_, 2, confirmed), (97.0, simple, 2, {**noisy_b, "runs": 2})])[1] == simple
    assert best_of([(100.0, complex_, 2, {**clear_a, "runs": 2}), (97.0, simple, 2, {**clear_b, "runs": 2})])[1] \
        == complex_


def test_every_dry_run_failing_the_same_way_is_the_users_mistake(space, tmp_path) -> None:
    """A float64 batch fails every strategy the same way: after two dry-runs of strategies that share no method the
    search stops and raises that error as the setup's (never "raise memory_limit"), and the study is left
    unfinished, so a fixed setup searches again. Failures that differ, or that a shared method may explain, do
    not stop it."""
    from atorch.strategy_search.costing.diagnosis import StepError

    def dtype_error(cand: Candidate) -> Run:
        batch = 4 * cand.micro_batch_size
        return Run("failed", 0.0, 0.0, f"rank 0: step: RuntimeError: mat1 and mat2 must have the same dtype, but got "
                                       f"Double and Float ({batch}x16); rank 1: step: RuntimeError: the same")

    calls: list = []

    def measure(cand: Candidate) -> Run:
        calls.append(cand)
        return dtype_error(cand)

    planner = Planner(space, storage=storage(tmp_path), study_key="same", predict=predict, measure=measure,
                      memory_budget=BUDGET, max_trials=8)
    with pytest.raises(StepError, match="training setup.*mat1 and mat2 must have the same dtype") as raised:
        planner.search()
    assert "memory_limit" not in str(raised.value) and 2 <= len(calls) < 8
    record = optuna.load_study(study_name="same", storage=storage(tmp_path)).user_attrs["searches"][-1]
    assert not record["finished"]

    def varied(cand: Candidate) -> Run:  # a different error each time: nothing in common to blame
        return Run("failed", 0.0, 0.0, f"rank 0: build: RuntimeError: {cand.key}")

    result = Planner(space, storage=storage(tmp_path), study_key="varied", predict=predict, measure=varied,
                     memory_budget=BUDGET, max_trials=4).search()
    assert result.candidate is None and result.dry_runs == 4


def test_a_method_that_cannot_build_rules_out_its_family_after_one_dry_run(tmp_path) -> None:
    """Tensor parallel refuses the model in its build step (as on a conv classifier: "get_input_embeddings not
    auto-handled"): one dry-run says so, and every other candidate using tensor parallel at that size is told
    'skipped' with the reason, not dry-run; the rest of the space is searched as before."""
    gpt2_space = SearchSpace(toy_models.tiny_gpt2(), WORLD, GLOBAL_BATCH)
    tensor = [c for c in gpt2_space.enumerate() if dict(c.point).get("tensor", 1) > 1]
    assert len(tensor) > 10

    def predict_tensor_first(cand: Candidate) -> Pred:  # the cost model likes tensor parallel best
        p = dict(cand.point)
        return Pred(true_memory(p), GLOBAL_BATCH / (true_speed(p) * (3.0 if p.get("tensor", 1) > 1 else 1.0)))

    calls: list = []

    def measure(cand: Candidate) -> Run:
        calls.append(cand)
        if dict(cand.point).get("tensor", 1) > 1:
            return Run("failed", 0.0, 0.0, "rank 0: build [tensor_parallel]: NotImplementedError: "
                                           "`get_input_embeddings` not auto-handled; rank 1: build [tensor_parallel]: "
                                           "NotImplementedError: the same")
        return Run("ok", true_speed(dict(cand.point)), true_memory(dict(cand.point)))

    result = Planner(gpt2_space, storage=storage(tmp_path), study_key="tp", predict=predict_tensor_first,
                     measure=measure, memory_budget=10 * BUDGET, max_trials=8, top_k=3).search()
    assert sum(dict(c.point).get("tensor", 1) > 1 for c in calls) == 1
    assert result.candidate is not None and dict(result.candidate.point).get("tensor", 1) == 1
    study = optuna.load_study(study_name="tp", storage=storage(tmp_path))
    skipped = [t.user_attrs for t in study.trials if t.user_attrs.get("status") == "skipped"
               and "could not be applied" in t.user_attrs.get("reason", "")]
    assert skipped and all(json.loads(a["key"]).get("tensor", 1) > 1 for a in skipped)
    assert "tensor_parallel could not be applied to this model at this layout" in skipped[0]["reason"]


def test_a_split_layout_s_measured_memory_error_reaches_its_other_families() -> None:
    """Under tensor parallel the analytical model's memory errors are shared by the layout's families (on the held-out
    MobileViT each ran 17-30% over its figure): once every measured family of a split layout came out above its figure,
    an unmeasured family of that layout is scaled by the smallest ratio (its band's optimism kept), so it is not
    dry-run out of memory next; families over the data ranks alone, and other layouts, keep their band."""
    gpt2_space = SearchSpace(toy_models.tiny_gpt2(), 4, 16)  # tensor 2 x data 2: twelve families

    def banded(c: Candidate) -> dict:
        p = predict(c)
        return Predicted.of(p.peak_memory_bytes, p.step_time_s, GLOBAL_BATCH, memory_band=0.08).to_json()

    table = CandidateTable.from_space(gpt2_space, banded)
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, direction="maximize")
    state = SearchState(study, table, BUDGET, storage=storage)
    split = [k for k, p in zip(table.keys, table.points, strict=True) if int(p.get("tensor", 1)) == 2]
    data_only = [k for k, p in zip(table.keys, table.points, strict=True) if int(p.get("tensor", 1)) == 1
                 and int(p.get("pipeline", 1)) == 1]
    first, second = split[0], next(k for k in split if table.family(k) != table.family(split[0]))
    other = [k for k in split if table.family(k) not in (table.family(first), table.family(second))]
    four = [k for k, p in zip(table.keys, table.points, strict=True) if int(p.get("tensor", 1)) == 4]
    assert other and data_only
    measured = {"status": "oom", "samples_per_s": 0.0, "reason": "over", "step_time_s": 0.0}
    state._remember(first, 0, {**measured, "peak_memory_bytes": 1.35 * table.prediction(first)["peak_memory_bytes"]})
    assert state.correction(first) == pytest.approx(1.35)
    assert all(state.correction(k) == pytest.approx(1.35 * 0.92) for k in other)  # the layout's ratio, band kept
    assert all(state.correction(k) is None for k in data_only + four)  # other layouts: as predicted
    # a second family of the layout measured at its figure: the layout no longer says its figures are low
    state._remember(second, 1, {**measured, "peak_memory_bytes": 0.99 * table.prediction(second)["peak_memory_bytes"]})
    assert all(state.correction(k) is None for k in other)
    # over the data ranks alone one family's error stays its own
    state._remember(data_only[0], 2, {**measured, "peak_memory_bytes": 1.5 * table.prediction(data_only[0])[
        "peak_memory_bytes"]})
    assert all(state.correction(k) is None for k in data_only if table.family(k) != table.family(data_only[0]))


def test_a_failure_repeated_word_for_word_rules_out_the_methods_the_two_share_but_not_a_precision() -> None:
    """JetMoE's experts under expert parallel failed four dry-runs with one TypeError: from the second failure alike
    at a layout, the methods the two failed candidates share are ruled out there. A precision is a candidate's own
    setting (DBRX's experts fail under autocast alone and run under bf16 ZeRO-2), never blamed so; nor is a method
    that every candidate has, or one that ran in a dry-run that did not fail."""
    gpt2_space = SearchSpace(toy_models.tiny_gpt2(), WORLD, GLOBAL_BATCH)
    def predicted(c: Candidate) -> dict:
        p = predict(c)
        return Predicted.of(p.peak_memory_bytes, p.step_time_s, GLOBAL_BATCH).to_json()

    table = CandidateTable.from_space(gpt2_space, predicted)
    storage = optuna.storages.InMemoryStorage()
    state = SearchState(optuna.create_study(storage=storage, direction="maximize"), table, BUDGET, storage=storage)
    names = {k: state._names(k) for k in table.keys}
    tensor = [k for k, p in zip(table.keys, table.points, strict=True) if int(p.get("tensor", 1)) > 1]
    first = tensor[0]
    second = next(k for k in tensor if names[k] != names[first] and table.layout(k) == table.layout(first))
    failed = {"status": "failed", "samples_per_s": 0.0, "peak_memory_bytes": 0, "step_time_s": 0.0,
              "reason": "rank 0: warm-up step 0: TypeError: forward() missing 1 required positional argument: 'w'; "
                        "rank 1: warm-up step 0: TypeError: forward() missing 1 required positional argument: 'w'"}
    state._remember(first, 0, failed)
    assert not state.unbuildable(second)  # one failure says nothing of the method
    state._remember(second, 1, failed)
    rules = set(state.unbuildable_at)
    assert ("tensor_parallel", table.layout(first)) in rules
    assert all(method != "parallel_mode" for method, _ in rules)  # in every candidate: not blamed
    later = [k for k in tensor if table.layout(k) == table.layout(first) and k not in (first, second)]
    assert later and all("failed alike in two dry-runs" in state.unbuildable(k) for k in later)
    data_only = [k for k, p in zip(table.keys, table.points, strict=True) if int(p.get("tensor", 1)) == 1]
    assert not any(state.unbuildable(k) for k in data_only)

    # the same error twice under a precision that the two share, and nothing else they share but the layout
    precise = [k for k in data_only if "amp_native" in names[k]]
    one = precise[0]
    other = next(k for k in precise if len(names[k] & names[one] - {"parallel_mode", "amp_native"}) == 0
                 and table.layout(k) == table.layout(one) and k != one)
    fresh = SearchState(optuna.create_study(storage=storage, direction="maximize"), table, BUDGET, storage=storage)
    fresh._remember(one, 0, {**failed, "reason": "rank 0: warm-up step 0: RuntimeError: index_add_(): dtypes differ"})
    fresh._remember(other, 1, {**failed, "reason": "rank 1: warm-up step 0: RuntimeError: index_add_(): dtypes differ"})
    assert not fresh.unbuildable_at
