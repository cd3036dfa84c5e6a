"""Checkpoints: a sharded save/load under every strategy resumes training with identical losses,
the consolidated export loads into a plain model in this process, and bad input gets a clear error.

Two launches: 2 ranks (all strategies), then 1 rank (world size 1, loading the 2-rank checkpoints
under other strategies, errors, DeepSpeed). See tests/workers/checkpoint_worker.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from launcher import run_json
from toy_models import mlp, tiny_gpt2
from workers.checkpoint_worker import MULTI, RESHARD, RESHARD_SAME, SINGLE, K, probe

WORKER = Path(__file__).resolve().parent / "workers" / "checkpoint_worker.py"
pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_json(WORKER, "multi", str(tmp_path_factory.mktemp("ckpt_multi")), nproc=2, timeout=600)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, multi: dict[str, Any]) -> dict[str, Any]:
    multi_root = Path(multi["ddp"]["dir"]).parent
    return run_json(WORKER, "single", str(tmp_path_factory.mktemp("ckpt_single")), str(multi_root), nproc=1,
                    timeout=600)


def _uses(strategy: list[Any], name: str) -> bool:
    return any(item == name or (isinstance(item, list) and item[0] == name) for item in strategy)


def _check_round_trip(name: str, report: dict[str, Any]) -> None:
    # The first loss after the save reads the restored weights; the second also the optimizer
    # moments, the learning rate from the restored scheduler and (fp16) the grad scaler.
    # Both runs execute the same operations in the same processes, so they agree bit for bit.
    assert report["losses_b"] == report["losses_a"], name
    assert report["max_param_diff"] == 0.0 and report["same_keys"], name
    assert report["info"] == {"step": report["k"], "extra": {"scenario": name, "lr": report["saved"]["lr"]}}
    assert report["loaded"] == report["saved"], name
    if _uses(report["strategy"], "amp_native"):
        assert report["loaded"]["scaler"]["_growth_tracker"] == K  # restored, not a fresh scaler (0)
    if report["k"] == 0:  # nothing stepped: loaded weights and hyper-parameters, untouched Adam state
        assert report["loaded"]["lr"] == pytest.approx(1e-2)


@pytest.mark.parametrize("name", list(MULTI))
def test_round_trip_on_two_ranks_resumes_identically(multi: dict[str, Any], name: str) -> None:
    _check_round_trip(name, multi[name])


def test_losses_depend_on_the_restored_optimizer_state(multi: dict[str, Any]) -> None:
    report = multi["ddp"]
    first, second = report["losses_control"]
    assert first == report["losses_a"][0]  # same weights
    assert abs(second - report["losses_a"][1]) > 1e-4  # Adam moments dropped: the step differs


@pytest.mark.parametrize("name", list(SINGLE))
def test_round_trip_at_world_size_one(single: dict[str, Any], name: str) -> None:
    _check_round_trip(name, single[name])


@pytest.mark.parametrize("source", list(RESHARD))
def test_two_rank_checkpoint_resumes_on_one_rank_under_another_strategy(
    multi: dict[str, Any], single: dict[str, Any], source: str
) -> None:
    report = single["reshard"][source]
    assert report["info"]["step"] == K and report["info"]["extra"]["scenario"] == source
    # Same global batches; 1 rank averages all 8 samples at once, 2 ranks average two means of 4.
    assert report["losses"] == pytest.approx(multi[source]["losses_a"], abs=1e-5, rel=0)


@pytest.mark.parametrize("source", list(RESHARD_SAME))
def test_checkpoint_resumes_under_another_strategy_at_the_same_world_size(multi: dict[str, Any], source: str) -> None:
    report = multi["reshard_same"][source]
    assert report["info"]["step"] == K
    # fp32 data-parallel strategies compute the same sums in the same order: equal to rounding.
    assert report["losses"] == pytest.approx(multi[source]["losses_a"], abs=1e-6, rel=0)


def _export_cases() -> list[tuple[str, str, str]]:
    cases = [("multi", name, kind) for name, (kind, _) in MULTI.items()]
    return cases + [("single", name, kind) for name, (kind, _) in SINGLE.items()] + [("single", "deepspeed", "mlp")]


@pytest.mark.parametrize(("launch", "name", "kind"), _export_cases())
def test_consolidated_export_loads_into_a_plain_model(
    multi: dict[str, Any], single: dict[str, Any], launch: str, name: str, kind: str
) -> None:
    report = (multi if launch == "multi" else single)[name]
    strategy = report["strategy"]
    directory = Path(report["dir"])
    state = torch.load(directory / "model.pt", weights_only=True)
    expected = torch.load(directory / "expected.pt", weights_only=True)["output"]
    assert all(type(v) is torch.Tensor for v in state.values())  # no DTensor, no parameters
    assert not [k for k in state if k.startswith("module.") or "_checkpoint_wrapped_module" in k]

    model = mlp(seed=11) if kind == "mlp" else tiny_gpt2(seed=11)  # other weights until loaded
    half = _uses(strategy, "half")
    if half:
        model.to(torch.bfloat16)
    model.load_state_dict(state, strict=True)
    model.eval()
    data = probe(kind)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16, enabled=_uses(strategy, "amp_native")):
        output = model(data[0].to(torch.bfloat16) if half else data[0]) if kind == "mlp" else model(**data).logits
    assert output.dtype == expected.dtype
    # Same weights and operations; fp32 to 1e-6, 16-bit outputs to their precision.
    tolerance = dict(atol=1e-6, rtol=0.0) if expected.dtype == torch.float32 else dict(atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(output, expected, **tolerance)


ERRORS = {
    "missing": ["no such directory", "save_checkpoint"],
    "empty_dir": ["no atorch_checkpoint.json", "did not finish"],
    "other_model": ["no weights for lm_head.weight", "weights this model lacks: blocks.0.0.bias", "different model"],
    "other_shape": ["blocks.0.0.weight [32, 32] there, [48, 48] here", "another configuration"],
    "other_optimizer": ["momentum_buffer", "saved with AdamW, this run uses SGD"],
    "other_optimizer_zero1": ["from AdamW, this run uses SGD"],
    "extra_not_json": ["extra is not JSON", "object"],
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_gets_a_clear_error(single: dict[str, Any], case: str) -> None:
    error = single["errors"][case]
    assert error["type"] == "CheckpointError", error
    for phrase in ERRORS[case]:
        assert phrase in error["message"], (phrase, error["message"])
    assert "Traceback" not in error["message"] and len(error["message"]) < 1500


def test_deepspeed_save_and_load_refuse_with_directions(single: dict[str, Any]) -> None:
    for what in ("save", "load"):
        error = single["deepspeed"][what]
        assert error["type"] == "CheckpointError"
        assert f"{what}_checkpoint does not support DeepSpeed" in error["message"]
        assert "result.model.save_checkpoint(dir)" in error["message"]
        assert "the default implementation" in error["message"]
