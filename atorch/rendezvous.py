"""Joining the processes of a launch (torch's env:// rendezvous), with a voice and a limit.

torch's own rendezvous waits for every process in silence: ``WORLD_SIZE=2`` with one process started (or a rank
that never starts) looks like a hang. Here each process joins the same TCPStore torch would use, counts itself in,
and waits for the others; every ``ATORCH_RENDEZVOUS_REPORT_S`` seconds it says which processes it waits for, and
after ``ATORCH_RENDEZVOUS_TIMEOUT_S`` it raises a SetupError naming them. The store it returns is then handed to
``init_process_group`` as torch's env:// handler would hand it over.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from atorch.agreement import ranks_label
from atorch.errors import SetupError
from atorch.log import get_logger, say_where_seen
from atorch.settings import settings

logger = get_logger(__name__)
_joins = 0  # rendezvous joined by this process so far (every process of a job joins in step)


def say(message: str) -> None:
    """A warning that must be seen: logged, and on stderr as well when logging would show it nowhere."""
    say_where_seen(logger, logging.WARNING, message, f"[atorch rank {os.environ.get('RANK', '?')}]")


class _Reporter(threading.Thread):
    """Says ``describe()`` every ``every`` seconds until stopped: the voice of a process blocked in C++ (a
    TCPStore client connecting to a host that is not up yet releases the GIL while it retries)."""

    def __init__(self, every: float, describe: Callable[[], str]) -> None:
        super().__init__(name="atorch-rendezvous", daemon=True)
        self.every, self.describe, self.stopped = every, describe, threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.every):
            say(self.describe())


def join(rank: int, world_size: int, addr: str, port: int, timeout: timedelta) -> dist.Store:
    """The launch's TCPStore once all ``world_size`` processes joined it (store operations then bounded by
    ``timeout``, the process group's); a SetupError naming the missing processes after the rendezvous timeout."""
    config = settings()
    limit, every = config.rendezvous_timeout_s, config.rendezvous_report_s
    where, started = f"{addr}:{port}", time.monotonic()
    # Under torchrun the agent hosts the store (torch's check); otherwise rank 0 does.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    host, opener = rank == 0 and not agent, "torchrun's agent" if agent else "rank 0"
    fix = (f"start all {world_size} processes (torchrun starts them: torchrun --nproc_per_node=N [--nnodes=M ...] "
           "train.py), each with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE and its own RANK; "
           f"ATORCH_RENDEZVOUS_TIMEOUT_S (now {limit:g}) sets how long a process waits")

    def connecting() -> str:
        return (f"waiting for {opener} to open the rendezvous at {where} ({time.monotonic() - started:.0f} s of "
                f"{limit:g}): no process answers there yet; this is rank {rank} of {world_size}")

    reporter = _Reporter(every, connecting)
    reporter.start()
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=host, timeout=timedelta(seconds=limit),
                              wait_for_workers=False, multi_tenant=host,
                              use_libuv=os.environ.get("USE_LIBUV", "1") == "1")
    except RuntimeError as exc:  # torch's DistNetworkError / DistStoreError
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")
        why = (f"could not open the rendezvous at {where} ({first}): is MASTER_PORT free on this host, and "
               "MASTER_ADDR this host's address?") if host else (
               f"found no rendezvous at {where} within {limit:g} s ({first}): {opener}, which opens it, has not "
               "started or cannot be reached there")
        raise SetupError(f"rank {rank} of {world_size} {why}; {fix}") from exc
    finally:
        reporter.stopped.set()
    # Keys of this launch attempt (torchrun's restart count) and of this process's n-th process group: a group
    # made again in the same processes may meet on the same store (multi-tenant), where the old keys remain.
    global _joins
    prefix, _joins = f"atorch/rendezvous/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_joins}", _joins + 1
    if store.add(f"{prefix}/rank{rank}", 1) > 1:
        raise SetupError(f"RANK={rank} was started twice (rendezvous at {where}); give every process its own "
                         f"RANK from 0 to {world_size - 1}, as torchrun does")
    joined, reported = store.add(f"{prefix}/joined", 1), time.monotonic()
    poll = min(1.0, 0.1 + world_size / 1000)  # a thousand processes ask the store at most ~1000 times a second

    def who() -> tuple[int, str]:
        present = {r for r in range(world_size) if store.check([f"{prefix}/rank{r}"])}
        missing = sorted(set(range(world_size)) - present)
        return len(missing), f"started: {ranks_label(sorted(present))}; missing: {ranks_label(missing)}"

    while joined < world_size:
        now = time.monotonic()
        if now - started > limit:
            count, ranks = who()
            raise SetupError(f"only {world_size - count} of {world_size} processes joined the rendezvous at {where} "
                             f"within {limit:g} s ({ranks}); {fix}")
        if now - reported >= every:
            count, ranks = who()
            say(f"waiting for {count} of {world_size} processes to join the rendezvous at {where} ({ranks}; "
                f"{now - started:.0f} s of {limit:g})")
            reported = now
        time.sleep(poll)
        joined = store.add(f"{prefix}/joined", 0)
    store.set_timeout(timeout)
    logger.debug("rendezvous at %s: all %d processes joined", where, world_size)
    return store
