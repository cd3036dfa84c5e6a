"""The ask/tell core shared by the local planner and the strategy server (real Optuna study on SQLite)."""

from __future__ import annotations

import json

import optuna
import pytest
from test_planner import BUDGET, GLOBAL_BATCH, Measure, landscape_space, predict

from atorch.strategy_search.search.ask_tell import SearchState
from atorch.strategy_search.search.candidates import CandidateTable
from atorch.strategy_search.search.outcome import Predicted
from atorch.strategy_search.search.planner import Planner
from atorch.strategy_search.search.space import SearchSpace


@pytest.fixture(scope="module")
def space() -> SearchSpace:
    return landscape_space()


def test_table_is_json_and_its_optuna_view_proposes_only_valid_points(space) -> None:
    table = CandidateTable.from_space(space, lambda c: Predicted.estimate(predict(c), GLOBAL_BATCH).to_json())
    again = CandidateTable.from_json(json.loads(json.dumps(table.to_json())))
    assert again.keys == table.keys and len(table.keys) == len(space)
    valid = set(table.keys)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(40):
        point = again.suggest(study.ask())
        assert json.dumps(point, sort_keys=True) in valid
    for point in table.points:  # every point has params, and they walk back to the same point
        params = again.to_params(point)
        assert {k.split("|", 1)[0]: v for k, v in params.items()} == point


def test_on_trial_sees_every_told_trial_with_its_record(space, tmp_path) -> None:
    seen: list[dict] = []
    result = Planner(space, storage=f"sqlite:///{tmp_path / 's.db'}", study_key="k", predict=predict,
                     measure=Measure(), memory_budget=BUDGET, max_trials=3, on_trial=seen.append).search()
    told = [r for r in result.trials if "status" in r]  # enqueued seeds never asked are still waiting
    assert seen == told and len(told) >= 3


def test_tell_twice_is_harmless_and_a_state_is_rebuilt_from_the_study(space, tmp_path) -> None:
    table = CandidateTable.from_space(space, lambda c: Predicted.estimate(predict(c), GLOBAL_BATCH).to_json())
    storage = optuna.storages.get_storage(f"sqlite:///{tmp_path / 's.db'}")
    study = optuna.create_study(storage=storage, study_name="k", direction="maximize")
    state = SearchState(study, table, BUDGET, storage=storage)
    state.seed()
    prop = state.ask()
    measured = {"status": "ok", "samples_per_s": 42.0, "peak_memory_bytes": 1.0, "reason": ""}
    first = state.tell(prop.number, measured)
    second = state.tell(prop.number, {**measured, "samples_per_s": 1.0})
    assert first["value"] == second["value"] == 42.0 and second["already_told"]
    rebuilt = SearchState(optuna.load_study(study_name="k", storage=storage), table, BUDGET, storage=storage)
    assert rebuilt.best()["key"] == prop.key and rebuilt.best_value == 42.0


# ----- time corrections: a measurement re-ranks its own family; favourites spread over the layouts -----------

MiB = 2**20


def layout_table() -> tuple[CandidateTable, dict[str, float]]:
    """Two layouts (tensor 1 and 2) x three shardings x two micro-batch sizes; predicted samples/s and the truth.
    The cost model rates tensor parallel 3x data parallel; in truth it runs at a fifth of that (per-layer
    collectives on a slow link). Every point fits (1 MiB predicted and measured)."""
    points, preds, truth = [], [], {}
    for tensor in (1, 2):
        for sharding, speed in (("ddp", 100.0), ("zero2", 110.0), ("fsdp", 80.0)):
            for mbs in (1, 2):
                point = {"checkpoint": False, "micro_batch_size": mbs, "precision": "fp32", "sharding": sharding,
                         "tensor": tensor}
                predicted = speed * (1 + 0.1 * mbs) * (3.0 if tensor == 2 else 1.0)
                points.append(point)
                preds.append(Predicted.of(MiB, GLOBAL_BATCH / predicted, GLOBAL_BATCH).to_json())
                truth[json.dumps(point, sort_keys=True)] = predicted * (0.2 if tensor == 2 else 1.0)
    return CandidateTable(points, preds, GLOBAL_BATCH), truth


