"""A user's method on 2 real ranks (launched by tests/test_user_methods.py): registered in each process, applied
under DDP by a semi-automatic strategy. Rank 0 prints ``RESULT {"scaled": ..., "ddp": ..., "losses": [...]}``."""

from __future__ import annotations

import os

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import json

import torch
import torch.distributed as dist
import toy_models
from user_method_example import ScaleOutput

import atorch


def main() -> None:
    atorch.register_method(ScaleOutput, after="checkpoint", reason="a forward hook on the whole model")
    _, result, _ = atorch.auto_accelerate(
        toy_models.mlp(), torch.optim.SGD, toy_models.mlp_dataset(), toy_models.mlp_loss,
        model_input_format="unpack_sequence", optim_args={"lr": 0.1},
        dataloader_args={"batch_size": 8, "shuffle": False},
        load_strategy=["parallel_mode", ("scale_output", {"factor": 0.5})],
    )
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        scaled = torch.equal(result.model(x), 0.5 * toy_models.mlp()(x))
    loss = atorch.train_step(result, [next(iter(result.dataloader))]).reshape(1)
    losses = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(losses, loss)
    if dist.get_rank() == 0:
        report = {"scaled": scaled, "ddp": isinstance(result.model, torch.nn.parallel.DistributedDataParallel),
                  "losses": [t.item() for t in losses]}
        print("RESULT " + json.dumps(report), flush=True)
    result.close()


if __name__ == "__main__":
    main()
