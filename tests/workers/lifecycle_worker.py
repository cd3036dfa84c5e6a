"""Process-group life cycle under atorch: a clean exit, and a crash on one rank.

Usage: ``torchrun --nproc_per_node=2 lifecycle_worker.py {clean|crash}``.
- clean: train a few zero2 steps (FSDP2, gloo), rank 0 finishing a second later than rank 1, and
  return; atorch tears the group down at exit.
- crash: rank 1 raises after auto_accelerate while rank 0 enters a training step (a collective).
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import sys
import time

import torch
import torch.distributed as dist
import toy_models

import atorch
from atorch.training import train_step


def main(mode: str) -> None:
    _, result, _ = atorch.auto_accelerate(
        toy_models.tiny_gpt2(), torch.optim.AdamW, toy_models.TokenDataset(), toy_models.gpt2_loss,
        model_input_format="unpack_dict", dataloader_args={"batch_size": 8},
        load_strategy=["parallel_mode", ("amp_native", {"dtype": "bf16"}), "zero2"],
    )
    if mode == "crash" and dist.get_rank() == 1:
        raise RuntimeError("deliberate failure on rank 1")
    for batch in result.dataloader:  # 8 steps, each loss averaged over ranks as a training log would
        loss = train_step(result, [batch])
        dist.all_reduce(loss)
    if dist.get_rank() == 0:  # rank 0 finishes last, as when it writes a report or a checkpoint
        time.sleep(1.0)
        print("RESULT {}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
