"""Process-group set-up from the torchrun environment, and the facts a strategy needs about it."""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

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
        backend = "nccl" if use_cuda else "gloo"
        timeout = timedelta(seconds=timeout_s)
        if "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend=backend, timeout=timeout)
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


_EXIT_BARRIER_S = 60.0  # how long a rank waits at exit for the others before tearing down alone
_failed = False


def shutdown() -> None:
    """Tear the process group down on every rank together.

    gloo aborts a process ("terminate called without an active exception") when a peer closes its
    connections while this rank still tears its own down, so ranks meet at a barrier first. After
    an uncaught exception there is no barrier: the other ranks may never arrive.
    """
    if not dist.is_initialized():
        return
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
