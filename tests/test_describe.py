"""What the search shows is what ran: the one description of a candidate, the trial table, the stop message.

The descriptions are checked on real search spaces (tensor, pipeline and tensor x pipeline layouts at world
size 4); the table is rendered by rich to text and read back; the stop messages come from real searches on
an Optuna study with a synthetic, deterministic cost model and dry-run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import toy_models
from rich.console import Console
from search_doubles import Pred, Run

from atorch.strategy import Strategy
from atorch.strategy_search.search.ask_tell import StopRules
from atorch.strategy_search.search.candidates import CandidateTable
from atorch.strategy_search.search.describe import describe_candidate, describe_record, search_json
from atorch.strategy_search.search.planner import Planner, PlanResult
from atorch.strategy_search.search.progress import SearchProgress, rejudged, trial_table
from atorch.strategy_search.search.space import SearchSpace

MiB = 2**20
WORLD = 4


@pytest.fixture(scope="module")
def gpt2_space() -> SearchSpace:
    return SearchSpace(toy_models.tiny_gpt2(), WORLD, 16, loop="train_step", precision="low")  # every method


def _method_names(description: str) -> list[str]:
    """The method names of a description's middle part (``name`` or ``name(config)``, comma separated)."""
    middle = description.split(" | ")[1]
    return [m.strip() for m in re.sub(r"\([^)]*\)", "", middle).split(",")]


@pytest.mark.parametrize("model", ["tiny_gpt2", "mlp"])
def test_every_description_names_every_method_and_layout_size_of_its_strategy(model, gpt2_space) -> None:
    space = gpt2_space if model == "tiny_gpt2" else SearchSpace(toy_models.mlp(), WORLD, 16, loop="train_step",
                                                                precision="low")
    cands = space.enumerate()
    table = CandidateTable.from_space(space, lambda c: {"error": "not predicted"})
    seen: set[str] = set()
    for cand, details in zip(cands, table.details or [], strict=True):
        text = describe_candidate(cand.strategy, cand.micro_batch_size, cand.micro_batches, WORLD)
        assert details["description"] == text  # what the study stores is the same line
        layout_part, methods_part, batching = text.split(" | ")
        layout = cand.strategy.layout(WORLD)
        assert layout_part == str(layout)
        for dim, size in layout.dims:  # every size, the data size too
            assert f"{dim} {size}" in layout_part, text
        names = [n for n in cand.strategy.names() if n != "parallel_mode"]
        assert sorted(_method_names(text)) == sorted(names or ["ddp"]), text
        for item in cand.strategy.methods:  # the config that changes the numerics or the schedule
            dtype = getattr(item.config, "dtype", None)
            if dtype is not None:
                assert f"{item.name}({dtype}" in methods_part, text
        schedule = cand.strategy.get("pipeline_parallel") or getattr(cand.strategy.get("mixed_parallel"), "pipeline",
                                                                     None)
        if schedule is not None:
            assert schedule.schedule in methods_part, text
            size, count = (int(x) for x in batching.removeprefix("mbs ").split(" × "))
            assert count == schedule.micro_batches and size * count == cand.micro_batch_size, text
        else:
            assert batching == f"mbs {cand.micro_batch_size} × {cand.micro_batches}", text
        seen.update(names)
    # The space really holds what the old names dropped.
    expected = {"pipeline_parallel", "checkpoint", "amp_native", "half", "fsdp", "zero1", "zero2"}
    if model == "tiny_gpt2":
        expected |= {"tensor_parallel", "mixed_parallel", "module_replace"}
    assert expected <= seen


def test_description_examples_and_a_stored_record_without_one() -> None:
    tp = Strategy.load([("parallel_mode", {"dims": [["tensor", 2], ["data", -1]]}), "tensor_parallel",
                        ("amp_native", {"dtype": "bf16"}), "checkpoint"])
    assert describe_candidate(tp, 4, 2, 2) == ("tensor 2 × data 1 | tensor_parallel, amp_native(bf16), checkpoint "
                                               "| mbs 4 × 2")
    fsdp = Strategy.load(["parallel_mode", ("fsdp", {"cpu_offload": True, "reshard_after_forward": False}),
                          ("zero1", {"implementation": "deepspeed"})])
    assert describe_candidate(fsdp, 2, 1, 4) == ("data 4 | fsdp(cpu_offload, no reshard_after_forward), "
                                                 "zero1(deepspeed) | mbs 2 × 1")
    # A trial stored before descriptions were: derived from its strategy (no world size: the data size is *).
    record = {"strategy": Strategy.load(["parallel_mode"]).to_list(), "micro_batch_size": 8, "micro_batches": 1}
    assert describe_record(record) == "data * | ddp | mbs 8 × 1"


