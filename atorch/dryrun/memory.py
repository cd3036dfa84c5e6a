"""Peak bytes of live tensor storage in this process during a block of code.

``with PeakMemory(device) as peak: ...`` then ``peak.bytes`` (the highest total reached, baseline
included), ``peak.baseline_bytes`` (live at entry) and ``peak.increase`` (``bytes - baseline_bytes``:
what the block itself needed at its worst moment).

CUDA: the caching allocator's own statistics (``reset_peak_memory_stats`` at entry,
``max_memory_allocated`` at exit) - bytes of live tensor blocks, not reserved cache.

CPU: torch keeps no statistics for its CPU allocator, and the resident set size is no measure (glibc
keeps freed pages, so a sharded run shows the same peak RSS as an unsharded one). The project counts
tensor storages itself:

* at entry, every storage Python can reach (a ``gc`` walk over tensors, each storage once) is the
  baseline; each gets a weak reference, so freeing one during the block (``zero_grad(set_to_none)``
  dropping old gradients) lowers the live total;
* during the block a ``TorchDispatchMode`` sees the output of every aten operation run on this thread
  (and on autograd's threads, which inherit the mode), also those called from C++ (DDP's buckets,
  autograd's gradients): a storage not seen before is added with its size, a storage that grew
  (``resize_``) is updated, and a weak reference on the storage's Python object - which torch keeps alive
  exactly as long as the C++ storage lives - subtracts it when it is freed;
* views share a storage and are counted once; tensor subclasses (DTensor) are counted through their
  inner tensors.

This is exact for tensors made by aten operations and for the Python-reachable baseline (tests hold it to
the byte on known sizes). It does not see memory that is not a tensor storage (gloo's own buffers,
allocator slack), nor temporaries made inside a subclass's own dispatch. It costs a Python call per
operation (tens of microseconds), so the dry-run measures memory on its warm-up steps and times the
other steps without it.
"""

from __future__ import annotations

import gc
import itertools
import threading
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def _storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding a tensor's data (through the inner tensors of a wrapper subclass)."""
    if is_traceable_wrapper_subclass(tensor):
        inner, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
        values = (getattr(tensor, name) for name in inner)  # DTensor also lists its device mesh
        return [s for value in values if isinstance(value, torch.Tensor) for s in _storages(value)]
    if tensor.is_sparse or tensor.device.type == "meta":
        return []
    try:
        return [tensor.untyped_storage()]
    except (RuntimeError, NotImplementedError):  # no storage (a fake or otherwise storageless tensor)
        return []


def live_tensor_bytes(device_type: str = "cpu") -> int:
    """Bytes of every distinct tensor storage on ``device_type`` that Python can reach (a gc walk)."""
    return sum(nbytes for nbytes, _ in _reachable_storages(device_type).values())


def _reachable_storages(device_type: str) -> dict[int, tuple[int, torch.UntypedStorage]]:
    found: dict[int, tuple[int, torch.UntypedStorage]] = {}
    settled = list(_SETTLED.tensors) if _SETTLED is not None else []  # gc.get_objects() skips frozen objects
    for obj in itertools.chain(gc.get_objects(), settled):
        if not issubclass(type(obj), torch.Tensor):  # type(), not isinstance: no lazy module attribute is touched
            continue
        for storage in _storages(obj):
            if storage.device.type == device_type:
                found.setdefault(storage._cdata, (storage.nbytes(), storage))
    return found


