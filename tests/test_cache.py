"""The search's cache is exact: a study is named by everything that changes the answer but the memory budget;
stored measurements are judged again under each call's budget; a search that did not finish is resumed, never
served; ``atorch cache list / clear``.

The planner runs on a real Optuna study (SQLite in tmp_path) with test_planner's synthetic landscape (its
documented predict/measure interface); the end-to-end test runs auto_accelerate in this process (one rank).
"""

from __future__ import annotations

import json
import logging

import optuna
import pytest
import torch
from search_doubles import Run
from test_planner import BUDGET, GLOBAL_BATCH, Measure, exhaustive_best, landscape_space, predict, true_speed
from torch import nn
from torch.utils.data import TensorDataset
from toy_models import mlp

import atorch
from atorch import cli
from atorch.errors import RankLost
from atorch.prebuilt_optimizer import factory_from_optimizer
from atorch.strategy_search.search.ask_tell import SearchRecord
from atorch.strategy_search.search.planner import Planner, StudyIdentity, study_key
from atorch.strategy_search.search.space import SearchSpace

GiB = 2**30


@pytest.fixture(scope="module")
def space() -> SearchSpace:
    return landscape_space()


def planner(space: SearchSpace, tmp_path, measure: Measure, **kw) -> Planner:
    args = {"memory_budget": BUDGET, "max_trials": 6, "study_key": "k", **kw}
    return Planner(space, storage=f"sqlite:///{tmp_path / 'cache.db'}", predict=predict, measure=measure, **args)


def record(p: Planner) -> SearchRecord:
    return SearchRecord.stored(p.study())[-1]


def test_a_larger_budget_is_not_answered_with_the_constrained_pick(space, tmp_path, atorch_log) -> None:
    """After a search under a tight budget, a call with room to spare re-selects among the stored measurements
    and measures what the tight budget ruled out; it never returns the constrained pick."""
    atorch_log.set_level(logging.INFO, logger="atorch")
    tight = planner(space, tmp_path, Measure()).search()
    assert tight.source == "search" and record(planner(space, tmp_path, Measure())).finished
    # A little more room: the tight search's best still fits, but candidates it ruled out (predicted over its
    # budget, never measured) might fit too: not served.
    assert planner(space, tmp_path, Measure(), memory_budget=BUDGET + 200 * 2**20).cached() is None
    roomy_measure = Measure()
    roomy = planner(space, tmp_path, roomy_measure, memory_budget=100 * GiB).search()
    assert roomy.source == "search" and roomy.dry_runs > 0
    assert roomy.candidate != tight.candidate and roomy.samples_per_s > tight.samples_per_s
    assert not {c.key for c in roomy_measure.calls} & {t["key"] for t in tight.trials if "measured" in t}
    assert "resuming study k, reusing its" in atorch_log.text and "ruled out" in atorch_log.text
    roomy_peak = next(t["measured"]["peak_memory_bytes"] for t in roomy.trials
                      if t.get("key") == roomy.candidate.key and "measured" in t)
    # Both budgets are now answered from the study with no dry-run, each re-selected under its own budget.
    again = Measure()
    for budget, expected in ((BUDGET, tight), (100 * GiB, roomy)):
        hit = planner(space, tmp_path, again, memory_budget=budget).search()
        assert hit.source == "cache" and hit.candidate == expected.candidate and again.calls == []
        assert hit.stop_reason.startswith("reused: finished search")
        assert "re-selected under this limit" in hit.stop_reason
    assert "from study k: cache" in atorch_log.text
    # Between the two, the roomy search answers: its best fits, and that search ruled nothing out.
    assert planner(space, tmp_path, again, memory_budget=roomy_peak).search().candidate == roomy.candidate


def test_a_time_limited_search_is_stored_unfinished_and_resumed(space, tmp_path) -> None:
    now = [0.0]

    class Slow(Measure):
        def __call__(self, cand):
            now[0] += 1.0
            return super().__call__(cand)

    first = Slow()
    cut = planner(space, tmp_path, first, time_limit_s=2.0, clock=lambda: now[0]).search()
    assert "time_limit" in cut.stop_reason and len(first.calls) == 2
    stored = record(planner(space, tmp_path, Measure()))
    assert not stored.finished and stored.stop == "time_limit"
    rest = Measure()
    resumed = planner(space, tmp_path, rest)
    assert resumed.cached() is None
    result = resumed.search()
    assert result.source == "search" and rest.calls
    assert not {c.key for c in rest.calls} & {c.key for c in first.calls}  # nothing measured twice
    assert record(resumed).finished and record(resumed).stop == "max_trials"
    assert planner(space, tmp_path, Measure()).search().source == "cache"


