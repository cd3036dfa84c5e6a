"""Tensor files in the Hugging Face layout: one file, or numbered shards plus an index JSON
(``{"metadata": {"total_size": N, ...}, "weight_map": {name: file}}``); safetensors or ``.bin``
(``torch.save`` of a plain tensor dict, read only with ``torch.load(weights_only=True)``)."""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from atorch.checkpointing.state_io import CheckpointError, listed_names

SAFE_EXT = ".safetensors"


def shard_names(weights_name: str, count: int) -> list[str]:
    """``model.safetensors`` -> ``model-00001-of-00002.safetensors``, ... (as transformers names them)."""
    stem, ext = os.path.splitext(weights_name)
    return [f"{stem}-{i:05d}-of-{count:05d}{ext}" for i in range(1, count + 1)]


def with_prefix(weights_name: str, prefix: str | None) -> str:
    if not prefix:
        return weights_name
    stem, ext = os.path.splitext(weights_name)
    return f"{stem}.{prefix}{ext}"


def plan_shards(tensors: dict[str, torch.Tensor], size_mb: float) -> list[list[str]]:
    """Names in order, cut into shards of at most size_mb MiB (a larger tensor gets a shard of its own)."""
    limit = size_mb * 2**20
    shards: list[list[str]] = [[]]
    used = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and used + nbytes > limit:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def write_file(path: Path, tensors: dict[str, torch.Tensor], safe: bool | None = None) -> None:
    """One tensor file (safetensors when ``safe``, by default when the name ends so), written under a
    temporary name then moved into place."""
    tmp = path.with_name(path.name + ".tmp")
    if path.name.endswith(SAFE_EXT) if safe is None else safe:
        from safetensors.torch import save_file

        save_file(tensors, str(tmp), metadata={"format": "pt"})
    else:
        torch.save(tensors, tmp)
    os.replace(tmp, path)


def write_sharded(directory: Path, tensors: dict[str, torch.Tensor], weights_name: str, size_mb: float,
                  metadata: dict[str, Any] | None = None) -> list[str]:
    """Shards and their index (written last); stale shards of the same name are removed. Returns the files."""
    directory.mkdir(parents=True, exist_ok=True)
    index_name = weights_name + ".index.json"
    stem, ext = os.path.splitext(weights_name)
    stale = re.compile(re.escape(stem) + r"-\d{5}-of-\d{5}" + re.escape(ext) + "$")
    (directory / index_name).unlink(missing_ok=True)
    for old in directory.iterdir():
        if stale.match(old.name):
            old.unlink()
    plan = plan_shards(tensors, size_mb)
    files = shard_names(weights_name, len(plan))
    weight_map = {}
    for names, file in zip(plan, files, strict=True):
        write_file(directory / file, {n: tensors[n] for n in names})
        weight_map.update({n: file for n in names})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total, **(metadata or {})}, "weight_map": weight_map}
    tmp = directory / (index_name + ".tmp")
    tmp.write_text(json.dumps(index, indent=2))
    os.replace(tmp, directory / index_name)
    return [*files, index_name]


def _read_bin(path: Path, where: str) -> dict[str, torch.Tensor]:
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, EOFError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(where, [f"{path} holds something other than tensors, or is not a torch file; it was "
                                      f"refused by torch.load(weights_only=True) ({first}); only plain dicts of "
                                      "tensors are read (never arbitrary pickles)"]) from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                             for k, v in data.items()):
        raise CheckpointError(where, [f"{path} is not a dict of named tensors ({type(data).__name__})"])
    return data


class TensorFiles:
    """The tensors of a checkpoint, read lazily file by file: a single file, or an index and its shards."""

    def __init__(self, checkpoint: str | os.PathLike, default_names: tuple[str, ...], where: str) -> None:
        self.where = where
        self.index: dict[str, Any] | None = None
        path = Path(checkpoint)
        if path.is_dir():
            indexes = sorted(p for p in path.iterdir() if p.is_file() and re.search(r"\.index.*\.json$", p.name))
            if len(indexes) > 1:
                raise CheckpointError(where, [f"the directory holds {len(indexes)} index files "
                                              f"({', '.join(p.name for p in indexes)}); keep one checkpoint per "
                                              "directory (the model and the optimizer in separate ones), or give "
                                              "the index file itself"])
            if indexes:
                path = indexes[0]
            else:
                found = [path / n for n in default_names if (path / n).is_file()]
                if not found:
                    raise CheckpointError(where, [f"no index file and none of {', '.join(default_names)} in {path}"])
                path = found[0]
        elif not path.is_file():
            raise CheckpointError(where, [f"{path} does not exist"])
        self.path = path
        self._cache: dict[str, Any] = {}
        if re.search(r"\.index.*\.json$", path.name):
            self._read_index(path)
            self.file_of = {name: path.parent / file for name, file in self.index["weight_map"].items()}
        else:
            self.file_of = {name: path for name in self._names_in(path)}

    def _read_index(self, path: Path) -> None:
        try:
            index = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(self.where, [f"{path} is not readable JSON ({exc})"]) from None
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise CheckpointError(self.where, [f"{path} has no weight_map: not a checkpoint index"])
        missing = sorted({f for f in index["weight_map"].values() if not (path.parent / f).is_file()})
        if missing:
            raise CheckpointError(self.where, [f"{path.name} names files that are not in {path.parent}: "
                                               f"{listed_names(missing)}; the checkpoint is incomplete"])
        self.index = index

    @property
    def metadata(self) -> dict[str, Any]:
        return (self.index or {}).get("metadata", {})

    def _open(self, file: Path) -> Any:
        if file not in self._cache:
            if _is_safetensors(file):
                from safetensors import safe_open

                try:
                    self._cache[file] = safe_open(str(file), framework="pt", device="cpu")
                except Exception as exc:  # safetensors raises its own error types
                    raise CheckpointError(self.where, [f"{file} is not a readable safetensors file ({exc})"]) from None
            else:
                self._cache[file] = _read_bin(file, self.where)
        return self._cache[file]

    def _names_in(self, file: Path) -> list[str]:
        opened = self._open(file)
        return list(opened.keys())

    def names(self) -> set[str]:
        return set(self.file_of)

    def get(self, name: str) -> torch.Tensor:
        file = self.file_of[name]
        opened = self._open(file)
        if name not in set(opened.keys()):
            raise CheckpointError(self.where, [f"the index places '{name}' in {file.name}, which does not hold it"])
        return opened[name] if isinstance(opened, dict) else opened.get_tensor(name)


def _is_safetensors(file: Path) -> bool:
    """By the name, else by the content: safetensors starts with an 8-byte header length, then '{'."""
    if file.name.endswith(SAFE_EXT):
        return True
    with open(file, "rb") as handle:
        head = handle.read(9)
    return len(head) == 9 and head[8:9] == b"{"