def _console() -> Console:
    return Console(record=True, width=110, force_terminal=False, color_system=None)


def _column(text: str, index: int) -> list[str]:
    """The cells of one column of a rendered table, a wrapped cell's lines joined (rows start where the
    first column has a value)."""
    cells: list[str] = []
    for line in text.splitlines():
        parts = line.split("│")
        if len(parts) < index + 3:
            continue
        if parts[1].strip():
            cells.append("")
        if cells:
            cells[-1] = (cells[-1] + " " + parts[index + 1].strip()).strip()
    return cells


def test_table_shows_brackets_as_written_and_the_whole_reason(gpt2_space) -> None:
    cand = next(c for c in gpt2_space.enumerate() if "tensor_parallel" in c.strategy)
    # A config with a list, as a loaded strategy can have: its description holds "[...]".
    with_list = Strategy.load(["parallel_mode", ("checkpoint", {"wrap_class": ["GPT2Block"]})])
    reason = "[rank1] RuntimeError: " + " ".join(f"word{i}" for i in range(40)) + " [/bold]"
    rows = [
        {"number": 0, "candidate": cand.to_json(), "status": "failed",
         "reason": reason, "measured": {"status": "failed", "peak_memory_bytes": 0.0, "samples_per_s": 0.0,
                                        "reason": reason}},
        {"number": 1, "candidate": {"strategy": with_list.to_list(), "micro_batch_size": 2, "micro_batches": 4},
         "status": "predicted_oom", "reason": "predicted peak 30.0 MiB > budget 20.0 MiB"},
    ]
    console = _console()
    console.print(trial_table(rows, "trials [all]", WORLD, 20 * MiB))
    text = console.export_text()
    assert "trials [all]" in text
    candidates, statuses = _column(text, 1), _column(text, 7)
    # Folded at the column's width (mid-word where a word is wider): compare without the spaces added there.
    assert [c.replace(" ", "") for c in candidates] == [
        describe_candidate(cand.strategy, cand.micro_batch_size, cand.micro_batches, WORLD).replace(" ", ""),
        "data4|checkpoint(wrap_class=[GPT2Block])|mbs2×4"]
    assert "tensor_parallel" in candidates[0] and "module_replace" in candidates[0]
    # The whole reason, "[...]" included (read as text, not as rich markup): wrapped, never cut.
    assert statuses == [f"failed: {reason}", "predicted_oom: predicted peak 30.0 MiB > budget 20.0 MiB"]


def test_summary_judges_measured_trials_again_under_the_current_limit(atorch_log) -> None:
    ok_then = {"number": 3, "status": "ok", "reason": "",
               "candidate": {"description": "data 4 | zero2(deepspeed) | mbs 2 × 1"},
               "predicted": {"peak_memory_bytes": 25.0 * MiB, "samples_per_s": 50.0},
               "measured": {"status": "ok", "peak_memory_bytes": 30.0 * MiB, "samples_per_s": 40.0, "reason": ""}}
    oom_then = {**ok_then, "number": 4, "status": "oom", "reason": "measured peak 30.0 MiB > budget 10.0 MiB",
                "measured": {**ok_then["measured"], "peak_memory_bytes": 15.0 * MiB}}
    # A limit added later (20 MiB): the first is over it now; the second, told under 10 MiB, fits.
    assert rejudged(ok_then, 20 * MiB)["status"] == "oom"
    assert "measured peak 30.0 MiB > budget 20.0 MiB" in rejudged(ok_then, 20 * MiB)["reason"]
    assert rejudged(oom_then, 20 * MiB)["status"] == "ok" and rejudged(oom_then, 20 * MiB)["reason"] == ""
    console = _console()
    progress = SearchProgress(20 * MiB, console=console, world_size=WORLD)
    pick = SearchSpace(toy_models.mlp(), WORLD, 16).enumerate()[0]
    progress.summary(PlanResult(pick, 40.0, "search", "study-x", 2, "2 dry-runs; exploration stopped: x",
                                [ok_then, oom_then]))
    text = console.export_text()
    row3 = next(line for line in text.splitlines() if line.startswith("│ 3 "))
    row4 = next(line for line in text.splitlines() if line.startswith("│ 4 "))
    assert "oom: measured peak 30.0 MiB > budget" in row3 and "│ ok" in row4
    # the pick is logged once, by the search that called the summary (its stop reason too), not again here
    assert "picked" not in atorch_log.text and progress.describe(pick).startswith("data 4 | ddp | mbs ")