def test_an_interrupted_or_failing_search_is_resumed(space, tmp_path) -> None:
    class Interrupted(Measure):
        def __call__(self, cand):
            if len(self.calls) == 1:
                raise KeyboardInterrupt
            return super().__call__(cand)

    first = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        planner(space, tmp_path, first).search()
    stored = record(planner(space, tmp_path, Measure()))
    assert not stored.finished and stored.stop == "interrupted"
    rest = Measure()
    assert planner(space, tmp_path, rest).search().source == "search"
    assert first.calls[0].key not in {c.key for c in rest.calls}
    # An error in the search itself (here: the caller's on_trial hook) is stored as such, then raised.
    def broken(record):
        raise RuntimeError("hook failed")

    with pytest.raises(RuntimeError, match="hook failed"):
        planner(space, tmp_path, Measure(), study_key="error", on_trial=broken).search()
    stored = record(planner(space, tmp_path, Measure(), study_key="error"))
    assert not stored.finished and stored.stop == "error" and "hook failed" in stored.stop_reason
    # A search killed outright (no exception handler ran) leaves the record it wrote when it started.
    p = planner(space, tmp_path, Measure(), study_key="killed")
    SearchRecord(finished=False, stop="running", memory_budget=BUDGET).store(p.study())
    assert p.cached() is None and p.search().source == "search" and record(p).finished


def test_a_lost_rank_stops_the_search_unfinished_with_nothing_recorded_that_did_not_run(space, tmp_path) -> None:
    """The automatic search's ``check`` raises RankLost (a rank never came back from the trial that timed out):
    the search stops before it asks again, is stored unfinished ("rank_lost"), keeps the timed-out trial as
    "timeout" and records no candidate that did not run. A RankLost from ``measure`` itself (before its candidate
    ran) marks that trial "not_run" (FAILED: asked again later), never "failed". The next search resumes both."""
    class TimesOut(Measure):
        def __call__(self, cand):
            if len(self.calls) == 1:
                self.calls.append(cand)
                return Run("timeout", 0.0, 0.0, "rank 1: not done within 4 s (warm-up step 0)")
            return super().__call__(cand)

    first = TimesOut()

    def check() -> None:
        if len(first.calls) == 2:
            raise RankLost("rank(s) 1 did not come back within 3 s after candidate 1", [1])

    with pytest.raises(RankLost):
        planner(space, tmp_path, first, check=check).search()
    stored = record(planner(space, tmp_path, Measure()))
    assert not stored.finished and stored.stop == "rank_lost" and "did not come back" in stored.stop_reason
    trials = planner(space, tmp_path, Measure()).study().get_trials()
    # told, or still only enqueued (the cost model's favourites that did not run): nothing running or failed
    assert {t.state for t in trials} <= {optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.WAITING}
    measured = {t.user_attrs["key"]: t.user_attrs["status"] for t in trials if "measured" in t.user_attrs}
    assert measured == {first.calls[0].key: "ok", first.calls[1].key: "timeout"}, measured
    rest = Measure()
    assert planner(space, tmp_path, rest).search().source == "search" and rest.calls
    assert not {c.key for c in rest.calls} & {c.key for c in first.calls}  # the timeout is kept, not run again

    class LostBeforeRunning(Measure):
        def __call__(self, cand):
            if len(self.calls) == 1:
                raise RankLost("rank(s) 1 did not come back within 3 s (before candidate 1)", [1])
            return super().__call__(cand)

    second = LostBeforeRunning()
    with pytest.raises(RankLost):
        planner(space, tmp_path, second, study_key="measure").search()
    trials = planner(space, tmp_path, Measure(), study_key="measure").study().get_trials()
    statuses = [(t.state, t.user_attrs.get("status")) for t in trials if t.state != optuna.trial.TrialState.WAITING]
    assert (optuna.trial.TrialState.FAIL, "not_run") in statuses and "failed" not in {s for _, s in statuses}
    (never,) = [t for t in trials if t.user_attrs.get("status") == "not_run"]
    assert "not run: the search stopped first" in never.user_attrs["reason"]
    assert record(planner(space, tmp_path, Measure(), study_key="measure")).stop == "rank_lost"
    again = Measure()
    assert planner(space, tmp_path, again, study_key="measure").search().source == "search"
    assert never.user_attrs["key"] in {c.key for c in again.calls}  # it never ran: it can be asked for again


