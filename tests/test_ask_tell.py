"""The ask/tell core shared by the local planner and the strategy server (real Optuna study on SQLite)."""

from __future__ import annotations

import json

import optuna
import pytest
from test_planner import BUDGET, GLOBAL_BATCH, Measure, landscape_space, predict

from atorch.strategy_search.ask_tell import SearchState
from atorch.strategy_search.candidates import CandidateTable
from atorch.strategy_search.outcome import Predicted
from atorch.strategy_search.planner import Planner
from atorch.strategy_search.space import SearchSpace


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
