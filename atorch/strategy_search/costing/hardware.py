"""A hardware profile: what the cost model needs to know about the machines, measured or from a table.

``measure_profile(group, memory_limit)`` runs short micro-benchmarks on every rank of the group at once
(so shared cores and links are measured under the load training puts on them):

* matmul throughput per dtype (fp32, bf16, fp16 where the device has them): the three products of a
  linear layer's training step (forward ``x @ w.T``, input gradient ``g @ w``, weight gradient ``g.T @ x``)
  on square operands of growing size, the fastest of a few timed calls per size (on a shared machine the
  least disturbed: the cost model reads each size's figure, so one disturbed call must not set it), the
  best size's TFLOP/s (capped in time so a slow dtype costs about a second), and every size's
  (``matmul_tflops_by_size``: a small model's matmuls do not reach the best size's rate: on this CPU bf16 runs
  1.3x fp32 at 128 and 1.9x at 512, so the cost model reads the rate at the model's own matmul size). All three layouts,
  because kernels differ by layout: on a CPU without fp16 units, fp16's forward layout runs ~10x faster than
  its input-gradient one, so a plain ``a @ b`` put fp16 steps at 3x their measured time;
* per-operation latency (``op_latency_s``): the time of one small operation as a training step runs it
  (a chain of multiplications of a 64-element tensor that requires grad, forward and backward, divided
  by the operations run; median of a few rounds): the fixed cost of an operation (Python, the
  dispatcher, autograd's bookkeeping, a kernel launch on CUDA), which dominates the step of a small model;
* memory bandwidth (``memory_bytes_per_s``): bytes read and written per second by a large elementwise
  operation (``torch.add(a, b, out=c)`` on 16 MiB tensors: 3 x 16 MiB moved), the best of a few: what
  elementwise work (the optimizer's update, casts, gradient copies) runs at;
* all-reduce / all-gather / reduce-scatter / all-to-all on the group: latency = median time of a one-element
  operation, bandwidth = the best bus bandwidth over a few message sizes, as nccl-tests define it
  (algbw = bytes / time, where bytes is the full tensor for all-reduce, the gathered output for all-gather and
  reduce-scatter, and a rank's send buffer for all-to-all (``all_to_all_single``, which gloo runs); busbw = algbw ×
  2(n−1)/n for all-reduce and × (n−1)/n for the other three), each repeat started after a barrier. A profile
  without all-to-all figures (a cluster table, an older saved profile) reads all-gather's for it
  (``HardwareProfile.collective``; the cost model notes it);
* DTensor's dispatch under tensor parallel (``parallel_costs.py``, two or more ranks): what a split linear adds
  to a micro-batch's forward and backward, and a DTensor parameter to an optimizer step, beyond plain tensors;
* each 16-bit dtype's step against fp32's (``dtype_step_ratio``, CPU devices): a small transformer-like block
  (linear, softmax attention, layer norm, gelu) run forward and backward under autocast and cast to the dtype, the
  time of each over fp32's, interleaved rounds (``_dtype_step_ratio``). The matmul micro-benchmark alone says bf16 is
  faster on a CPU with bf16 matmul kernels, but the rest of a step (casts, norms, softmax, elementwise) runs slower
  in 16 bits there: on this bench machine whole bf16 models run several times slower than fp32. Not measured on
  CUDA, where the by-size matmul rates hold (tensor cores) and a block this small measures launch latency only;
  absent (older caches, tables): no effect;
* the per-rank memory budget: ``memory_limit`` if given, else the CUDA device's memory, else available
  RAM divided by the processes on the node (LOCAL_WORLD_SIZE); the smallest over the ranks;
* the job's nodes: on a multi-node job (torchrun ``--nnodes``) ``gpus_per_node`` is the processes per node
  (LOCAL_WORLD_SIZE), so ``nodes`` = world size / that; 0 (one node) otherwise.

Rank 0's measurements are what every rank returns (sent as JSON, never pickled), so all ranks plan with
the same numbers. The measured part is cached as JSON in ``$ATORCH_CACHE_DIR/profiles`` (default
``~/.cache/atorch/profiles``), keyed by device name, world size, ranks per node, backend, torch version and
``PROFILE_FORMAT`` (bumped when the measured fields change, so older caches are measured again); the memory
budget is taken afresh on each call. ``load_profile`` / ``HardwareProfile.from_table`` read a profile
for a cluster that is not here (see ``profiles/``).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict

from atorch.distributed import all_gather_json
from atorch.log import get_logger
from atorch.settings import cache_dir
from atorch.strategy_search.costing.parallel_costs import measure_parallel_costs
from atorch.units import parse_bytes

logger = get_logger(__name__)

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"  # tables shipped with atorch
ALL_TO_ALL = "all_to_all"
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", ALL_TO_ALL)
# A profile without all-to-all figures (a cluster table without a sourced figure, a profile saved before format 6)
# reads all-gather's for it: in both, (n-1)/n of a rank's bytes leave it for the other ranks at once.
ALL_TO_ALL_FALLBACK = "all_gather"
_MATMUL_SIZES = (128, 256, 512, 1024, 2048, 4096, 8192)
_MATMUL_BUDGET_S = 1.0  # per dtype: stop growing the matmul once this much time is spent
_MATMUL_REPEATS = 5
_LATENCY_REPEATS = 15
_OP_REPEATS = 2000  # small operations per timed round (~10-20 ms on a CPU)
_OP_ROUNDS = 5
_BANDWIDTH_ELEMENTS = 1 << 22  # fp32 elements per operand of the memory-bandwidth benchmark
_BANDWIDTH_ROUNDS = 5
# 2: op_latency_s and memory_bytes_per_s; 3: matmul in a linear layer's three layouts; 4: by size; 5: DTensor's costs;
# 6: all-to-all
PROFILE_FORMAT = 6
_BANDWIDTH_BYTES = (1 << 20, 4 << 20, 16 << 20)  # full tensor sizes (the gathered output for all-gather)
_BANDWIDTH_REPEATS = 5
_COLLECTIVE_BUDGET_S = 1.5  # per collective: stop growing the message once this much time is spent


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CollectiveStats(_Frozen):
    bus_bandwidth: float  # bytes/s, nccl-tests' bus bandwidth convention
    latency_s: float  # time of a one-element operation
    size_bytes: int  # message size at which bus_bandwidth was reached (0 for a table)


class HardwareProfile(_Frozen):
    """The machines a plan is for. Every figure is per rank; collectives are over ``world_size`` ranks."""

    source: Literal["measured", "table"]
    device_type: str  # "cuda" or "cpu"
    device_name: str
    world_size: int
    local_world_size: int
    backend: str
    torch_version: str
    matmul_tflops: dict[str, float]  # dtype name ("float32", "bfloat16", "float16") -> TFLOP/s
    # dtype name -> {square operand size: TFLOP/s} (measured profiles; a table gives matmul_tflops only)
    matmul_tflops_by_size: dict[str, dict[int, float]] = {}
    collectives: dict[str, CollectiveStats]  # by name in COLLECTIVES; empty at world size 1
    op_latency_s: float = 0.0  # fixed cost of one small operation (0: unknown, e.g. an older table)
    memory_bytes_per_s: float = 0.0  # elementwise bytes moved per second (0: unknown)
    # DTensor's dispatch under tensor parallel (parallel_costs.py; 0: unknown, or one rank): seconds per split linear
    # and micro-batch (forward and backward, and the forward's part), per DTensor parameter and optimizer step
    tensor_parallel_linear_s: float = 0.0
    tensor_parallel_linear_forward_s: float = 0.0
    dtensor_param_step_s: float = 0.0
    memory_per_rank: int  # bytes a rank may use
    memory_source: Literal["memory_limit", "cuda", "ram", "table"]
    measure_s: float = 0.0  # how long the micro-benchmarks took
    note: str = ""
    # Cluster tables (profiles/a100-80gb.json, h100-80gb.json); a profile without them plans as before.
    # Ranks per node: a collective whose group spans nodes uses ``inter_node`` (hierarchical, as NCCL does).
    gpus_per_node: int = 0  # 0: one node (every collective uses ``collectives``)
    # per-GPU figures across nodes (one GPU per node in the group: its own network adapter), nccl-tests busbw
    inter_node: dict[str, CollectiveStats] = {}
    # achievable share of ``matmul_tflops`` for large matmuls, per dtype (a measured ceiling, from the sources)
    matmul_efficiency: dict[str, float] = {}
    sources: tuple[str, ...] = ()  # where each figure comes from
    # 16-bit dtype -> {matmul size: a small block's step time over fp32's} (``_dtype_step_ratio``): "bfloat16" under
    # autocast (amp_native), "bfloat16:half" with the block cast to it (half). Empty: not measured (CUDA, tables,
    # older caches): no effect
    dtype_step_ratio: dict[str, dict[int, float]] = {}

    @property
    def nodes(self) -> int:
        """Nodes of ``world_size`` ranks (``gpus_per_node`` each; 1 when not recorded)."""
        return self.world_size // self.gpus_per_node if self.gpus_per_node else 1

    @classmethod
    def from_table(cls, table: dict[str, Any] | str | Path) -> HardwareProfile:
        """A profile from a table (a dict, or a JSON file) for a cluster that is not here."""
        data = json.loads(Path(table).read_text()) if isinstance(table, (str, Path)) else dict(table)
        data.setdefault("source", "table")
        data.setdefault("memory_source", "table")
        return cls.model_validate(data)

    def matmul_tflops_at(self, dtype: str, size: float | None = None) -> float:
        """TFLOP/s of ``dtype``'s matmuls whose operands are about ``size`` on a side (a cube of the same FLOPs):
        interpolated in log-size between the measured sizes, the nearest measured size outside them; the best
        size's rate when the profile has no sizes (a table) or no size is given. Falls back to float32."""
        if dtype not in self.matmul_tflops:
            dtype = "float32"
        best = self.matmul_tflops.get(dtype, 0.0)
        by_size = sorted(self.matmul_tflops_by_size.get(dtype, {}).items())
        if not size or not by_size:
            return best
        if size <= by_size[0][0]:
            return by_size[0][1]
        for (n0, t0), (n1, t1) in itertools.pairwise(by_size):
            if size <= n1:
                w = math.log(size / n0) / math.log(n1 / n0)
                return t0 + w * (t1 - t0)
        return by_size[-1][1]  # beyond the largest size measured (the budget stopped there): its rate

    def collective(self, name: str, inter_node: bool = False) -> CollectiveStats | None:
        """The figures of collective ``name`` (within a node, or across nodes); all-to-all falls back to
        ``ALL_TO_ALL_FALLBACK``'s where the profile has none of its own."""
        table = self.inter_node if inter_node else self.collectives
        found = table.get(name)
        return table.get(ALL_TO_ALL_FALLBACK) if found is None and name == ALL_TO_ALL else found

    def dtype_ratio_at(self, dtype: str, half: bool, size: float | None = None) -> float | None:
        """A 16-bit dtype's step time over fp32's at matmul ``size`` (``_dtype_step_ratio``: under autocast, or cast
        to the dtype with ``half``), interpolated in log-size as ``matmul_tflops_at``; None where not measured."""
        by_size = sorted(self.dtype_step_ratio.get(f"{dtype}:half" if half else dtype, {}).items())
        if not by_size:
            return None
        if not size or size <= by_size[0][0]:
            return by_size[0][1] if size else statistics.median(r for _, r in by_size)
        for (n0, r0), (n1, r1) in itertools.pairwise(by_size):
            if size <= n1:
                return r0 + math.log(size / n0) / math.log(n1 / n0) * (r1 - r0)
        return by_size[-1][1]

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=2) + "\n")


