"""Strategy server load: ask/tell latency (p50/p99) and requests/s at 1, 8 and 32 concurrent clients.

The server runs as ``atorch serve`` in its own process on 127.0.0.1; each client is a thread with its own
httpx connection doing ask -> tell (the measurement itself is instant). A fresh study per run on a
synthetic table of 4096 candidates, all within the budget, so every ask proposes a new one.

    python bench/server.py                                  # SQLite (a file in a temp dir)
    python bench/server.py --postgres "$(bash scripts/postgres.sh)" --json results.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from server_harness import ProcessServer  # noqa: E402

from atorch.server.client import StrategyClient  # noqa: E402


def table() -> dict:
    points = [{"sharding": s, "checkpoint": c, "precision": p, "micro_batch_size": m}
              for s, c, p, m in itertools.product(["ddp", "zero1", "zero2", "fsdp"], [False, True],
                                                  ["fp32", "amp_bf16", "amp_fp16", "half_bf16"], range(1, 129))]
    preds = [{"peak_memory_bytes": 1e6 * (1 + i % 7), "step_time_s": 0.1 + (i % 13) / 100,
              "samples_per_s": 8 / (0.1 + (i % 13) / 100)} for i in range(len(points))]
    return {"points": points, "predictions": preds, "global_batch": 8}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def run(url: str, clients: int, pairs: int, tbl: dict, floor: bool = False) -> dict:
    """``floor``: the same clients calling ``/healthz`` (no storage, no search) twice per pair instead."""
    key = f"bench-{uuid.uuid4().hex[:8]}"
    if not floor:
        StrategyClient(url, timeout_s=300).create_study(key, tbl, 1e9, max_trials=10_000, top_k=0)
    asks: list[float] = []
    tells: list[float] = []
    left = iter(range(pairs))
    lock = threading.Lock()

    def client() -> None:
        c = StrategyClient(url, timeout_s=300)  # a queue of 32 clients on 2 cores takes seconds
        while True:
            with lock:
                if next(left, None) is None:
                    return
            t0 = time.perf_counter()
            p = c.health() if floor else c.ask(key)
            t1 = time.perf_counter()
            if floor:
                c.health()
            else:
                c.tell(key, p["number"], {"status": "ok", "samples_per_s": 1.0 + p["number"], "peak_memory_bytes": 1e6})
            t2 = time.perf_counter()
            asks.append(t1 - t0)
            tells.append(t2 - t1)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if not floor:
        StrategyClient(url).delete(key)
    ms = 1000.0
    return {"clients": clients, "pairs": len(asks), "ask_p50_ms": pct(asks, .5) * ms, "ask_p99_ms": pct(asks, .99) * ms,
            "tell_p50_ms": pct(tells, .5) * ms, "tell_p99_ms": pct(tells, .99) * ms,
            "requests_per_s": 2 * len(asks) / wall, "mean_ms": statistics.mean(asks + tells) * ms}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--postgres", default=os.environ.get("ATORCH_TEST_POSTGRES_URL"),
                        help="PostgreSQL URL (default $ATORCH_TEST_POSTGRES_URL; none: SQLite only)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--pairs", type=int, default=160, help="ask+tell pairs per run")
    parser.add_argument("--repeats", type=int, default=1, help="runs per row (the row is their median)")
    parser.add_argument("--storages", nargs="+", default=["floor", "sqlite", "postgresql"],
                        help="floor: /healthz only (uvicorn's per-request cost on this machine)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    tbl = table()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        urls = {"floor": f"sqlite:///{tmp}/floor.db", "sqlite": f"sqlite:///{tmp}/bench.db",
                "postgresql": args.postgres}
        for name in args.storages:
            if not urls.get(name):
                continue
            server = ProcessServer(urls[name]).start()
            try:
                run(server.url, 1, 5, tbl, floor=name == "floor")  # warm-up: connections, table parse
                for clients in args.clients:
                    runs = [run(server.url, clients, args.pairs, tbl, floor=name == "floor")
                            for _ in range(args.repeats)]
                    row = {"storage": name, "repeats": len(runs), "load_average": os.getloadavg()[0],
                           **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
                    results.append(row)
                    print(f"{name:10s} clients {clients:3d}: ask p50 {row['ask_p50_ms']:6.1f} ms p99 "
                          f"{row['ask_p99_ms']:6.1f} ms | tell p50 {row['tell_p50_ms']:6.1f} ms p99 "
                          f"{row['tell_p99_ms']:6.1f} ms | {row['requests_per_s']:6.1f} requests/s", flush=True)
            finally:
                server.kill()
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "cpus": os.cpu_count()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
