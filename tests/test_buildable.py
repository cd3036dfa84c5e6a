"""The build check before the search (atorch.strategy_search.search.buildable): one build per method family on fake
tensors; a family that does not build leaves the search (never seeded or dry-run) and the report names it."""

from __future__ import annotations

from pathlib import Path

import optuna
import torch
import toy_models
from search_doubles import Pred, Run

from atorch.model_context import UserSetup
from atorch.strategy_search.search.buildable import check_families
from atorch.strategy_search.search.planner import Planner
from atorch.strategy_search.search.report import write_report
from atorch.strategy_search.search.space import Candidate, SearchSpace

MiB = 2**20
WORLD, BATCH = 2, 8


def conv_setup() -> tuple[UserSetup, tuple[torch.Tensor, torch.Tensor]]:
    model = toy_models.ConvClassifier()
    setup = UserSetup(model=model, optim_func=torch.optim.SGD, optim_args={"lr": 0.1},
                      loss_func=lambda data, out: torch.nn.functional.cross_entropy(out, data[1]),
                      model_input_format="unpack_sequence", dataloader_args={"batch_size": BATCH})
    return setup, (torch.randn(BATCH // WORLD, 3, 8, 8), torch.zeros(BATCH // WORLD, dtype=torch.long))


def test_a_family_that_does_not_build_is_never_dry_run_and_the_report_says_why(tmp_path: Path) -> None:
    setup, batch = conv_setup()
    space = SearchSpace(setup.model, WORLD, BATCH)
    tensor = [c for c in space.enumerate() if dict(c.point).get("tensor", 1) > 1]
    assert tensor, "the space varies tensor parallel on this model (a plan derives from its linear pair)"

    checked = check_families(setup, batch, WORLD, torch.device("cpu"), space.enumerate())
    ((method, layout), why), = checked.unbuildable.items()
    assert method == "tensor_parallel" and '"tensor": 2' in layout
    assert why == "TypeError: a convolutional classifier has no token embedding"
    # one build per method of each layout, the simplest candidates first: a handful, not the space's 72
    assert 1 < checked.builds <= 10 and checked.seconds < 60, checked

    calls: list[Candidate] = []

    def predict(cand: Candidate) -> Pred:  # the cost model likes tensor parallel best
        return Pred(100 * MiB, 0.1 if dict(cand.point).get("tensor", 1) > 1 else 1.0)

    def measure(cand: Candidate) -> Run:
        calls.append(cand)
        return Run("ok", 10.0, 100 * MiB)

    storage = f"sqlite:///{tmp_path}/s.db"
    result = Planner(space, storage=storage, study_key="atorch-search-conv", predict=predict, measure=measure,
                     memory_budget=1000 * MiB, max_trials=6, top_k=3, prepare=lambda cands: check_families(
                         setup, batch, WORLD, torch.device("cpu"), cands).unbuildable).search()
    assert calls and result.candidate is not None
    assert not [c for c in calls if dict(c.point).get("tensor", 1) > 1], "a ruled-out family was dry-run"
    study = optuna.load_study(study_name="atorch-search-conv", storage=storage)
    skipped = [t.user_attrs for t in study.trials if t.user_attrs.get("status") == "skipped"]
    assert all("no token embedding" in a["reason"] for a in skipped if '"tensor": 2' in a["key"])
    assert study.user_attrs["unbuildable"] == [{"method": "tensor_parallel", "layout": layout, "reason": why}]

    page = write_report(storage, tmp_path / "report.html").read_text()
    assert "Ruled out before the search" in page and "no token embedding" in page and "tensor_parallel" in page