def test_search_json_carries_the_pick_and_every_trial_described() -> None:
    @dataclass
    class Outcome:
        strategy: Strategy
        micro_batch_size: int = 2
        micro_batches: int = 2
        trials: tuple = ({"number": 0, "status": "ok", "candidate": {"description": "data 2 | zero1 | mbs 2 × 2"}},
                         {"number": 1, "status": "duplicate", "candidate": {}})

        def to_json(self) -> dict:
            return {"source": "search"}

    out = search_json(Outcome(Strategy.load(["parallel_mode", "zero1"])), 2)
    assert out["source"] == "search" and out["description"] == "data 2 | zero1 | mbs 2 × 2"
    assert [t["description"] for t in out["trials"]] == ["data 2 | zero1 | mbs 2 × 2"]  # duplicates left out


# ----- the stop message ------------------------------------------------------------------------------------
def _search(tmp_path, runner_up: float, confirm_within: float | None,
            nothing_left: bool = False, unpredictable: bool = False,
            second_predicted: float = 190.0) -> tuple[PlanResult, list]:
    """A search whose cost model ranks two candidates first; the first measures 100 samples/s, the second
    ``runner_up``, everything else 10 (``nothing_left``: the rule that stops exploring once nothing left can win,
    off so the other rules are seen). ``second_predicted`` above 200: the cost model ranks the second first."""
    space = SearchSpace(toy_models.mlp(), 2, 8, excluded=["tensor_parallel", "pipeline_parallel"])
    cands = space.enumerate()
    first, second = cands[0].key, cands[1].key
    speed = {first: 100.0, second: runner_up}

    def predict(cand) -> Pred:
        # the rest within skip_slower_than of the best also once corrected by the first two runs (x0.4-0.5)
        if unpredictable and cand.key == cands[-1].key:  # a cost model gap: that candidate is measured, it may win
            raise ValueError("no figure for this one")
        return Pred(MiB, 8 / {first: 200.0, second: second_predicted}.get(cand.key, 120.0))

    calls: list = []

    def measure(cand) -> Run:
        calls.append(cand)
        return Run("ok", speed.get(cand.key, 10.0), MiB)

    result = Planner(space, storage=f"sqlite:///{tmp_path / 's.db'}",
                     study_key=f"k{runner_up}{confirm_within}{second_predicted}",
                     predict=predict, measure=measure, memory_budget=100 * MiB, max_trials=8, top_k=2,
                     confirm_within=confirm_within, stop_when_nothing_left=nothing_left).search()
    return result, calls


def test_stop_message_with_a_confirmation(tmp_path) -> None:
    result, calls = _search(tmp_path, runner_up=95.0, confirm_within=0.1)
    # 5% apart, without step times to show the noise: undecided, but exploration used max_trials but the two runs
    # kept for the first round, so no further round runs (the budget of dry-runs holds)
    assert len(calls) == 8 == result.dry_runs
    assert result.stop_reason == ("8 dry-runs; exploration stopped: its 6 dry-runs done (max_trials 8, 2 of them "
                                  "kept for a confirmation); confirmation: the best and the runner-up re-measured "
                                  "interleaved, 1 round (2 dry-runs); tie within noise over 1 round: the simpler "
                                  "strategy wins")


