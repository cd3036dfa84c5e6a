"""ATorchStrategy under Lightning on 2 real ranks (launched by tests/test_lightning.py).

argv: a scratch directory (checkpoints, the search's storage and hardware-profile cache).
Rank 0 prints ``RESULT {json}``; each scenario fits with Lightning's own "ddp" or with ATorchStrategy
on the same data and records the global (mean over ranks) loss of every training pass.

- ``ddp`` / ``ddp_accum``: Lightning's DDPStrategy, the reference (accumulate_grad_batches 1 and 2).
- ``<strategy>`` / ``<strategy>_accum``: ATorchStrategy with that atorch strategy.
- ``ddp_clip`` / ``fsdp_clip``: gradient_clip_val (by norm) with Lightning's ddp, and through atorch's clipping.
- ``search``: no load_strategy: atorch's automatic search (3 trials) on the train dataset and training_step.
- ``by_name``: strategy="atorch" (the registry's instance): the search's cached pick.
- ``parallel_mode_manual``: manual optimisation (manual_backward, step and schedule by hand) with atorch's DDP.
- ``tensor_parallel``: tensor 2 x data 1: the sampler's size and rank are the data-parallel ones.
- ``resume``: fsdp, 2 epochs, Trainer.save_checkpoint, then a new Trainer and a module of another seed
  resumes to epoch 3 (fit(ckpt_path=...)); the losses of epoch 3 against an uninterrupted run.
- ``evaluate``: after an fsdp fit, validate / test / predict on the same Trainer; ddp's validation loss;
  validate on a new Trainer and module from the ``resume`` checkpoint (no fit: the plain module).
- ``bf16``: precision="bf16-mixed" becomes amp_native bf16 (the strategy in effect); losses finite.
- ``bf16_true``: precision="bf16-true" becomes half bf16 (weights and floating inputs cast).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ["ATORCH_CACHE_DIR"] = sys.argv[1]

import json
import math
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader
from toy_models import MLP, mlp_dataset
from worker_common import run_each

from atorch.distributed import shutdown
from atorch.lightning import ATorchStrategy

SCRATCH = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
SAMPLES, BATCH = 16, 4  # per epoch: 16 samples / (4 per rank x 2 ranks) = 2 training passes
LR = 0.1
CLIP = 0.2
QUICK_SEARCH = {"max_trials": 3, "warmup_steps": 1, "measure_steps": 1, "min_measure_s": 0, "top_k": 2,
                "storage": f"sqlite:///{SCRATCH}/search.db"}
# name -> atorch strategy
STRATEGIES = {
    "fsdp": ["fsdp"],
    "parallel_mode": ["parallel_mode"],
    "zero1": ["zero1"],
    "zero2_checkpoint": ["zero2", "checkpoint"],
}


class Module(pl.LightningModule):
    """The toy MLP built in configure_model (idempotent), SGD with momentum and a StepLR schedule."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.seed = seed
        self.net: nn.Module | None = None
        self.passes: list[torch.Tensor] = []
        self.syncs: list[bool | None] = []  # whether this pass's backward reduces gradients
        self.configured = 0

    def configure_model(self) -> None:
        self.configured += 1
        if self.net is not None:
            return
        torch.manual_seed(self.seed)
        self.net = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).float(), y)
        self.passes.append(loss.detach().float().clone())
        if self._trainer is not None:  # the search's trials run training_step on copies without a Trainer
            self.syncs.append(_gradient_sync(self.trainer.strategy.model))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x).float(), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self(x).float(), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.8)}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(mlp_dataset(SAMPLES), batch_size=BATCH)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(mlp_dataset(SAMPLES, seed=5), batch_size=BATCH)

    test_dataloader = val_dataloader

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(mlp_dataset(SAMPLES, seed=6), batch_size=BATCH)


def _gradient_sync(model: nn.Module) -> bool | None:
    """DDP's flag for the coming backward, or FSDP2's reduce-scatter flag (None for other wrappers)."""
    if hasattr(model, "require_backward_grad_sync"):
        return bool(model.require_backward_grad_sync)
    state = getattr(model, "_get_fsdp_state", None)
    if state is not None:
        return all(group.reduce_grads for group in state()._fsdp_param_groups)
    return None


def trainer(strategy: Any, epochs: int, accumulate: int = 1, **extra: Any) -> pl.Trainer:
    options = {"limit_val_batches": 0, **extra}
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=epochs,
                      accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **options)


def global_losses(module: Module) -> list[float]:
    """The mean over ranks of each training pass's loss (the loss of the global batch).

    The pass counts are compared first: a rank whose module ran training_step more often (the search must
    never call the user's own module) fails here on every rank instead of hanging the launch."""
    counts = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([float(len(module.passes))]))
    if len({int(c.item()) for c in counts}) != 1:
        raise AssertionError(f"training_step ran {[int(c.item()) for c in counts]} times on the ranks")
    local = torch.stack(module.passes)
    dist.all_reduce(local)
    return (local / dist.get_world_size()).tolist()


