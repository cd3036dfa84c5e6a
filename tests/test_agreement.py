"""Processes that disagree raise the same error on every rank instead of deadlocking, and a launch whose world
never assembles says what it waits for, then raises (issue 29, item 7)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from launcher import HERE, _free_port, launch_fixture
from torch import nn

from atorch.agreement import Same, difference_problems, model_signature, ranks_label

launch = launch_fixture(HERE / "workers" / "agree_worker.py", timeout=240)
QUICK_S = 20.0  # a disagreement is found in the first exchange: seconds on a loaded 2-core machine, not a hang


def _raised(launch: dict[str, Any], scenario: str) -> str:
    """The message every rank raised in ``scenario`` (the same one on both), after asserting it was quick."""
    ranks = launch[scenario]
    assert [r["raised"] for r in ranks] == ["StrategyError"] * 2, ranks
    assert ranks[0]["message"] == ranks[1]["message"], ranks
    assert max(r["seconds"] for r in ranks) < QUICK_S, ranks
    return ranks[0]["message"]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_rank_dependent_load_strategy_is_one_error_on_every_rank(launch: dict[str, Any]) -> None:
    message = _raised(launch, "strategy")
    assert message.startswith("auto_accelerate cannot start (1 problem(s))")
    assert "rank 1's strategy differs from rank 0's: rank 0 [fsdp], rank 1 [parallel_mode" in message
    assert "every process must pass the same load_strategy" in message
    # Lightning's path (agreed_preflight) checks the same.
    assert "rank 1's strategy differs from rank 0's: rank 0 [zero1], rank 1 [zero2]" in _raised(launch, "preflight")


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_rank_dependent_model_names_the_first_differing_parameters(launch: dict[str, Any]) -> None:
    message = _raised(launch, "model")
    assert ("rank 1's model differs from rank 0's: parameter 'inp.weight' [32, 16] float32 on rank 0, [48, 16] "
            "float32 on rank 1; parameter 'inp.bias' [32] float32 on rank 0, [48] float32 on rank 1") in message
    assert "(and 6 more)" in message and "every process must build the same model" in message


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_automatic_mode_and_the_search_entry_check_before_searching(launch: dict[str, Any]) -> None:
    # auto_accelerate without load_strategy: refused before the search starts (it would take far longer).
    assert "rank 1's model differs from rank 0's" in _raised(launch, "automatic")
    # The search's own entry (as the Lightning strategy starts it): a parameter only rank 1 has.
    message = _raised(launch, "search_entry")
    assert message.startswith("the automatic search cannot start")
    assert "parameter 'blocks.3.0.weight' absent on rank 0, [32, 32] float32 on rank 1" in message


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_rank_dependent_argument_is_named_and_agreeing_ranks_build(launch: dict[str, Any]) -> None:
    assert "rank 1's options differ from rank 0's: dataloader_args['batch_size'] 8 on rank 0, 16 on rank 1" in (
        _raised(launch, "batch_size"))
    assert [r["status"] for r in launch["agreeing"]] == [True, True], launch["agreeing"]


# ----- the words, without processes ------------------------------------------------------------------------
def _problems(item: Same, held: list[Any]) -> list[str]:
    digests = [Same(item.what, value, item.fix).digest() for _, value in held]
    return difference_problems(item, held, digests)


def test_ranks_that_differ_are_grouped_against_rank_0() -> None:
    item = Same("strategy", None, "fix it")
    held = [["[a]", "A"], ["[a]", "A"], ["[b]", "B"], ["[b]", "B"], ["[c]", "C"]]
    assert _problems(item, held) == [
        "ranks 2, 3's strategy differs from rank 0's: rank 0 [a], ranks 2, 3 [b]; fix it",
        "rank 4's strategy differs from rank 0's: rank 0 [a], rank 4 [c]; fix it",
    ]
    # Short forms that look alike show the values themselves.
    assert _problems(item, [["[a]", "A1"], ["[a]", "A2"]]) == [
        "rank 1's strategy differs from rank 0's: rank 0 A1, rank 1 A2; fix it"]
    # A rank with nothing to compare (it reported a problem of its own) is left out.
    assert _problems(item, [[None, None], ["[a]", "A"], ["[a]", "A"]]) == []
    assert ranks_label([7, 1, 2, 3, 9, 10]) == "ranks 1-3, 7, 9, 10" and ranks_label([]) == "no rank"


def test_the_model_signature_holds_shapes_dtypes_frozen_parameters_and_buffers() -> None:
    model = nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2)).to(torch.float64)
    model[0].bias.requires_grad_(False)
    assert model_signature(model) == {
        "parameter '0.weight'": "[2, 4] float64", "parameter '0.bias'": "[2] float64 (frozen)",
        "parameter '1.weight'": "[2] float64", "parameter '1.bias'": "[2] float64",
        "buffer '1.running_mean'": "[2] float64", "buffer '1.running_var'": "[2] float64",
        "buffer '1.num_batches_tracked'": "[] int64",
    }
    many = {f"parameter 'w{i}'": "[1] float32" for i in range(5)}
    other = {**many, "parameter 'w4'": "[2] float32", "buffer 'b'": "[1] float32"}
    (message,) = _problems(Same("model", None, "fix"), [[None, many], [None, other]])
    assert message == ("rank 1's model differs from rank 0's: parameter 'w4' [1] float32 on rank 0, [2] float32 on "
                       "rank 1; buffer 'b' absent on rank 0, [1] float32 on rank 1; fix")


# ----- a world that never assembles ------------------------------------------------------------------------
JOIN = """
import sys, time
from atorch.distributed import init_distributed
print(f"JOINING {time.time()}", file=sys.stderr, flush=True)
init_distributed()
print("JOINED", flush=True)
"""
REPORT_S, TIMEOUT_S = 1.0, 4.0


def _alone(rank: int, port: int) -> subprocess.Popen:
    """One process of a 2-process launch, started alone, with a short report interval and time-out."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "LOCAL_WORLD", "GROUP_RANK"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0",
               ATORCH_RENDEZVOUS_REPORT_S=str(REPORT_S), ATORCH_RENDEZVOUS_TIMEOUT_S=str(TIMEOUT_S),
               PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]), OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="")
    return subprocess.Popen([sys.executable, "-c", JOIN], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _lines(proc: subprocess.Popen) -> tuple[int, list[tuple[float, str]]]:
    """The exit code, and each stderr line with the time it arrived, relative to the JOINING mark."""
    lines, mark = [], None
    assert proc.stderr is not None
    for line in proc.stderr:  # read as it comes: the arrival time of the first report is asserted
        now = time.time()
        if line.startswith("JOINING "):
            mark = float(line.split()[1])
        lines.append((now - (mark or now), line.rstrip()))
    return proc.wait(timeout=60), lines


@pytest.mark.timeout(120)
def test_a_world_that_never_assembles_says_what_it_waits_for_then_raises() -> None:
    port_alone, port_missing_host = _free_port(), _free_port()
    rank0, rank1 = _alone(0, port_alone), _alone(1, port_missing_host)  # rank 1's host (rank 0) never starts
    with ThreadPoolExecutor(2) as pool:  # both read as they write: arrival times are asserted
        read = list(pool.map(_lines, (rank0, rank1)))
    for proc, (code, lines), waiting, error in (
        (rank0, read[0], f"waiting for 1 of 2 processes to join the rendezvous at 127.0.0.1:{port_alone} "
                "(started: rank 0; missing: rank 1;",
         f"SetupError: only 1 of 2 processes joined the rendezvous at 127.0.0.1:{port_alone} within 4 s "
         "(started: rank 0; missing: rank 1); start all 2 processes"),
        (rank1, read[1], f"waiting for rank 0 to open the rendezvous at 127.0.0.1:{port_missing_host}",
         f"SetupError: rank 1 of 2 found no rendezvous at 127.0.0.1:{port_missing_host} within 4 s"),
    ):
        text = "\n".join(line for _, line in lines)
        assert code != 0 and "JOINED" not in (proc.stdout.read() if proc.stdout else ""), text
        reports = [t for t, line in lines if waiting in line]
        assert reports and reports[0] < REPORT_S + 3, text  # the first report within the interval
        assert len(reports) >= 2, text  # and again, periodically
        assert error in text and "ATORCH_RENDEZVOUS_TIMEOUT_S" in text, text
        ended = max(t for t, line in lines if "SetupError" in line)
        assert ended < TIMEOUT_S * 2 + 5, text  # raised after the configured time-out, not torch's 10 minutes