def test_stop_message_without_a_confirmation(tmp_path) -> None:
    result, calls = _search(tmp_path, runner_up=50.0, confirm_within=0.1)
    assert len(calls) == 6 == result.dry_runs
    assert result.stop_reason == ("6 dry-runs; exploration stopped: its 6 dry-runs done (max_trials 8, 2 of them "
                                  "kept for a confirmation); no confirmation: the runner-up was not within 10% of "
                                  "the best (20% for a runner-up that the cost model ranked first)")
    off, calls = _search(tmp_path, runner_up=95.0, confirm_within=None)
    assert len(calls) == 8 and off.stop_reason == ("8 dry-runs; exploration stopped: max_trials 8 reached; "
                                                   "no confirmation (off)")


def test_a_runner_up_the_cost_model_ranked_first_is_confirmed_in_a_wider_band(tmp_path) -> None:
    """Measured 15% behind the best, outside confirm_within (10%): re-measured only where the cost model had ranked
    it first (the measurements contradict the model: twice the band, 20%); 25% behind is not, either way."""
    agreed, calls = _search(tmp_path, runner_up=85.0, confirm_within=0.1)
    assert len(calls) == 6 and "no confirmation: the runner-up was not within 10%" in agreed.stop_reason
    disputed, calls = _search(tmp_path, runner_up=85.0, confirm_within=0.1, second_predicted=210.0)
    assert len(calls) == 8
    assert "confirmation: the best and the runner-up re-measured interleaved" in disputed.stop_reason
    far, calls = _search(tmp_path, runner_up=75.0, confirm_within=0.1, second_predicted=210.0)
    assert len(calls) == 6 and "no confirmation" in far.stop_reason


def test_stop_message_when_nothing_left_can_win(tmp_path) -> None:
    """The rest measure at a tenth of the best, so once corrected by those runs every unmeasured candidate is predicted
    far slower: exploration stops after NOTHING_LEFT_AFTER dry-runs, and says so."""
    from atorch.strategy_search.search.ask_tell import NOTHING_LEFT_AFTER

    result, calls = _search(tmp_path, runner_up=50.0, confirm_within=0.1, nothing_left=True)
    assert len(calls) == NOTHING_LEFT_AFTER == result.dry_runs
    assert result.stop_reason.startswith(f"{NOTHING_LEFT_AFTER} dry-runs; exploration stopped: nothing left can win: "
                                         "every candidate not yet measured that is predicted to fit (")
    assert "more than 50% slower than the best measured one once corrected by the measurements" in result.stop_reason
    # a candidate the cost model could not predict can always win: exploration goes on to max_trials
    result, calls = _search(tmp_path, runner_up=49.0, confirm_within=0.1, nothing_left=True, unpredictable=True)
    assert "nothing left can win" not in result.stop_reason and len(calls) > NOTHING_LEFT_AFTER


def test_stop_rules_name_the_rule() -> None:
    now = [0.0]
    rules = StopRules(None, 8, 2, clock=lambda: now[0])
    rules.record(True)
    rules.record(False)
    assert rules.reason() == ""
    rules.record(False)
    assert rules.reason() == "patience 2 reached: no improvement in the last 2 dry-runs"
    assert rules.ended(rules.reason()) == "3 dry-runs; exploration stopped: patience 2 reached: no improvement in " \
                                          "the last 2 dry-runs"
    timed = StopRules(5.0, 8, None, clock=lambda: now[0])
    now[0] = 6.0
    assert timed.reason() == "time_limit 5 s reached (6.0 s)"
    timed.record(True)
    # it counts what ran, and says the dry-run budget was not reached
    assert timed.ended(timed.reason(), "no confirmation (off)") == ("1 dry-run; max_trials 8 not reached: time_limit "
                                                                     "5 s reached (6.0 s); no confirmation (off)")
    # a dry-run that the time left cannot hold (the median of those that ran) is not started
    early = StopRules(10.0, 8, None, clock=lambda: now[0])
    now[0] = 14.0
    early.timed(3.0)
    early.record(True)
    assert early.reason() == "time_limit 10 s: 2.0 s left, a dry-run takes 3.0 s (the median of the 1 that ran)"