class ManualModule(Module):
    """Manual optimisation: manual_backward, step and the schedule by hand."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).float(), y)
        self.passes.append(loss.detach().float().clone())
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()

    def on_train_epoch_end(self) -> None:
        self.lr_schedulers().step()


def fit(strategy: Any, epochs: int = 3, accumulate: int = 1, seed: int = 0, manual: bool = False,
        **extra: Any) -> dict[str, Any]:
    module = ManualModule(seed) if manual else Module(seed)
    t = trainer(strategy, epochs, accumulate, **extra)
    t.fit(module)
    in_effect = getattr(t.strategy, "strategy_in_effect", None)
    engine = getattr(t.strategy, "engine", None)
    return {"losses": global_losses(module), "strategy": in_effect.to_list() if in_effect else None,
            "syncs": module.syncs,
            "search_source": engine.search["source"] if engine is not None and engine.search else None,
            "global_step": t.global_step, "configured": module.configured,
            "optimizer": type(getattr(t.optimizers[0], "optimizer", t.optimizers[0])).__name__,
            "lr": t.optimizers[0].param_groups[0]["lr"]}


class Block(nn.Module):
    """A width-changing pair, which tensor_parallel's derived plan splits (up colwise, down rowwise)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class TensorParallelModule(Module):
    def configure_model(self) -> None:
        self.configured += 1
        if self.net is None:
            torch.manual_seed(self.seed)
            self.net = nn.Sequential(nn.Sequential(Block(), Block()), nn.Linear(16, 8))


def tensor_parallel() -> dict[str, Any]:
    """tensor 2 x data 1: both ranks read the same (whole) data; every rank computes the same loss."""
    strategy = ATorchStrategy(load_strategy=[("parallel_mode", {"dims": [["tensor", 2]]}), "tensor_parallel"])
    module = TensorParallelModule(0)
    trainer(strategy, 1).fit(module)
    local = torch.stack(module.passes)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return {"sampler": strategy.distributed_sampler_kwargs, "per_rank": [g.tolist() for g in gathered],
            "strategy": strategy.strategy_in_effect.to_list()}


def resume() -> dict[str, Any]:
    path = SCRATCH / "resume.ckpt"
    first = Module(0)
    t = trainer(ATorchStrategy(load_strategy=["fsdp"]), 2)
    t.fit(first)
    t.save_checkpoint(path)
    saved = sorted(p.name for p in path.iterdir())
    resumed = Module(seed=7)  # other weights: the checkpoint must bring them back
    t2 = trainer(ATorchStrategy(load_strategy=["fsdp"]), 3)
    t2.fit(resumed, ckpt_path=path)
    meta = json.loads((path / "lightning.json").read_text())
    return {"losses": global_losses(resumed), "files": saved, "global_step": t2.global_step,
            "saved_epoch": meta["epoch"], "saved_step": meta["global_step"],
            "lr": t2.optimizers[0].param_groups[0]["lr"]}


def evaluate() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, strategy in (("ddp", "ddp"), ("atorch", ATorchStrategy(load_strategy=["fsdp"]))):
        module = Module(0)
        t = trainer(strategy, 2, limit_val_batches=None)
        t.fit(module)
        out[name] = {"validate": t.validate(module, verbose=False)[0]["val_loss"],
                     "test": t.test(module, verbose=False)[0]["test_loss"]}
        if name == "atorch":
            predictions = t.predict(module)
            out[name]["predict"] = [int(p.numel()) for p in predictions]
            out[name]["configured"] = module.configured
    # Evaluation before any fit, from the resume scenario's checkpoint (the same 2 fsdp epochs of Module(0)).
    fresh = Module(seed=9)
    t = trainer(ATorchStrategy(load_strategy=["fsdp"]), 1, limit_val_batches=None)
    out["fresh_validate"] = t.validate(fresh, ckpt_path=SCRATCH / "resume.ckpt", verbose=False)[0]["val_loss"]
    return out


def bf16() -> dict[str, Any]:
    out = fit(ATorchStrategy(load_strategy=["fsdp"]), epochs=1, precision="bf16-mixed")
    out["finite"] = all(math.isfinite(v) for v in out["losses"])
    return out


def main() -> None:
    warnings.filterwarnings("ignore")
    scenarios: dict[str, Any] = {
        "ddp": lambda: fit("ddp"),
        "ddp_accum": lambda: fit("ddp", epochs=4, accumulate=2),
    }
    for name, strategy in STRATEGIES.items():
        scenarios[name] = lambda s=strategy: fit(ATorchStrategy(load_strategy=s))
        if name in ("fsdp", "parallel_mode"):  # FSDP2's and DDP's no-sync paths
            scenarios[f"{name}_accum"] = lambda s=strategy: fit(ATorchStrategy(load_strategy=s), epochs=4,
                                                                accumulate=2)
    # A clip small enough to bind (the test checks the losses differ from unclipped ones): Lightning's torch
    # clip of whole gradients against atorch's global norm over fsdp's shards.
    scenarios["ddp_clip"] = lambda: fit("ddp", gradient_clip_val=CLIP)
    scenarios["fsdp_clip"] = lambda: fit(ATorchStrategy(load_strategy=["fsdp"]), gradient_clip_val=CLIP)
    # time_limit counts the search's one-time preparations: on a fresh machine under load, DeepSpeed's op build
    # alone took most of 120 s and left no dry-run (the cost model's pick then stands in: source "cost_model")
    scenarios["search"] = lambda: fit(ATorchStrategy(search=QUICK_SEARCH, time_limit=600))
    scenarios["by_name"] = lambda: fit("atorch")  # the same search's key: its cached pick
    scenarios["parallel_mode_manual"] = lambda: fit(ATorchStrategy(load_strategy=["parallel_mode"]), manual=True)
    scenarios["tensor_parallel"] = tensor_parallel
    scenarios["resume"] = resume
    scenarios["evaluate"] = evaluate
    scenarios["bf16"] = bf16
    scenarios["bf16_true"] = lambda: fit(ATorchStrategy(load_strategy=["parallel_mode"]), epochs=1,
                                         precision="bf16-true")
    only = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else None
    report = run_each({k: v for k, v in scenarios.items() if only is None or k in only})
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(report), flush=True)
    shutdown()  # ranks meet before gloo closes its connections (a lone teardown can abort a peer)


if __name__ == "__main__":
    main()
