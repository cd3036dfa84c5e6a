"""The per-rank dataloader: the user's dataset and dataloader_args, split over data-parallel ranks.

Map-style datasets get a DistributedSampler (or the user's ``distributed_sampler_cls``); it shuffles
by default under data parallel, as ATorch does, and the returned loader advances the sampler's
epoch on every pass, so each epoch has a new order. Iterable datasets are sharded by rank instead:
rank r (and within it, dataloader worker w) takes every n-th sample of the stream.
"""

from __future__ import annotations

import itertools
import multiprocessing
import sys
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
from torch.utils.data.distributed import DistributedSampler

from atorch.errors import SetupError
from atorch.log import get_logger

logger = get_logger(__name__)
_warned_fork_hazard = False


class EpochDataLoader(DataLoader):
    """A torch DataLoader that calls ``sampler.set_epoch`` before each pass and then advances
    the epoch, so a shuffling sampler gives a new order every epoch without the user's help.
    ``set_epoch(e)`` sets the epoch of the next pass (e.g. when resuming)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Any:
        for source in (self.sampler, self.dataset):  # the dataset: RankShard forwards to the user's
            if hasattr(source, "set_epoch"):
                source.set_epoch(self.epoch)
        self.epoch += 1
        return super().__iter__()


class RankShard(IterableDataset):
    """One data-parallel rank's share of an iterable dataset: every (dp_size * workers)-th sample.

    The user's dataset yields the whole stream in every process and worker; each sample goes to
    exactly one (rank, worker) pair, so ranks and workers see disjoint samples covering the stream.
    """

    def __init__(self, dataset: IterableDataset, dp_size: int, dp_rank: int) -> None:
        self.dataset = dataset
        self.dp_size = dp_size
        self.dp_rank = dp_rank

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:  # TypeError (as for any unsized stream) when the dataset has no len
        return len(range(self.dp_rank, len(self.dataset), self.dp_size))  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        start = self.dp_rank + worker * self.dp_size  # rank-major within each group of dp_size*workers
        return itertools.islice(iter(self.dataset), start, None, self.dp_size * workers)


def local_batch_size(dataloader_args: dict[str, Any], dp_size: int) -> int:
    """ATorch's batch_size is the global batch: each data-parallel rank loads its share."""
    return int(dataloader_args.get("batch_size", 1)) // dp_size


def build_dataloader(
    dataset: Dataset, dataloader_args: dict[str, Any], dp_size: int, dp_rank: int, sampler_cls: type | None = None
) -> EpochDataLoader:
    """This rank's dataloader. ``shuffle`` defaults to True under data parallel (dp_size > 1)."""
    global _warned_fork_hazard
    args = dict(dataloader_args)
    hazard = worker_fork_hazard(sys.version_info[:3], start_method(args.get("multiprocessing_context")),
                                int(args.get("num_workers") or 0), dist_initialized())
    if hazard and not _warned_fork_hazard:
        _warned_fork_hazard = True
        logger.warning(hazard)
    args["batch_size"] = local_batch_size(dataloader_args, dp_size)
    if isinstance(dataset, IterableDataset):
        if args.pop("shuffle", False) or sampler_cls is not None:
            raise SetupError("an IterableDataset is read in order: remove shuffle / distributed_sampler_cls")
        return EpochDataLoader(RankShard(dataset, dp_size, dp_rank), **args)  # also splits over workers
    shuffle = bool(args.pop("shuffle", dp_size > 1))
    if sampler_cls is None and (dp_size > 1 or shuffle):
        sampler_cls = DistributedSampler  # also at one rank when shuffling: seeded, per-epoch orders
    if sampler_cls is not None:
        args["sampler"] = sampler_cls(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle)
    return EpochDataLoader(dataset, **args)


def start_method(context: Any) -> str:
    """How the dataloader's workers start: ``multiprocessing_context`` (a name or a context), else the default."""
    if context is None:
        return multiprocessing.get_start_method()
    return context if isinstance(context, str) else str(context.get_start_method())


def dist_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def worker_fork_hazard(version: tuple[int, int, int], method: str, workers: int, distributed: bool) -> str | None:
    """A warning where forked workers may hang at start-up: CPython before 3.11.10 (gh-112275; 3.12 is fixed) can
    deadlock a forked child when another thread of the parent was creating its Python thread state at the fork.
    torch.distributed's threads do that after a collective; a stress test of short passes on Python 3.11.7 under
    gloo hung about 1 worker start in 2,000 (the hang examined: on a gloo thread's state), and the training
    waited forever."""
    if workers <= 0 or method != "fork" or not distributed or version >= (3, 11, 10) or version < (3, 10, 0):
        return None
    return (f"dataloader_args: num_workers={workers} forks worker processes, and Python "
            f"{'.'.join(map(str, version))} can hang a forked worker at start-up when a torch.distributed thread "
            "enters Python at that moment (CPython gh-112275, fixed in 3.11.10 and 3.12). Upgrade Python, or pass "
            "dataloader_args={'multiprocessing_context': 'forkserver'} (the dataset must then be picklable and the "
            "script's training code under `if __name__ == '__main__':`)")


def empty_loader_problems(dataset: Any, dataloader_args: dict[str, Any], dp_size: int | None) -> list[str]:
    """A dataloader that would yield no batch on some rank (a dataset smaller than one batch with drop_last=True):
    a loop over it does nothing, one that cycles it never ends. ``dp_size`` None: the automatic search, which may
    pick one data-parallel rank, so the dataset must hold a whole global batch. [] where the dataset has no len."""
    if not dataloader_args.get("drop_last"):
        return []
    try:
        size = len(dataset)
    except Exception:  # noqa: BLE001  (a stream without len: not checked)
        return []
    batch = int(dataloader_args.get("batch_size", 1))
    if dp_size is None:
        if size >= batch:
            return []
        where = "one process (the automatic search may train on one data-parallel rank)"
        per_rank, local = size, batch
    else:
        local = max(batch // dp_size, 1)
        if isinstance(dataset, IterableDataset):
            per_rank = min(len(range(r, size, dp_size)) for r in range(dp_size))
        else:  # DistributedSampler pads each rank's share to ceil(size / dp_size)
            per_rank = -(-size // dp_size) if dp_size > 1 else size
        if per_rank >= local:
            return []
        where = f"each of {dp_size} data-parallel ranks" if dp_size > 1 else "one process"
    return [f"dataset has {size} sample(s), fewer than one batch with drop_last=True: batch_size={batch} gives "
            f"{where} {local} sample(s) per batch but only {per_rank} sample(s), so the dataloader yields no batch "
            "(a loop over it does nothing; one that cycles it never ends); lower batch_size to at most "
            f"{size if dp_size is None else per_rank * (dp_size or 1)}, drop drop_last, or give more samples"]


def short_dataset_warning(dataset: Any, dataloader_args: dict[str, Any]) -> str | None:
    """A dataset smaller than one global batch (without drop_last): every step trains on fewer samples than
    batch_size says. Legitimate for a smoke test, so a warning; None where all is well or the length is unknown."""
    if dataloader_args.get("drop_last"):
        return None
    try:
        size = len(dataset)
    except Exception:  # noqa: BLE001  (a stream without len)
        return None
    batch = dataloader_args.get("batch_size", 1)
    if not isinstance(batch, int) or not 0 < size < batch:
        return None
    return (f"dataset has {size} sample(s), fewer than one global batch (batch_size={batch}): every step trains on "
            f"those {size} (split over the data-parallel ranks, padded by repeating samples); lower batch_size or "
            "give more samples if that is not meant")
