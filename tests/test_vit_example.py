"""examples/vit/train.py: the ViT walk-through's steps (data, pipeline, tensor, hybrid parallel, and the
automatic pick) run on real processes (gloo) and train like one process; and the two model-side parts
they need: the tensor-parallel plan of transformers' ViT, and its pipeline split."""

from __future__ import annotations

import importlib.util
import json
import math
from typing import Any

import pytest
import torch
from launcher import HERE, torchrun

ROOT = HERE.parent
SCRIPT = ROOT / "examples" / "vit" / "train.py"
STEPS = 6
ARGS = ("--size", "tiny", "--steps", str(STEPS), "--no-shuffle", "--eval-samples", "128", "--log-every", "3")
# First-step loss against one process: the same weights on the same 32 images (--no-shuffle makes the first
# global batch samples 0..31 under every layout), so only the fp32 summation order differs: tensor parallel
# sums each row-parallel matmul's two halves after an all-reduce, data and pipeline parallel average
# per-rank / per-micro-batch means. Each reordered sum of n fp32 terms is off by at most n * 2^-24 relative
# to the sum of its absolute values; the longest reductions here are 192 long (the 8x8x3 patch projection)
# and about ten of them are chained, so 10 * 192 * 6e-8 ≈ 1.2e-4 bounds the relative change of the loss
# (in practice a few 1e-7).
RTOL = 2e-4


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("vit_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _untrained_loss(samples: int, loss: Any = None) -> float:
    """The untrained tiny ViT's loss on samples 0..samples-1 (the model's own, or ``loss(batch, output)``)."""
    ex = _example()
    model = ex.build_vit("tiny", seed=0)
    data = ex.SyntheticCIFAR(4096, seed=1)
    items = [data[i] for i in range(samples)]
    batch = {key: torch.stack([item[key] for item in items]) for key in items[0]}
    with torch.no_grad():
        output = model(**batch)
        return float(output.loss if loss is None else loss(ex)(batch, output))


def reference_first_loss() -> float:
    """The untrained model's loss on the first global batch (samples 0..31), in this one process."""
    return _untrained_loss(32)


def results(*args: str, nproc: int, timeout: float) -> dict[str, dict[str, Any]]:
    """Every run's RESULT line, by step."""
    proc = torchrun(SCRIPT, *ARGS, *args, nproc=nproc, timeout=timeout)
    lines = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return {run["step"]: run for run in lines}


def _uses_low_precision(strategy: list[Any]) -> bool:
    return any((m[0] if isinstance(m, list) else m) in ("amp_native", "half", "fp8") for m in strategy)


def check_run(run: dict[str, Any], reference: float, world: int) -> None:
    losses = run["losses"]
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses), run
    if _uses_low_precision(run["strategy"]):  # bf16 autocast: not the fp32 numbers; it must learn
        assert losses[-1] < 0.9 * losses[0], run
    else:
        assert losses[0] == pytest.approx(reference, rel=RTOL), (run["step"], losses[0], reference)
        assert losses[-1] < 0.9 * losses[0], run
    assert run["eval"]["samples"] == 128, run  # each held-out sample counted once, whatever the layout
    assert run["eval"]["accuracy"] > 0.2, run  # chance is 0.1; the classes are learnable
    assert len(run["peak_bytes_per_rank"]) == world and min(run["peak_bytes_per_rank"]) > 0, run
    assert run["images_per_s"] > 0 and run["world_size"] == world


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_dp_pp_tp_and_auto_on_two_processes() -> None:
    runs = results("--step", "dp,pp,tp,auto", "--max-trials", "1", nproc=2, timeout=380)
    assert set(runs) == {"dp", "pp", "tp", "auto"}
    reference = reference_first_loss()
    for run in runs.values():
        check_run(run, reference, world=2)
    assert _uses_low_precision(runs["dp"]["strategy"])  # step 1 of the tutorial: data parallel + amp
    names = {step: [m[0] for m in run["strategy"]] for step, run in runs.items()}
    assert "pipeline_parallel" in names["pp"] and "tensor_parallel" in names["tp"]
    assert runs["auto"]["search"]["source"] == "search" and runs["auto"]["search"]["dry_runs"] >= 1
    # The two pipeline stages hold different layers: different peaks (the last stage also has the head).
    assert len(set(runs["pp"]["peak_bytes_per_rank"])) == 2


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_hybrid_tensor_by_pipeline_on_four_processes() -> None:
    runs = results("--step", "hybrid", nproc=4, timeout=280)
    run = runs["hybrid"]
    check_run(run, reference_first_loss(), world=4)
    layout = dict(run["strategy"][0][1]["dims"])
    assert layout == {"tensor": 2, "pipeline": 2, "data": 1}


