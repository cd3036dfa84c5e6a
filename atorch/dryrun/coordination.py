"""How the ranks of a dry-run stay together when a trial fails or hangs on some of them.

Two channels, each chosen for what survives a broken trial:

* **The store** (the c10d key-value store the job was launched with) carries every agreement: the
  meeting before a trial, the preflight problems, the outcome after it. A store exchange is keyed by
  name, so it has no sequence to fall out of, and waiting on it is bounded. A collective that timed out
  is different: gloo closes the connection and the group is out of step for good.
* **A process group per trial**: every collective of a trial (DDP, FSDP, the loss reduction, mesh
  sub-groups) runs on a fresh group that stands in for the default one while the trial runs. After the
  trial it is dropped (destroyed at the next meeting, when no rank can still be inside it), so a trial
  that broke its group cannot break the next one. The job's own default group is never used by a trial.

This uses torch internals in one place (this module): the default group is swapped with
``_update_default_pg`` (meshes and every ``group=None`` collective follow it; atorch's mesh cache is
keyed by the default group, so it rebuilds), and the group counter that names new groups is agreed at
each meeting (a trial that failed on one rank before making a sub-group would otherwise leave the
ranks naming the next group differently and waiting on each other's rendezvous keys).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from atorch.parallel_layout import forget_meshes

_sessions = 0  # per process; every rank opens sessions in the same order


class Coordinator:
    """Store exchanges and per-trial process groups for one series of trials."""

    def __init__(self, rank: int, world_size: int) -> None:
        global _sessions
        _sessions += 1
        self.rank, self.world_size = rank, world_size
        self.distributed = dist.is_initialized() and world_size > 1
        base = _own_store_client() if self.distributed else dist.HashStore()
        self.store = dist.PrefixStore(f"atorch-dryrun/{_sessions}/", base)
        self._stale: list[Any] = []  # groups of finished trials, destroyed at the next meeting

    # ----- agreement through the store ---------------------------------------------------------
    def publish(self, name: str, value: Any) -> None:
        self.store.set(f"{name}/{self.rank}", json.dumps(value))

    def collect(self, name: str, timeout_s: float) -> list[Any | None]:
        """Every rank's value published under ``name``; None for a rank that did not publish in time."""
        keys = [f"{name}/{r}" for r in range(self.world_size)]
        with contextlib.suppress(RuntimeError):  # a DistStoreError on time-out; report who is missing below
            self.store.wait(keys, timedelta(seconds=max(timeout_s, 0.001)))
        return [json.loads(self.store.get(k)) if self.store.check([k]) else None for k in keys]

    def exchange(self, name: str, value: Any, timeout_s: float) -> list[Any | None]:
        self.publish(name, value)
        return self.collect(name, timeout_s)

    # ----- the trial's process group -----------------------------------------------------------
    def meet(self, name: str, timeout_s: float) -> str | None:
        """Wait (bounded) until every rank is here; None if all came, else why the ranks give up.

        The verdict is the store's first answer (compare-and-set), so a rank that arrives just after
        another gave up waiting follows that verdict instead of going on alone. Once all have come, no
        rank is inside an earlier trial: its groups are destroyed, and the counter that names new
        groups is set to the same value everywhere.
        """
        seen = self.exchange(name, {"group_count": c10d._world.group_count}, timeout_s)
        missing = [r for r, v in enumerate(seen) if v is None]
        mine = "" if not missing else (
            f"rank(s) {', '.join(map(str, missing))} did not come back within {timeout_s:.0f} s")
        verdict = self.store.compare_set(f"{name}/verdict", "", mine or "go").decode()
        if verdict != "go":
            return verdict
        for group in self._stale:
            with contextlib.suppress(Exception):  # already gone with its peers: nothing to free
                dist.destroy_process_group(group)
        self._stale.clear()
        c10d._world.group_count = max(v["group_count"] for v in seen if v is not None)
        return None

    @contextlib.contextmanager
    def trial_world(self, timeout_s: float) -> Iterator[None]:
        """Run the block with a fresh process group of all ranks standing in for the default group."""
        if not self.distributed:
            yield
            return
        before = set(c10d._world.pg_map)
        group = dist.new_group(ranks=list(range(self.world_size)), timeout=timedelta(seconds=timeout_s))
        default = c10d._get_default_group()
        forget_meshes()
        c10d._update_default_pg(group)
        try:
            yield
        finally:
            c10d._update_default_pg(default)
            forget_meshes()
            self._stale += [g for g in c10d._world.pg_map if g not in before and g is not default]

    def close(self, timeout_s: float) -> None:
        """Meet a last time, so the last trial's group is freed with no rank still inside it."""
        if self.distributed:
            self.meet("closed", timeout_s)


def _own_store_client() -> dist.Store:
    """A connection to the job's store of its own, so a watchdog thread never queues behind a store
    wait of the main thread on the shared client (a TCPStore client serves one request at a time)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host and port:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=300),
                             wait_for_workers=False)
    return c10d._get_default_store()
