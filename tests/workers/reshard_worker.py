"""Checkpoints resharded between layouts (launched by tests/test_checkpoint_reshard.py).

``multi OUT`` on 4 processes: for each saving scenario (SAVES) a model trains K steps under its layout,
saves, writes what each rank holds (weights and optimizer state, global tensors under the user's names)
to ``OUT/<save>/held.<rank>.pt`` and trains 2 more steps (the uninterrupted losses). Then, in the same
processes, each loading scenario (LOADS) builds the model under another layout from other weights, loads
the checkpoint, compares what each rank holds with what was saved, bit for bit, and trains the same 2 steps.
``single OUT MULTI_OUT`` on 1 process: the saves of SINGLE_SAVES (for their keys) and the loads of
SINGLE_LOADS (plain training in one process).
Rank 0 prints ``RESULT {json}``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import functools
import json
import sys
from itertools import islice
from pathlib import Path
from typing import Any

import shard_models as sm
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor
from worker_common import run_each

import atorch
from atorch.checkpointing import qkv as state_io_qkv
from atorch.checkpointing.keys import CheckpointNames
from atorch.distributed import all_gather_json
from atorch.training import train_step

K = 2  # steps before the save
AFTER = 2  # steps after it: the first loss reads the weights, the second also the optimizer's momentum
GLOBAL_BATCH = 8
MODELS = {
    "gpt2": sm.Setup(functools.partial(sm.tiny_gpt2, layers=4), sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    "llama": sm.Setup(functools.partial(sm.tiny_llama, layers=4), sm.TokenDataset, sm.hf_loss, "unpack_dict"),
}


def mode(*dims: tuple[str, int]) -> tuple[str, dict[str, Any]]:
    return ("parallel_mode", {"dims": [list(d) for d in dims]})


# Tensor parallel over data parallel takes fsdp on the data dimension (DDP cannot replicate DTensors).
TP2xDP2 = [mode(("data", -1), ("tensor", 2)), "tensor_parallel", "fsdp"]
PP2xDP2 = [mode(("pipeline", 2), ("data", -1)), ("pipeline_parallel", {"schedule": "1f1b"})]
# ZBV: the rank holding the first stage also holds the last, so both copies of a tied weight are on one rank.
PP2xDP2_ZBV = [mode(("pipeline", 2), ("data", -1)), ("pipeline_parallel", {"schedule": "zbv"})]
GPT2_TP2xDP2 = [mode(("data", -1), ("tensor", 2)), "module_replace", "tensor_parallel", "fsdp"]
# tensor 2 × pipeline 2 (mixed): each rank holds half of one stage's split layers.
TP2xPP2 = [mode(("pipeline", 2), ("data", -1), ("tensor", 2)), "tensor_parallel", ("pipeline_parallel",
                                                                                 {"schedule": "1f1b"})]
DP4 = ["parallel_mode"]
FSDP4 = ["fsdp"]
PLAIN = ["parallel_mode"]

# saving scenario -> (model, layout)
SAVES = {
    "llama/tp2xdp2+fsdp": ("llama", TP2xDP2),
    "gpt2/pp2xdp2": ("gpt2", PP2xDP2),
    "llama/pp2xdp2+fsdp": ("llama", [*PP2xDP2, "fsdp"]),
    # GPT-2 under tensor_parallel (which needs module_replace: Conv1D -> nn.Linear) holds c_attn's rows
    # reordered per tensor rank; its checkpoint holds them in the user's order.
    "gpt2/tp2xdp2+fsdp": ("gpt2", GPT2_TP2xDP2),
    "gpt2/pp2xdp2+module_replace": ("gpt2", [*PP2xDP2, "module_replace"]),
    "gpt2/tp2xpp2": ("gpt2", [*TP2xPP2, "module_replace"]),
}
# Saved on 1 process (single launch): the keys and shapes every layout's checkpoint must have.
SINGLE_SAVES = {"llama/one process": ("llama", PLAIN), "gpt2/one process": ("gpt2", PLAIN),
                "gpt2/one process+module_replace": ("gpt2", [*PLAIN, "module_replace"])}
# loading scenario -> (checkpoint of SAVES, layout it is loaded under)
LOADS = {
    "llama/tp2xdp2+fsdp -> dp4": ("llama/tp2xdp2+fsdp", DP4),
    "llama/tp2xdp2+fsdp -> fsdp4": ("llama/tp2xdp2+fsdp", FSDP4),
    "llama/tp2xdp2+fsdp -> pp2xdp2": ("llama/tp2xdp2+fsdp", PP2xDP2),
    "gpt2/pp2xdp2 -> pp2xdp2[zbv]": ("gpt2/pp2xdp2", PP2xDP2_ZBV),
    "gpt2/pp2xdp2 -> fsdp4": ("gpt2/pp2xdp2", FSDP4),
    "llama/pp2xdp2+fsdp -> tp2xdp2": ("llama/pp2xdp2+fsdp", TP2xDP2),
    "gpt2/tp2xdp2+fsdp -> pp2xdp2": ("gpt2/tp2xdp2+fsdp", [*PP2xDP2, "module_replace"]),
    "gpt2/pp2xdp2+module_replace -> tp2xdp2+fsdp": ("gpt2/pp2xdp2+module_replace", GPT2_TP2xDP2),
    "llama/tp2xdp2+fsdp -> tp2xpp2": ("llama/tp2xdp2+fsdp", TP2xPP2),
    # nn.Linear holds Conv1D's weight transposed: refused, naming module_replace.
    "refused/gpt2/pp2xdp2 -> tp2xdp2+fsdp": ("gpt2/pp2xdp2", GPT2_TP2xDP2),
}
SINGLE_LOADS = {
    "llama/tp2xdp2+fsdp -> one process": ("llama/tp2xdp2+fsdp", PLAIN),
    "gpt2/pp2xdp2 -> one process": ("gpt2/pp2xdp2", PLAIN),
    "llama/pp2xdp2+fsdp -> one process": ("llama/pp2xdp2+fsdp", PLAIN),
    "gpt2/tp2xdp2+fsdp -> one process": ("gpt2/tp2xdp2+fsdp", [*PLAIN, "module_replace"]),
    "gpt2/tp2xpp2 -> one process": ("gpt2/tp2xpp2", [*PLAIN, "module_replace"]),
}


def build(model_name: str, layout: list[Any], seed: int) -> Any:
    setup = MODELS[model_name]
    torch.manual_seed(seed)
    _, result, _ = atorch.auto_accelerate(
        setup.make(), torch.optim.SGD, setup.dataset(), setup.loss, model_input_format=setup.input_format,
        optim_args={"lr": 0.1, "momentum": 0.9}, dataloader_args={"batch_size": GLOBAL_BATCH, "shuffle": False},
        load_strategy=layout,
    )
    return result


def held(result: Any) -> dict[str, torch.Tensor]:
    """What this rank holds, as global tensors under the user's names and in the user's order (GPT-2's fused
    q|k|v rows), as a checkpoint holds them: ``model.<name>``, ``optim.<name>.<key>``.
    Collective (a DTensor is gathered over its mesh): keys are visited in sorted order on every rank."""
    names = CheckpointNames(result.model)
    model_sd, osd = get_state_dict(result.model, result.optim.optimizer)
    model_sd, optim_state = names.outward(model_sd, osd["state"])
    flat = {f"model.{k}": v for k, v in model_sd.items()}
    flat.update({f"optim.{k}.{n}": v for k, entry in optim_state.items() for n, v in entry.items()
                 if isinstance(v, torch.Tensor)})
    flat = state_io_qkv.to_user_order(flat, state_io_qkv.reordered_layers(result.model, names.user))
    out = {}
    for key in sorted(flat):
        value = flat[key].detach()
        out[key] = (value.full_tensor() if isinstance(value, DTensor) else value).cpu().clone()
    return out


def steps(result: Any, count: int) -> list[float]:
    """The losses of the ``count`` steps after the first K batches (every layout sees the same global batches)."""
    batches = list(islice(result.dataloader, K + count))
    return [float(train_step(result, [b])) for b in batches[K:]]


def _mean(value: float) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.item() / dist.get_world_size()


def save(name: str, root: Path, saves: dict[str, tuple[str, list[Any]]]) -> dict[str, Any]:
    model_name, layout = saves[name]
    result = build(model_name, layout, seed=0)
    batches = list(islice(result.dataloader, K))
    for batch in batches:
        train_step(result, [batch])
    directory = root / _dirname(name)
    atorch.save_checkpoint(directory / "ckpt", result, step=K, extra={"scenario": name})
    torch.save(held(result), directory / f"held.{dist.get_rank()}.pt")
    atorch.export_consolidated(directory / "model.pt", result)
    losses = [_mean(loss) for loss in steps(result, AFTER)]
    result.close()
    return {"losses": losses, "dir": str(directory)}


def _dirname(scenario: str) -> str:
    return scenario.replace("/", "_").replace(" ", "_")


def saved_state(directory: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The union of what the saving ranks held, and the keys whose copies on two ranks differ."""
    merged: dict[str, torch.Tensor] = {}
    unequal = set()
    for path in sorted(directory.glob("held.*.pt")):
        for key, value in torch.load(path, weights_only=True).items():
            if key in merged and not torch.equal(merged[key], value):
                unequal.add(key)
            merged.setdefault(key, value)
    return merged, sorted(unequal)


