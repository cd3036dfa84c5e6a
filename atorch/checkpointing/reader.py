"""Reading torch.distributed.checkpoint (DCP) files without running code from them.

torch's ``FileSystemReader`` reads a checkpoint's ``.metadata`` with ``pickle.load``: a replaced
``.metadata`` could run anything on load. Here it is unpickled by ``MetadataUnpickler``, which builds
only the types DCP writes there (its metadata dataclasses, ``torch.Size``, dtypes, layouts, paths) and
refuses every other global before it is imported or called. The result is then checked: tensor entries
only (DCP reads a non-tensor entry with ``torch.load(weights_only=False)``) whose data files are plain
names inside the checkpoint directory. Tensor data itself is read by torch with ``weights_only=True``.
Every DCP load in atorch goes through ``load_tensors``.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from atorch.errors import CheckpointError

METADATA_FILE = ".metadata"
_MAX_METADATA_BYTES = 1 << 30  # far above any real checkpoint's: a bound on what is read into memory

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# The globals a DCP .metadata pickle refers to: recorded from the checkpoints the tests save under every layout
# (DDP, ZeRO-1/2, fsdp, tensor and pipeline parallel, Lightning), plus BytesStorageMetadata, OrderedDict and the
# other path classes, which other DCP writers produce. Each builds plain values; none runs code of the file's.
_ALLOWED: frozenset[tuple[str, str]] = frozenset({
    *((_DCP_METADATA, n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a torch.layout up by its name
    ("collections", "OrderedDict"),
    # StorageMeta.checkpoint_id: the path the checkpoint was saved to (pathlib._local from Python 3.13)
    *((m, n) for m in ("pathlib", "pathlib._local") for n in ("PosixPath", "PurePosixPath", "WindowsPath",
                                                              "PureWindowsPath")),
})
# torch.<name> values pickled by name: dtypes, layouts, memory formats (looked up here, never through
# torch's module __getattr__, which imports submodules)
_TORCH_VALUES = {name: value for name, value in vars(torch).items()
                 if isinstance(value, (torch.dtype, torch.layout, torch.memory_format))}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: only the globals in ``_ALLOWED`` and torch's dtypes, layouts and memory
    formats; anything else raises ``CheckpointError`` naming it."""

    def __init__(self, file: Any, source: str):
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and name in _TORCH_VALUES:
            return _TORCH_VALUES[name]
        raise CheckpointError(f"refused to load {self._source}", [
            f"its DCP metadata refers to {module}.{name}, which DCP metadata never holds: this checkpoint is not "
            "trusted (it may have been altered to run code on load) and nothing from it was loaded or run; load "
            "only checkpoints written by atorch.save_checkpoint / ATorchStrategy"])

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"refused to load {self._source}", [
            "its DCP metadata holds a persistent reference, which DCP never writes: this checkpoint is not trusted"])


def read_metadata(path: str | os.PathLike) -> Metadata:
    """The checked ``Metadata`` in the DCP metadata file ``path``; a ``CheckpointError`` when it cannot be
    read, refers to anything DCP does not write, or describes anything but tensor files in its directory."""
    path = Path(path)
    where = f"cannot load checkpoint {path.parent}"
    try:
        with open(path, "rb") as stream:
            data = stream.read(_MAX_METADATA_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(where, [f"cannot read {path.name} ({exc}); the checkpoint's save did not finish, or "
                                      "this is not a checkpoint directory"]) from None
    if len(data) > _MAX_METADATA_BYTES:
        raise CheckpointError(where, [f"{path.name} is over {_MAX_METADATA_BYTES >> 20} MiB: not DCP metadata"])
    try:
        metadata = MetadataUnpickler(io.BytesIO(data), os.fspath(path.parent)).load()
    except CheckpointError:
        raise
    except Exception as exc:  # a damaged file: pickle raises many kinds
        raise CheckpointError(where, [f"{path.name} is not readable DCP metadata ({type(exc).__name__}: {exc})"]) \
            from None
    problems = _problems(metadata)
    if problems:
        raise CheckpointError(f"refused to load {path.parent}", problems)
    return metadata


def _problems(metadata: Any) -> list[str]:
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        return [f"{METADATA_FILE} holds a {type(metadata).__name__}, not DCP metadata"]
    problems = []
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            problems.append(f"entry {key!r} is stored as pickled bytes, which torch loads with "
                            "torch.load(weights_only=False); atorch checkpoints hold tensors only, so this checkpoint "
                            "is not trusted and was not loaded")
        elif not isinstance(key, str) or not isinstance(entry, TensorStorageMetadata):
            problems.append(f"entry {key!r} is a {type(entry).__name__}, not tensor metadata")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        return problems + [f"its storage data is a {type(storage).__name__}, not a dict"]
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            problems.append(f"its storage data holds a {type(info).__name__}, not DCP's storage info")
            continue
        name = info.relative_path
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or "\\" in name:
            problems.append(f"entry {index.fqn!r} is stored in {name!r}, not a file of the checkpoint directory; "
                            "this checkpoint is not trusted and was not loaded")
    return problems[:6]


class CheckedReader(FileSystemReader):
    """torch's file-system reader, with its metadata read by ``read_metadata`` instead of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self._get_metadata_path(kwargs.get("rank")))
        if metadata.storage_meta is None:  # as torch's reader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_tensors(state: dict[str, Any], directory: str | os.PathLike) -> None:
    """``dcp.load(state, checkpoint_id=directory)`` with the metadata checked first, so that a refused
    checkpoint raises ``CheckpointError`` on every rank before any collective (DCP would log the error
    and fall back to per-rank metadata)."""
    import torch.distributed.checkpoint as dcp  # imported on use: it takes seconds

    read_metadata(Path(directory) / METADATA_FILE)
    dcp.load(state, storage_reader=CheckedReader(directory))