def measured(sps: float) -> dict:
    return {"status": "ok", "samples_per_s": sps, "peak_memory_bytes": MiB, "reason": "", "step_time_s": 1.0}


def in_memory_state(table: CandidateTable, **kwargs) -> SearchState:
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, direction="maximize",
                                sampler=optuna.samplers.RandomSampler(seed=0))
    return SearchState(study, table, 100 * MiB, storage=storage, **kwargs)


def key_of(table: CandidateTable, **point) -> str:
    return next(k for k, p in zip(table.keys, table.points, strict=True) if all(p[n] == v for n, v in point.items()))


def test_a_time_correction_stays_in_its_family_and_an_unmeasured_layout_gets_the_benefit_of_the_doubt() -> None:
    table, truth = layout_table()
    state = in_memory_state(table)
    tp_ddp = key_of(table, tensor=2, sharding="ddp", micro_batch_size=2)
    state._remember(tp_ddp, 0, measured(truth[tp_ddp]))  # a fifth of its prediction
    assert state.time_correction(key_of(table, tensor=2, sharding="ddp", micro_batch_size=1)) == pytest.approx(0.2)
    # another family of the same layout: the best factor its layout ran at
    assert state.time_correction(key_of(table, tensor=2, sharding="fsdp", micro_batch_size=1)) == pytest.approx(0.2)
    # a layout that has not run: its prediction as it is
    assert state.time_correction(key_of(table, tensor=1, sharding="fsdp", micro_batch_size=1)) == 1.0
    # the skip rule judges the measured best against the corrected prediction: a tensor-parallel look-alike is
    # predicted as slow as its family ran, a data-parallel candidate as the cost model says
    tp_mbs1 = key_of(table, tensor=2, sharding="ddp", micro_batch_size=1)
    assert state.slower_than_best(table.prediction(tp_mbs1), tp_mbs1) == pytest.approx(
        truth[tp_ddp] / truth[tp_mbs1])
    dp = key_of(table, tensor=1, sharding="ddp", micro_batch_size=2)
    assert state.slower_than_best(table.prediction(dp), dp) == pytest.approx(
        truth[tp_ddp] / table.prediction(dp)["samples_per_s"])
    # a layout that ran faster than predicted lends its factor to its untried families (the skip rule then
    # judges them on the same scale as the best)
    fsdp1 = key_of(table, tensor=1, sharding="fsdp", micro_batch_size=1)
    state._remember(dp, 1, measured(3.0 * table.prediction(dp)["samples_per_s"]))
    assert state.time_correction(fsdp1) == pytest.approx(3.0)
    # without correct_time both are judged on predictions alone (the rule before corrections)
    plain = in_memory_state(table, correct_time=False)
    plain._remember(tp_ddp, 0, measured(truth[tp_ddp]))
    assert plain.time_correction(tp_mbs1) == 1.0


def precision_table() -> CandidateTable:
    """One layout, two shardings x fp32 / amp_bf16, one micro-batch size: amp predicted 10% faster than fp32."""
    points, preds = [], []
    for sharding in ("zero2", "fsdp"):
        for precision, speed in (("fp32", 100.0), ("amp_bf16", 110.0)):
            points.append({"checkpoint": True, "micro_batch_size": 2, "precision": precision, "sharding": sharding,
                           "tensor": 1})
            preds.append(Predicted.of(MiB, GLOBAL_BATCH / speed, GLOBAL_BATCH).to_json())
    return CandidateTable(points, preds, GLOBAL_BATCH)


