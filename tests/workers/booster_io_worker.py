"""The Booster's checkpoint IO under real strategies (launched by tests/test_booster_io.py on 2 ranks).

``booster_io_worker.py GROUP OUT``: runs the scenarios of GROUP, writing under the directory OUT, and
rank 0 prints ``RESULT {scenario: {...} or {"error": ...}}``.

Weights are compared through per-name checksums of whole tensors (the sum and a position-weighted
sum, in float64): identical tensors give identical checksums, and the reference side is taken with
torch's own DTensor.full_tensor on the rank that holds each tensor, not with the code under test.
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import functools
import json
import sys
from pathlib import Path
from typing import Any

import shard_models as sm
import torch
import torch.distributed as dist
from torch import nn
from worker_common import run_each

import atorch
from atorch.booster import checkpoint_io as io
from atorch.booster.lora import enable_lora
from atorch.distributed import all_gather_json
from atorch.state_names import named_state
from atorch.training import train_step

OUT = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(".")
PP2 = [("parallel_mode", {"dims": [["pipeline", 2], ["data", -1]]}), ("pipeline_parallel", {"schedule": "1f1b"})]
SMALL_SHARD_MB = 0.02  # 20 KiB: the tiny GPT-2's 16 KiB embedding and its blocks need several files


def rank() -> int:
    return dist.get_rank()


ARCHS = {"gpt2": sm.tiny_gpt2, "llama": sm.tiny_llama}


def build(strategy: list[Any], seed: int = 0, layers: int = 2, model: nn.Module | None = None,
          optim: Any = torch.optim.SGD, lr: float = 0.1, scheduler: bool = False, arch: str = "gpt2") -> Any:
    torch.manual_seed(seed)
    model = model if model is not None else ARCHS[arch](layers)
    extra = {"lr_scheduler_cls": torch.optim.lr_scheduler.StepLR,
             "lr_scheduler_args": {"step_size": 1, "gamma": 0.5}} if scheduler else {}
    _, result, _ = atorch.auto_accelerate(
        model, optim, sm.TokenDataset(), sm.hf_loss, model_input_format="unpack_dict", optim_args={"lr": lr},
        dataloader_args={"batch_size": 8, "shuffle": False}, load_strategy=strategy, **extra)
    return result


def sums(tensor: torch.Tensor) -> list[float]:
    flat = tensor.detach().double().reshape(-1)
    return [flat.sum().item(), (flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum().item()]


def checksums(model: nn.Module) -> dict[str, list[float]]:
    """Every name's checksums over all ranks (the first rank holding a name gives it), on every rank."""
    mine = {}
    for name, tensor in named_state(model):
        whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        mine.setdefault(name, sums(whole))
    merged: dict[str, list[float]] = {}
    for part in all_gather_json(mine):
        for name, value in part.items():
            merged.setdefault(name, value)
    return merged


def plain_sums(state: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    return {name: sums(t) for name, t in state.items()}


def differing(a: dict[str, list[float]], b: dict[str, list[float]]) -> list[str]:
    return sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))


def train(result: Any, steps: int) -> list[float]:
    batches = iter(result.dataloader)
    losses = []
    for _ in range(steps):
        losses.append(train_step(result, [next(batches)]).item())  # steps the LR scheduler too
    return losses


