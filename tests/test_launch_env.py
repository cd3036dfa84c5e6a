"""torchrun's environment with a variable missing on one process: a clear SetupError before any process
group is made, instead of a one-process job that trains alone (issue 18, "Measured" 11)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from launcher import HERE

from atorch.distributed import launcher_env_problem

TORCHRUN = {  # what torchrun sets for rank 0 of 2 (the part atorch reads)
    "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none",
}


def _without(*names: str) -> dict[str, str]:
    return {k: v for k, v in TORCHRUN.items() if k not in names}


@pytest.mark.parametrize("missing", ["WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"])
def test_a_torchrun_variable_missing_is_named_with_the_fix(missing: str) -> None:
    problem = launcher_env_problem(_without(missing))
    assert problem is not None and problem.startswith(f"the launcher's environment is incomplete: {missing} is not set")
    assert "TORCHELASTIC_RUN_ID" in problem and "train alone" in problem
    assert "launch with torchrun" in problem and "without removing or overriding them" in problem


def test_world_size_without_the_rest_is_refused_too() -> None:
    problem = launcher_env_problem({"WORLD_SIZE": "2"})
    assert problem is not None and "RANK, MASTER_ADDR and MASTER_PORT are not set while WORLD_SIZE is" in problem


@pytest.mark.parametrize("environ", [
    {}, TORCHRUN, {"LOCAL_RANK": "0"},  # LOCAL_RANK alone: DeepSpeed sets it in a plain one-process run
    {"WORLD_SIZE": "1"}, {"WORLD_SIZE": "1", "RANK": "0"},  # one process, said explicitly
])
def test_complete_or_one_process_environments_pass(environ: dict[str, str]) -> None:
    assert launcher_env_problem(environ) is None


SCRIPT = """
import os, json, sys
os.environ.update(json.loads(sys.argv[1]))
from atorch.distributed import init_distributed
from atorch.errors import SetupError
import torch.distributed as dist
try:
    init_distributed()
    print("RESULT " + json.dumps({"started": dist.get_world_size()}))
except SetupError as exc:
    print("RESULT " + json.dumps({"raised": str(exc), "initialized": dist.is_initialized()}))
"""


def test_init_distributed_refuses_before_making_a_group() -> None:
    """In a fresh process, as rank 0 of a torchrun job that lost WORLD_SIZE: no one-process group is made."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN}
    env.update(PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]), OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(_without("WORLD_SIZE"))], capture_output=True,
                          text=True, timeout=120, env=env, check=True)
    out = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])
    assert out.get("raised", "").startswith("the launcher's environment is incomplete: WORLD_SIZE is not set"), out
    assert out["initialized"] is False
