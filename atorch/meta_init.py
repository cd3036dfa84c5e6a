"""Models built on the meta device (``with torch.device("meta"): model = Model(cfg)``).

Such a model holds shapes but no values. Each rank materialises it (allocates its tensors) and
initialises it itself, so that every rank holds the same weights without any being sent:

* every module is initialised with its own RNG seed, derived from a seed agreed by all ranks (rank
  0's ``torch.initial_seed()``) and the module's name, so the values do not depend on the order in
  which modules are materialised: the whole model at once (DDP, ZeRO-1, DeepSpeed) and one FSDP unit
  at a time give the same weights;
* a module is initialised by transformers' ``_initialize_weights`` when it belongs to a
  ``PreTrainedModel`` (children first, as ``initialize_weights`` does), else by its own
  ``reset_parameters()``; a module holding tensors with neither is refused up front (``meta_problems``);
* fsdp/zero2 (FSDP2) materialise, initialise and shard one unit at a time, deepest first
  (``materialise_region`` before each ``fully_shard``), so a rank holds about one unit's full
  parameters at a time, plus its shards of the units already sharded.

A parent's init may rewrite its children's tensors (GPT-2's attention rescales ``c_proj``): before a
unit is sharded, its ancestors' inits run too (their own tensors are still meta, so only the unit is
written), with the shards made earlier masked. A unit then gets the values the whole-model
materialisation gives it whenever an ancestor's init draws random numbers for that unit alone (as
GPT-2's does); otherwise the values differ from it, but are still the same on every rank.
"""

from __future__ import annotations

import sys
import weakref
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from atorch.log import get_logger
from atorch.names import WRAPPER_PARTS

logger = get_logger(__name__)

# Wrapper parts followed by a dot: a module's own name keeps a trailing wrapper part (the wrapped module is
# initialised under a name of its own, apart from its wrapper's).
_WRAPPER_PARTS = tuple(f"{part}." for part in sorted(WRAPPER_PARTS))
# The key of the record ``ShardMaterialiser.finish`` logs its MaterialiseStats under (``record.<key>``), for a
# handler that wants the figures (the tests read them there).
STATS_KEY = "atorch_materialise_stats"


def is_meta(model: nn.Module) -> bool:
    """True if any parameter or buffer of the model is on the meta device."""
    return any(t.is_meta for t in _tensors(model))


def _tensors(model: nn.Module) -> Iterable[torch.Tensor]:
    yield from model.parameters()
    yield from (b for b in model.buffers() if b is not None)


def to_device(model: nn.Module, device: torch.device) -> nn.Module:
    """``model.to(device)``, except that a meta model stays on meta (materialised later), and a model already
    on ``device`` is returned as it is (a fake-tensor copy traced by the cost model cannot be moved: ``.to``
    swaps fake parameters, which fails)."""
    if is_meta(model) or all(t.device == device for t in _tensors(model)):
        return model
    return model.to(device)