def profile_names() -> list[str]:
    """The tables shipped with atorch, by the name ``load_profile`` and ``atorch plan --hardware`` take."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def load_profile(path: str | Path) -> HardwareProfile:
    """Read a profile (measured and saved, or a table); a bare name looks in atorch's ``profiles/``."""
    path = Path(path)
    if not path.exists() and path.suffix != ".json" and not (PROFILES_DIR / f"{path.name}.json").exists():
        raise FileNotFoundError(f"no hardware profile {str(path)!r}: give a JSON file or one of {profile_names()}")
    if not path.exists() and (PROFILES_DIR / path.with_suffix(".json").name).exists():
        path = PROFILES_DIR / path.with_suffix(".json").name
    return HardwareProfile.from_table(path)


# ----- cache ---------------------------------------------------------------------------------------------

def profile_dir() -> Path:
    return cache_dir() / "profiles"


def cache_path(device_name: str, world_size: int, backend: str, per_node: int = 0) -> Path:
    """Where a measured profile is cached: by device, world size, ranks per node (0: one node), backend, torch
    and format (4 ranks on one node and 2 nodes × 2 ranks measure different collectives)."""
    nodes = f"|{world_size // per_node} nodes x {per_node}" if per_node else ""
    key = f"{device_name}|{world_size}{nodes}|{backend}|{torch.__version__}|format {PROFILE_FORMAT}"
    shape = f"{world_size // per_node}x{per_node}" if per_node else f"{world_size}x"
    slug = re.sub(r"[^A-Za-z0-9]+", "_", f"{device_name}_{shape}_{backend}").strip("_")[:80]
    return profile_dir() / f"{slug}_{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"