def test_a_time_error_measured_in_one_precision_is_not_carried_to_another() -> None:
    """Held-out EfficientNet on a CPU: its bf16 candidates ran at a fifth of their prediction (16-bit depthwise
    convolutions), its fp32 ones at half; judged by the amp family's factor, the fp32 sibling (the true best) never
    looked worth a dry-run. The amp factor stays with amp, in its own family and its layout's other families; fp32
    keeps its prediction until an fp32 candidate runs, and is then promoted past the measured amp best."""
    table = precision_table()
    state = in_memory_state(table)
    state.seed(top_k=1)
    amp_zero2 = key_of(table, sharding="zero2", precision="amp_bf16")
    fp32_zero2, fp32_fsdp = key_of(table, sharding="zero2", precision="fp32"), key_of(table, sharding="fsdp",
                                                                                       precision="fp32")
    state._remember(amp_zero2, 0, measured(0.2 * table.prediction(amp_zero2)["samples_per_s"]))
    assert state.time_correction(key_of(table, sharding="fsdp", precision="amp_bf16")) == pytest.approx(0.2)
    assert state.time_correction(fp32_zero2) == state.time_correction(fp32_fsdp) == 1.0
    assert state.promising() == fp32_zero2  # predicted 100 samples/s against 22 measured
    state._remember(fp32_zero2, 1, measured(0.5 * table.prediction(fp32_zero2)["samples_per_s"]))
    assert state.time_correction(fp32_fsdp) == pytest.approx(0.5)  # now an fp32 factor is known in the layout
    # a 16-bit precision not yet run takes the factor of one of the same width (fp16 beside bf16)
    wide = CandidateTable([*table.points, {"checkpoint": True, "micro_batch_size": 2, "precision": "amp_fp16",
                                           "sharding": "fsdp", "tensor": 1}],
                          [*table.predictions, table.predictions[-1]], GLOBAL_BATCH)
    fp16 = in_memory_state(wide)
    fp16._remember(amp_zero2, 0, measured(0.2 * table.prediction(amp_zero2)["samples_per_s"]))
    assert fp16.time_correction(key_of(wide, precision="amp_fp16")) == pytest.approx(0.2)
    assert fp16.time_correction(fp32_fsdp) == 1.0
    # a layout that ran faster than predicted lends that to a precision it has not run
    fast = in_memory_state(table)
    fast._remember(amp_zero2, 0, measured(2.0 * table.prediction(amp_zero2)["samples_per_s"]))
    assert fast.time_correction(fp32_fsdp) == pytest.approx(2.0)


def test_favourites_spread_over_the_layouts_and_a_corrected_prediction_that_beats_the_best_is_promoted() -> None:
    """The cost model's top six are tensor parallel; the search seeds the best of each layout instead. With one
    favourite (tensor parallel) and the DDP baseline seeded, tensor parallel measures at a fifth of its
    prediction, and the data-parallel candidate predicted to beat the best measured (DDP) is promoted to the
    next dry-run: it is the true best."""
    table, truth = layout_table()
    true_best = max(truth, key=truth.get)
    assert table.ranked(100 * MiB)[:2] != [true_best] and true_best != table.ranked(100 * MiB)[0]

    def run(state: SearchState, top_k: int, dry_runs: int) -> list[str]:
        state.seed(top_k)
        ran = []
        for _ in range(dry_runs):
            proposal = state.ask()
            ran.append(proposal.key)
            state.tell(proposal.number, measured(truth[proposal.key]))
        return ran

    spread = in_memory_state(table)
    assert spread.spread(table.ranked(100 * MiB), 2) == [table.ranked(100 * MiB)[0], true_best]
    # top_k=1: the tensor-parallel favourite and the DDP baseline are seeded; the promotion finds the true best next
    promoted = in_memory_state(table)
    ddp = table.baseline(100 * MiB)
    ran = run(promoted, top_k=1, dry_runs=3)
    assert ran == [table.ranked(100 * MiB)[0], ddp, true_best] and promoted.promoted == [true_best]
    assert promoted.best_key == true_best
    # nothing is left queued after the search stops (a queued trial would mark the search unfinished)
    assert not promoted.study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    # the same search without time corrections does not propose it second
    plain = in_memory_state(table, correct_time=False)
    assert run(plain, top_k=1, dry_runs=3)[2] != true_best and not plain.promoted


