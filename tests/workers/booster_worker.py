"""The Booster (Colossal-AI API) on 2 real processes (launched by tests/test_booster.py).

Usage: ``torchrun --nproc_per_node=2 booster_worker.py GROUP CACHE_DIR``. Rank 0 prints
``RESULT {name: {...} or {"error": ...}}``.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ["ATORCH_CACHE_DIR"] = sys.argv[2]

import functools
import json
import time
from collections.abc import Callable
from typing import Any

import shard_models as sm
import torch
import torch.distributed as dist
from torch.optim import SGD
from torch.utils.data import DataLoader
from toy_models import mlp, mlp_dataset
from worker_common import mean_over_ranks, run_each

import atorch
from atorch.booster import Booster
from atorch.booster.plugin import (
    AutoPlugin,
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from atorch.optimizer import local_tensor

STEPS = 3
LR = 0.1


def rank() -> int:
    return dist.get_rank()


def mlp_input(step: int) -> torch.Tensor:
    """Each rank's own batch (data parallel), different every step."""
    g = torch.Generator().manual_seed(100 * step + rank())
    return torch.randn(4, 16, generator=g)


def token_input(step: int) -> torch.Tensor:
    """The same batch on both ranks: one tensor-parallel group reads one batch."""
    g = torch.Generator().manual_seed(100 * step)
    return torch.randint(0, sm.VOCAB, (4, sm.SEQ_LEN), generator=g)


def mlp_criterion(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).mean()


def llama_criterion(x: Any) -> torch.Tensor:
    return x.logits.float().pow(2).mean()


MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[int], torch.Tensor], Callable[..., Any]]] = {
    "mlp": (mlp, mlp_input, mlp_criterion),
    "llama": (lambda: (torch.manual_seed(0), sm.tiny_llama())[1], token_input, llama_criterion),
}


def doc_example(plugin: Any, model_name: str, mixed_precision: str | None = None) -> dict[str, Any]:
    """Colossal-AI's documented Booster loop, unchanged but for the imports, the model and its input
    (a tiny model, a criterion that depends on every weight, lr 0.1 so that steps matter)."""
    make_model, make_input, loss_of = MODELS[model_name]
    booster = Booster(plugin=plugin, mixed_precision=mixed_precision)
    model = make_model()
    criterion = loss_of
    optimizer = SGD((model.parameters()), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    model, optimizer, criterion, _, scheduler = booster.boost(model, optimizer, criterion, lr_scheduler=scheduler)

    losses = []
    for step in range(STEPS):
        x = make_input(step)
        output = model(x)
        loss = criterion(output)
        booster.backward(loss, optimizer)
        optimizer.clip_grad_by_norm(1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss))
    return {"losses": losses, "strategy": booster.strategy.to_json(indent=None), "lr": optimizer.param_groups[0]["lr"]}


def engine_run(strategy: str, model_name: str) -> list[float]:
    """The same loop written against auto_accelerate with the strategy the plugin translated into."""
    make_model, make_input, loss_of = MODELS[model_name]
    _, result, _ = atorch.auto_accelerate(make_model(), SGD, optim_args={"lr": LR}, load_strategy=strategy,
                                          dataloader_args={"batch_size": 2})
    return engine_steps(result, [make_input(step) for step in range(STEPS)], loss_of)


def engine_steps(result: Any, inputs: list[Any], loss_of: Any) -> list[float]:
    """The documented loop on an auto_accelerate result (StepLR, clipping at 1.0); closes the result."""
    scheduler = torch.optim.lr_scheduler.StepLR(result.optim, step_size=1, gamma=0.5)
    losses = []
    for x in inputs:
        loss = loss_of(result.model(result.prepare_input(x, result.args.device)))
        result.optim.backward(loss) if result.args.use_optim_backward else loss.backward()
        result.optim.clip_grad_norm_(1.0)
        result.optim.step()
        scheduler.step()
        result.optim.zero_grad()
        losses.append(mean_over_ranks(loss))
    result.close()
    return losses


def compare(plugin: Callable[[], Any], model_name: str = "mlp", mixed_precision: str | None = None) -> dict[str, Any]:
    entry = doc_example(plugin(), model_name, mixed_precision)
    entry["engine"] = engine_run(entry["strategy"], model_name)
    return entry


# ----- pipeline: execute_pipeline against one process ----------------------------------------------------
PP_BATCH = 4


