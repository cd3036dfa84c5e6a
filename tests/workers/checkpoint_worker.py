"""Checkpoint round trips under real strategies (launched by tests/test_checkpoint.py).

``multi OUT``: on 2 ranks, for each scenario: train K steps, save, export, train 2 more steps
(losses A); build a fresh result from a model with another seed, load, train the same 2 steps
(losses B). The first loss after the save checks the weights, the second the optimizer moments,
the LR schedule and the grad scaler.
``single OUT MULTI_OUT``: on 1 rank: round trips at world size 1, loading the 2-rank checkpoints
under another strategy, and the errors for bad input.
Rank 0 prints ``RESULT {json}``.
"""

from __future__ import annotations

import json
import sys
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import default_collate
from toy_models import MLP, TokenDataset, gpt2_loss, mlp, mlp_dataset, mlp_loss, tiny_gpt2

import atorch
from atorch.model_context import call_model
from atorch.training import train_step

K = 2  # steps before the save
SCHEDULER = dict(lr_scheduler_cls=torch.optim.lr_scheduler.StepLR, lr_scheduler_args={"step_size": 1, "gamma": 0.7})

# name -> (model kind, strategy)
MULTI = {
    "ddp": ("mlp", ["parallel_mode"]),
    "ddp_amp_fp16": ("mlp", ["parallel_mode", ("amp_native", {"dtype": "fp16"})]),
    "zero1": ("mlp", ["zero1"]),
    "zero2": ("mlp", ["zero2"]),
    "fsdp": ("mlp", ["fsdp"]),
    "fsdp_amp_fp16": ("mlp", ["fsdp", ("amp_native", {"dtype": "fp16"})]),
    "half_bf16_zero1": ("mlp", ["zero1", ("half", "bf16")]),
    "checkpoint_fsdp_gpt2": ("gpt2", ["fsdp", "checkpoint"]),
}
SINGLE = {
    "single_plain": ("mlp", ["parallel_mode"]),
    "single_fsdp": ("mlp", ["fsdp"]),
    "single_step0": ("mlp", ["parallel_mode"]),  # saved before any optimizer step: no optimizer state yet
}
# (2-rank checkpoint, strategy it is loaded under on 1 rank)
RESHARD = {"fsdp": ["parallel_mode"], "zero1": ["fsdp"]}
# (2-rank checkpoint, another strategy it is loaded under on the same 2 ranks)
RESHARD_SAME = {"fsdp": ["zero1"], "zero1": ["fsdp"], "ddp": ["zero2"], "zero2": ["parallel_mode"]}


def gpt2_with_dropout(seed: int) -> nn.Module:
    model = tiny_gpt2(seed)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.1  # the restored RNG state must reproduce the dropout masks
    return model


def accelerate(kind: str, strategy: Any, seed: int) -> Any:
    if kind == "mlp":
        model, data, loss, fmt, lr = mlp(seed), mlp_dataset(), mlp_loss, "unpack_sequence", 1e-2
    else:
        model, data, loss, fmt, lr = gpt2_with_dropout(seed), TokenDataset(), gpt2_loss, "unpack_dict", 3e-3
    _, result, _ = atorch.auto_accelerate(
        model, torch.optim.AdamW, data, loss, model_input_format=fmt, optim_args={"lr": lr},
        dataloader_args={"batch_size": 8, "shuffle": False}, load_strategy=strategy, **SCHEDULER,
    )
    return result


def probe(kind: str) -> Any:
    data = mlp_dataset() if kind == "mlp" else TokenDataset()
    return default_collate([data[i] for i in range(4)])


def output_of(result: Any, kind: str) -> torch.Tensor:
    result.model.eval()
    with torch.no_grad():
        out = call_model(result.model, result.prepare_input(probe(kind), result.args.device),
                         result.args.model_input_format)
    result.model.train()
    return (out if kind == "mlp" else out.logits).detach().cpu()


def global_mean(loss: torch.Tensor) -> float:
    loss = loss.detach().float().clone()
    dist.all_reduce(loss)
    return (loss / dist.get_world_size()).item()


def full_params(result: Any) -> dict[str, torch.Tensor]:
    return get_model_state_dict(result.model, options=StateDictOptions(full_state_dict=True))


def scaler_state(result: Any) -> dict[str, Any] | None:
    scaler = result.optim.grad_scaler
    return scaler.state_dict() if scaler is not None else None