def load_plain_from_index(directory: Path, layers: int, arch: str = "gpt2") -> dict[str, Any]:
    """Rank 0: a fresh unboosted model loaded with safetensors + load_state_dict, and with from_pretrained."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    index = json.loads((directory / "model.safetensors.index.json").read_text())
    state: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        state.update(load_file(str(directory / file)))
    torch.manual_seed(123)
    plain = ARCHS[arch](layers)
    plain.load_state_dict(state, strict=True)
    pretrained = AutoModelForCausalLM.from_pretrained(str(directory))
    return {"plain": plain_sums(plain.state_dict()), "pretrained": plain_sums(pretrained.state_dict()),
            "files": sorted(os.listdir(directory)), "total_size": index["metadata"]["total_size"]}


# ----- scenarios -------------------------------------------------------------------------------------------
def model_round_trip(name: str, strategy: list[Any], layers: int, reload: dict[str, list[Any]],
                     arch: str = "gpt2") -> dict[str, Any]:
    """Train, save sharded safetensors, load into plain models (rank 0) and into fresh boosted ones."""
    result = build(strategy, layers=layers, arch=arch)
    train(result, 2)
    reference = checksums(result.model)
    folder = OUT / name
    io.save_model(result.model, str(folder), shard=True, size_per_shard=SMALL_SHARD_MB, use_safetensors=True)
    entry: dict[str, Any] = {"names": len(reference)}
    if rank() == 0:
        loaded = load_plain_from_index(folder, layers, arch)
        entry.update(files=loaded["files"], total_size=loaded["total_size"],
                     plain_differs=differing(loaded["plain"], reference),
                     pretrained_differs=differing(loaded["pretrained"], reference))
    result.close()
    for label, other in reload.items():
        fresh = build(other, seed=7, layers=layers, arch=arch)
        before = differing(checksums(fresh.model), reference)
        io.load_model(fresh.model, str(folder))
        entry[f"reload[{label}]"] = {"differs_before": len(before), "differs": differing(checksums(fresh.model),
                                                                                            reference)}
        fresh.close()
    return entry


def optimizer_resume(name: str, strategy: list[Any], load_strategy: list[Any], shard: bool,
                     control: bool = False) -> dict[str, Any]:
    """Two steps, save model + optimizer + scheduler, two more steps (A); a fresh result loads and runs
    the same two steps (B). The first loss checks the weights, the second the optimizer state and LR."""
    result = build(strategy, optim=torch.optim.AdamW, lr=0.01, scheduler=True)
    batches = iter(result.dataloader)
    first = [next(batches) for _ in range(4)]
    for batch in first[:2]:
        train_step(result, [batch])  # steps the LR scheduler too
    folder = OUT / name
    io.save_model(result.model, str(folder / "model"), shard=True, size_per_shard=SMALL_SHARD_MB)
    optim_path = str(folder / "optim") if shard else str(folder / "optim.safetensors")
    io.save_optimizer(result.optim, optim_path, shard=shard, size_per_shard=SMALL_SHARD_MB)
    io.save_lr_scheduler(result.lr_scheduler, str(folder / "scheduler.json"))
    after_a = []
    for batch in first[2:]:
        after_a.append(train_step(result, [batch]).item())
    lr_a = result.optim.param_groups[0]["lr"]
    result.close()

    fresh = build(load_strategy, seed=7, optim=torch.optim.AdamW, lr=0.5, scheduler=True)
    io.load_model(fresh.model, str(folder / "model"))
    io.load_optimizer(fresh.optim, optim_path)
    io.load_lr_scheduler(fresh.lr_scheduler, str(folder / "scheduler.json"))
    lr_loaded = fresh.optim.param_groups[0]["lr"]
    after_b = []
    for batch in first[2:]:
        after_b.append(train_step(fresh, [batch]).item())
    entry = {"a": after_a, "b": after_b, "lr_a": lr_a, "lr_b": fresh.optim.param_groups[0]["lr"],
             "lr_loaded": lr_loaded, "files": sorted(os.listdir(folder / "optim")) if shard else None}
    if shard and rank() == 0:
        index = json.loads((folder / "optim" / "optimizer.safetensors.index.json").read_text())
        entry["keys"] = sorted(index["weight_map"])
        entry["groups"] = [sorted(g["params"]) for g in index["metadata"]["param_groups"]]
    fresh.close()
    if control:  # the same without the optimizer state: the second loss must differ, or the check shows nothing
        fresh = build(load_strategy, seed=7, optim=torch.optim.AdamW, lr=0.5, scheduler=True)
        io.load_model(fresh.model, str(folder / "model"))
        io.load_lr_scheduler(fresh.lr_scheduler, str(folder / "scheduler.json"))
        entry["without_optimizer_state"] = [train_step(fresh, [batch]).item() for batch in first[2:]]
        fresh.close()
    return entry


def tied_optimizer_state() -> dict[str, Any]:
    """DDP state (GPT-2's tied weight saved once, as transformer.wte.weight) loaded at pp2, where the last stage
    trains its own copy under the name lm_head.weight: that copy takes the tied weight's state."""
    result = build(["parallel_mode"], layers=4, optim=torch.optim.AdamW, lr=0.01)
    train(result, 2)
    io.save_optimizer(result.optim, str(OUT / "tied" / "ddp.safetensors"))
    result.close()
    fresh = build(PP2, seed=7, layers=4, optim=torch.optim.AdamW, lr=0.01)
    io.load_optimizer(fresh.optim, str(OUT / "tied" / "ddp.safetensors"))
    io.save_optimizer(fresh.optim, str(OUT / "tied" / "pp2.safetensors"))  # what each stage now holds
    fresh.close()
    entry: dict[str, Any] = {}
    if rank() == 0:
        from safetensors.torch import load_file

        ddp, pp = load_file(str(OUT / "tied" / "ddp.safetensors")), load_file(str(OUT / "tied" / "pp2.safetensors"))
        entry["ddp_names"] = sorted(k for k in ddp if "wte" in k or "lm_head" in k)
        entry["pp2_names"] = sorted(k for k in pp if "wte" in k or "lm_head" in k)
        entry["equal"] = all(torch.equal(pp[k.replace("transformer.wte", "lm_head")], ddp[k])
                             and torch.equal(pp[k], ddp[k]) for k in ddp if "wte" in k)
        entry["all_equal"] = all(torch.equal(pp[k], v) for k, v in ddp.items() if k.startswith("state."))
    return entry


def lora(name: str, strategy: list[Any]) -> dict[str, Any]:
    from peft import LoraConfig, PeftModel

    torch.manual_seed(0)
    model = enable_lora(sm.tiny_gpt2(), lora_config=LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                               lora_dropout=0.0))
    before = plain_sums(model.state_dict())
    result = build(strategy, model=model, optim=torch.optim.AdamW, lr=0.01)
    train(result, 2)
    after = checksums(result.model)
    changed = differing(before, after)
    folder = OUT / name
    io.save_lora_as_pretrained(result.model, str(folder), use_safetensors=True)
    batch = {"input_ids": sm.TokenDataset(samples=2, seed=9).tokens}
    with torch.no_grad():
        trained_logits = result.model(**batch).logits
    entry: dict[str, Any] = {"changed": changed, "lora_names": sorted(n for n in after if "lora_" in n)}
    if rank() == 0:
        torch.manual_seed(0)
        loaded = PeftModel.from_pretrained(sm.tiny_gpt2(), str(folder))
        with torch.no_grad():
            logits = loaded(**batch).logits
        entry.update(files=sorted(os.listdir(folder)), max_logit_diff=(logits - trained_logits).abs().max().item(),
                     loaded_differs=differing(plain_sums(loaded.state_dict()), after))
    result.close()
    return entry


