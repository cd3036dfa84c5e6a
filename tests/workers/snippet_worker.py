"""Run documentation examples (launched by tests/test_doc_snippets.py), each in a fresh namespace.

Usage: ``torchrun --nproc_per_node=N snippet_worker.py SNIPPETS.json WORKDIR``: the JSON file maps an example's
name (page:line) to the blocks it runs, ``[[page:line, source], ...]``: the setup blocks it comes after, then the
example itself, all in one namespace (tests/doc_blocks.py). The examples run one after the other in WORKDIR (what
they write lands there). Rank 0 prints ``RESULT {name: {"seconds": ...} or {"error": ...}}``.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import json
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from worker_common import run_each

from atorch.distributed import shutdown


def runner(steps: list[list[str]]) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        torch.manual_seed(0)  # the examples build models with random weights: the same on every rank
        start = time.perf_counter()
        namespace = {"__name__": "__main__"}
        for where, source in steps:  # tracebacks name the page and line of the block
            exec(compile(source, where, "exec"), namespace)  # noqa: S102 - this repository's own docs
        return {"seconds": round(time.perf_counter() - start, 2)}

    return run


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as handle:
        snippets: dict[str, list[list[str]]] = json.load(handle)
    os.chdir(sys.argv[2])
    dist.init_process_group("gloo")  # the examples' own calls find it and use it
    report = run_each({name: runner(steps) for name, steps in snippets.items()})
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(report), flush=True)
    shutdown()  # ranks meet before gloo closes its connections (a lone teardown can abort a peer)


if __name__ == "__main__":
    main()
