"""Checkpoint files in this process: DCP metadata is read without running code from it
(atorch/checkpointing/reader.py), and a checkpoint directory is replaced without a moment when the path holds
neither the old nor the new one (atorch/checkpointing/atomic_dir.py). The distributed crash-and-resume scenario is in
tests/test_checkpoint_crash.py.
"""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from atorch.checkpointing import atomic_dir as checkpoint_dir
from atorch.checkpointing.reader import load_tensors, read_metadata
from atorch.errors import CheckpointError


class Payload:
    """Pickles to a call that creates ``marker`` (a harmless stand-in for an attacker's code)."""

    def __init__(self, call: str, marker: Path) -> None:
        self.call, self.marker = call, marker

    def __reduce__(self) -> tuple[Any, ...]:
        if self.call == "os.system":
            return os.system, (f"touch {self.marker}",)
        return open, (str(self.marker), "w")  # io.open: creates the file


def dcp_save(state: dict[str, torch.Tensor], directory: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        dcp.save(state, checkpoint_id=directory)


def dcp_load(state: dict[str, torch.Tensor], directory: Path, reader: Any = None) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if reader is None:
            load_tensors(state, directory)
        else:
            dcp.load(state, storage_reader=reader)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    state = {"model.w": torch.randn(4, 3), "model.h": torch.randn(5).to(torch.bfloat16),
             "optim.w.step": torch.tensor(3.0), "rng.cpu.0": torch.get_rng_state()}
    dcp_save(state, tmp_path / "ckpt")
    return tmp_path / "ckpt", state


def empty_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def tamper(directory: Path, change: Any) -> None:
    """Rewrite ``.metadata`` as an attacker would: the real metadata (read with plain pickle), changed."""
    metadata = pickle.loads((directory / ".metadata").read_bytes())
    change(metadata)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


def test_a_real_checkpoint_loads_exactly(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    directory, state = saved
    loaded = empty_like(state)
    dcp_load(loaded, directory)
    assert all(torch.equal(loaded[k], state[k]) for k in state)


@pytest.mark.parametrize(("call", "named"), [("os.system", "posix.system"), ("open", "io.open")])
def test_a_metadata_pickle_that_calls_code_is_refused(saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path,
                                                      call: str, named: str) -> None:
    directory, state = saved
    marker = tmp_path / "marker"
    # The attack as reported: the real metadata still loads, with the payload hidden inside it.
    tamper(directory, lambda md: setattr(md, "planner_data", {"model.w": ("model.w",), "x": Payload(call, marker)}))
    loaded = empty_like(state)
    with pytest.raises(CheckpointError) as caught:
        dcp_load(loaded, directory)
    message = str(caught.value)
    assert f"refers to {named}" in message and "not trusted" in message and "nothing from it was loaded" in message
    assert not marker.exists()
    assert all(not v.any() for k, v in loaded.items() if k != "rng.cpu.0")  # nothing was loaded

    # A bare payload in place of the metadata: refused the same way.
    (directory / ".metadata").write_bytes(pickle.dumps(Payload(call, marker)))
    with pytest.raises(CheckpointError, match=f"refers to {named}"):
        read_metadata(directory / ".metadata")
    assert not marker.exists()


def test_torch_own_reader_runs_the_payload(saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    """The control: the same file through torch's FileSystemReader creates the marker, so the test above
    would fail if atorch used it."""
    from torch.distributed.checkpoint import FileSystemReader

    directory, state = saved
    marker = tmp_path / "marker"
    tamper(directory, lambda md: setattr(md, "planner_data", {"x": Payload("open", marker)}))
    dcp_load(empty_like(state), directory, FileSystemReader(directory))
    assert marker.exists()


def test_an_entry_stored_as_pickled_bytes_is_refused(saved: tuple[Path, dict[str, torch.Tensor]],
                                                     tmp_path: Path) -> None:
    """DCP reads a bytes entry with torch.load(weights_only=False): metadata made only of DCP's own types can
    point a tensor's name at a pickle in a data file."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    directory, state = saved
    marker = tmp_path / "marker"
    torch.save(Payload("open", marker), directory / "evil.distcp")

    def point_at_pickle(md: Any) -> None:
        info = next(v for k, v in md.storage_data.items() if k.fqn == "model.w")
        md.state_dict_metadata["model.w"] = BytesStorageMetadata()
        md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != "model.w"}
        size = (directory / "evil.distcp").stat().st_size
        md.storage_data[MetadataIndex("model.w")] = type(info)("evil.distcp", 0, size)

    tamper(directory, point_at_pickle)
    with pytest.raises(CheckpointError, match=r"entry 'model.w' is stored as pickled bytes.*not trusted"):
        dcp_load(empty_like(state), directory)
    assert not marker.exists()
    dcp_load(empty_like(state), directory, FileSystemReader(directory))  # the control: torch's reader runs it
    assert marker.exists()


def test_data_outside_the_checkpoint_directory_is_refused(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    directory, state = saved

    def elsewhere(md: Any) -> None:
        for info in md.storage_data.values():
            info.relative_path = "../other/__0_0.distcp"

    tamper(directory, elsewhere)
    with pytest.raises(CheckpointError, match=r"stored in '../other/__0_0.distcp', not a file of the checkpoint"):
        dcp_load(empty_like(state), directory)


def test_damaged_or_missing_metadata_is_a_clear_error(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    directory, state = saved
    (directory / ".metadata").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(CheckpointError, match=r"\.metadata is not readable DCP metadata"):
        dcp_load(empty_like(state), directory)
    (directory / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"cannot read \.metadata.*did not finish"):
        dcp_load(empty_like(state), directory)


def test_lightning_weights_load_through_the_checked_reader(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from atorch.lightning import state as lightning_state

    module = nn.Linear(3, 2)
    directory = tmp_path / "epoch=0.ckpt"
    dcp_save({f"model.{k}": v for k, v in module.state_dict().items()}, directory)
    (directory / lightning_state.LIGHTNING_FILE).write_text('{"epoch": 0}')
    fresh = nn.Linear(3, 2)
    assert lightning_state.load_weights(directory, fresh)["epoch"] == 0
    assert torch.equal(fresh.weight, module.weight)
    marker = tmp_path / "marker"
    tamper(directory, lambda md: setattr(md, "planner_data", {"x": Payload("open", marker)}))
    with pytest.raises(CheckpointError, match="refers to io.open"):
        lightning_state.load_weights(directory, nn.Linear(3, 2))
    assert not marker.exists()


# ----- replacing a checkpoint directory -----------------------------------------------------------
def make(directory: Path, content: str) -> Path:
    directory.mkdir(parents=True)
    (directory / "atorch_checkpoint.json").write_text(content)
    return directory


def beside(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.iterdir() if p.name != target.name)


def test_commit_replaces_an_existing_checkpoint(tmp_path: Path) -> None:
    target = make(tmp_path / "latest", "old")
    staging = checkpoint_dir.prepare(target)
    assert staging.parent == tmp_path and staging.name.startswith(".latest.tmp-")
    assert (target / "atorch_checkpoint.json").read_text() == "old"  # untouched while the new one is written
    (staging / "atorch_checkpoint.json").write_text("new")
    replaced = checkpoint_dir.commit(staging, target)
    assert (target / "atorch_checkpoint.json").read_text() == "new" and beside(target) == [replaced.name]
    assert (replaced / "atorch_checkpoint.json").read_text() == "old"
    checkpoint_dir.remove_replaced(replaced)
    assert beside(target) == []


def test_an_interrupted_swap_is_read_from_and_restored(tmp_path: Path) -> None:
    target = make(tmp_path / "latest", "old")
    stale = checkpoint_dir.prepare(target)  # a save that stopped while writing
    (stale / "__0_0.distcp").write_bytes(b"partial")
    os.rename(target, tmp_path / ".latest.old-0123")  # ... or stopped between its two renames
    assert checkpoint_dir.resolve(target) == tmp_path / ".latest.old-0123"
    staging = checkpoint_dir.prepare(target)  # the next save puts the old one back and clears the rest
    assert (target / "atorch_checkpoint.json").read_text() == "old"
    assert beside(target) == [staging.name]
    assert checkpoint_dir.resolve(target) == target


def test_what_cannot_be_replaced_is_named(tmp_path: Path) -> None:
    other = tmp_path / "data"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    problems = checkpoint_dir.replace_problems(other, ("atorch_checkpoint.json", ".metadata"))
    assert "is a directory that is not a checkpoint" in problems[0] and "replaces the whole directory" in problems[0]
    assert "is a file" in checkpoint_dir.replace_problems(other / "notes.txt", (".metadata",))[0]
    assert checkpoint_dir.replace_problems(tmp_path / "new", (".metadata",)) == []
    (tmp_path / "empty").mkdir()
    assert checkpoint_dir.replace_problems(tmp_path / "empty", (".metadata",)) == []


def test_a_file_is_written_durably_whole(tmp_path: Path) -> None:
    checkpoint_dir.write_durably(tmp_path / "a.json", b"{}")
    assert (tmp_path / "a.json").read_bytes() == b"{}" and sorted(os.listdir(tmp_path)) == ["a.json"]


def test_a_symbolic_link_keeps_pointing_at_the_replaced_checkpoint(tmp_path: Path) -> None:
    real = make(tmp_path / "step-100", "old")
    (tmp_path / "latest").symlink_to(real)
    target = checkpoint_dir.real_target(tmp_path / "latest")
    assert target == real.resolve()
    staging = checkpoint_dir.prepare(target)
    (staging / "atorch_checkpoint.json").write_text("new")
    checkpoint_dir.remove_replaced(checkpoint_dir.commit(staging, target))
    assert (tmp_path / "latest").is_symlink() and (tmp_path / "latest" / "atorch_checkpoint.json").read_text() == "new"
