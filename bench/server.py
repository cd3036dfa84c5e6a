"""Strategy server load against what the machine and the storage can do, measured in the same run.

The server runs as ``atorch serve`` in its own process on 127.0.0.1; each client is a thread with its own httpx
connection doing ask -> tell in a closed loop (the measurement itself is instant, and equal to the prediction), on
a fresh study of a synthetic table of 4096 candidates, all within the budget. Per storage and client count it
reports ask and tell p50/p99, ``/healthz`` p99 polled every 20 ms while the load runs, requests/s, and errors,
duplicate and lost trials (checked in the study afterwards); and the same ask/tell sequence called in-process on
Optuna directly (the same storage, the same number of threads, no HTTP: the floor of the storage itself).
``--journal`` adds that sequence on a JournalStorage over the same database; ``--statements`` counts SQL
statements per pair instead.

    python bench/server.py                                  # SQLite (a file in a temp dir)
    python bench/server.py --postgres "$(bash scripts/postgres.sh)" --json results.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import httpx  # noqa: E402
from server_harness import ProcessServer  # noqa: E402

from atorch.strategy_search.search.remote import StrategyClient  # noqa: E402


def table() -> dict:
    points = [{"sharding": s, "checkpoint": c, "precision": p, "micro_batch_size": m}
              for s, c, p, m in itertools.product(["ddp", "zero1", "zero2", "fsdp"], [False, True],
                                                  ["fp32", "amp_bf16", "amp_fp16", "half_bf16"], range(1, 129))]
    preds = [{"peak_memory_bytes": 1e6 * (1 + i % 7), "step_time_s": 0.1 + (i % 13) / 100,
              "samples_per_s": 8 / (0.1 + (i % 13) / 100)} for i in range(len(points))]
    return {"points": points, "predictions": preds, "global_batch": 8}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def closed_loop(clients: int, pairs: int, pair: Callable[[Any], tuple[float, float]],
                make: Callable[[], Any]) -> tuple[list[float], list[float], list[str], float]:
    """``clients`` threads doing ``pair(worker)`` (an ask then a tell: their seconds) until ``pairs`` are done."""
    asks: list[float] = []
    tells: list[float] = []
    errors: list[str] = []
    left = iter(range(pairs))
    lock = threading.Lock()

    def client() -> None:
        worker = make()
        while True:
            with lock:
                if next(left, None) is None:
                    return
            try:
                a, t = pair(worker)
            except Exception as exc:  # counted, and the run goes on
                errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
                continue
            asks.append(a)
            tells.append(t)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return asks, tells, errors, time.perf_counter() - start


def over_http(url: str, clients: int, pairs: int, tbl: dict) -> dict:
    name = StrategyClient(url, timeout_s=300).create_study(f"bench-{uuid.uuid4().hex[:8]}", tbl, 1e9,
                                                           max_trials=10_000, top_k=0)["study_key"]
    health: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=30) as h:
            while not done.is_set():
                t0 = time.perf_counter()
                h.get("/healthz")
                health.append(time.perf_counter() - t0)
                time.sleep(0.02)

    def pair(c: StrategyClient) -> tuple[float, float]:
        t0 = time.perf_counter()
        p = c.ask(name)
        t1 = time.perf_counter()
        if p["number"] is None:
            raise RuntimeError(f"stopped: {p['stop']}")
        # The measurement is the prediction: no candidate is ruled out as hopelessly slow on the way, so each ask
        # creates one trial, as in the in-process sequence.
        c.tell(name, p["number"], {"status": "ok", "samples_per_s": p["predicted"]["samples_per_s"],
                                   "peak_memory_bytes": 1e6})
        return t1 - t0, time.perf_counter() - t1

    poller = threading.Thread(target=poll)
    poller.start()
    asks, tells, errors, wall = closed_loop(clients, pairs, pair, lambda: StrategyClient(url, timeout_s=300))
    done.set()
    poller.join()
    trials = StrategyClient(url, timeout_s=300).trials(name)
    StrategyClient(url, timeout_s=300).delete(name)
    measured = [t["user_attrs"]["key"] for t in trials if t["state"] == "COMPLETE" and "measured" in t["user_attrs"]
                and t["user_attrs"]["status"] != "duplicate"]
    ms = 1000.0
    return {"ask_p50_ms": pct(asks, .5) * ms, "ask_p99_ms": pct(asks, .99) * ms, "tell_p50_ms": pct(tells, .5) * ms,
            "tell_p99_ms": pct(tells, .99) * ms, "healthz_p99_ms": pct(health, .99) * ms,
            "requests_per_s": 2 * len(asks) / wall, "errors": len(errors), "error_sample": errors[:3],
            "measured": len(measured), "twice_measured": len(measured) - len(set(measured)),
            "lost": len(asks) - len(measured), "extra_trials": len(trials) - len(asks),
            "left_running": sum(t["state"] == "RUNNING" for t in trials)}


class SQLJournal:
    """A ``BaseJournalBackend`` on a SQLAlchemy database (Optuna ships file and Redis ones): one row per
    journal entry, numbered in commit order (an append locks the table, so no reader sees entry n + 1 before
    entry n). Made here to measure what a JournalStorage on the server's database would sustain (``--journal``);
    the server does not use it."""

    def __init__(self, url: str) -> None:
        import sqlalchemy as sa

        self.sa, self.engine = sa, sa.create_engine(url)
        self.table = f"journal_{uuid.uuid4().hex[:8]}"
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"create table {self.table} (n integer primary key, entry text not null)"))

    def read_logs(self, log_number_from: int) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(self.sa.text(f"select entry from {self.table} where n >= :n order by n"),
                                {"n": log_number_from}).scalars().all()
        return [json.loads(r) for r in rows]

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        with self.engine.begin() as conn:
            if self.engine.dialect.name == "postgresql":
                conn.execute(self.sa.text(f"lock table {self.table} in exclusive mode"))
            else:
                conn.execute(self.sa.text(f"delete from {self.table} where n < 0"))  # SQLite: take the write lock
            n = conn.execute(self.sa.text(f"select coalesce(max(n) + 1, 0) from {self.table}")).scalar()
            conn.execute(self.sa.text(f"insert into {self.table} (n, entry) values (:n, :e)"),
                         [{"n": n + i, "e": json.dumps(log)} for i, log in enumerate(logs)])

    def drop(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(self.sa.text(f"drop table {self.table}"))
        self.engine.dispose()


def in_process(storage: str, clients: int, pairs: int, tbl: dict, journal: bool = False) -> dict:
    """The same ask/tell sequence on Optuna directly: ask, suggest the point, set its attributes, tell (on the
    RDB storage; with ``journal``, on a JournalStorage over ``SQLJournal`` in the same database)."""
    import optuna

    from atorch.strategy_search.search.candidates import CandidateTable, point_key

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    cand = CandidateTable.from_json(tbl)
    cand.to_params(cand.points[0])  # builds its walk index before the threads share it (the build is not thread-safe)
    backend = SQLJournal(storage) if journal else None
    on = optuna.storages.JournalStorage(backend) if backend is not None else storage
    study = optuna.create_study(storage=on, study_name=f"floor-{uuid.uuid4().hex[:8]}", direction="maximize",
                                sampler=optuna.samplers.TPESampler(n_startup_trials=5000))
    number = itertools.count()

    def pair(_: Any) -> tuple[float, float]:
        t0 = time.perf_counter()
        trial = study.ask()
        point = cand.suggest(trial)
        trial.set_user_attr("key", point_key(point))
        trial.set_user_attr("lease_expires", time.time() + 600)
        t1 = time.perf_counter()
        trial.set_user_attr("measured", {"status": "ok", "samples_per_s": 1.0 + next(number)})
        trial.set_user_attr("status", "ok")
        study.tell(trial, 1.0)
        return t1 - t0, time.perf_counter() - t1

    asks, tells, errors, wall = closed_loop(clients, pairs, pair, lambda: None)
    prefix = "journal_inproc" if journal else "inproc"
    if backend is not None:
        backend.drop()
    else:
        optuna.delete_study(study_name=study.study_name, storage=storage)
    return {f"{prefix}_requests_per_s": 2 * len(asks) / wall, f"{prefix}_errors": len(errors)}


def statements(storage: str, pairs: int, tbl: dict) -> dict:
    """SQL statements and commits per ask + tell pair (a SQLAlchemy event listener on the engine): the server's
    ``Studies`` called in this process (no HTTP), and the in-process floor's sequence, on the same storage. Each
    tell reports the candidate's predicted samples/s, so no candidate is skipped and every pair is one trial."""
    import optuna
    from sqlalchemy import event

    from atorch.server.store import Studies
    from atorch.strategy_search.search.candidates import CandidateTable, point_key

    def counting(engine: Any) -> dict[str, int]:
        counts = {"statements": 0, "commits": 0}

        @event.listens_for(engine, "before_cursor_execute")
        def _statement(*_: Any) -> None:
            counts["statements"] += 1

        @event.listens_for(engine, "commit")
        def _commit(*_: Any) -> None:
            counts["commits"] += 1

        return counts

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    studies = Studies(storage)
    name = studies.create(f"sql-{uuid.uuid4().hex[:8]}", tbl, {"memory_budget": 1e9, "sampler": "tpe",
                                                                "max_trials": 10_000, "top_k": 0, "seed": 1,
                                                                "lease_s": 600.0})["study_key"]

    def server_pair() -> None:
        p = studies.ask(name, None)
        studies.tell(name, p["number"], {"status": "ok", "samples_per_s": p["predicted"]["samples_per_s"],
                                         "peak_memory_bytes": 1e6, "reason": ""})

    rdb = optuna.storages.RDBStorage(storage)
    cand = CandidateTable.from_json(tbl)
    study = optuna.create_study(storage=rdb, study_name=f"sql-floor-{uuid.uuid4().hex[:8]}", direction="maximize",
                                sampler=optuna.samplers.TPESampler(n_startup_trials=5000, seed=1))

    def floor_pair() -> None:
        trial = study.ask()
        point = cand.suggest(trial)
        trial.set_user_attr("key", point_key(point))
        trial.set_user_attr("lease_expires", time.time() + 600)
        trial.set_user_attr("measured", {"status": "ok", "samples_per_s": 1.0})
        trial.set_user_attr("status", "ok")
        study.tell(trial, 1.0)

    row = {}
    for label, engine, pair in (("server", studies.rdb.engine, server_pair), ("in_process", rdb.engine, floor_pair)):
        for _ in range(5):  # warm: connections, caches
            pair()
        counts = counting(engine)
        for _ in range(pairs):
            pair()
        row.update({f"{label}_{k}_per_pair": v / pairs for k, v in counts.items()})
    studies.delete(name)
    studies.close()
    optuna.delete_study(study_name=study.study_name, storage=rdb)
    rdb.engine.dispose()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--postgres", default=os.environ.get("ATORCH_TEST_POSTGRES_URL"),
                        help="PostgreSQL URL (default $ATORCH_TEST_POSTGRES_URL; none: SQLite only)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--pairs", type=int, default=160, help="ask+tell pairs per run")
    parser.add_argument("--storages", nargs="+", default=["sqlite", "postgresql"])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--journal", action="store_true",
                        help="also run the in-process sequence on a JournalStorage over the same database")
    parser.add_argument("--statements", action="store_true",
                        help="only count SQL statements and commits per ask + tell pair (server vs in-process)")
    args = parser.parse_args()
    tbl = table()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        urls = {"sqlite": f"sqlite:///{tmp}/bench.db", "postgresql": args.postgres}
        for name in args.storages:
            if not urls.get(name):
                continue
            if args.statements:
                row = {"storage": name, **statements(urls[name], 30, tbl)}
                results.append(row)
                print(f"{name:10s} SQL per ask + tell pair: server {row['server_statements_per_pair']:.1f} statements, "
                      f"{row['server_commits_per_pair']:.1f} commits | in-process "
                      f"{row['in_process_statements_per_pair']:.1f} statements, "
                      f"{row['in_process_commits_per_pair']:.1f} commits", flush=True)
                continue
            server = ProcessServer(urls[name]).start()
            try:
                over_http(server.url, 1, 5, tbl)  # warm-up: connections, table parse
                for clients in args.clients:
                    row = {"storage": name, "clients": clients, "load_average": os.getloadavg()[0],
                           **over_http(server.url, clients, args.pairs, tbl)}
                    row.update(in_process(urls[name], clients, args.pairs, tbl))
                    if args.journal:
                        row.update(in_process(urls[name], clients, args.pairs, tbl, journal=True))
                    row["vs_in_process"] = row["requests_per_s"] / row["inproc_requests_per_s"]
                    results.append(row)
                    print(f"{name:10s} {clients:3d} clients: ask p50 {row['ask_p50_ms']:6.1f} p99 "
                          f"{row['ask_p99_ms']:6.1f} ms | tell p50 {row['tell_p50_ms']:6.1f} p99 "
                          f"{row['tell_p99_ms']:6.1f} ms | healthz p99 "
                          f"{row['healthz_p99_ms']:6.1f} ms | {row['requests_per_s']:6.1f} req/s "
                          f"({row['vs_in_process']:.2f}x in-process {row['inproc_requests_per_s']:.1f}) | errors "
                          f"{row['errors']} twice {row['twice_measured']} lost {row['lost']} extra trials "
                          f"{row['extra_trials']}"
                          + (f" | journal in-process {row['journal_inproc_requests_per_s']:.1f} req/s "
                             f"({row['journal_inproc_errors']} errors)" if args.journal else ""), flush=True)
            finally:
                server.kill()
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "cpus": os.cpu_count()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