# The tutorial's recipe, every flag at once: 2 micro-batches per step, clipping, warm-up + cosine LR, label
# smoothing, activation checkpointing, the interleaved schedule under pp; fp32 so that layouts compare.
RECIPE = ("--no-amp", "--accumulate", "2", "--clip", "1.0", "--lr-schedule", "cosine", "--warmup-ratio", "0.3",
          "--label-smoothing", "0.1", "--grad-checkpoint", "--schedule", "interleaved_1f1b")
# Data parallel and the interleaved pipeline run the same fp32 training (the clip norm taken over both stages):
# only summation order differs (see RTOL); AdamW's normalisation can let it grow over the steps (measured 1.1e-7
# over 6 steps), so 1e-4 (a clip norm of one stage only, or a missed micro-batch, is off by far more).
RECIPE_RTOL = 1e-4


def reference_recipe_first_loss() -> float:
    """The first step's loss under the recipe: label-smoothed cross-entropy over samples 0..63 (2 micro-batches
    of the global batch of 32), in one process."""
    return _untrained_loss(64, lambda ex: ex.smoothed_loss(0.1))


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_the_tutorials_recipe_and_a_resumed_run(tmp_path: Any) -> None:
    args = ("--step", "dp,pp", *RECIPE, "--checkpoint-dir", str(tmp_path))
    runs = results(*args, "--save-at", "3", nproc=2, timeout=190)
    reference = reference_recipe_first_loss()
    for run in runs.values():
        assert run["losses"][0] == pytest.approx(reference, rel=RTOL), run
        assert run["losses"][-1] < run["losses"][0] and run["global_batch_size"] == 64, run
        assert run["lr"] == 0.0  # the cosine schedule reached its end with the last step
    assert runs["pp"]["losses"] == pytest.approx(runs["dp"]["losses"], rel=RECIPE_RTOL)
    methods = {m[0]: m[1] for m in runs["pp"]["strategy"]}
    assert methods["pipeline_parallel"]["schedule"] == "interleaved_1f1b" and "checkpoint" in methods
    resumed = results(*args, "--resume", nproc=2, timeout=190)
    for step, run in resumed.items():  # steps 4..6 continue exactly where the saved run was
        assert run["first_step"] == 4 and run["losses"] == runs[step]["losses"][3:], (step, run["losses"])


# ----- the model-side parts -------------------------------------------------------------------------
def test_tensor_parallel_plan_of_vit_splits_attention_and_mlp() -> None:
    """Attention is recognised by its q/k/v/o names; the MLP (fc1, fc2) by pairing. The classifier stays
    whole on every rank, so num_labels (10) needs no padding to a multiple of the tensor size."""
    from atorch.opt_lib.tensor_parallel import TensorParallelConfig, derive_plan

    model = _example().build_vit("tiny")
    plan = derive_plan(model, TensorParallelConfig(), 2)
    assert not plan.problems
    layers = model.config.num_hidden_layers
    for i in range(layers):
        prefix = f"vit.layers.{i}."
        assert {k[len(prefix):]: v for k, v in plan.styles.items() if k.startswith(prefix)} == {
            "attention.q_proj": "colwise", "attention.k_proj": "colwise", "attention.v_proj": "colwise",
            "attention.o_proj": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
    assert len(plan.styles) == 6 * layers and plan.head_modules == [f"vit.layers.{i}.attention" for i in range(layers)]


def test_pipeline_split_of_vit_chains_to_the_whole_model() -> None:
    """The blocks are vit.layers (ViT also declares its embeddings unsplittable: met once, not repeated);
    stage 0 (embeddings + 2 layers) hands all positions on, stage 1 (2 layers, norm, head) runs the model
    on the batch with its first layer taking them; chained in one process they give the whole model's logits."""
    from atorch.opt_lib.pipeline_split import StageModule, build_stage, find_blocks, plan_stages

    ex = _example()
    model = ex.build_vit("tiny")
    blocks, why = find_blocks(model)
    assert why is None and blocks.container == "vit.layers"
    assert blocks.pre == ("vit.embeddings",) and blocks.post == ("vit.layernorm", "classifier")
    owned = plan_stages(model, blocks, 2)
    assert owned == [("0", "1"), ("2", "3")]
    first = StageModule(build_stage(model, blocks, owned[0], True, False), 0, True, False, None)
    last = StageModule(build_stage(model, blocks, owned[1], False, True), 1, False, True, None)
    assert not any(n.startswith("classifier") for n, _ in first.module.named_parameters())
    assert not any(n.startswith("vit.embeddings") for n, _ in last.module.named_parameters())
    pixels = torch.stack([ex.SyntheticCIFAR(8, seed=1)[i]["pixel_values"] for i in range(4)])
    with torch.no_grad():
        hidden = first(pixel_values=pixels)
        assert hidden.shape == (4, 17, 64)  # every position (16 patches + [CLS]), not the head's [CLS] slice
        torch.testing.assert_close(last(hidden, pixel_values=pixels), model(pixel_values=pixels).logits, rtol=0,
                                   atol=0)
