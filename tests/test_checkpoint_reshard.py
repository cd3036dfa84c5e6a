"""Checkpoints under tensor, pipeline and mixed layouts, resharded between layouts.

Two launches (gloo): 4 processes save under tensor 2 × data 2 (with fsdp), pipeline 2 × data 2 (GPT-2 with
its tied weight; Llama with fsdp) and load each checkpoint under other layouts in the same processes; then
1 process saves the same models plainly (the keys every checkpoint must have) and loads the 4-process
checkpoints. See tests/workers/reshard_worker.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from launcher import HERE, run_json
from workers.reshard_worker import LOADS, MODELS, SAVES, SINGLE_LOADS, K

WORKER = HERE / "workers" / "reshard_worker.py"
pytestmark = pytest.mark.distributed
# The losses after loading against those of the uninterrupted run under the saving layout. The weights and
# the optimizer state are bitwise the saved ones (checked below), so only the layouts' fp32 sums differ:
# tensor parallel adds partial products, data parallel the ranks' gradients, a pipeline accumulates over
# micro-batches, each in its own order. Each sum differs by a few ulps (2^-23 ~ 1.2e-7 relative); over a few
# layers and 2 SGD steps that stays well below 1e-6 relative, so (1e-5 rel, 1e-6 abs) leaves margin
# (the bound of tests/test_pipeline_parallel.py, which covers 4 steps).
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
REFUSED = {"refused/gpt2/pp2xdp2 -> tp2xdp2+fsdp": ["transformer.h.0.attn.c_attn.weight [32, 96] there, [96, 32] here",
                                                    "transposed", "module_replace"]}


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_json(WORKER, "multi", str(tmp_path_factory.mktemp("reshard_multi")), nproc=4, timeout=600)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, multi: dict[str, Any]) -> dict[str, Any]:
    multi_root = Path(multi["saves"]["llama/tp2xdp2+fsdp"]["dir"]).parent
    return run_json(WORKER, "single", str(tmp_path_factory.mktemp("reshard_single")), str(multi_root), nproc=1,
                    timeout=300)


def test_every_layout_saves(multi: dict[str, Any]) -> None:
    for name, entry in multi["saves"].items():
        assert "error" not in entry, f"{name}: {entry['error']}"


@pytest.mark.parametrize("launch", ["multi", "single"])
def test_loaded_state_is_bitwise_the_saved_one_and_training_resumes(
    multi: dict[str, Any], single: dict[str, Any], launch: str
) -> None:
    loads = {"multi": LOADS, "single": SINGLE_LOADS}[launch]
    report = {"multi": multi, "single": single}[launch]["loads"]
    for name, (source, _) in loads.items():
        entry = report[name]
        if name in REFUSED:
            continue
        assert "error" not in entry, f"{name}: {entry['error']}"
        assert entry["info"] == {"step": K, "extra": {"scenario": source}}, name
        # Every weight and optimizer state (momentum) a rank holds, as a global tensor, equals the saved one.
        assert entry["differ"] == [] and entry["saved_unequal"] == [], (name, entry)
        assert entry["losses"] == pytest.approx(multi["saves"][source]["losses"], rel=FP32_TOL["rtol"],
                                                abs=FP32_TOL["atol"]), name


def test_a_pipeline_stage_loads_only_its_part(multi: dict[str, Any]) -> None:
    for name in ("llama/tp2xdp2+fsdp -> pp2xdp2", "gpt2/pp2xdp2 -> pp2xdp2[zbv]", "llama/tp2xdp2+fsdp -> tp2xpp2"):
        entry = multi["loads"][name]
        # 2 pipeline ranks × 2 copies (data or tensor ranks of a stage hold the same entries) make up the whole twice.
        assert max(entry["held"]) < entry["saved_keys"] and sum(entry["held"]) == 2 * entry["saved_keys"], entry
    for name in ("llama/tp2xdp2+fsdp -> dp4", "gpt2/pp2xdp2 -> fsdp4"):
        entry = multi["loads"][name]
        assert entry["held"] == [entry["saved_keys"]] * 4, entry


def test_both_copies_of_a_tied_weight_load_on_one_rank(multi: dict[str, Any]) -> None:
    # Under zbv the rank of the first stage also holds the last: GPT-2's wte and lm_head copies, equal.
    entry = multi["loads"]["gpt2/pp2xdp2 -> pp2xdp2[zbv]"]
    assert entry["tied_equal"].count(True) == 2 and None in entry["tied_equal"], entry


def _keys(directory: str) -> dict[str, Any]:
    tensors = json.loads((Path(directory) / "ckpt" / "atorch_checkpoint.json").read_text())["tensors"]
    return {k: v for k, v in tensors.items() if not k.startswith("rng.")}


@pytest.mark.parametrize("source", list(SAVES))
def test_checkpoints_are_layout_independent(multi: dict[str, Any], single: dict[str, Any], source: str) -> None:
    """The same names, shapes and dtypes as a checkpoint of the same model saved in one process: the user's
    names, global tensors, the optimizer state of a tied weight once. (Its values in the user's order, GPT-2's
    fused q|k|v rows under tensor_parallel included: the bitwise comparisons above.)"""
    model = source.split("/")[0]
    replaced = "module_replace" in SAVES[source][1]
    plain = _keys(single["saves"][f"{model}/one process{'+module_replace' if replaced else ''}"]["dir"])
    assert _keys(multi["saves"][source]["dir"]) == plain
    assert "model.lm_head.weight" in plain and len(plain) > 70
    assert ("optim.lm_head.weight.momentum_buffer" in plain) == (model == "llama")  # GPT-2's is tied to wte


@pytest.mark.parametrize("source", list(SAVES))
def test_consolidated_export_holds_the_saved_weights(multi: dict[str, Any], source: str) -> None:
    """export_consolidated under every layout: every weight whole, under the user's names and order, on rank 0."""
    directory = Path(multi["saves"][source]["dir"])
    exported = torch.load(directory / "model.pt", weights_only=True)
    saved: dict[str, torch.Tensor] = {}
    for path in directory.glob("held.*.pt"):
        saved.update({k[len("model."):]: v for k, v in torch.load(path, weights_only=True).items()
                      if k.startswith("model.")})
    assert sorted(exported) == sorted(saved)
    assert [k for k in saved if not torch.equal(exported[k], saved[k])] == []
    model_name, layout = SAVES[source]
    if "module_replace" not in layout:  # the user's own model takes it as it is
        MODELS[model_name].make().load_state_dict(exported, strict=True)


def test_a_checkpoint_with_other_module_replace_is_refused_with_the_reason(multi: dict[str, Any]) -> None:
    for name, phrases in REFUSED.items():
        error = multi["loads"][name]["error"]
        assert "CheckpointError" in error, error
        for phrase in phrases:
            assert phrase in error, (phrase, error)


def test_saving_layouts_trained(multi: dict[str, Any]) -> None:
    """The losses compared above move by more than the tolerance between steps (so the comparison can fail)."""
    for entry in multi["saves"].values():
        first, second = entry["losses"]
        assert abs(first - second) > 100 * FP32_TOL["atol"], entry
    assert torch.isfinite(torch.tensor([e["losses"] for e in multi["saves"].values()])).all()
