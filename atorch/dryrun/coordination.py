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

A rank that fails on its own error in a trial **stops the others within seconds**, not at the trial's
deadline: it announces the failure under the trial's "abort" key (the first announcement stands) and
drops its trial groups at once. Each rank's trial runs an ``AbortWatcher`` that polls the key; when
another rank set it, the watcher ``abort()``s this rank's trial groups and flags the trial, which stops
at its next step. On NCCL, ``abort()`` (ncclCommAbort) is what ends a collective that waits for the failed
rank. On gloo ``abort()`` and ``shutdown()`` leave a pending collective waiting until its timeout (torch
2.13, measured); what ends it is the peer's connections closing, which happens when the failed rank's
group object is freed: hence the drop, done on every rank that stops (so a rank waiting on a rank that
stopped is freed in turn). The same announcement, watcher and drop run on both backends. Not ended this
way: a rank waiting in the store rendezvous of a group that is being made (DeepSpeed's engine makes its
own groups) when the failed rank never comes; it waits for the store's timeout.

This uses torch internals in one place (this module): the default group is swapped with
``_update_default_pg`` (meshes and every ``group=None`` collective follow it; atorch's mesh cache is
keyed by the default group, so it rebuilds), and the group counter that names new groups is agreed at
each meeting (a trial that failed on one rank before making a sub-group would otherwise leave the
ranks naming the next group differently and waiting on each other's rendezvous keys).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from atorch.parallel_layout import forget_meshes

_sessions = 0  # per process; every rank opens sessions in the same order
ABORT_POLL_S = 0.2  # how often a rank looks for another's failure (a failure may cost 10 s at most)


@dataclass(frozen=True)
class GaveUp:
    """A meeting's verdict when some ranks did not come: the ranks given up, and the sentence that says so."""

    missing: list[int]
    why: str


class Coordinator:
    """Store exchanges and per-trial process groups for one series of trials."""

    def __init__(self, rank: int, world_size: int) -> None:
        global _sessions
        _sessions += 1
        self.rank, self.world_size = rank, world_size
        self.distributed = dist.is_initialized() and world_size > 1
        base = _own_store_client() if self.distributed else dist.HashStore()
        self.prefix = f"atorch-dryrun/{_sessions}/"
        self.store = dist.PrefixStore(self.prefix, base)
        self._stale: list[Any] = []  # groups of finished trials, destroyed at the next meeting
        self._trial_groups: Callable[[], list[Any]] = list  # the running trial's groups (see trial_world)
        self._watch_store: dist.Store | None = None  # the abort watchers' own connection, made on first use
        self.brought: list[Any] = []  # what each rank brought to the last meeting (``meet``)

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

    # ----- stopping the other ranks when one fails -------------------------------------------
    def announce_abort(self, trial: int, reason: str) -> dict[str, Any]:
        """Tell every rank that this one failed in ``trial``; the first announcement (rank, reason) stands."""
        mine = json.dumps({"rank": self.rank, "reason": reason})
        return json.loads(self.store.compare_set(f"{trial}/abort", "", mine).decode())

    def abort_announced(self, trial: int, store: dist.Store | None = None) -> dict[str, Any] | None:
        """The first announcement of a failure in ``trial`` (rank, reason), or None."""
        store = store or self.store
        key = f"{trial}/abort"
        return json.loads(store.get(key)) if store.check([key]) else None

    def watch_store(self) -> dist.Store:
        """A store client for the abort watchers, so their polls never queue behind a store wait of the
        main thread or of the deadline watchdog."""
        if self._watch_store is None:
            self._watch_store = dist.PrefixStore(self.prefix, _own_store_client()) if self.distributed else self.store
        return self._watch_store

    def abort_trial_groups(self) -> None:
        """Abort the running trial's groups from any thread: on NCCL this ends a pending collective
        with an error (on gloo it does not; the failed rank's ``drop_finished_groups`` does)."""
        for group in self._trial_groups():
            with contextlib.suppress(Exception):  # already aborted or destroyed
                group.abort()

    def drop_finished_groups(self) -> None:
        """Free the finished trial's groups now instead of at the next meeting: after a failure, this
        rank's connections close, so a peer still waiting in one of their collectives gets an error at
        once (gloo: "Connection closed by peer") and stops too. Only after a failure: after a trial that
        went well a peer may still be finishing its last collective."""
        groups, self._stale = self._stale, []
        for group in groups:
            with contextlib.suppress(Exception):  # NCCL: abort, as a destroy may wait for the peers
                group.abort()
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)
        del groups
        if "deepspeed.utils.groups" in sys.modules:  # DeepSpeed keeps its engine's groups in module globals
            from atorch.opt_lib.deepspeed_zero import forget_destroyed_groups

            forget_destroyed_groups()
        gc.collect()  # the trial's objects (a DDP reducer, a mesh) hold the groups in reference cycles

    # ----- a rank given up ---------------------------------------------------------------------
    def mark_given_up(self, gave_up: GaveUp) -> None:
        """Say in the store, for the session, which ranks the others gave up (``given_up`` reads it: the
        watchdog of a rank still stuck ends its process)."""
        self.store.set("gave_up", json.dumps({"missing": gave_up.missing, "why": gave_up.why}))

    def given_up(self, store: dist.Store | None = None) -> GaveUp | None:
        store = store or self.store
        if not store.check(["gave_up"]):
            return None
        found = json.loads(store.get("gave_up"))
        return GaveUp(found["missing"], found["why"])

    # ----- the trial's process group -----------------------------------------------------------
    def meet(self, name: str, timeout_s: float, brings: Any = None) -> GaveUp | None:
        """Wait (bounded) until every rank is here; None if all came, else which ranks the others give up.

        The verdict is the store's first answer (compare-and-set), so a rank that arrives just after
        another gave up waiting follows that verdict instead of going on alone. Once all have come, no
        rank is inside an earlier trial: its groups are destroyed, and the counter that names new
        groups is set to the same value everywhere. ``brings``: a JSON value each rank brings to the
        meeting (what it is about to run); every rank reads them all in ``brought``, the same list everywhere.
        """
        seen = self.exchange(name, {"group_count": c10d._world.group_count, "brings": brings}, timeout_s)
        self.brought = [None if v is None else v.get("brings") for v in seen]
        missing = [r for r, v in enumerate(seen) if v is None]
        mine = "go" if not missing else json.dumps(
            {"missing": missing, "why": f"rank(s) {', '.join(map(str, missing))} did not come back within "
                                        f"{timeout_s:g} s"})
        verdict = self.store.compare_set(f"{name}/verdict", "", mine).decode()
        if verdict != "go":
            found = json.loads(verdict)
            return GaveUp(found["missing"], found["why"])
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
        self._trial_groups = lambda: [g for g in list(c10d._world.pg_map) if g not in before and g is not default]
        try:
            yield
        finally:
            c10d._update_default_pg(default)
            forget_meshes()
            self._stale += self._trial_groups()
            self._trial_groups = list

    def close(self, timeout_s: float) -> GaveUp | None:
        """Meet a last time, so the last trial's group is freed with no rank still inside it; the verdict."""
        return self.meet("closed", timeout_s) if self.distributed else None


