"""Measures the hardware profile on all launched processes: first call, cached call, memory limit.

Usage: ``torchrun --nproc_per_node=2 hardware_worker.py CACHE_DIR``. Rank 0 prints ``RESULT {...}`` with
every rank's profiles (gathered as JSON) and how long each call took.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import json
import time

from atorch.distributed import all_gather_json, init_distributed
from atorch.strategy_search.costing.hardware import measure_profile, profile_dir


def main() -> None:
    os.environ["ATORCH_CACHE_DIR"] = sys.argv[1]
    env = init_distributed()
    timed = {}
    profiles = {}
    for name, kwargs in (("first", {}), ("cached", {}), ("limited", {"memory_limit": "1GiB"})):
        start = time.perf_counter()
        profiles[name] = measure_profile(**kwargs).model_dump(mode="json")
        timed[name] = time.perf_counter() - start
    everyone = all_gather_json({"profiles": profiles, "times": timed})
    if env.is_main:
        files = sorted(p.name for p in profile_dir().glob("*"))
        print("RESULT " + json.dumps({"ranks": everyone, "cache_files": files}), flush=True)


if __name__ == "__main__":
    main()