def error_of(call: Any) -> str | None:
    try:
        call()
    except atorch.AtorchError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def half_unsharded() -> dict[str, Any]:
    """half (bf16) under fsdp: one safetensors file in bf16; loading into an fp32 DDP model casts (exactly)."""
    result = build(["fsdp", ("half", "bf16")])
    train(result, 1)
    reference = checksums(result.model)
    path = OUT / "half" / "weights.safetensors"
    io.save_model(result.model, str(path))
    entry: dict[str, Any] = {}
    if rank() == 0:
        from safetensors.torch import load_file

        state = load_file(str(path))
        entry["dtypes"] = sorted({str(t.dtype) for t in state.values()})
        entry["file_differs"] = differing(plain_sums(state), reference)
    result.close()
    fresh = build(["parallel_mode"], seed=7)
    io.load_model(fresh.model, str(path))
    entry["fp32_differs"] = differing(checksums(fresh.model), reference)
    entry["fp32_dtypes"] = sorted({str(t.dtype) for _, t in named_state(fresh.model)})
    fresh.close()
    return entry


def errors() -> dict[str, Any]:
    """Bad input on 2 ranks: every rank raises the same clear error (none is left in a collective)."""
    result = build(["fsdp"])
    other = OUT / "errors_other"
    torch.manual_seed(0)
    io.save_model(sm.tiny_gpt2(3), str(other), shard=True)  # a plain model with one more block (collective)
    entry = {
        "missing": error_of(lambda: io.load_model(result.model, str(OUT / "nothing_here"))),
        "other_model": error_of(lambda: io.load_model(result.model, str(other))),
        "optimizer_from_model": error_of(lambda: io.load_optimizer(result.optim, str(other))),
    }
    # still usable afterwards: the ranks are in step
    entry["after"] = train(result, 1)
    result.close()
    return entry


