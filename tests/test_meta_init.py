"""Models built on the meta device: materialised and initialised identically on every rank (DDP: the
whole model; fsdp: one unit at a time, right before it is sharded), or refused up front when a module
cannot be initialised."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import toy_models
from launcher import HERE, launch_fixture
from torch import nn
from workers.meta_worker import SCENARIOS

import atorch
from atorch import meta_init

WORKER = HERE / "workers" / "meta_worker.py"
# fp32: the same argument as test_numerics (same gradients reduced in another order, a few ulps of
# 2^-23 per op over 4 SGD steps, which do not amplify rounding as AdamW does near zero gradients).
FP32_TOL = (1e-5, 1e-6)
launch = launch_fixture(WORKER, timeout=300)


@pytest.mark.distributed
@pytest.mark.timeout(360)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_meta_model_trains_from_identical_weights(launch: dict[str, Any], scenario: str) -> None:
    entry = launch["scenarios"][scenario]
    assert "error" not in entry, f"{scenario} failed: {entry['error']}"
    # Every rank's materialised weights (gathered from the shards under fsdp) are exactly those of a
    # single-process materialisation with the same seed: the ranks agree with each other and with it.
    assert entry["weight_gap"] == 0.0, entry
    assert entry["user_model_still_meta"], "the user's model was changed"
    reference = launch["reference"][SCENARIOS[scenario][0]]
    rtol, atol = FP32_TOL
    assert abs(reference[0] - reference[-1]) > 100 * (atol + rtol * max(map(abs, reference))), reference
    torch.testing.assert_close(torch.tensor(entry["losses"]), torch.tensor(reference), rtol=rtol, atol=atol)


@pytest.mark.distributed
@pytest.mark.timeout(360)
@pytest.mark.parametrize("model", ["mlp", "gpt2"])
def test_fsdp_materialises_one_unit_at_a_time(launch: dict[str, Any], model: str) -> None:
    stats = launch["scenarios"][f"{model}/fsdp"]["stats"]
    full = launch["full_bytes"][model]
    assert stats["full_bytes"] == full
    # At most one unit's (or the root's remaining) full tensors are alive at once, and they are freed once
    # sharded: one of 8 MLP blocks is 11% of the model's bytes, one of 4 GPT-2 blocks (beside the
    # embeddings) 23%; keeping every full tensor alive, as a leak would, reaches 100%.
    assert stats["peak_full_bytes"] < 0.25 * full, stats
    assert stats["live_full_bytes_after"] == 0, stats
    # With this rank's shards of the units already sharded (half the model at 2 ranks): still below it.
    assert stats["peak_bytes"] < 0.7 * full, stats


@pytest.mark.distributed
@pytest.mark.timeout(360)
def test_modules_kept_whole_stay_whole(launch: dict[str, Any]) -> None:
    whole = launch["scenarios"]["mlp/fsdp[ignored_modules]"]["whole"]
    assert whole == ["blocks.7.0.bias", "blocks.7.0.weight", "head.bias", "head.weight"], whole
    assert launch["scenarios"]["mlp/fsdp"]["whole"] == []


class Scaled(nn.Module):
    """Holds a parameter and has no reset_parameters(): cannot be initialised on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))
        self.inner = toy_models.MLP()

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner(x * self.scale)


def test_meta_module_without_init_is_refused_up_front() -> None:
    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(atorch.StrategyError) as raised:
        atorch.auto_accelerate(
            model, torch.optim.SGD, toy_models.mlp_dataset(), toy_models.mlp_loss,
            model_input_format="unpack_sequence", dataloader_args={"batch_size": 8}, load_strategy=["fsdp"],
        )
    message = str(raised.value)
    assert "meta device" in message and "<root> (Scaled)" in message and "reset_parameters()" in message, message
    assert "inner" not in message  # its Linear layers can be initialised


def test_whole_model_materialisation_does_not_depend_on_the_global_seed_state() -> None:
    with torch.device("meta"):
        model = toy_models.MLP()
    torch.manual_seed(123)
    first = meta_init.materialise(model, torch.device("cpu"), seed=7)
    with torch.device("meta"):
        again = toy_models.MLP()
    torch.rand(5)  # the global generator moved on: the seeds per module are fixed by seed and name
    second = meta_init.materialise(again, torch.device("cpu"), seed=7)
    assert not meta_init.is_meta(first)
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert first.blocks[0][0].weight.std() > 0 and not torch.equal(first.blocks[0][0].weight, first.blocks[1][0].weight)