def round_trip(name: str, kind: str, strategy: Any, root: Path, k: int = K, control: bool = False) -> dict[str, Any]:
    out = root / name
    a = accelerate(kind, strategy, seed=0)
    batches = list(islice(a.dataloader, k + 2))
    for batch in batches[:k]:
        train_step(a, [batch])
    saved = {"lr": a.optim.param_groups[0]["lr"], "scaler": scaler_state(a)}
    atorch.save_checkpoint(out / "ckpt", a, step=k, extra={"scenario": name, "lr": saved["lr"]})
    atorch.export_consolidated(out / "model.pt", a)
    expected = output_of(a, kind)
    if dist.get_rank() == 0:
        torch.save({"output": expected}, out / "expected.pt")
    losses_a = [global_mean(train_step(a, [batch])) for batch in batches[k:]]
    params_a = full_params(a)

    b = accelerate(kind, strategy, seed=7)
    b_batches = list(islice(b.dataloader, k + 2))  # the iterator draws a seed: create it before loading
    info = atorch.load_checkpoint(out / "ckpt", b)
    loaded = {"lr": b.optim.param_groups[0]["lr"], "scaler": scaler_state(b)}
    losses_b = [global_mean(train_step(b, [batch])) for batch in b_batches[k:]]
    params_b = full_params(b)
    diff = max((params_a[k].float() - params_b[k].float()).abs().max().item() for k in params_a)
    report = {
        "k": k, "kind": kind, "strategy": strategy, "losses_a": losses_a, "losses_b": losses_b,
        "max_param_diff": diff, "same_keys": sorted(params_a) == sorted(params_b), "info": info,
        "saved": saved, "loaded": loaded, "dir": str(out),
    }
    if control:  # the same load, then the optimizer moments dropped: the second loss must differ
        c = accelerate(kind, strategy, seed=7)
        c_batches = list(islice(c.dataloader, k + 2))
        atorch.load_checkpoint(out / "ckpt", c)
        c.optim.optimizer.state.clear()
        report["losses_control"] = [global_mean(train_step(c, [batch])) for batch in c_batches[k:]]
    return report


def reshard(source: Path, kind: str, strategy: Any) -> dict[str, Any]:
    """A 2-rank checkpoint loaded under another strategy (on 1 rank, or on the same 2); the same
    global batches."""
    result = accelerate(kind, strategy, seed=3)
    batches = list(islice(result.dataloader, K + 2))
    info = atorch.load_checkpoint(source, result)
    return {"losses": [global_mean(train_step(result, [b])) for b in batches[K:]], "info": info}


def error_of(call: Any) -> dict[str, str]:
    try:
        call()
    except Exception as exc:  # reported to the test, which checks type and message
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": "none", "message": ""}


def mlp_with(model: nn.Module, optim: Any, strategy: Any, **optim_args: Any) -> Any:
    _, result, _ = atorch.auto_accelerate(
        model, optim, mlp_dataset(), mlp_loss, model_input_format="unpack_sequence", optim_args=optim_args,
        dataloader_args={"batch_size": 8}, load_strategy=strategy, **SCHEDULER,
    )
    return result


def bad_inputs(root: Path, multi: Path) -> dict[str, Any]:
    mlp_result = accelerate("mlp", ["parallel_mode"], seed=0)
    (root / "empty").mkdir(parents=True, exist_ok=True)
    wider = mlp_with(MLP(dim=48), torch.optim.AdamW, ["parallel_mode"])
    sgd = mlp_with(mlp(0), torch.optim.SGD, ["parallel_mode"], lr=0.1, momentum=0.9)
    train_step(sgd, [next(iter(sgd.dataloader))])
    sgd_zero1 = mlp_with(mlp(0), torch.optim.SGD, ["zero1"], lr=0.1, momentum=0.9)
    gpt2 = accelerate("gpt2", ["parallel_mode"], seed=0)
    return {
        "missing": error_of(lambda: atorch.load_checkpoint(root / "nowhere", mlp_result)),
        "empty_dir": error_of(lambda: atorch.load_checkpoint(root / "empty", mlp_result)),
        "other_model": error_of(lambda: atorch.load_checkpoint(multi / "ddp" / "ckpt", gpt2)),
        "other_shape": error_of(lambda: atorch.load_checkpoint(multi / "ddp" / "ckpt", wider)),
        "other_optimizer": error_of(lambda: atorch.load_checkpoint(multi / "ddp" / "ckpt", sgd)),
        "other_optimizer_zero1": error_of(lambda: atorch.load_checkpoint(multi / "zero1" / "ckpt", sgd_zero1)),
        "extra_not_json": error_of(lambda: atorch.save_checkpoint(root / "bad", mlp_result, extra={"x": object()})),
    }


def deepspeed_case(root: Path) -> dict[str, Any]:
    """DeepSpeed: save/load refuse with directions; the consolidated export works."""
    strategy = [["zero1", {"use_ds_zero": True}]]
    result = accelerate("mlp", strategy, seed=0)
    for batch in islice(result.dataloader, K):
        train_step(result, [batch])
    report = {
        "save": error_of(lambda: atorch.save_checkpoint(root / "ds", result)),
        "load": error_of(lambda: atorch.load_checkpoint(root / "ds", result)),
    }
    atorch.export_consolidated(root / "ds" / "model.pt", result)
    torch.save({"output": output_of(result, "mlp")}, root / "ds" / "expected.pt")
    report.update(dir=str(root / "ds"), strategy=strategy)
    return report


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    report: dict[str, Any] = {}
    if mode == "multi":
        for name, (kind, strategy) in MULTI.items():
            report[name] = round_trip(name, kind, strategy, root, control=name == "ddp")
        report["reshard_same"] = {
            src: reshard(root / src / "ckpt", "mlp", strategy) for src, strategy in RESHARD_SAME.items()
        }
    else:
        multi = Path(sys.argv[3])
        for name, (kind, strategy) in SINGLE.items():
            report[name] = round_trip(name, kind, strategy, root, k=0 if name == "single_step0" else K)
        report["reshard"] = {src: reshard(multi / src / "ckpt", "mlp", strategy) for src, strategy in RESHARD.items()}
        report["errors"] = bad_inputs(root, multi)
        report["deepspeed"] = deepspeed_case(root)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
