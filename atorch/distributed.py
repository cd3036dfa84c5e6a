"""Process-group set-up from the torchrun environment, and the facts a strategy needs about it."""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from atorch import rendezvous
from atorch.agreement import Same, difference_problems, differing
from atorch.errors import SetupError
from atorch.log import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def init_distributed(timeout_s: float = 600.0) -> DistEnv:
    """Create the default process group if needed (torchrun's env, or a one-process group).

    A plain ``python train.py`` gets a one-process group, so every method runs unchanged at
    world size 1. NCCL on CUDA, gloo otherwise.
    """
    use_cuda = torch.cuda.is_available()
    local_rank = _env_int("LOCAL_RANK", 0)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if problem := launcher_env_problem(os.environ):
            raise SetupError(problem)
        global _pg_timeout
        backend = "nccl" if use_cuda else "gloo"
        timeout = _pg_timeout = timedelta(seconds=timeout_s)
        if "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ:
            # torch's env:// rendezvous, joined by atorch: a world that never assembles is named, not a hang.
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = rendezvous.join(rank, world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout)
            dist.init_process_group(backend=backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                                    world_size=world, timeout=timeout)
        else:
            # No launcher: a private in-process store, no network port.
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        logger.debug("initialised process group: backend=%s world_size=%d", backend, dist.get_world_size())
        _install_shutdown()
    return DistEnv(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        backend=dist.get_backend(),
    )


# What a process group made from the environment (env://) reads; torchrun sets all four for every process.
_RENDEZVOUS_VARS = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")
# Set by torchrun only (LOCAL_RANK is not one: DeepSpeed sets it in a plain one-process run too).
_TORCHRUN_MARKERS = ("LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def launcher_env_problem(environ: Mapping[str, str]) -> str | None:
    """Why this environment is a launcher's with variables missing, or None.

    A process group is made from the environment only when it names both a rendezvous (MASTER_ADDR)
    and a world (WORLD_SIZE); a process that lost one of them would otherwise start as a one-process
    job and train alone while its peers wait for it (or, rank 0, finish as if it were the whole job).
    """
    present = [name for name in (*_RENDEZVOUS_VARS, *_TORCHRUN_MARKERS) if environ.get(name, "").strip()]
    missing = [name for name in _RENDEZVOUS_VARS if not environ.get(name, "").strip()]
    if not present or not missing:
        return None
    torchrun = any(name in present for name in _TORCHRUN_MARKERS)
    if not torchrun and "MASTER_ADDR" in missing and environ.get("WORLD_SIZE", "").strip() == "1":
        return None  # WORLD_SIZE=1 (RANK=0) and no rendezvous, outside torchrun: one process, as asked
    names = " and ".join(missing) if len(missing) <= 2 else ", ".join(missing[:-1]) + " and " + missing[-1]
    return (
        f"the launcher's environment is incomplete: {names} {'is' if len(missing) == 1 else 'are'} not set while "
        f"{', '.join(present)} {'is' if len(present) == 1 else 'are'}, so this process would start as a "
        "one-process job and train alone; launch with torchrun (torchrun --nproc_per_node=N train.py), which "
        f"sets {', '.join(_RENDEZVOUS_VARS)} for every process, without removing or overriding them, "
        f"or unset {', '.join(present)} to run a single process with plain python"
    )


_pg_timeout = timedelta(minutes=30)  # torch's default; atorch's own when it created the group
_EXIT_BARRIER_S = 60.0  # how long a rank waits at exit for the others before tearing down alone
_failed = False


def shutdown() -> None:
    """Tear the process group down on every rank together (``atorch.shutdown()``).

    gloo aborts a process ("terminate called without an active exception") when a peer closes its
    connections while this rank still tears its own down, so ranks meet at a barrier first. After
    an uncaught exception there is no barrier: the other ranks may never arrive. atorch calls it at
    exit for a process group it created; a script that created its own calls it in place of
    ``torch.distributed.destroy_process_group()``. Nothing happens without a process group.
    """
    if not dist.is_initialized():
        return
    from atorch.parallel_layout import forget_meshes

    # Work that can take a while happens before the barrier, so that the ranks leave it and close
    # their connections close together: cached meshes, and cyclic garbage (FSDP2 keeps module/state
    # cycles) that still holds process groups, are released first.
    forget_meshes()
    gc.collect()
    try:
        if not _failed and dist.get_world_size() > 1 and dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=_EXIT_BARRIER_S))
    except RuntimeError as exc:  # a peer is gone: tear down alone
        logger.warning("exit barrier: %s", str(exc).splitlines()[0])
    finally:
        dist.destroy_process_group()