def _read_cache(path: Path) -> dict[str, Any] | None:
    try:
        return HardwareProfile.model_validate_json(path.read_text()).model_dump(mode="json")
    except (OSError, ValueError) as exc:  # missing, unreadable or from an older format: measure again
        if path.exists():
            logger.warning("ignoring hardware profile cache %s: %s", path, str(exc).splitlines()[0])
        return None


def _write_cache(path: Path, profile: HardwareProfile) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        profile.save(tmp)
        tmp.replace(path)  # atomic: a reader never sees half a file
    except OSError as exc:
        logger.warning("could not cache the hardware profile at %s: %s", path, exc)


# ----- what this rank is on ------------------------------------------------------------------------------

def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _available_ram() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("cannot tell the available memory: install psutil or pass memory_limit") from None


def _memory_budget(memory_limit: int | None, device: torch.device, local_world: int) -> tuple[int, str]:
    if memory_limit is not None:
        return memory_limit, "memory_limit"
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory), "cuda"
    return _available_ram() // local_world, "ram"


# ----- micro-benchmarks ----------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _matmul_dtypes(device: torch.device) -> list[torch.dtype]:
    if device.type == "cuda":
        return [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_bf16_supported() else [])
    return [torch.float32, torch.bfloat16, torch.float16]  # CPU kernels exist for all three