def _hf_owner_map(model: nn.Module) -> dict[int, Any]:
    """Module id -> the nearest transformers PreTrainedModel at or above it (as ``smart_apply`` dispatches)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return {}
    owners: dict[int, Any] = {}

    def visit(module: nn.Module, owner: Any) -> None:
        if isinstance(module, transformers.PreTrainedModel):
            owner = module
        if owner is not None:
            owners[id(module)] = owner
        for child in module.children():
            visit(child, owner)

    visit(model, None)
    return owners


def _holds_own_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(
        b is not None for b in module.buffers(recurse=False)
    )


def meta_problems(model: nn.Module) -> list[str]:
    """Why a meta model could not be initialised: modules with tensors and no way to initialise them."""
    if not is_meta(model):
        return []
    owners = _hf_owner_map(model)
    missing = sorted(
        f"{name or '<root>'} ({type(m).__name__})" for name, m in model.named_modules()
        if _holds_own_tensors(m) and id(m) not in owners and not callable(getattr(m, "reset_parameters", None))
    )
    if not missing:
        return []
    return [
        "the model is on the meta device, and these modules hold parameters or buffers but have no "
        f"reset_parameters() to initialise them: {', '.join(missing[:10])}"
        + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        + "; give them a reset_parameters() that initialises their tensors, or build the model on the CPU"
    ]


def agreed_seed() -> int:
    """Rank 0's initial seed, on every rank (sent as a tensor, nothing unpickled)."""
    seed = torch.tensor([torch.initial_seed() % 2**62], dtype=torch.int64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        backend_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        seed = seed.to(backend_device)
        dist.broadcast(seed, src=0)
    return int(seed.item())


def _clean_name(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


class _Tracker:
    """Live bytes of the full tensors made here (weak references: a tensor freed is counted out)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0  # full tensors plus the shards already made
        self.peak_full = 0  # full tensors only

    def add(self, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        self.live += size
        weakref.finalize(tensor, self._drop, size)

    def _drop(self, size: int) -> None:
        self.live -= size


def materialise_region(
    model: nn.Module, region: nn.Module, device: torch.device, seed: int, done: dict[int, torch.Tensor],
    skip: set[int] | None = None, tracker: _Tracker | None = None,
) -> None:
    """Allocate and initialise the meta tensors of ``region`` (a module of ``model``), except those of
    modules in ``skip`` (units already sharded). ``done`` maps old tensor ids to their new tensors, so
    a tensor registered twice (tied weights) becomes one tensor again."""
    skip = skip or set()
    names = {id(m): _clean_name(n) for n, m in model.named_modules()}
    owners = _hf_owner_map(model)
    order: list[nn.Module] = []

    def visit(module: nn.Module) -> None:  # children first, as nn.Module.apply and transformers do
        if id(module) in skip:
            return
        for child in module.children():
            visit(child)
        order.append(module)

    visit(region)
    made: set[int] = set()  # modules given new tensors of their own
    for module in order:
        for slots, is_param in ((module._parameters, True), (module._buffers, False)):
            for key, tensor in slots.items():
                if tensor is None or not tensor.is_meta:
                    continue
                if id(tensor) not in done:
                    new = torch.empty_like(tensor, device=device)
                    if is_param:
                        new = nn.Parameter(new, requires_grad=tensor.requires_grad)
                        if tracker is not None:
                            tracker.add(new)
                    done[id(tensor)] = new
                slots[key] = done[id(tensor)]
                made.add(id(module))
    # A parent's init may rewrite its children's tensors (GPT-2 rescales c_proj): initialise every
    # module above a new tensor, children first, then the region's ancestors (whose own tensors are
    # still meta, so their init reaches only this region). Tensors made earlier (shards of units
    # already sharded) are masked by meta placeholders meanwhile, so no later init rewrites them.
    touched: set[int] = set()
    for module in order:
        if id(module) in made or any(id(c) in touched for c in module.children()):
            touched.add(id(module))
    steps = [m for m in order if id(m) in touched] + (_ancestors(model, region) if made else [])
    with _masked(model, keep=_own_tensor_ids(region, skip)):
        for module in steps:
            _initialise(module, names.get(id(module), ""), owners.get(id(module)), seed, device, id(module) in made)


def _own_tensor_ids(region: nn.Module, skip: set[int]) -> set[int]:
    """Ids of the region's tensors, leaving out those of the modules in skip (and below them).

    Ids, gathered without a recursive closure: a list of tensors held by a self-referencing closure
    sits in a reference cycle, which would keep the full tensors alive after fully_shard until the
    garbage collector runs."""
    found: set[int] = set()
    stack = [region]
    while stack:
        module = stack.pop()
        if id(module) in skip:
            continue
        found.update(id(t) for t in [*module._parameters.values(), *module._buffers.values()] if t is not None)
        stack.extend(module.children())
    return found


def _ancestors(model: nn.Module, region: nn.Module) -> list[nn.Module]:
    """The modules above region, nearest first."""
    path: list[nn.Module] = []

    def find(module: nn.Module) -> bool:
        if module is region:
            return True
        for child in module.children():
            if find(child):
                path.append(module)
                return True
        return False

    find(model)
    return path


@contextmanager
def _masked(model: nn.Module, keep: set[int]) -> Iterator[None]:
    """Swap every materialised tensor of the model not in keep for a meta placeholder, then restore."""
    saved: list[tuple[dict, str, torch.Tensor]] = []
    placeholders: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for slots in (module._parameters, module._buffers):
            for key, tensor in slots.items():
                if tensor is None or tensor.is_meta or id(tensor) in keep:
                    continue
                if id(tensor) not in placeholders:
                    empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
                    is_param = isinstance(tensor, nn.Parameter)
                    placeholders[id(tensor)] = nn.Parameter(empty, requires_grad=False) if is_param else empty
                saved.append((slots, key, tensor))
                slots[key] = placeholders[id(tensor)]
    try:
        yield
    finally:
        for slots, key, tensor in saved:
            slots[key] = tensor


def _initialise(module: nn.Module, name: str, owner: Any, seed: int, device: torch.device, own: bool) -> None:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed((seed + zlib.crc32(name.encode())) % 2**62)
        if owner is not None:
            module.__dict__.pop("_is_hf_initialized", None)
            owner._initialize_weights(module)
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
        elif own:  # meta_problems refuses such models up front; reaching here means a method added one
            from atorch.errors import SetupError

            raise SetupError(
                f"module {name or '<root>'} ({type(module).__name__}) of the meta-device model has no "
                "reset_parameters() to initialise its tensors; give it one or build the model on the CPU"
            )


def materialise(model: nn.Module, device: torch.device, seed: int | None = None) -> nn.Module:
    """The whole model at once: allocate on ``device`` and initialise every module (identically on all ranks)."""
    seed = agreed_seed() if seed is None else seed
    materialise_region(model, model, device, seed, {})
    logger.info("meta model materialised on %s and initialised (seed %d)", device, seed)
    return model


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@dataclass(frozen=True)
class MaterialiseStats:
    """Parameter bytes alive on this rank while an FSDP2 model is materialised one unit at a time."""

    peak_bytes: int  # full tensors of the unit being made plus the shards already kept
    peak_full_bytes: int  # full (unsharded) tensors alive at once
    full_bytes: int  # the whole model's parameter bytes
    live_full_bytes_after: int  # full tensors still alive once every unit is sharded (0: none leaked)


class ShardMaterialiser:
    """Materialise a meta model one FSDP2 unit at a time (call ``before_shard(unit)`` before each
    ``fully_shard``, deepest units first, the root last)."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device
        self.seed = agreed_seed()
        self.sharded: set[int] = set()
        self.tracker = _Tracker()
        self.full_bytes = param_bytes(model)

    def before_shard(self, unit: nn.Module) -> None:
        # A fresh memo per unit: tied tensors never span units (choose_units), and a memo kept across
        # units would keep every full tensor alive after fully_shard replaced it by its shard.
        materialise_region(self.model, unit, self.device, self.seed, {}, self.sharded, self.tracker)
        # Kept: shards of the units already sharded, plus the full tensors made for this one.
        live = self.tracker.live + _local_shard_bytes(self.model)
        self.tracker.peak = max(self.tracker.peak, live)
        self.tracker.peak_full = max(self.tracker.peak_full, self.tracker.live)
        self.sharded.add(id(unit))

    def finish(self) -> MaterialiseStats:
        """The figures measured while materialising, also logged (``extra``: STATS_KEY) with the summary line."""
        stats = MaterialiseStats(peak_bytes=self.tracker.peak, peak_full_bytes=self.tracker.peak_full,
                                 full_bytes=self.full_bytes, live_full_bytes_after=self.tracker.live)
        logger.info(
            "meta model materialised one unit at a time (seed %d): peak %.1f%% of the full model's parameter bytes",
            self.seed, 100 * stats.peak_bytes / max(stats.full_bytes, 1), extra={STATS_KEY: stats},
        )
        return stats


def _local_shard_bytes(model: nn.Module) -> int:
    from torch.distributed.tensor import DTensor

    return sum(
        p.to_local().numel() * p.element_size() for p in model.parameters() if isinstance(p, DTensor)
    )
