"""Lightning checkpoints through atorch.checkpointing.state_io: model and optimizer with DCP (sharded where the
strategy shards), Lightning's own metadata (epoch, global_step, loops, callbacks, LR schedulers) as
JSON next to them, written into the checkpoint before it is renamed into place. Nothing is pickled
(DCP's own metadata is read by atorch.checkpointing.reader, which builds only DCP's types); small
tensors in the metadata (a callback's best score) are stored as lists with their dtype.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from atorch.checkpointing.atomic_dir import resolve
from atorch.checkpointing.state_io import CheckpointError, load_checkpoint, write_checkpoint

LIGHTNING_FILE = "lightning.json"
_TENSOR, _TUPLE, _PATH = "__tensor__", "__tuple__", "__path__"
ENGINE_KEYS = ("state_dict", "optimizer_states")  # what DCP holds instead


def to_json(value: Any, where: str = "checkpoint") -> Any:
    """JSON values for a Lightning checkpoint entry; anything else is refused with its key."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return {_TENSOR: value.detach().cpu().tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, os.PathLike):
        return {_PATH: os.fspath(value)}
    if isinstance(value, tuple):
        return {_TUPLE: [to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise CheckpointError(f"cannot save {where}", [f"{where} has a key {bad[0]!r} that is not a string; "
                                                            "checkpoint metadata is JSON"])
        return {k: to_json(v, f"{where}[{k!r}]") for k, v in value.items()}
    raise CheckpointError(f"cannot save {where}", [
        f"{where} is a {type(value).__name__}; ATorchStrategy writes Lightning's checkpoint metadata as JSON "
        "(numbers, strings, lists, dicts, tensors), never pickled: return such values from state_dict / "
        "on_save_checkpoint"])


def from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if isinstance(value, dict):
        if _TENSOR in value:
            return torch.tensor(value[_TENSOR], dtype=getattr(torch, value["dtype"]))
        if _TUPLE in value:
            return tuple(from_json(v) for v in value[_TUPLE])
        if _PATH in value:
            return Path(value[_PATH])
        return {k: from_json(v) for k, v in value.items()}
    return value


def save(checkpoint: dict[str, Any], path: str | os.PathLike, engine: Any) -> None:
    """On every rank: the engine's tensors with DCP and Lightning's metadata (rank 0's), put in place together
    (atomically, replacing a checkpoint at ``path``)."""
    meta = to_json({k: v for k, v in checkpoint.items() if k not in ENGINE_KEYS})
    write_checkpoint(path, engine.checkpoint_view, step=int(checkpoint.get("global_step", 0)),
                     files={LIGHTNING_FILE: json.dumps(meta).encode()})


def load(path: str | os.PathLike, engine: Any) -> dict[str, Any]:
    """On every rank: restore the engine's model and optimizer; return Lightning's metadata."""
    directory = resolve(Path(path))  # or the previous checkpoint, when a save of it was interrupted
    meta_file = directory / LIGHTNING_FILE
    if not meta_file.is_file():
        raise CheckpointError(f"cannot load {os.fspath(path)}", [
            f"{os.fspath(path)} is not a checkpoint written by ATorchStrategy (a directory with {LIGHTNING_FILE}); "
            "resume from a path Trainer.save_checkpoint / ModelCheckpoint wrote under strategy='atorch'"])
    load_checkpoint(directory, engine.checkpoint_view)
    checkpoint = from_json(json.loads(meta_file.read_text()))
    checkpoint.setdefault("state_dict", {})  # loaded by DCP above; Lightning's copy stays empty
    return checkpoint


def load_weights(path: str | os.PathLike, module: torch.nn.Module) -> dict[str, Any]:
    """Evaluation before any fit: only the model's tensors into the plain module (DCP reshards)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from atorch.checkpointing.reader import load_tensors  # imports DCP: seconds

    directory = resolve(Path(path))
    if not (directory / LIGHTNING_FILE).is_file():
        return load(path, None)  # the same refusal, with the fix
    model_sd = get_model_state_dict(module)
    tensors = {f"model.{k}": v for k, v in model_sd.items()}
    load_tensors(tensors, directory)  # nothing in the checkpoint is unpickled but DCP's own metadata types
    set_model_state_dict(module, {k: tensors[f"model.{k}"] for k in model_sd})
    checkpoint = from_json(json.loads((directory / LIGHTNING_FILE).read_text()))
    checkpoint.setdefault("state_dict", {})
    return checkpoint


def remove(path: str | os.PathLike) -> None:
    if _rank() == 0 and os.path.exists(path):
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def broadcast_json(obj: Any, src: int = 0) -> Any:
    """Lightning's ``broadcast`` without pickle: tensors as tensors, the rest as JSON bytes."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach().clone().to(device)
        dist.broadcast(tensor, src)
        return tensor.to(obj.device)
    data, error = b"", None
    if _rank() == src:
        try:
            data = json.dumps(to_json(obj, "broadcast value")).encode()
        except CheckpointError as exc:  # told to every rank, so none waits for the bytes
            error = exc
    size = torch.tensor([len(data) if error is None else -1], dtype=torch.int64, device=device)
    dist.broadcast(size, src)
    if int(size.item()) < 0:
        raise error if error is not None else CheckpointError("cannot broadcast", [
            f"rank {src} broadcast a value that is not JSON (see its error); ATorchStrategy never pickles"])
    buffer = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if _rank() == src:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src)
    return from_json(json.loads(bytes(buffer.cpu().tolist()).decode()))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