class SettledHeap:
    """Many measurements in one process (a dry-run session): what lives at ``settle`` is collected once, then kept
    out of the cycle collector's way (``gc.freeze``) until ``release``, so each ``PeakMemory`` entry's collection
    walks only the objects made since. A search process holds some 400,000 objects (torch, transformers, Optuna):
    a full collection cost 0.2-0.6 s per dry-run, a third of a small model's. The tensors frozen are remembered
    (weakly) for the baseline walk, which ``gc.get_objects`` would no longer show them to. A frozen object that
    dies in a reference cycle is reclaimed after ``release``, not before. One settled heap at a time: a second
    ``settle`` while one holds, or a heap the application froze itself, leaves things as they are."""

    def __init__(self) -> None:
        self.tensors: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
        self.wanted = False  # settle at the first measurement (``settle(now=False)``)

    def settle(self, now: bool = True) -> SettledHeap:
        """Settle the heap now, or (``now=False``) at the first ``settle_if_wanted``: a search that ends without a
        dry-run (a cached pick) then pays nothing (a settle is a full collection and a walk: 0.3-0.5 s)."""
        global _SETTLED
        if not now:
            self.wanted = True
            return self
        if _SETTLED is not None or gc.get_freeze_count():
            return self
        gc.collect()
        self.tensors = weakref.WeakSet(obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))
        gc.freeze()
        _SETTLED = self
        return self

    @property
    def settled(self) -> bool:
        return _SETTLED is self

    def settle_if_wanted(self) -> None:
        if self.wanted and not self.settled:
            self.settle()

    def release(self) -> None:
        global _SETTLED
        self.wanted = False
        if _SETTLED is self:
            gc.unfreeze()
            _SETTLED = None
            self.tensors = weakref.WeakSet()


_SETTLED: SettledHeap | None = None


class _StorageTracker(TorchDispatchMode):
    """Live bytes of the storages it knows of, and the highest value they reached."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.sizes: dict[int, int] = {}  # StorageImpl address -> bytes
        self.refs: dict[int, weakref.ref] = {}
        self.live = 0
        self.peak = 0
        self._lock = threading.Lock()  # weakref callbacks may run on another thread

    def track(self, storage: torch.UntypedStorage) -> None:
        if storage.device.type != self.device_type:
            return
        key, nbytes = storage._cdata, storage.nbytes()
        with self._lock:
            old = self.sizes.get(key)
            if old is None:
                self.refs[key] = weakref.ref(storage, lambda _ref, key=key: self._freed(key))
                self.sizes[key] = nbytes
                self.live += nbytes
            elif nbytes != old:  # resized in place
                self.sizes[key] = nbytes
                self.live += nbytes - old
            self.peak = max(self.peak, self.live)

    def _freed(self, key: int) -> None:
        with self._lock:
            self.live -= self.sizes.pop(key, 0)
            self.refs.pop(key, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                for storage in _storages(leaf):
                    self.track(storage)
        return out


_RESIZE = torch.UntypedStorage.resize_


def _watch_resizes(tracker: _StorageTracker | None) -> None:
    """Storage resized outside aten (FSDP2 allocates and frees its unsharded parameters with
    ``untyped_storage().resize_``, which no dispatch mode sees): counted through ``tracker``, or no more."""
    if tracker is None:
        torch.UntypedStorage.resize_ = _RESIZE  # type: ignore[method-assign]
        return

    def resize_(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
        out = _RESIZE(storage, size)
        tracker.track(storage)
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]


class PeakMemory:
    """Peak live tensor bytes on ``device`` during a ``with`` block (see the module's docstring)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.bytes = 0
        self.baseline_bytes = 0
        self._tracker: _StorageTracker | None = None

    @property
    def increase(self) -> int:
        """The most the block added on top of what was live at its start."""
        return self.bytes - self.baseline_bytes

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline_bytes = torch.cuda.memory_allocated(self.device)
            return self
        # Garbage that the cycle collector frees during the block would lower the live total below the
        # baseline and hide the block's own allocations: collect it first.
        gc.collect()
        tracker = _StorageTracker(self.device.type)
        for _nbytes, storage in _reachable_storages(self.device.type).values():
            tracker.track(storage)
        self.baseline_bytes = tracker.live
        tracker.peak = tracker.live
        self._tracker = tracker
        tracker.__enter__()
        _watch_resizes(tracker)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device)
            return
        tracker = self._tracker
        assert tracker is not None
        _watch_resizes(None)
        tracker.__exit__(*exc)
        self.bytes = tracker.peak
        # Drop the weak references (and their callbacks): nothing is kept past the block.
        tracker.refs.clear()
        tracker.sizes.clear()
        self._tracker = None
