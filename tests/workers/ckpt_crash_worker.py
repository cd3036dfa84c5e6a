"""A rank killed while it overwrites a checkpoint, then a resume (launched by tests/test_checkpoint_crash.py).

``crash ROOT`` (fails on purpose): 2 ranks, fsdp. One step, save ``ROOT/latest`` (step 1), rank 0 writes the
whole model and optimizer state to ``ROOT/expected.pt``; one more step, save ``ROOT/latest`` again: rank 1
kills itself (SIGKILL) when it opens its own DCP data file in the save's staging directory, once rank 0's data
file there has bytes, so the new checkpoint is partly written when the job dies.
``resume ROOT``: 2 ranks. Load ``ROOT/latest`` into a result built from other weights, and again after moving
it aside as a save stopped between its two renames leaves it; load a copy whose
``.metadata`` was replaced by the real metadata carrying a payload (refused, payload not run); then save
``ROOT/latest`` again (the crash's leftovers go) and load that. Rank 0 prints ``RESULT {json}``.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import sys
import time
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from checkpoint_worker import error_of
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from toy_models import mlp, mlp_dataset, mlp_loss

import atorch
from atorch.training import train_step


def accelerate(seed: int) -> Any:
    _, result, _ = atorch.auto_accelerate(
        mlp(seed), torch.optim.AdamW, mlp_dataset(), mlp_loss, model_input_format="unpack_sequence",
        optim_args={"lr": 1e-2}, dataloader_args={"batch_size": 8, "shuffle": False}, load_strategy=["fsdp"])
    return result


def train(result: Any, steps: int) -> None:
    for batch in islice(result.dataloader, steps):
        train_step(result, [batch])


def full_state(result: Any) -> dict[str, torch.Tensor]:
    """Every weight and optimizer tensor, whole (collective)."""
    model_sd, optim_sd = get_state_dict(result.model, result.optim.optimizer,
                                        options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v.detach().clone() for k, v in model_sd.items()}
    out.update({f"optim.{fqn}.{k}": v.detach().clone() for fqn, entry in optim_sd["state"].items()
                for k, v in entry.items() if isinstance(v, torch.Tensor)})
    return out


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {"same_keys": sorted(a) == sorted(b),
            "max_diff": max((a[k].float() - b[k].float()).abs().max().item() for k in a if k in b)}


def kill_when_writing_own_file(event: str, args: tuple[Any, ...]) -> None:
    """Audit hook (no patching of torch): SIGKILL this process when it opens its DCP data file for writing."""
    if event != "open" or not isinstance(args[1], str) or "w" not in args[1]:
        return
    path = Path(os.fspath(args[0]))
    if path.name != "__1_0.distcp":  # installed for the second save only: wherever that save writes
        return
    peer = path.parent / "__0_0.distcp"
    deadline = time.monotonic() + 60
    while not (peer.exists() and peer.stat().st_size > 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    size = peer.stat().st_size if peer.exists() else 0
    print(f"KILLED rank 1 opening {path.name} in {path.parent.name}; {peer.name} had {size} bytes", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return open, (str(self.marker), "w")  # a harmless stand-in for an attacker's code


def crash(root: Path) -> None:
    a = accelerate(seed=0)
    train(a, 1)
    atorch.save_checkpoint(root / "latest", a, step=1)
    expected = full_state(a)
    if dist.get_rank() == 0:
        torch.save(expected, root / "expected.pt")
    train(a, 1)
    dist.barrier()
    if dist.get_rank() == 1:
        sys.addaudithook(kill_when_writing_own_file)
    atorch.save_checkpoint(root / "latest", a, step=2)
    print("RESULT " + json.dumps({"error": "the save finished: rank 1 was not killed"}), flush=True)


def resume(root: Path) -> dict[str, Any]:
    latest = root / "latest"
    report: dict[str, Any] = {"beside_before": sorted(p.name for p in root.iterdir() if p.name.startswith(".latest"))}
    b = accelerate(seed=7)
    report["info"] = atorch.load_checkpoint(latest, b)
    expected = torch.load(root / "expected.pt", weights_only=True)
    report["loaded"] = differences(full_state(b), expected)

    # A save stopped between its two renames: the path is missing, the previous checkpoint is beside it.
    if dist.get_rank() == 0:
        os.rename(latest, root / ".latest.old-0000")
    dist.barrier()
    report["info_between"] = atorch.load_checkpoint(latest, d := accelerate(seed=8))
    report["loaded_between"] = differences(full_state(d), expected)

    tampered = root / "tampered"
    if dist.get_rank() == 0:
        shutil.copytree(root / ".latest.old-0000", tampered)  # the step-1 checkpoint, where it is now
        metadata = pickle.loads((tampered / ".metadata").read_bytes())  # the attacker's side: plain pickle
        metadata.planner_data = {**(metadata.planner_data or {}), "x": Payload(root / "marker")}
        (tampered / ".metadata").write_bytes(pickle.dumps(metadata))
    dist.barrier()
    report["tampered"] = error_of(lambda: atorch.load_checkpoint(tampered, accelerate(seed=7)))

    train(b, 1)
    atorch.save_checkpoint(latest, b, step=3)
    report["beside_after"] = sorted(p.name for p in root.iterdir() if p.name.startswith(".latest"))
    c = accelerate(seed=9)
    report["info_3"] = atorch.load_checkpoint(latest, c)
    report["reloaded"] = differences(full_state(c), full_state(b))
    return report


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    if mode == "crash":
        crash(root)
        return
    report = resume(root)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
