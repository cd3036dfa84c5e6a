"""fsdp/zero2 units and checkpoint on models that used to crash or shard nothing: tied weights across
units (BERT masked LM), nested and overlapping units, blocks held in nn.Sequential, T5 under checkpoint.

One launch (2 real processes, gloo) runs every scenario; each must train like plain single-process
fp32 training from the same weights on the same global batches.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from launcher import HERE, launch_fixture
from workers.sharding_worker import SCENARIOS

WORKER = HERE / "workers" / "sharding_worker.py"
# fp32: FSDP all-reduces / reduce-scatters the same gradients in another order than the single
# process sums them (a few ulps, 2^-23 ~ 1.2e-7 each, over a handful of ops and 4 SGD steps, which
# do not amplify rounding as AdamW's normalisation does near zero gradients); 1e-5 rel leaves a wide margin.
FP32_TOL = (1e-5, 1e-6)
# How many FSDP units (besides the root) each scenario must shard.
UNITS = {
    "vit/fsdp": 3,  # the MixerBlocks in the nn.Sequential
    "cnn/fsdp": 4,  # the residual blocks of both Sequential stages
    "flat/fsdp": 0,
    "staged/fsdp[nested]": 6,  # 2 stages + 4 blocks inside them
    "staged/zero2[nested]": 6,
    "bert/fsdp": 2,  # the BertLayers; BertEmbeddings holds the tied word embeddings: left to the root
    "bert/zero2": 2,
    "t5/checkpoint+fsdp": 4,
}
launch = launch_fixture(WORKER, timeout=420)


@pytest.mark.distributed
@pytest.mark.timeout(480)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_scenario_trains_like_the_reference(launch: dict[str, Any], scenario: str) -> None:
    entry = launch["scenarios"][scenario]
    assert "error" not in entry, f"{scenario} failed: {entry['error']}"
    reference = launch["reference"][SCENARIOS[scenario][0]]
    rtol, atol = FP32_TOL
    # The comparison can fail: training moves the loss by far more than the tolerance.
    assert abs(reference[0] - reference[-1]) > 100 * (atol + rtol * max(map(abs, reference))), reference
    torch.testing.assert_close(
        torch.tensor(entry["losses"]), torch.tensor(reference), rtol=rtol, atol=atol,
        msg=lambda m: f"{scenario} losses {entry['losses']} vs reference {reference}: {m}",
    )
    if scenario in UNITS:
        assert entry["units"] == UNITS[scenario], entry
    if scenario.startswith("bert/"):
        assert entry["tied"], "the MLM decoder no longer shares the word embeddings' parameter"


@pytest.mark.distributed
@pytest.mark.timeout(480)
def test_size_based_units_add_to_the_classes(launch: dict[str, Any]) -> None:
    assert launch["scenarios"]["staged/fsdp[classes+size]"]["units"] > UNITS["staged/fsdp[nested]"] - 2


@pytest.mark.distributed
@pytest.mark.timeout(480)
def test_no_units_is_warned_with_the_fix(launch: dict[str, Any]) -> None:
    warned = [w for w in launch["scenarios"]["flat/fsdp"]["warnings"] if "no units" in w]
    assert warned and "atorch_wrap_cls" in warned[0] and "wrap_min_num_params" in warned[0], warned
    assert not any("no units" in w for w in launch["scenarios"]["vit/fsdp"]["warnings"])



class _NormNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                         torch.nn.ReLU())
        self.head = torch.nn.Linear(8 * 8 * 8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x).flatten(1))


def test_batch_norm_under_fsdp_mixed_precision_keeps_fp32_parameters():
    """CPU batch_norm refuses 16-bit weights next to its fp32 running statistics ("expected scalar type
    BFloat16 but found Float" before): norms become fp32 units of their own; the rest computes in bf16."""
    import atorch
    from atorch.training import train_step

    torch.manual_seed(0)
    data = [(torch.randn(3, 8, 8), torch.tensor(i % 4)) for i in range(8)]
    _, result, _ = atorch.auto_accelerate(
        _NormNet(), torch.optim.SGD, data, lambda batch, out: torch.nn.functional.cross_entropy(out, batch[1]),
        model_input_format="unpack_sequence", dataloader_args={"batch_size": 4}, optim_args={"lr": 0.1},
        load_strategy=["fsdp", ("amp_native", {"dtype": "bf16"})],
    )
    batches = iter(result.dataloader)
    losses = [float(train_step(result, [next(batches)])) for _ in range(2)]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert result.model.block[1].weight.to_local().dtype == torch.float32
    assert result.model.block[0].weight.to_local().dtype == torch.float32  # sharded master copy; gathered in bf16
    result.close()