def pp_reference(dataset: Any, steps: int, clip: float | None) -> list[float]:
    """Plain single-process fp32 training on the same batches, torch's clipping, the same scheduler."""
    torch.manual_seed(0)
    model = sm.tiny_llama(layers=4)
    optimizer = SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    batches, losses = iter(DataLoader(dataset, batch_size=PP_BATCH)), []
    for _ in range(steps):
        batch = next(batches)
        loss = model(**batch).loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def pipeline(clip: float | None) -> dict[str, Any]:
    """Colossal-AI's pipeline loop (HybridParallelPlugin docs): execute_pipeline, then the step."""
    dataset = sm.TokenDataset(samples=16)
    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2, precision="fp32")
    booster = Booster(plugin=plugin)
    torch.manual_seed(0)
    model = sm.tiny_llama(layers=4)
    optimizer = SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    dataloader = plugin.prepare_dataloader(dataset, batch_size=PP_BATCH)

    def criterion(outputs: Any, inputs: Any) -> torch.Tensor:
        return outputs.loss

    model, optimizer, criterion, dataloader, scheduler = booster.boost(model, optimizer, criterion, dataloader,
                                                                       scheduler)
    it, losses, on_ranks = iter(dataloader), [], []
    for _ in range(STEPS):
        outputs = booster.execute_pipeline(it, model, criterion, optimizer, return_loss=True)
        if clip is not None:
            optimizer.clip_grad_by_norm(clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(outputs["loss"].item())
        on_ranks.append(gathered(outputs["loss"].item()))
    refusals = {}
    try:
        model(next(it))
    except atorch.SetupError as exc:
        refusals["forward"] = str(exc)
    try:
        with booster.no_sync(model, optimizer):
            pass
    except atorch.SetupError as exc:
        refusals["no_sync"] = str(exc)
    return {"losses": losses, "on_ranks": on_ranks, "reference": pp_reference(dataset, STEPS, clip),
            "sampler": [dataloader.sampler.num_replicas, dataloader.sampler.rank], "refusals": refusals}


def gathered(value: float) -> list[float]:
    out = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([value], dtype=torch.float64))
    return [o.item() for o in out]


# ----- no_sync: two micro-batches equal one batch ---------------------------------------------------------
def no_sync(plugin: Callable[[], Any]) -> dict[str, Any]:
    """The first micro-batch inside booster.no_sync, the second outside, then the step: the weights must equal
    one step on both micro-batches together; inside, gradients stay each rank's own and a step is refused."""
    def run(accumulate: bool) -> dict[str, Any]:
        booster = Booster(plugin=plugin())
        model = mlp()
        optimizer = SGD(model.parameters(), lr=LR)
        model, optimizer, *_ = booster.boost(model, optimizer)
        x1, x2 = mlp_input(0), mlp_input(1)
        entry: dict[str, Any] = {}
        if accumulate:
            with booster.no_sync(model, optimizer):
                booster.backward(mlp_criterion(model(x1)) / 2, optimizer)
                try:
                    optimizer.step()
                except atorch.SetupError as exc:
                    entry["step_refused"] = str(exc)
            grad = sum(float(local_tensor(p.grad).double().sum()) for p in model.parameters() if p.grad is not None)
            values = gathered(grad)
            entry["unsynced"] = abs(values[0] - values[1])  # each rank still holds its own gradient
            booster.backward(mlp_criterion(model(x2)) / 2, optimizer)
        else:
            booster.backward(mlp_criterion(model(torch.cat([x1, x2]))), optimizer)
        optimizer.step()
        entry["weights"] = [mean_over_ranks(local_tensor(p).detach().double().sum()) for p in model.parameters()]
        return entry

    accumulated = run(True)
    accumulated["whole"] = run(False)["weights"]
    return accumulated


# ----- parameter groups and a scheduler that was stepped before boost --------------------------------------
def param_groups(plugin: Callable[[], Any]) -> dict[str, Any]:
    booster = Booster(plugin=plugin())
    model = mlp()
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0, "lr": 0.05}], lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    optimizer.step()  # before any gradient: a no-op that keeps the optimizer state empty
    scheduler.step()  # the schedule is at epoch 1 when boosted
    model, optimizer, _, _, scheduler = booster.boost(model, optimizer, lr_scheduler=scheduler)
    before = [(g["lr"], g["weight_decay"], len(g["params"])) for g in optimizer.param_groups]
    booster.backward(mlp_criterion(model(mlp_input(0))), optimizer)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    trained = {id(p) for p in model.parameters()}
    return {"before": before, "after": [g["lr"] for g in optimizer.param_groups],
            "last_epoch": scheduler.last_epoch, "groups_on_boosted_model":
            all(id(p) in trained for g in optimizer.param_groups for p in g["params"]),
            "scheduler_on": type(scheduler.optimizer).__name__}