def _install_shutdown() -> None:
    """For a process group atorch created: remember a crash, and shut down cleanly at exit."""
    previous = sys.excepthook

    def excepthook(*args: object) -> None:
        global _failed
        _failed = True
        previous(*args)  # type: ignore[arg-type]

    sys.excepthook = excepthook
    atexit.register(shutdown)


# ----- agreement across ranks --------------------------------------------------------------
AGREE_TIMEOUT_S = 300.0  # how long a rank waits for the others to report what they found


def _collective_device() -> torch.device:
    # NCCL moves CUDA tensors only.
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _wait(work: Any, timeout_s: float, what: str) -> None:
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise TimeoutError(
            f"{what}: another process did not answer within {timeout_s:.0f} s ({str(exc).splitlines()[0]}); "
            "it may have crashed or be stuck: look at the other ranks' output"
        ) from exc


def all_gather_json(value: Any, timeout_s: float = AGREE_TIMEOUT_S, group: Any = None) -> list[Any]:
    """Every rank's JSON value, in rank order (UTF-8 bytes in tensors: nothing is pickled).

    Waits at most timeout_s for the other ranks, then raises TimeoutError instead of hanging.
    ``group``: a process group to gather over instead of the world (ranks in its order).
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [value]
    world, device = dist.get_world_size(group), _collective_device()
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).to(device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    mine = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    _wait(dist.all_gather(sizes, mine, group=group, async_op=True), timeout_s, "exchanging checks between ranks")
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    chunks = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    _wait(dist.all_gather(chunks, padded, group=group, async_op=True), timeout_s, "exchanging checks between ranks")
    return [json.loads(bytes(c[: int(s.item())].cpu().tolist()).decode()) for c, s in zip(chunks, sizes, strict=True)]


def agreed_problems(problems: list[str], timeout_s: float = AGREE_TIMEOUT_S, same: Sequence[Same] = ()) -> list[str]:
    """The problems any rank found, the same list on every rank.

    A problem seen on some ranks only (a file on one node, a package on some) is labelled with
    those ranks, so that every rank can raise the same error and none waits in a collective.
    ``same``: values every rank must hold equal (the strategy, the model, ...); their digests travel with the
    problems, and where ranks differ, one more exchange of the values names the difference as a problem.
    """
    everyone = all_gather_json({"problems": list(problems), "same": [s.digest() for s in same]}, timeout_s)
    merged: dict[str, list[int]] = {}
    for rank, found in enumerate(everyone):
        for problem in found["problems"]:
            merged.setdefault(problem, []).append(rank)
    world = len(everyone)
    agreed = [p if len(ranks) == world else f"on rank(s) {', '.join(map(str, ranks))} only: {p}"
              for p, ranks in merged.items()]
    # Every rank sees the same digests, so every rank takes part in the second exchange, or none does.
    if differ := differing([found["same"] for found in everyone], len(same)):
        held = all_gather_json([[same[i].shown, same[i].value] for i in differ], timeout_s)
        for k, i in enumerate(differ):
            agreed += difference_problems(same[i], [h[k] for h in held], [found["same"][i] for found in everyone])
    return agreed


@contextlib.contextmanager
def collective_timeout(seconds: float) -> Iterator[None]:
    """Bound every collective of every process group in this block to ``seconds``.

    A collective that does not complete in time raises on that rank instead of waiting for the
    group's default timeout, so a caller (a search trial) can bound the work it starts.
    """
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    if not dist.is_initialized():
        yield
        return
    groups = list(_world.pg_map)
    for group in groups:
        _set_pg_timeout(timedelta(seconds=seconds), group)
    try:
        yield
    finally:
        for group in groups:
            _set_pg_timeout(_pg_timeout, group)
