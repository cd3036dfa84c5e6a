"""ATorchStrategy: atorch's engine as a Lightning strategy.

One launch of 2 real gloo processes fits the same LightningModule with Lightning's own "ddp" and with
ATorchStrategy (given strategies, the automatic search, accumulation, clipping, a checkpoint resume,
evaluation, bf16); see tests/workers/lightning_worker.py. The rest runs in this process: registration
in both Lightning namespaces, precision flags, options, and the JSON form of Lightning's metadata.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from launcher import run_json

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402

import atorch.lightning as atorch_lightning  # noqa: E402
from atorch.errors import SetupError, StrategyError  # noqa: E402
from atorch.lightning import ATorchStrategy, engine, state  # noqa: E402

WORKER = Path(__file__).resolve().parent / "workers" / "lightning_worker.py"
LR, GAMMA = 0.1, 0.8

# Tolerance: the runs feed the same samples to the same forward on each rank; they differ only in how
# gradients are averaged (DDP's bucketed all-reduce then /2, FSDP2's reduce-scatter, ZeRO's broadcast of
# updated shards) and how a clip norm is summed: a few fp32 ulps (2^-23 ~ 1.2e-7 relative) per gradient
# element per step. Through 5 linear layers of width <= 32 (a dot product adds <= 32 eps relative) and
# 6-8 SGD steps with lr 0.1 that stays well under 1e-5 relative; a wrong reduction (a missing average,
# a skipped sync, a double step) changes the loss in the first digits.
RTOL, ATOL = 1e-5, 1e-6
STRATEGIES = ("fsdp", "parallel_mode", "zero1", "zero2_checkpoint")
ACCUMULATING = ("fsdp", "parallel_mode")  # FSDP2's and DDP's no-sync paths


# One launch runs every scenario (17, two of them automatic searches): about 25 s alone on 2 cores.
@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_json(WORKER, str(tmp_path_factory.mktemp("lightning")), nproc=2, timeout=300)


def _entry(report: dict[str, Any], name: str) -> dict[str, Any]:
    entry = report[name]
    assert "error" not in entry, f"{name}: {entry.get('error')}"
    return entry


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=RTOL, abs_tol=ATOL) for x, y in zip(a, b, strict=True))


# ----- 2 processes ------------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.parametrize("name", STRATEGIES)
def test_losses_match_lightning_ddp(report: dict[str, Any], name: str) -> None:
    ddp, ours = _entry(report, "ddp"), _entry(report, name)
    assert ours["strategy"] is not None and name.startswith(ours["strategy"][0][0])
    assert _close(ours["losses"], ddp["losses"]), (ours["losses"], ddp["losses"])
    assert ours["global_step"] == ddp["global_step"] == 6
    # the StepLR (per epoch) from configure_optimizers drives the rebuilt optimizer
    assert ours["lr"] == ddp["lr"] == pytest.approx(LR * GAMMA**3)
    assert ours["optimizer"] in ("SGD", "ZeroRedundancyOptimizer")  # rebuilt from configure_optimizers' SGD
    assert ours["configured"] == 1


@pytest.mark.distributed
@pytest.mark.parametrize("name", ACCUMULATING)
def test_accumulation_matches_lightning_ddp(report: dict[str, Any], name: str) -> None:
    ddp, ours = _entry(report, "ddp_accum"), _entry(report, f"{name}_accum")
    assert _close(ours["losses"], ddp["losses"]), (ours["losses"], ddp["losses"])
    assert ours["global_step"] == ddp["global_step"] == 4 and len(ours["losses"]) == 8  # 2 passes per step
    assert ours["lr"] == ddp["lr"]
    # the gradient reduction is skipped in the first pass of each step and done in the second
    assert ours["syncs"] == [False, True] * 4 and ddp["syncs"] == [False, True] * 4


@pytest.mark.distributed
def test_clipping_through_atorch_matches_lightning_ddp(report: dict[str, Any]) -> None:
    ddp, ours, unclipped = _entry(report, "ddp_clip"), _entry(report, "fsdp_clip"), _entry(report, "fsdp")
    assert _close(ours["losses"], ddp["losses"]), (ours["losses"], ddp["losses"])
    assert not _close(ours["losses"], unclipped["losses"])  # the clip binds


@pytest.mark.distributed
def test_automatic_search_fits_like_ddp(report: dict[str, Any]) -> None:
    ddp, ours = _entry(report, "ddp"), _entry(report, "search")
    assert ours["strategy"], "no strategy in effect"
    assert not {m for m, _ in ours["strategy"]} & set(engine.precision_methods())  # precision is the Trainer's flag
    assert _close(ours["losses"], ddp["losses"]), (ours["losses"], ddp["losses"])


@pytest.mark.distributed
def test_strategy_by_name_takes_the_cached_search(report: dict[str, Any]) -> None:
    searched, by_name, ddp = _entry(report, "search"), _entry(report, "by_name"), _entry(report, "ddp")
    assert searched["search_source"] == "search" and by_name["search_source"] == "cache"
    assert by_name["strategy"] == searched["strategy"] and _close(by_name["losses"], ddp["losses"])


@pytest.mark.distributed
def test_manual_optimisation_matches_lightning_ddp(report: dict[str, Any]) -> None:
    # the manual loop does what Lightning's automatic one does (zero_grad, backward, step; schedule per epoch)
    ddp, ours = _entry(report, "ddp"), _entry(report, "parallel_mode_manual")
    assert _close(ours["losses"], ddp["losses"]) and len(ours["losses"]) == 6, (ours["losses"], ddp["losses"])
    assert ours["lr"] == ddp["lr"] == pytest.approx(LR * GAMMA**3)


@pytest.mark.distributed
def test_tensor_parallel_samples_by_data_rank(report: dict[str, Any]) -> None:
    result = _entry(report, "tensor_parallel")
    assert [m for m, _ in result["strategy"]] == ["parallel_mode", "tensor_parallel"]
    assert result["sampler"] == {"num_replicas": 1, "rank": 0}  # one data-parallel rank, not the 2 processes
    rank0, rank1 = result["per_rank"]
    assert len(rank0) == 4 and rank0 == rank1  # all 16 samples on each rank; one tensor-parallel model


@pytest.mark.distributed
def test_checkpoint_resumes_to_identical_losses(report: dict[str, Any]) -> None:
    # The resumed run executes the same operations in the same processes as the uninterrupted one from the
    # restored weights, momentum and schedule, so its losses agree bit for bit.
    resumed, uninterrupted = _entry(report, "resume"), _entry(report, "fsdp")
    assert resumed["saved_epoch"] == 2 and resumed["saved_step"] == 4 and resumed["global_step"] == 6
    assert resumed["losses"] == uninterrupted["losses"][4:]
    assert resumed["lr"] == uninterrupted["lr"] == pytest.approx(LR * GAMMA**3)  # the schedule, restored from JSON
    files = set(resumed["files"])
    assert {"lightning.json", "atorch_checkpoint.json", ".metadata"} <= files
    assert {f for f in files if f.endswith(".distcp")} == {"__0_0.distcp", "__1_0.distcp"}  # sharded: one per rank


@pytest.mark.distributed
def test_validate_test_predict(report: dict[str, Any]) -> None:
    result = _entry(report, "evaluate")
    for key in ("validate", "test"):  # sync_dist=True: reduce is an all-reduce
        assert math.isclose(result["atorch"][key], result["ddp"][key], rel_tol=RTOL, abs_tol=ATOL)
    assert result["atorch"]["predict"] == [4, 4]  # 16 samples over 2 ranks, batches of 4
    assert result["atorch"]["configured"] == 4  # configure_model ran for fit, validate, test and predict
    # the resume checkpoint holds the same 2 fsdp epochs: loaded into a new module without fitting
    assert math.isclose(result["fresh_validate"], result["atorch"]["validate"], rel_tol=RTOL, abs_tol=ATOL)


@pytest.mark.distributed
def test_bf16_mixed_is_amp_native_bf16(report: dict[str, Any]) -> None:
    result, fp32 = _entry(report, "bf16"), _entry(report, "fsdp")
    assert ["amp_native", {"dtype": "bf16", "skip_if_nonfinite": False}] in result["strategy"]
    assert result["finite"]
    # bf16 keeps 8 bits of mantissa (relative rounding 2^-8 ~ 4e-3); after one step the loss stays within 2%.
    assert all(math.isclose(a, b, rel_tol=2e-2) for a, b in zip(result["losses"], fp32["losses"][:2], strict=True))


@pytest.mark.distributed
def test_bf16_true_is_half_bf16(report: dict[str, Any]) -> None:
    result, fp32 = _entry(report, "bf16_true"), _entry(report, "parallel_mode")
    assert ["half", {"dtype": "bf16"}] in result["strategy"]
    # bf16 weights and inputs: 8 mantissa bits; the first loss (before any step) within 2% of fp32's.
    assert math.isclose(result["losses"][0], fp32["losses"][0], rel_tol=2e-2) and math.isfinite(result["losses"][1])


# ----- this process -----------------------------------------------------------------------------------
def test_registered_in_both_namespaces() -> None:
    import pytorch_lightning as ptl

    for ns in (pl, ptl):
        assert "atorch" in ns.strategies.StrategyRegistry
        strategy = ns.strategies.StrategyRegistry.get("atorch")
        assert isinstance(strategy, ns.strategies.DDPStrategy)
    assert atorch_lightning.STRATEGIES["pytorch_lightning"] is not atorch_lightning.STRATEGIES["lightning.pytorch"]
    trainer = ptl.Trainer(strategy="atorch", accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy) is atorch_lightning.STRATEGIES["pytorch_lightning"]
    assert isinstance(trainer.strategy.precision_plugin, ptl.plugins.precision.Precision)


@pytest.mark.parametrize(("flag", "method"), [("bf16-mixed", ("amp_native", "bf16")), ("bf16-true", ("half", "bf16")),
                                              ("32-true", None)])
def test_precision_flags_become_atorch_methods(flag: str, method: tuple[str, str] | None) -> None:
    trainer = pl.Trainer(strategy=ATorchStrategy(load_strategy=["fsdp"]), accelerator="cpu", devices=1,
                         precision=flag, logger=False)
    plugin = trainer.strategy.precision_plugin
    assert type(plugin).__name__ == "ATorchPrecision" and plugin.precision == flag
    resolved = engine.resolve(["fsdp"], atorch_lightning.precision.FLAG_TO_METHOD[flag], world_size=1)
    names = resolved.names()
    if method is None:
        assert names == ["fsdp"]
    else:
        assert names == ["fsdp", method[0]] and resolved.get(method[0]).dtype == method[1]


def test_fp16_mixed_has_one_loss_scaler() -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    strategy = ATorchStrategy(load_strategy=["fsdp"])
    strategy.precision_plugin = MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cpu"))
    plugin = strategy.precision_plugin
    assert plugin.precision == "16-mixed" and getattr(plugin, "scaler", None) is None  # Lightning's scaler is gone
    resolved = engine.resolve(["fsdp"], atorch_lightning.precision.FLAG_TO_METHOD["16-mixed"], world_size=1)
    assert resolved.get("amp_native").dtype == "fp16"  # atorch's GradScaler is the only one


def test_unsupported_precision_is_refused_by_name() -> None:
    with pytest.raises(SetupError, match="'64-true'"):
        pl.Trainer(strategy=ATorchStrategy(load_strategy=["fsdp"]), accelerator="cpu", devices=1, precision="64-true")


def test_bad_options_are_refused_early() -> None:
    with pytest.raises(SetupError, match="unknown option"):
        ATorchStrategy(load_strategy=["fsdp"], max_trials=3)
    with pytest.raises(SetupError) as err:  # Colossal-AI's strategy arguments: each with its equivalent
        ATorchStrategy(placement_policy="cpu", chunk_size=1024, initial_scale=2**16, max_scale=2**32)
    text = str(err.value)
    assert "placement_policy (ColossalAIStrategy): 'cpu': load_strategy=[('fsdp', {'cpu_offload': True})]" in text
    assert "chunk_size (ColossalAIStrategy): FSDP2 shards by units" in text and "initial_scale (Colossal" in text
    assert "max_scale (ColossalAIStrategy): none" in text


def test_strategy_name_resolves_after_import_atorch() -> None:
    """Lightning has no registration hook: `import atorch` registers "atorch" when Lightning is already loaded."""
    import subprocess
    import sys

    script = ("import lightning.pytorch as pl, atorch\n"
              "t = pl.Trainer(strategy='atorch', accelerator='cpu', devices=1, logger=False,\n"
              "               enable_checkpointing=False)\n"
              "print(type(t.strategy).__name__)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0 and out.stdout.strip().endswith("ATorchStrategy"), out.stderr[-2000:]
    with pytest.raises(StrategyError, match="fsdpp"):
        ATorchStrategy(load_strategy=["fsdpp"])
    with pytest.raises(StrategyError, match="precision in one place"):
        engine.resolve([("amp_native", {"dtype": "bf16"})], ("half", {"dtype": "bf16"}), world_size=1)


def test_metadata_json_round_trip() -> None:
    meta = {"epoch": 2, "score": torch.tensor(0.25), "shape": (1, 2), "dir": Path("/tmp/x"), "loops": {"a": [1, None]}}
    back = state.from_json(state.to_json(meta))
    assert back["score"].dtype == torch.float32 and float(back["score"]) == 0.25
    assert back["shape"] == (1, 2) and back["dir"] == Path("/tmp/x") and back["loops"] == {"a": [1, None]}
    with pytest.raises(state.CheckpointError, match=r"checkpoint\['fn'\] is a function"):
        state.to_json({"fn": lambda: 0})


def test_foreign_checkpoint_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "epoch=0.ckpt"
    plain.write_bytes(b"")  # a file written by another strategy
    with pytest.raises(state.CheckpointError, match="not a checkpoint written by ATorchStrategy"):
        state.load(plain, None)


@pytest.mark.parametrize("sharding", ["fsdp", "zero2"])
def test_empty_init_builds_on_meta_where_the_strategy_shards_unit_by_unit(sharding: str) -> None:
    # Trainer.init_module(empty_init=True): FSDP2 materialises the model one unit at a time as it shards it
    strategy = ATorchStrategy(load_strategy=["parallel_mode", sharding])
    with strategy.tensor_init_context(empty_init=True):
        assert torch.empty(1).device.type == "meta"