def test_a_sibling_group_is_corrected_by_the_error_its_traced_members_share_not_by_one_sharding_s_own() -> None:
    # (the held-out EfficientNet under checkpoint, MiB: DDP traced 9% over its figure by its gradient buckets, torch
    # ZeRO-1 5% over, FSDP2's ZeRO-2 10% under; carried from DDP, ZeRO-2's figure went 27% over its peak)
    from atorch.strategy_search.search.candidates import SiblingErrors

    mib = 2**20
    point = {"checkpoint": True, "precision": "fp32", "micro_batch_size": 2}
    errors = SiblingErrors(band=0.08)
    errors.add({**point, "sharding": "ddp"}, 4.45 * mib, 4.08 * mib)  # one member over its figure: raises nothing
    assert not errors.knows({**point, "sharding": "zero2"})
    assert errors.corrected({**point, "sharding": "zero2"}, 2.74 * mib, 0.68 * mib) is None
    errors.add({**point, "sharding": "zero1"}, 3.68 * mib, 3.50 * mib)  # 5%: within the band, shared by both
    assert errors.corrected({**point, "sharding": "zero2"}, 2.74 * mib, 0.68 * mib) is None
    # two members over their figures beyond the band: the smaller raises the others
    raised = SiblingErrors(band=0.08)
    raised.add({**point, "sharding": "ddp"}, 4.6 * mib, 4.0 * mib)
    raised.add({**point, "sharding": "zero1"}, 3.9 * mib, 3.5 * mib)
    assert raised.corrected({**point, "sharding": "zero2"}, 2.74 * mib, 0.68 * mib) == pytest.approx(3.14 * mib)
    # errors of both signs: nothing shared, whatever their size
    opposite = SiblingErrors(band=0.08)
    opposite.add({**point, "sharding": "ddp"}, 4.45 * mib, 4.08 * mib)
    opposite.add({**point, "sharding": "fsdp"}, 2.0 * mib, 2.5 * mib)
    assert opposite.corrected({**point, "sharding": "zero2"}, 2.74 * mib, 0.68 * mib) is None
    # an error every sharding shows (recomputation over-predicted, Swin: 28-34%): one member lowers the others,
    # two the smaller of theirs
    lowered = SiblingErrors(band=0.08)
    lowered.add({**point, "sharding": "ddp"}, 3.0 * mib, 4.2 * mib)
    assert lowered.corrected({**point, "sharding": "zero2"}, 2.74 * mib, 1.5 * mib) == pytest.approx(1.54 * mib)
    shared = SiblingErrors(band=0.08)
    shared.add({**point, "sharding": "ddp"}, 3.0 * mib, 4.2 * mib)
    shared.add({**point, "sharding": "zero1"}, 2.4 * mib, 3.5 * mib)
    assert shared.corrected({**point, "sharding": "zero2"}, 2.74 * mib, 1.5 * mib) == pytest.approx(1.64 * mib)
    # never below the figure's terms other than activations
    assert shared.corrected({**point, "sharding": "zero2"}, 2.74 * mib, 0.5 * mib) == pytest.approx(2.24 * mib)
    # another group (another micro-batch size) learns nothing from these
    assert shared.corrected({**point, "micro_batch_size": 1, "sharding": "zero2"}, 2.0 * mib, 0.5 * mib) is None


