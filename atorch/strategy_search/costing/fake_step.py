"""The user's model and sample batch as fake tensors (``FakeTensorMode``: shapes, dtypes and devices, no
storage): the copy (made with the fake tensors in the deepcopy memo, so no parameter of the user's is moved,
copied or hooked), the batch, and torch's fake-tensor log kept quiet. What the analysis (``analyser``), the
diagnosis of the user's step (``diagnosis``) and the memory tracing (``tracing``) run on.
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

# ----- the fake copy and the batch ---------------------------------------------------------------------

def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def fake_copy(model: nn.Module, mode: FakeTensorMode, device: torch.device) -> nn.Module:
    """A deep copy whose parameters and buffers are fresh fake tensors on ``device``, the sample batch's
    (tied ones stay tied): the search analyses the user's CPU model on the batch of the device it trains on."""
    memo: dict[int, Any] = {}
    with mode:
        for t in itertools.chain(model.parameters(), model.buffers()):
            if id(t) in memo:
                continue
            fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            memo[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
    return copy.deepcopy(model, memo)


def map_tensors(data: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, dict):
        return type(data)((k, map_tensors(v, fn)) for k, v in data.items())
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(map_tensors(v, fn) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(map_tensors(v, fn) for v in data)
    return data


def tensor_leaves(data: Any) -> Iterator[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(data, found.append)
    return iter(found)


def fake_setup(model: nn.Module, sample_batch: Any) -> tuple[FakeTensorMode, nn.Module, Any, torch.device]:
    """A fake mode, the model's fake copy (train mode) and the batch as fake tensors, on the batch's device."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    batch_device = next((t.device for t in tensor_leaves(sample_batch) if not t.is_meta), torch.device("cpu"))
    work = fake_copy(model, mode, batch_device)
    work.train()
    with mode:
        batch = map_tensors(sample_batch, lambda t: torch.empty_strided(
            t.shape, t.stride(), dtype=t.dtype, device=batch_device) if t.is_meta else mode.from_tensor(t))
    return mode, work, batch, batch_device


@contextmanager
def quiet_fake_tensor_log() -> Iterator[None]:
    """torch logs every meta kernel that fails (a shape mistake) with its traceback; the error says it once."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        fake_log.setLevel(level)


