"""fp16 under pipeline parallel on 2 real processes (launched by tests/test_pipeline_fp16.py).

Colossal-AI's pipeline loop with HybridParallelPlugin's default precision ('fp16'): the last stage scales the loss,
every stage unscales its gradients in ``optimizer.step()``, an overflow on any stage skips the step on all.

Usage: ``torchrun --nproc_per_node=2 pp_fp16_worker.py``. Rank 0 prints ``RESULT {name: {...} or {"error": ...}}``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import json
from typing import Any

import shard_models as sm
import torch
import torch.distributed as dist
from torch.optim import SGD
from torch.utils.data import DataLoader
from worker_common import gathered, run_each

from atorch.booster import Booster
from atorch.booster.plugin import HybridParallelPlugin
from atorch.optimizer import local_tensor

STEPS = 4
LR = 0.1
BATCH = 4  # per step, split into MICRO micro-batches
MICRO = 2
# A scale that grows in this short run: after every GROWTH steps without overflow it doubles.
SCALE, GROWTH = 2.0**8, 2


def dataset() -> list[dict[str, torch.Tensor]]:
    """One batch of BATCH samples, once per step: memorised, so the loss falls within the few steps."""
    samples = sm.TokenDataset(samples=BATCH)
    return [samples[i % BATCH] for i in range(BATCH * STEPS)]


def plugin() -> HybridParallelPlugin:
    # precision left at Colossal-AI's default, 'fp16'
    return HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=MICRO, initial_scale=SCALE,
                                growth_interval=GROWTH)


def criterion(outputs: Any, inputs: Any) -> torch.Tensor:
    return outputs.loss


def boosted() -> tuple[Booster, Any, Any, Any]:
    booster = Booster(plugin=(p := plugin()))
    torch.manual_seed(0)
    model = sm.tiny_llama(layers=4)
    optimizer = SGD(model.parameters(), lr=LR)
    dataloader = p.prepare_dataloader(dataset(), batch_size=BATCH)
    model, optimizer, _, dataloader, _ = booster.boost(model, optimizer, criterion, dataloader)
    return booster, model, optimizer, dataloader


def reference() -> dict[str, list[float]]:
    """One process: the whole model under fp16 autocast with torch's GradScaler (same settings), each batch in
    the pipeline's micro-batches (loss / MICRO each), so the same fp16 operations run on the same shapes."""
    torch.manual_seed(0)
    model = sm.tiny_llama(layers=4)
    optimizer = SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=GROWTH)
    losses, scales = [], []
    for batch in DataLoader(dataset(), batch_size=BATCH):
        step_loss = 0.0
        for part in range(MICRO):
            micro = {k: v.chunk(MICRO)[part] for k, v in batch.items()}  # the schedule's split
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**micro).loss
            scaler.scale(loss / MICRO).backward()
            step_loss += loss.item() / MICRO
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(step_loss)
        scales.append(float(scaler.get_scale()))
    return {"losses": losses, "scales": scales}


def matches_one_process() -> dict[str, Any]:
    booster, model, optimizer, dataloader = boosted()
    it, losses, scales = iter(dataloader), [], []
    for _ in range(STEPS):
        out = booster.execute_pipeline(it, model, criterion, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out["loss"].item())
        scales.append(gathered(float(optimizer.optim.grad_scaler.get_scale())))
    entry = {"losses": losses, "scales": scales, "skipped": gathered(optimizer.skipped_steps),
             "methods": booster.strategy.names(), "dtype": booster.strategy.get("amp_native").dtype}
    model.result.close()
    if dist.get_rank() == 0:
        entry["reference"] = reference()
    return entry


def overflow_skips_everywhere() -> dict[str, Any]:
    """Step 0: an inf in one gradient on rank 0 (the first stage, which never scales a loss); step 1: on rank 1
    (the last stage); step 2: none. Per step and rank: weights unchanged, the scale, the skipped count."""
    booster, model, optimizer, dataloader = boosted()
    it = iter(dataloader)
    steps = []
    for step, culprit in enumerate((0, 1, None)):
        booster.execute_pipeline(it, model, criterion, optimizer)
        before = [local_tensor(p).detach().clone() for p in optimizer.parameters()]
        scale = float(optimizer.optim.grad_scaler.get_scale())
        if dist.get_rank() == culprit:
            grad = next(p.grad for p in optimizer.parameters() if p.grad is not None)
            local_tensor(grad).view(-1)[step] = float("inf")
        optimizer.step()
        optimizer.zero_grad()
        changed = any(not torch.equal(b, local_tensor(p).detach()) for b, p in zip(before, optimizer.parameters(),
                                                                                   strict=True))
        steps.append({"changed": gathered(float(changed)),
                      "scale_ratio": gathered(float(optimizer.optim.grad_scaler.get_scale()) / scale),
                      "skipped": gathered(optimizer.skipped_steps)})
    model.result.close()
    return {"steps": steps}


def main() -> None:
    report = run_each({"matches_one_process": matches_one_process, "overflow": overflow_skips_everywhere})
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
