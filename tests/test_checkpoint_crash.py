"""Overwriting a checkpoint is atomic: a rank killed in the middle of re-saving ``latest`` leaves the previous
checkpoint there, loadable exactly; the next save clears what the crash left. A copy whose DCP metadata carries
a payload is refused by ``load_checkpoint`` on every rank without running it.

Two launches of 2 real gloo processes (fsdp): ``crash`` (fails on purpose: rank 1 SIGKILLs itself when it opens
its data file in the staging directory, after rank 0's is written) and ``resume``. See
tests/workers/ckpt_crash_worker.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from launcher import run_failing, run_json

WORKER = Path(__file__).resolve().parent / "workers" / "ckpt_crash_worker.py"
pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("ckpt_crash")
    crashed = run_failing(WORKER, "crash", str(root), nproc=2, timeout=300)
    return root, crashed.stdout + crashed.stderr, run_json(WORKER, "resume", str(root), nproc=2, timeout=300)


def test_the_rank_died_mid_save_and_the_old_checkpoint_stayed(runs: tuple[Path, str, dict[str, Any]]) -> None:
    _, output, report = runs
    assert "KILLED rank 1 opening __1_0.distcp in .latest.tmp-" in output, output[-3000:]
    assert "the save finished" not in output
    # What the crash left: the staging directory, with rank 0's new data but no description.
    (staging,) = report["beside_before"]
    assert staging.startswith(".latest.tmp-")


def test_the_staging_directory_held_part_of_the_new_checkpoint(runs: tuple[Path, str, dict[str, Any]]) -> None:
    _, output, _ = runs
    line = next(x for x in output.splitlines() if x.startswith("KILLED"))
    assert int(line.split(" had ")[1].split()[0]) > 0  # rank 0's data file was written before the kill


def test_the_path_loads_the_previous_checkpoint_exactly(runs: tuple[Path, str, dict[str, Any]]) -> None:
    _, _, report = runs
    assert report["info"] == {"step": 1, "extra": {}}
    assert report["loaded"] == {"same_keys": True, "max_diff": 0.0}  # every weight and Adam moment, bitwise


def test_a_save_stopped_between_its_renames_leaves_the_previous_checkpoint_loadable(
        runs: tuple[Path, str, dict[str, Any]]) -> None:
    _, _, report = runs
    assert report["info_between"] == {"step": 1, "extra": {}}
    assert report["loaded_between"] == {"same_keys": True, "max_diff": 0.0}


def test_the_next_save_clears_the_leftovers_and_loads(runs: tuple[Path, str, dict[str, Any]]) -> None:
    root, _, report = runs
    assert report["beside_after"] == []
    assert json.loads((root / "latest" / "atorch_checkpoint.json").read_text())["step"] == 3
    assert report["info_3"]["step"] == 3 and report["reloaded"] == {"same_keys": True, "max_diff": 0.0}


def test_a_payload_in_the_metadata_is_refused_and_not_run(runs: tuple[Path, str, dict[str, Any]]) -> None:
    root, _, report = runs
    error = report["tampered"]
    assert error["type"] == "CheckpointError", error
    assert "refers to io.open" in error["message"] and "not trusted" in error["message"]
    assert not (root / "marker").exists()