def _matmul_tflops(device: torch.device) -> tuple[dict[str, float], dict[str, dict[int, float]]]:
    """Per dtype: the best size's TFLOP/s, and every measured size's."""
    found: dict[str, float] = {}
    by_size: dict[str, dict[int, float]] = {}
    for dtype in _matmul_dtypes(device):
        best, spent = 0.0, 0.0
        sizes: dict[int, float] = {}
        for n in _MATMUL_SIZES:
            x, w, g = (torch.randn(n, n, device=device).to(dtype) for _ in range(3))

            def linear_step(x: torch.Tensor = x, w: torch.Tensor = w, g: torch.Tensor = g) -> None:
                x @ w.T, g @ w, g.T @ x  # forward, input gradient, weight gradient

            first = _timed(linear_step, device)  # warm-up (kernel selection, caches)
            times = [_timed(linear_step, device) for _ in range(_MATMUL_REPEATS)]
            sizes[n] = 3 * 2 * n**3 / min(times) / 1e12
            best = max(best, sizes[n])
            spent += first + sum(times)
            # The next size costs ~8x this one: stop before it would blow the budget.
            if spent + 8 * (_MATMUL_REPEATS + 1) * statistics.median(times) > _MATMUL_BUDGET_S:
                break
        found[str(dtype).removeprefix("torch.")] = best
        by_size[str(dtype).removeprefix("torch.")] = sizes
    return found, by_size