def test_patience_with_untried_favourites_is_not_final_and_max_trials_is(space, tmp_path) -> None:
    class FirstBest(Measure):  # the first dry-run is the best: patience stops at the second
        def __call__(self, cand):
            run = super().__call__(cand)
            run.samples_per_s = 1000.0 if len(self.calls) == 1 else 1.0
            return run

    p = planner(space, tmp_path, FirstBest(), patience=1, top_k=3)
    assert "patience" in p.search().stop_reason
    assert record(p).stop == "patience" and not record(p).finished  # cost-model favourites were left untried
    assert p.cached() is None

    # Stopping at max_trials finishes a search, whatever a later call's max_trials (strategy="atorch" takes the
    # pick of a search made with other options); force=True searches more, reusing what was measured.
    one = planner(space, tmp_path, Measure(), study_key="one", max_trials=1)
    first = one.search()
    assert first.dry_runs == 1 and record(one).finished
    assert planner(space, tmp_path, Measure(), study_key="one", max_trials=4).search().source == "cache"
    more = Measure()
    forced = planner(space, tmp_path, more, study_key="one", max_trials=4).search(force=True)
    assert forced.source == "search" and more.calls and first.candidate.key not in {c.key for c in more.calls}


def test_sample_shapes_optimizer_args_groups_and_loss_name_different_studies(tmp_path, atorch_log) -> None:
    """auto_accelerate in this process: a change of sample shape or optimizer arguments is a new study; the
    same job again is served from its study, and the log says which and why."""
    atorch_log.set_level(logging.INFO, logger="atorch")
    storage = f"sqlite:///{tmp_path / 'auto.db'}"

    def run(seq: int, lr: float, loss=None, decay: float | None = None) -> dict:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32, seq, 16, generator=g), torch.randint(0, 8, (32, seq), generator=g))
        model = mlp()
        optimizer = {"optim_func": torch.optim.SGD, "optim_args": {"lr": lr}}
        if decay is not None:  # a prebuilt optimizer with two parameter groups
            biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
            weights = [p for n, p in model.named_parameters() if not n.endswith("bias")]
            prebuilt = torch.optim.SGD([{"params": weights, "weight_decay": decay}, {"params": biases}], lr=lr)
            optimizer = factory_from_optimizer(prebuilt, model).as_kwargs()
        _, result, _ = atorch.auto_accelerate(
            model, dataset=data, loss_func=loss or seq_loss, model_input_format="unpack_sequence",
            dataloader_args={"batch_size": GLOBAL_BATCH}, **optimizer,
            search={"storage": storage, "max_trials": 1, "warmup_steps": 0, "measure_steps": 1, "min_measure_s": 0,
                    "confirm_within": 0})
        result.close()
        return result.args.search

    base = run(4, 0.1)
    assert base["source"] == "search"
    longer, slower, other_loss = run(16, 0.1), run(4, 0.01), run(4, 0.1, other_seq_loss)
    decayed, other_decay = run(4, 0.1, decay=0.1), run(4, 0.1, decay=0.01)  # groups inside a closure
    runs = [base, longer, slower, other_loss, decayed, other_decay]
    assert len({r["study_name"] for r in runs}) == len(runs) and {r["source"] for r in runs} == {"search"}
    atorch_log.clear()
    again = run(4, 0.1)
    assert again["source"] == "cache" and again["study_name"] == base["study_name"] and again["dry_runs"] == 0
    # said once: where the study answered, with why; the pick's line names the study, not the reason again
    assert atorch_log.text.count("reused: finished search") == 1
    assert f"from study {base['study_name']}: cache" in atorch_log.text
    assert f"(cache, study {base['study_name']})" in atorch_log.text

    # What a study is for is stored with it, and the CLI shows it.
    identity = optuna.load_study(study_name=base["study_name"], storage=storage).user_attrs["identity"]
    assert study_key(StudyIdentity.model_validate(identity)) == base["study_name"]
    assert identity["sample"] == [{"tensor": [GLOBAL_BATCH, 4, 16], "dtype": "torch.float32"},
                                  {"tensor": [GLOBAL_BATCH, 4], "dtype": "torch.int64"}]
    assert identity["optimizer"]["args"] == {"lr": 0.1} and identity["loss"].endswith("seq_loss")