# ----- the Colossal-AI documentation example, with checkpoints -------------------------------------------
def doc_input(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank())  # each rank its own batch (data parallel)
    return torch.randn(4, 16, generator=g)


def doc_example(plugin: Any, name: str) -> dict[str, Any]:
    """Colossal-AI's documented Booster loop (tiny model, lr 0.1), then its checkpoint calls: save the model
    as a sharded safetensors folder, the optimizer and the scheduler; a fresh plain model loads the folder,
    and a fresh boosted run loads everything and takes the next step as the original does."""
    from toy_models import mlp

    from atorch.booster import Booster

    def boosted(seed: int) -> tuple[Any, Any, Any, Any, Any]:
        booster = Booster(plugin=plugin())
        model = mlp(seed)
        criterion = lambda x: x.pow(2).mean()  # noqa: E731  (depends on every weight)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        model, optimizer, criterion, _, scheduler = booster.boost(model, optimizer, criterion, lr_scheduler=scheduler)
        return booster, model, optimizer, criterion, scheduler

    def step(booster: Any, model: Any, optimizer: Any, criterion: Any, scheduler: Any, index: int) -> float:
        loss = criterion(model(doc_input(index)))
        booster.backward(loss, optimizer)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        value = loss.detach().reshape(1).clone()
        dist.all_reduce(value)
        return value.item() / dist.get_world_size()

    run = boosted(0)
    booster, model, optimizer, _, scheduler = run
    for index in range(2):
        step(*run, index)
    folder = OUT / name
    booster.save_model(model, str(folder / "model"), shard=True, use_safetensors=True, size_per_shard=0.002)
    booster.save_optimizer(optimizer, str(folder / "optimizer"), shard=True)
    booster.save_lr_scheduler(scheduler, str(folder / "scheduler.json"))
    reference = checksums(model.module)
    next_losses = [step(*run, index) for index in (2, 3)]

    entry: dict[str, Any] = {"next": next_losses}
    if rank() == 0:
        from safetensors.torch import load_file

        index = json.loads((folder / "model" / "model.safetensors.index.json").read_text())
        state: dict[str, torch.Tensor] = {}
        for file in sorted(set(index["weight_map"].values())):
            state.update(load_file(str(folder / "model" / file)))
        plain = mlp(5)
        plain.load_state_dict(state, strict=True)
        entry.update(shards=len(set(index["weight_map"].values())),
                     plain_differs=differing(plain_sums(plain.state_dict()), reference))
    fresh = boosted(7)
    booster, model, optimizer, _, scheduler = fresh
    booster.load_model(model, str(folder / "model"))
    booster.load_optimizer(optimizer, str(folder / "optimizer"))
    booster.load_lr_scheduler(scheduler, str(folder / "scheduler.json"))
    entry["loaded_differs"] = differing(checksums(model.module), reference)
    entry["resumed"] = [step(*fresh, index) for index in (2, 3)]
    return entry