def load(name: str, root: Path, loads: dict[str, tuple[str, list[Any]]]) -> dict[str, Any]:
    source, layout = loads[name]
    model_name = SAVES[source][0]
    directory = root / _dirname(source)
    result = build(model_name, layout, seed=5)  # other weights until loaded
    info = atorch.load_checkpoint(directory / "ckpt", result)
    expected, unequal = saved_state(directory)
    mine = held(result)
    differ = sorted(k for k, v in mine.items() if k not in expected or not torch.equal(v, expected[k]))
    tied = tied_copies_equal(result.model)
    losses = [_mean(loss) for loss in steps(result, AFTER)]
    result.close()
    ranks = all_gather_json({"held": len(mine), "differ": differ, "tied_equal": tied})
    return {"info": info, "losses": losses, "held": [r["held"] for r in ranks], "saved_keys": len(expected),
            "differ": sorted({k for r in ranks for k in r["differ"]}), "saved_unequal": unequal,
            "tied_equal": [r["tied_equal"] for r in ranks]}


def tied_copies_equal(model: nn.Module) -> bool | None:
    """Under pipeline parallel on a rank holding both copies of GPT-2's tied weight: whether they are equal."""
    copies = [p for n, p in model.named_parameters() if n.endswith(("wte.weight", "lm_head.weight"))]
    return torch.equal(copies[0], copies[1]) if len(copies) == 2 else None


def main() -> None:
    what, root = sys.argv[1], Path(sys.argv[2])
    if what == "multi":
        report = {"saves": run_each({n: functools.partial(save, n, root, SAVES) for n in SAVES}),
                  "loads": run_each({n: functools.partial(load, n, root, LOADS) for n in LOADS})}
    else:
        multi = Path(sys.argv[3])
        report = {"saves": run_each({n: functools.partial(save, n, root, SINGLE_SAVES) for n in SINGLE_SAVES}),
                  "loads": run_each({n: functools.partial(load, n, multi, SINGLE_LOADS) for n in SINGLE_LOADS})}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