def seq_loss(data, output):
    return nn.functional.cross_entropy(output.reshape(-1, 8).float(), data[1].reshape(-1))


def other_seq_loss(data, output):
    return 2 * seq_loss(data, output)


def test_cache_list_and_clear_on_the_default_storage(space, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("ATORCH_CACHE_DIR", str(tmp_path))
    identity = StudyIdentity.of(space, model=mlp(), hardware="cpu-test")
    done = Planner(space, predict=predict, measure=Measure(), memory_budget=BUDGET, max_trials=2,
                   identity=identity).search()
    now = [0.0]
    Planner(space, predict=predict, measure=Measure(), memory_budget=BUDGET, study_key="cut", time_limit_s=0.5,
            clock=lambda: now.__setitem__(0, now[0] + 1.0) or now[0]).search()

    capsys.readouterr()  # the search's log
    assert cli.main(["cache", "list", "--json"]) == 0
    rows = {r["study"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {done.study_name, "cut"}
    mine = rows[done.study_name]
    assert mine["world_size"] == 2 and mine["global_batch"] == GLOBAL_BATCH and mine["measured"] == 2
    assert mine["finished"] == [BUDGET] and mine["fingerprint"] == identity.model[:12] and mine["model"].endswith("MLP")
    assert mine["best"] and mine["best_samples_per_s"] == pytest.approx(done.samples_per_s)
    assert rows["cut"]["finished"] == [] and rows["cut"]["last_stop"].startswith("time_limit")

    assert cli.main(["cache", "list"]) == 0
    table = capsys.readouterr().out
    assert done.study_name in table and "cut" in table and "time_limit" in table

    assert cli.main(["cache", "clear", "nope"]) == 1 and "no study 'nope'" in capsys.readouterr().err
    assert cli.main(["cache", "clear", "cut"]) == 0
    assert "deleted 1 study" in capsys.readouterr().out
    assert cli.main(["cache", "list", "--json", "--storage", f"sqlite:///{tmp_path / 'search.db'}"]) == 0
    assert [r["study"] for r in json.loads(capsys.readouterr().out)] == [done.study_name]
    assert cli.main(["cache", "clear"]) == 0 and cli.main(["cache", "list"]) == 0
    assert "no studies" in capsys.readouterr().out


def test_the_search_finds_the_unconstrained_best_after_a_constrained_one(space, tmp_path) -> None:
    """The resumed search under a larger budget explores as a fresh one would: with the landscape's trial
    budget it reaches the exhaustive best of that budget."""
    planner(space, tmp_path, Measure()).search()
    budget = 2 * BUDGET
    truth, truth_sps = exhaustive_best(space, budget)
    result = planner(space, tmp_path, Measure(), memory_budget=budget, max_trials=8).search()
    assert result.samples_per_s >= 0.95 * truth_sps and true_speed(dict(result.candidate.point)) >= 0.95 * truth_sps


def test_fingerprint_covers_module_settings_and_the_transformers_config() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from atorch.strategy_search.costing.analyser import fingerprint

    def llama(**kw) -> nn.Module:
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=2, vocab_size=64, **kw))

    base = fingerprint(llama())
    assert fingerprint(llama()) == base  # another instance of one config
    assert fingerprint(llama(attn_implementation="eager")) != base  # to_dict() leaves this out
    assert fingerprint(llama(use_cache=False)) != base
    assert fingerprint(llama(rms_norm_eps=1e-5)) != base
    # Settings that no parameter shows: a dropout's p.
    assert fingerprint(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))) != fingerprint(
        nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2)))