def doc_lora(plugin: Any) -> dict[str, Any]:
    """booster.enable_lora before boost, train, booster.save_lora_as_pretrained, PeftModel.from_pretrained."""
    from peft import LoraConfig, PeftModel

    from atorch.booster import Booster

    booster = Booster(plugin=plugin())
    torch.manual_seed(0)
    model = booster.enable_lora(sm.tiny_gpt2(), lora_config=LoraConfig(r=4, target_modules=["c_attn"]))
    before = plain_sums(model.state_dict())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    model, optimizer, *_ = booster.boost(model, optimizer)
    tokens = sm.TokenDataset(samples=4, seed=rank()).tokens
    for _ in range(2):
        booster.backward(model(input_ids=tokens, labels=tokens).loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
    folder = OUT / "doc_lora"
    changed = differing(before, checksums(model.module))
    booster.save_lora_as_pretrained(model, str(folder))
    with torch.no_grad():
        trained = model(input_ids=tokens).logits
    entry: dict[str, Any] = {"changed": changed}
    if rank() == 0:
        torch.manual_seed(0)
        loaded = PeftModel.from_pretrained(sm.tiny_gpt2(), str(folder))
        with torch.no_grad():
            entry["max_logit_diff"] = (loaded(input_ids=tokens).logits - trained).abs().max().item()
        entry["files"] = sorted(os.listdir(folder))
    return entry


def _plugins() -> dict[str, Any]:
    from atorch.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin, TorchFSDPPlugin

    return {"TorchDDPPlugin": TorchDDPPlugin, "TorchFSDPPlugin": TorchFSDPPlugin,
            "LowLevelZeroPlugin[stage1]": functools.partial(LowLevelZeroPlugin, stage=1, precision="fp32"),
            "LowLevelZeroPlugin[stage2]": functools.partial(LowLevelZeroPlugin, stage=2, precision="fp32"),
            "GeminiPlugin[offload]": functools.partial(GeminiPlugin, precision="bf16", offload_optim_frac=1.0,
                                                       offload_param_frac=1.0)}


GROUPS = {
    "model": {
        "fsdp->plain,ddp": functools.partial(model_round_trip, "fsdp_hf", ["fsdp"], 2,
                                             {"ddp": ["parallel_mode"]}),
        "pp2->plain,fsdp,pp2": functools.partial(model_round_trip, "pp2_hf", PP2, 4,
                                                 {"fsdp": ["fsdp"], "pp2": PP2}),
        "errors": errors,
    },
    "optim": {
        "llama tp2->plain,fsdp": functools.partial(
            model_round_trip, "tp2_hf", [("parallel_mode", {"dims": [["data", -1], ["tensor", 2]]}),
                                         "tensor_parallel"], 2, {"fsdp": ["fsdp"]}, "llama"),
        "half[bf16]": half_unsharded,
        "resume[fsdp, sharded]": functools.partial(optimizer_resume, "opt_fsdp", ["fsdp"], ["fsdp"], True),
        "resume[zero1]": functools.partial(optimizer_resume, "opt_zero1", ["zero1"], ["zero1"], False),
        "resume[ddp]": functools.partial(optimizer_resume, "opt_ddp", ["parallel_mode"], ["parallel_mode"], False,
                                         control=True),
        "resume[pp2]": functools.partial(optimizer_resume, "opt_pp2", PP2, PP2, True),
        "tied state ddp->pp2": tied_optimizer_state,
        "resume[fsdp->ddp]": functools.partial(optimizer_resume, "opt_cross", ["fsdp"], ["parallel_mode"], True),
        "lora[fsdp]": functools.partial(lora, "lora_fsdp", ["fsdp"]),
    },
}


GROUPS["model"].update({  # one launch: starting the processes costs a good part of each
    **{f"doc[{n}]": functools.partial(doc_example, p, f"doc_{i}") for i, (n, p) in enumerate(_plugins().items())},
    "doc_lora[TorchDDPPlugin]": functools.partial(doc_lora, _plugins()["TorchDDPPlugin"]),
})


def main() -> None:
    only = sys.argv[3:]
    report = run_each({n: s for n, s in GROUPS[sys.argv[1]].items() if not only or n in only})
    if rank() == 0:
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
