"""ds_3d_parallel: the conversion to DeepSpeed pipeline layers, refusals, and DeepSpeed's pipeline engine
training on real processes (gloo): pipeline 2 on 2 processes, pipeline 2 × data 2 (ZeRO-1) on 4.

Each scenario must train like plain single-process fp32 training from the same weights on the same global
batches; a stage must hold only its layers; ZeRO-1 must split the optimizer's share over the data ranks.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import shard_models as sm
import torch
from launcher import HERE, launch_fixture
from torch import nn
from workers.ds3d_worker import GROUPS

from atorch.strategy import Strategy

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # importing deepspeed.pipe in this process (conversion tests)

WORKER = HERE / "workers" / "ds3d_worker.py"
# fp32: the pipeline computes the same operations as one process; only sums are taken in another order (the
# loss is the mean of micro-batch means of equal token counts; weight gradients accumulate over micro-batches
# and are scaled by 1/m; data parallel averages the ranks' gradients; the tied embedding/head gradient is the
# sum of its two stages' parts). Each such sum differs by a few ulps (2^-23 ~ 1.2e-7 relative); over 4 layers
# and 4 SGD steps (SGD does not amplify rounding as AdamW does near zero gradients) that stays near 1e-6
# relative, so 1e-5 leaves margin (as in test_pipeline_parallel.py).
FP32_TOL = (1e-5, 1e-6)
NPROC = {"pp2": 2, "pp2xdp2": 4}
# GPT-2's wte/lm_head is held by the first and the last stage.
TIED_COPY = {"gpt2": sm.VOCAB * 32, "llama": 0, "sequential": 0}
launch = launch_fixture(WORKER, timeout=420, groups=NPROC)


@pytest.mark.distributed
@pytest.mark.timeout(480)
def test_deepspeed_pipeline_trains_like_the_reference(launch: tuple[str, dict[str, Any]]) -> None:
    group, report = launch
    nproc = NPROC[group]
    for scenario, (model_name, _) in GROUPS[group].items():
        entry = report["scenarios"][scenario]
        assert "error" not in entry, f"{scenario} failed: {entry['error']}"
        assert entry["engine"] == "PipelineEngine", entry
        assert "atorch.train_step(result, [batch])" in (entry["forward_error"] or ""), entry
        reference = report["reference"][model_name]
        rtol, atol = FP32_TOL
        # The comparison can fail: training moves the loss by far more than the tolerance.
        assert abs(reference[0] - reference[-1]) > 5 * (atol + rtol * max(map(abs, reference))), reference
        torch.testing.assert_close(
            torch.tensor(entry["losses"]), torch.tensor(reference), rtol=rtol, atol=atol,
            msg=lambda m, s=scenario, e=entry, r=reference: f"{s} losses {e['losses']} vs reference {r}: {m}",
        )
        assert len(set(entry["loss_on_ranks"])) == 1, entry["loss_on_ranks"]  # the same loss on every rank
        if model_name == "gpt2":  # the tied embedding/head copies stay equal on the first and the last stage
            assert len(set(entry["tied"])) == 1 and entry["tied"][0] != 0, entry["tied"]
        # Memory from local tensors: a stage holds only its layers; the stages add up to the model (the tied
        # weight twice). ZeRO-1 gives each data rank its share of the stage for the optimizer to update.
        local, whole, stages = entry["local"], entry["whole"], entry["stage"]
        assert len(local) == nproc and sorted(set(stages)) == [0, 1], stages
        first, last = local[stages.index(0)], local[stages.index(1)]
        assert max(local) < whole and first + last == whole + TIED_COPY[model_name], (local, whole)
        data = nproc // 2
        for held, share in zip(local, entry["zero_partition"], strict=True):
            assert held / data <= share < held / data + data, (local, entry["zero_partition"])  # padding < data


# ----- the conversion, in this process ---------------------------------------------------------------------
def run_sequentially(layers: Any, ids: torch.Tensor) -> torch.Tensor:
    """The converted layers run one after another in this process (what the stages compute together)."""
    from deepspeed.pipe import TiedLayerSpec

    built: dict[str, nn.Module] = {}
    x = ids
    for spec in layers.specs:
        if isinstance(spec, TiedLayerSpec):
            module = built.setdefault(spec.key, spec.build())
            x = spec.forward_fn(module, x) if spec.forward_fn is not None else module(x)
        else:
            x = spec.build()(x)
    return x


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_converted_layers_compute_the_model(family: str) -> None:
    from deepspeed.pipe import TiedLayerSpec

    from atorch.opt_lib.ds_pipe_layers import build_layers

    torch.manual_seed(0)
    model = (sm.tiny_gpt2 if family == "gpt2" else sm.tiny_llama)(layers=4).eval()
    layers = build_layers(model)
    blocks = [f"block {i}" for i in range(4)]
    if family == "gpt2":
        assert layers.names == ["embedding", "position embedding", *blocks, "final norm", "head (tied)"]
        tied = [i for i, s in enumerate(layers.specs) if isinstance(s, TiedLayerSpec)]
        assert tied == [0, len(layers.specs) - 1] and layers.tied  # one key, used first and last
        assert layers.specs[-1].forward_fn is not None and layers.specs[0].forward_fn is None
    else:
        assert layers.names == ["embedding", *blocks, "final norm", "head"] and not layers.tied
        assert not any(isinstance(s, TiedLayerSpec) for s in layers.specs)
    # Run one after another in this process: the model's logits and loss (the same operations in the same order).
    ids = torch.randint(0, sm.VOCAB, (2, sm.SEQ_LEN))
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids)
        logits = run_sequentially(layers, ids)
    torch.testing.assert_close(logits, expected.logits, rtol=0, atol=0)
    loss = layers.loss_function(logits=logits, labels=ids, vocab_size=layers.vocab_size)
    torch.testing.assert_close(loss, expected.loss, rtol=0, atol=0)


def sequential_model(classes: int = 8) -> nn.Sequential:
    """An nn.Sequential with its blocks in a nested Sequential: embed, 4 blocks, norm, head."""
    return nn.Sequential(nn.Linear(16, 32), nn.Sequential(*[sm.MixerBlock(32) for _ in range(4)]), nn.LayerNorm(32),
                         nn.Linear(32, classes))


def test_sequential_models_convert_in_call_order() -> None:
    from atorch.opt_lib.ds_pipe_layers import build_layers, conversion_problem

    torch.manual_seed(0)
    model = sequential_model().eval()
    layers = build_layers(model)
    assert layers.names == ["0", "1.0", "1.1", "1.2", "1.3", "2", "3"], layers.names
    assert layers.kinds == ["pre"] + ["block"] * 4 + ["post"] * 2, layers.kinds
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(run_sequentially(layers, x), model(x), rtol=0, atol=0)
    # A model whose forward may do more than call its modules in order is not converted; the reason says so.
    why = conversion_problem(sm.SequentialViT(depth=4))
    assert why is not None and "nn.Sequential" in why and "use pipeline_parallel" in why, why
    assert "no repeated blocks" in conversion_problem(sm.FlatMLP())
    assert "use pipeline_parallel" in conversion_problem(sm.tiny_t5()) or "lists" in conversion_problem(sm.tiny_t5())


def test_stage_bounds_balance_cost() -> None:
    from atorch.opt_lib.ds_pipe_layers import build_layers, stage_bounds

    layers = build_layers(sm.tiny_gpt2(layers=4))
    # 8 layers: embedding, position, 4 blocks (12,704 each), norm, tied head (4,096): two blocks per stage.
    assert stage_bounds(layers, 2) == [0, 4, 8]
    big_head = build_layers(sequential_model(classes=400))  # its head costs about 3 blocks
    assert stage_bounds(big_head, 2) == [0, 4, 7]  # embed + 3 blocks | 1 block + norm + head


PP = ("parallel_mode", {"dims": [["pipeline", 2], ["data", -1]]})


def test_strategy_checks_name_the_fix() -> None:
    assert Strategy.load([PP, "ds_3d_parallel"]).problems(4) == []
    assert Strategy.load([PP, "module_replace", "ds_3d_parallel"]).problems(4) == []
    assert any("needs a 'pipeline' dimension" in p for p in Strategy.load(["ds_3d_parallel"]).problems(2))
    tp = ("parallel_mode", {"dims": [["pipeline", 2], ["data", -1], ["tensor", 2]]})
    problems = Strategy.load([tp, "ds_3d_parallel"]).problems(4)
    assert any("tensor size > 1" in p and "use mixed_parallel" in p for p in problems), problems
    for other, fix in (("fsdp", "drop 'fsdp'"), ("zero2", "drop 'zero2'"), ("zero1", "drop 'zero1'"),
                       ("pipeline_parallel", "keep one"), ("checkpoint", "activation_checkpoint_interval"),
                       ("amp_native", "drop 'amp_native'")):
        problems = Strategy.load([PP, "ds_3d_parallel", other]).problems(4)
        assert any(fix in p for p in problems), (other, problems)
    problems = Strategy.load([PP, ("ds_3d_parallel", {"partition_method": "balanced"})]).problems(4)
    assert any("not one of cost, parameters, uniform" in p for p in problems), problems


def test_model_problems_are_found_before_building() -> None:
    from atorch.distributed import DistEnv
    from atorch.model_context import ModelContext, UserSetup
    from atorch.opt_lib.ds_3d_parallel import Ds3dParallel, Ds3dParallelConfig
    from atorch.parallel_layout import ParallelLayout

    env = DistEnv(rank=0, world_size=4, local_rank=0, device=torch.device("cpu"), backend="gloo")

    class PaddedTokens(sm.TokenDataset):
        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            sample = super().__getitem__(index)
            return {**sample, "attention_mask": torch.ones_like(sample["input_ids"])}

    def problems(model: nn.Module, loss: Any = sm.hf_loss, pipeline: int = 2, dataset: Any = None,
                 **config: Any) -> list[str]:
        dataset = dataset if dataset is not None else sm.TokenDataset()
        setup = UserSetup(model=model, optim_func=torch.optim.SGD, loss_func=loss, dataset=dataset,
                          dataloader_args={"batch_size": 8})
        layout = ParallelLayout((("pipeline", pipeline), ("data", 4 // pipeline)))
        return Ds3dParallel().model_problems(ModelContext(setup, env, layout), Ds3dParallelConfig(**config))

    assert problems(sm.tiny_gpt2(layers=4)) == []
    assert any("too few for 4 pipeline stages" in p for p in problems(sm.tiny_gpt2(layers=2), pipeline=4))
    assert any("give loss_func" in p for p in problems(sm.tiny_gpt2(layers=4), loss=None))
    assert any("does not split into 3 micro-batches" in p for p in problems(sm.tiny_gpt2(layers=4), micro_batches=3))
    assert any("use pipeline_parallel" in p for p in problems(sm.SequentialViT(depth=4)))
    padded = problems(sm.tiny_gpt2(layers=4), dataset=PaddedTokens())
    assert any("keys ['attention_mask'] would be ignored" in p for p in padded), padded