def _op_latency(device: torch.device) -> float:
    """Seconds per small operation of a training step: a chain of ``_OP_REPEATS`` multiplications of a
    64-element tensor that requires grad, forward and backward (autograd records each and runs its
    backward: 2 operations per link), median over rounds."""
    leaf = torch.zeros(64, device=device, requires_grad=True)

    def chain() -> None:
        y = leaf
        for _ in range(_OP_REPEATS // 2):
            y = y * 1.0
        y.sum().backward()

    chain()  # warm-up
    return statistics.median(_timed(chain, device) for _ in range(_OP_ROUNDS)) / _OP_REPEATS


def _memory_bandwidth(device: torch.device) -> float:
    """Bytes read and written per second by a large elementwise add (best of a few rounds)."""
    a, b, c = (torch.ones(_BANDWIDTH_ELEMENTS, device=device) for _ in range(3))
    torch.add(a, b, out=c)  # warm-up (pages touched)
    best = min(_timed(lambda: torch.add(a, b, out=c), device) for _ in range(_BANDWIDTH_ROUNDS))
    return 3 * 4 * _BANDWIDTH_ELEMENTS / best


_DTYPE_HIDDEN = (16, 32, 64, 128, 256)  # hidden sizes of the block _dtype_step_ratio times (batch hidden/8, 32 tokens)
_DTYPE_ROUNDS = 5
_DTYPE_BUDGET_S = 1.5  # all sizes together: stop growing the block once this much time is spent


def _block(hidden: int, dtype: torch.dtype | None, autocast: bool) -> tuple[Callable[[], None], float]:
    """A transformer-like block's forward and backward at ``hidden`` (fp32; under ``dtype``'s autocast; or cast to
    ``dtype``), and the side of a square matmul with the FLOPs of its average matmul (``cost_model._matmul_size``'s
    measure, so the cost model reads the ratio at its model's own size)."""
    batch, tokens = max(1, hidden // 8), 32
    gen = torch.Generator().manual_seed(0)
    cast = dtype if dtype is not None and not autocast else torch.float32
    ws = [(torch.randn(a, b, generator=gen) * b**-0.5).to(cast).requires_grad_() for a, b in
          ((3 * hidden, hidden), (hidden, hidden), (4 * hidden, hidden), (hidden, 4 * hidden))]
    x = torch.randn(batch, tokens, hidden, generator=gen).to(cast)
    linear, rows = torch.nn.functional.linear, batch * tokens

    def step() -> None:
        with torch.autocast("cpu", dtype=dtype) if autocast and dtype is not None else contextlib.nullcontext():
            q, k, v = linear(x, ws[0]).chunk(3, dim=-1)
            att = torch.softmax(q @ k.transpose(-1, -2) * hidden**-0.5, dim=-1) @ v
            h = torch.nn.functional.layer_norm(x + linear(att, ws[1]), (hidden,))
            loss = (h + linear(torch.nn.functional.gelu(linear(h, ws[2])), ws[3])).float().square().mean()
        loss.backward()

    flops = 2 * rows * hidden * hidden * (3 + 1 + 4 + 4) + 2 * 2 * batch * tokens * tokens * hidden
    return step, (flops / 6 / 2) ** (1 / 3)


def _dtype_step_ratio(device: torch.device) -> dict[str, dict[int, float]]:
    """Each 16-bit dtype's forward and backward of a small transformer-like block over fp32's, by the block's
    matmul size: under autocast (key: the dtype's name) and cast to the dtype (key: ``name:half``). Rounds
    interleave the variants, so a load that comes and goes on a shared machine falls on all of them; the fastest
    round per variant. The ratio depends on the size (here, one thread, bf16 autocast ran 1.9x fp32's time at
    hidden 16 and 0.8x at 64): sizes grow until the budget is spent. CPU only (see the module docstring)."""
    if device.type != "cpu":
        return {}
    found: dict[str, dict[int, float]] = {}
    begin = time.perf_counter()
    for hidden in _DTYPE_HIDDEN:
        start = time.perf_counter()
        base, side = _block(hidden, None, False)
        variants = {"float32": base}
        for dtype in _matmul_dtypes(device):
            if dtype != torch.float32:
                name = str(dtype).removeprefix("torch.")
                variants[name] = _block(hidden, dtype, True)[0]
                variants[f"{name}:half"] = _block(hidden, dtype, False)[0]
        times: dict[str, list[float]] = {k: [] for k in variants}
        try:
            for step in variants.values():
                step()  # warm-up (kernel selection, autograd's first graph)
            for _ in range(_DTYPE_ROUNDS):
                for name, step in variants.items():
                    times[name].append(_timed(step, device))
        except RuntimeError as exc:  # a dtype without CPU kernels for one of the ops: the sizes so far stand
            logger.debug("dtype step ratio not measured at hidden %d: %s", hidden, exc)
            break
        # the fastest round of each (the least disturbed on a shared machine, as the matmul benchmark's): a median
        # under load 8 on 2 cores once read 22x where quiet rounds read 1.9x
        fp32 = min(times["float32"])
        for name, ts in times.items():
            if name != "float32" and fp32 > 0:
                found.setdefault(name, {})[round(side)] = min(ts) / fp32
        spent, one = time.perf_counter() - begin, time.perf_counter() - start
        if spent + 8 * one > _DTYPE_BUDGET_S:  # the next size costs ~8x this one
            break
    return found


def _collective(name: str, numel: int, world: int, group: Any, device: torch.device) -> Callable[[], Any]:
    """The operation on ``numel`` elements in all (the gathered output for all-gather and reduce-scatter, a rank's
    send buffer for all-to-all)."""
    chunk = max(1, numel // world)
    if name == "all_reduce":
        full = torch.ones(max(1, numel), device=device)
        return lambda: dist.all_reduce(full, group=group)
    if name == "all_gather":
        mine, out = torch.ones(chunk, device=device), torch.empty(chunk * world, device=device)
        return lambda: _ALL_GATHER(out, mine, group=group)
    if name == ALL_TO_ALL:  # every rank sends a chunk to each rank (its own included) and receives one from each
        send, recv = torch.ones(chunk * world, device=device), torch.empty(chunk * world, device=device)
        return lambda: dist.all_to_all_single(recv, send, group=group)
    full, mine = torch.ones(chunk * world, device=device), torch.empty(chunk, device=device)
    return lambda: _REDUCE_SCATTER(mine, full, group=group)


# torch 2.13 names the single-tensor collectives *_single and warns on the older names (FutureWarning)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _median_time(op: Callable[[], Any], repeats: int, group: Any, device: torch.device) -> float:
    op()  # warm-up (connections, buffers)
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)  # start together: the time is the collective's, not a rank's lateness
        times.append(_timed(op, device))
    return statistics.median(times)


def _collective_stats(group: Any, world: int, device: torch.device) -> dict[str, dict[str, float]]:
    if world == 1:
        return {}
    stats = {}
    for name in COLLECTIVES:
        factor = 2 * (world - 1) / world if name == "all_reduce" else (world - 1) / world
        latency = _median_time(_collective(name, world, world, group, device), _LATENCY_REPEATS, group, device)
        best, best_size, spent = 0.0, 0, 0.0
        for size in _BANDWIDTH_BYTES:
            op = _collective(name, size // 4, world, group, device)  # float32 elements
            t = _median_time(op, _BANDWIDTH_REPEATS, group, device)
            if size / t * factor > best:
                best, best_size = size / t * factor, size
            spent += t * (_BANDWIDTH_REPEATS + 1)
            # Every rank must make the same choice: decide on rank 0's time (sent to all).
            stop = all_gather_json(spent * 4 > _COLLECTIVE_BUDGET_S, group=group)[0]
            if stop:
                break
        stats[name] = {"bus_bandwidth": best, "latency_s": latency, "size_bytes": best_size}
    return stats


# ----- the profile ---------------------------------------------------------------------------------------

def ranks_per_node(world_size: int) -> int:
    """Processes per node of this job: torchrun's LOCAL_WORLD_SIZE (the same on every node), else the whole
    world (one node). A local world that does not divide the world (uneven nodes) counts as one node."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)
    return local if 0 < local < world_size and world_size % local == 0 else world_size


def measure_profile(group: Any = None, memory_limit: int | str | None = None, refresh: bool = False) -> HardwareProfile:
    """Measure (or read from the cache) the profile of ``group`` (default: the world); call on all its ranks.

    Every rank returns the same profile: rank 0's measurements and cache, the smallest memory budget.
    ``refresh=True`` measures again even if a cached profile exists.
    """
    limit = parse_bytes(memory_limit)
    device = _device()
    distributed = dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    rank = dist.get_rank(group) if distributed else 0
    backend = str(dist.get_backend(group)) if distributed else "none"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    per_node = ranks_per_node(world)
    name = _device_name(device)
    path = cache_path(name, world, backend, per_node if per_node < world else 0)

    budget, source = _memory_budget(limit, device, local_world)
    cached = _read_cache(path) if rank == 0 and not refresh else None
    mine = {"cached": cached, "budget": budget, "source": source}
    everyone = all_gather_json(mine, group=group) if distributed else [mine]
    memory = {"memory_per_rank": min(e["budget"] for e in everyone), "memory_source": everyone[0]["source"]}
    if everyone[0]["cached"] is not None:
        cached = HardwareProfile.model_validate({**everyone[0]["cached"], **memory})
        return _with_dtype_ratio(cached, group, device, distributed, rank, path)

    start = time.perf_counter()
    matmul, matmul_by_size = _matmul_tflops(device)
    measured = {
        "source": "measured", "device_type": device.type, "device_name": name, "world_size": world,
        "local_world_size": local_world, "backend": backend, "torch_version": torch.__version__,
        # nodes × ranks per node: the processes of a multi-node job (torchrun --nnodes), for the planner
        "gpus_per_node": per_node if per_node < world else 0,
        "matmul_tflops": matmul, "matmul_tflops_by_size": matmul_by_size,
        "op_latency_s": _op_latency(device),
        "memory_bytes_per_s": _memory_bandwidth(device),
        "dtype_step_ratio": _dtype_step_ratio(device),
        "collectives": _collective_stats(group, world, device),
    }
    # What the cost model charges for the all-reduce the tensor-parallel benchmark runs (cost_model._collective_s),
    # taken off its figures.
    reduce = measured["collectives"].get("all_reduce")
    measured.update(measure_parallel_costs(group, world, device, lambda size: reduce["latency_s"] + size * 2 * (
        world - 1) / world / reduce["bus_bandwidth"] if reduce else 0.0))
    measured["measure_s"] = time.perf_counter() - start
    if distributed:
        measured = all_gather_json(measured, group=group)[0]
    profile = HardwareProfile.model_validate({**measured, **memory})
    if rank == 0:
        _write_cache(path, profile)
    logger.debug("hardware profile measured in %.1f s: %s", measured["measure_s"], profile)
    return profile


def _with_dtype_ratio(profile: HardwareProfile, group: Any, device: torch.device, distributed: bool, rank: int,
                      path: Path) -> HardwareProfile:
    """A cached profile from before ``dtype_step_ratio`` (its format unchanged): the ratio measured now, on every
    rank at once (rank 0's sent to all), and the cache rewritten; a profile that has it, or a device that does not
    measure it (CUDA), as it is."""
    if profile.dtype_step_ratio or device.type != "cpu":
        return profile
    ratio = _dtype_step_ratio(device)
    if distributed:
        ratio = all_gather_json(ratio, group=group)[0]
    # validated, not copied: JSON (all_gather_json) made the sizes strings
    profile = HardwareProfile.model_validate({**profile.model_dump(), "dtype_step_ratio": ratio})
    if rank == 0 and ratio:
        _write_cache(path, profile)
    return profile