class AbortWatcher:
    """While a trial runs (a ``with`` block): poll the trial's abort key in a thread; when another rank
    announced a failure, keep its announcement (rank, reason) in ``stopped_by`` and abort this rank's
    trial groups. The trial reads ``stopped_by`` at its next step."""

    def __init__(self, coordinator: Coordinator, trial: int) -> None:
        self.coordinator, self.trial = coordinator, trial
        self.stopped_by: dict[str, Any] | None = None
        self._done = threading.Event()

    def __enter__(self) -> AbortWatcher:
        if self.coordinator.distributed:
            store = self.coordinator.watch_store()
            threading.Thread(target=self._watch, args=(store,), name=f"atorch-abort-watch-{self.trial}",
                             daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()

    def _watch(self, store: dist.Store) -> None:
        while not self._done.wait(ABORT_POLL_S):
            try:
                first = self.coordinator.abort_announced(self.trial, store)
            except Exception:  # noqa: BLE001  (the job's store is gone: the job is ending)
                return
            if first is not None and first["rank"] != self.coordinator.rank:
                self.stopped_by = first
                self.coordinator.abort_trial_groups()
                return


def _own_store_client() -> dist.Store:
    """A connection to the job's store of its own, so a watchdog thread never queues behind a store
    wait of the main thread on the shared client (a TCPStore client serves one request at a time)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host and port:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=300),
                             wait_for_workers=False)
    return c10d._get_default_store()