# ----- AutoPlugin -------------------------------------------------------------------------------------------
AUTO_SEARCH = {"max_trials": 2, "warmup_steps": 1, "measure_steps": 1, "min_measure_s": 0, "top_k": 2}


def auto() -> dict[str, Any]:
    plugin = AutoPlugin(search=AUTO_SEARCH)
    booster = Booster(plugin=plugin)
    model = mlp()
    optimizer = SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    dataloader = plugin.prepare_dataloader(mlp_dataset(), batch_size=4)
    model, optimizer, criterion, dataloader, scheduler = booster.boost(model, optimizer, mlp_criterion, dataloader,
                                                                       scheduler)
    losses, batches = [], iter(dataloader)
    for _ in range(STEPS):
        x, _y = next(batches)
        loss = criterion(model(x))
        booster.backward(loss, optimizer)
        optimizer.clip_grad_by_norm(1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss))
    strategy = booster.strategy.to_json(indent=None)
    # the engine with the picked strategy, on the same data
    _, result, _ = atorch.auto_accelerate(mlp(), SGD, mlp_dataset(), optim_args={"lr": LR}, load_strategy=strategy,
                                          dataloader_args={"batch_size": booster.result.args.global_batch_size,
                                                           "shuffle": False})
    batches = iter(result.dataloader)
    engine = engine_steps(result, [next(batches)[0] for _ in range(STEPS)], mlp_criterion)
    return {"losses": losses, "engine": engine, "strategy": strategy,
            "source": booster.result.args.search["source"] if booster.result.args.search else None}


def tp_sampler() -> dict[str, Any]:
    plugin = HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32")
    loader = plugin.prepare_dataloader(mlp_dataset(), batch_size=4, shuffle=True)
    ddp = TorchDDPPlugin().prepare_dataloader(mlp_dataset(), batch_size=4)
    return {"tp": [loader.sampler.num_replicas, loader.sampler.rank], "ddp": [ddp.sampler.num_replicas,
                                                                               ddp.sampler.rank]}


P = functools.partial
GROUPS: dict[str, dict[str, Callable[[], dict[str, Any]]]] = {
    "plugins": {
        "TorchDDPPlugin": P(compare, TorchDDPPlugin),
        "TorchDDPPlugin+bf16": P(compare, TorchDDPPlugin, mixed_precision="bf16"),
        "TorchFSDPPlugin": P(compare, TorchFSDPPlugin),
        "LowLevelZeroPlugin[stage1,bf16]": P(compare, P(LowLevelZeroPlugin, stage=1, precision="bf16")),
        "LowLevelZeroPlugin[stage2]": P(compare, P(LowLevelZeroPlugin, stage=2, precision="fp32")),
        "GeminiPlugin[offload]": P(compare, P(GeminiPlugin, precision="bf16", offload_optim_frac=1.0,
                                              offload_param_frac=1.0)),
        "HybridParallelPlugin[tp2]": P(compare, P(HybridParallelPlugin, tp_size=2, pp_size=1, precision="fp32"),
                                       "llama"),
        "pipeline[pp2,clip]": P(pipeline, 1.0),
        "pipeline[pp2]": P(pipeline, None),
        "tp_sampler": tp_sampler,
    },
    "accumulate": {
        "no_sync/TorchDDPPlugin": P(no_sync, TorchDDPPlugin),
        "no_sync/TorchFSDPPlugin": P(no_sync, TorchFSDPPlugin),
        "no_sync/LowLevelZeroPlugin[stage1]": P(no_sync, P(LowLevelZeroPlugin, stage=1, precision="fp32")),
        "no_sync/LowLevelZeroPlugin[stage2]": P(no_sync, P(LowLevelZeroPlugin, stage=2, precision="fp32")),
        "groups/LowLevelZeroPlugin[stage1]": P(param_groups, P(LowLevelZeroPlugin, stage=1, precision="fp32")),
        "groups/TorchFSDPPlugin": P(param_groups, TorchFSDPPlugin),
        "AutoPlugin": auto,
    },
}
GROUPS["all"] = {**GROUPS["plugins"], **GROUPS["accumulate"]}  # one launch: starting processes costs most


def timed(fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        start = time.perf_counter()
        entry = fn()
        entry["seconds"] = round(time.perf_counter() - start, 2)
        return entry

    return run


def main() -> None:
    only = sys.argv[3:]
    report = run_each({name: timed(fn) for name, fn in GROUPS[sys.argv[1]].items() if not only or name in only})
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
