"""Run under torchrun (2 processes): mistakes that the misuse battery checks at two processes, each raised with
the same message on every rank (also one seen on rank 1 alone). Rank 0 prints ``RESULT {json}``: per mistake,
every rank's error type and message."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from toy_models import MLP, mlp, mlp_dataset, mlp_loss

import atorch

DATA2 = [("parallel_mode", {"dims": [["data", 2]]})]


class TwoHeads(MLP):
    """A second head that forward never uses (left over from an experiment)."""

    def __init__(self) -> None:
        super().__init__()
        self.aux_head = nn.Linear(32, 4)


class LayerDropMLP(MLP):
    """The toy MLP configured as transformers' speech encoders are: each block skipped at random in training."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(layerdrop=0.1)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            if not self.training or torch.rand(()) >= self.config.layerdrop:
                x = x + block(x)
        return self.head(x)


def error_of(model: nn.Module | None = None, **kwargs: Any) -> dict[str, str]:
    args: dict[str, Any] = dict(dataset=mlp_dataset(), loss_func=mlp_loss, model_input_format="unpack_sequence",
                                optim_args={"lr": 0.1}, dataloader_args={"batch_size": 8}, load_strategy=DATA2)
    args.update(kwargs)
    try:
        atorch.auto_accelerate(model or mlp(), torch.optim.SGD, **args)
    except Exception as exc:  # reported to the test, which checks type and message
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": "none", "message": ""}


def main() -> None:
    rank = int(__import__("os").environ["RANK"])
    float64 = TensorDataset(torch.randn(32, 16, dtype=torch.float64), torch.randint(0, 8, (32,)))
    scenarios = {
        "batch-not-dividing-over-ranks": dict(dataloader_args={"batch_size": 3}),
        "drop-last-no-batch-per-rank": dict(dataset=mlp_dataset(2), dataloader_args={"batch_size": 4,
                                                                                      "drop_last": True}),
        # rank 1 read its data differently (a cast forgotten in one code path): every rank hears of it
        "float64-on-one-rank-only": dict(dataset=float64 if rank == 1 else mlp_dataset()),
        "non-scalar-loss-both-ranks": dict(loss_func=lambda d, o: F.cross_entropy(o, d[1], reduction="none")),
        "unused-parameters-under-ddp": dict(model=TwoHeads()),
        # automatic mode too: named before the search, not as the failure of its DDP dry-runs
        "unused-parameters-in-automatic-mode": dict(model=TwoHeads(), load_strategy=None),
        "unused-parameters-with-find-unused": dict(model=TwoHeads(), find_unused_parameters=True),  # legitimate
        # a sample step may keep every block: the setting is named, in both modes
        "layer-drop-under-ddp": dict(model=LayerDropMLP()),
        "layer-drop-in-automatic-mode": dict(model=LayerDropMLP(), load_strategy=None),
        "layer-drop-with-find-unused": dict(model=LayerDropMLP(), find_unused_parameters=True),  # legitimate
        # a rank that skips a layer would leave the others in its collectives: refused before anything is built
        "layer-drop-under-fsdp": dict(model=LayerDropMLP(), load_strategy=["fsdp"]),
    }
    out = {}
    for name, kwargs in scenarios.items():
        mine = error_of(**kwargs)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        out[name] = every
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