def close_call_table(lead: float) -> CandidateTable:
    """ZeRO-1 predicted 4% over the 100 MiB budget (within the 8% band) and ``lead`` times as fast as ZeRO-2, predicted
    at 80 MiB; two micro-batch sizes each (the second 1% slower)."""
    points, preds = [], []
    for sharding, peak, speed in (("zero1", 104 * MiB, 100.0 * lead), ("zero2", 80 * MiB, 100.0)):
        for mbs, slower in ((2, 1.0), (1, 0.99)):
            points.append({"checkpoint": False, "micro_batch_size": mbs, "precision": "fp32", "sharding": sharding,
                           "tensor": 1})
            preds.append(Predicted.of(peak, GLOBAL_BATCH / (speed * slower), GLOBAL_BATCH, memory_band=0.08).to_json())
    return CandidateTable(points, preds, GLOBAL_BATCH)


def test_a_close_call_over_the_budget_is_weighed_by_its_chance_to_fit() -> None:
    """A figure over the budget within the band runs out of memory about 3 times in 4 (bench/memory_replay.py
    --close-calls): seeded after a sure fit unless its lead pays for that, and once something ran, dry-run only
    where its chance times its lead over the best measured one is worth a slot."""
    pred = {"peak_memory_bytes": 104 * MiB, "memory_band": 0.08}
    assert CandidateTable.fit_chance(pred, 104 * MiB) == pytest.approx(0.5)  # the figure at the budget
    assert CandidateTable.fit_chance(pred, 100 * MiB) == pytest.approx(0.5 - (1 - 100 / 104) / 0.16)  # about 0.26
    assert CandidateTable.fit_chance(pred, 95 * MiB) == 0.0 and not CandidateTable.fits(pred, 95 * MiB)
    assert CandidateTable.fit_chance(pred, 120 * MiB) == 1.0
    assert CandidateTable.fit_chance(pred, 100 * MiB, correction=0.9) == 1.0  # measured: the figure decides
    assert CandidateTable.fit_chance(pred, 100 * MiB, correction=1.0) == 0.0
    # seeds: 1.5x faster at a quarter's chance loses to the sure fit; 5x faster wins
    modest = close_call_table(lead=1.5)
    state = in_memory_state(modest)
    sure, close = key_of(modest, sharding="zero2", micro_batch_size=2), key_of(modest, sharding="zero1",
                                                                                micro_batch_size=2)
    assert modest.ranked(100 * MiB)[0] == close and state.seed(top_k=1)[0] == sure
    bold = close_call_table(lead=5.0)
    assert in_memory_state(bold).seed(top_k=1)[0] == key_of(bold, sharding="zero1", micro_batch_size=2)
    # the sure fit ran at its prediction: the close call (lead 1.5, chance 0.26: gain 0.13 of the best) is promoted
    state._remember(sure, 0, measured(100.0))
    assert state.expected_gain(close) == pytest.approx(state.fit_chance(close) * 50.0)
    assert not state.long_shot(close) and state.promising() == close
    # at a lead of 1.1 its expected gain (about 0.026 of the best) is under the margin: never dry-run
    slim = close_call_table(lead=1.1)
    state = in_memory_state(slim, stop_when_nothing_left=False)
    sure, close = key_of(slim, sharding="zero2", micro_batch_size=2), key_of(slim, sharding="zero1", micro_batch_size=2)
    state._remember(sure, 0, measured(100.0))
    assert state.promising() is None
    why = state.long_shot(close)
    assert "4% over the budget" in why and "fits about 26% of the time" in why and "1.10x" in why
    state.study.enqueue_trial(slim.to_params(slim.points[slim.by_key[close]]))
    state.ask()
    skipped = next(t for t in state.study.trials if t.user_attrs.get("key") == close)
    assert skipped.user_attrs["status"] == "skipped" and skipped.user_attrs["reason"] == why
    # nothing left to win once the long shots are set aside (the sure fit's look-alike is 1% slower)
    assert in_memory_state(slim).long_shot(close) == ""  # nothing measured yet: no best to weigh it against
