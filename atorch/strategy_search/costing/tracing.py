"""Peak memory per rank traced from the real training step on fake tensors (the one home of torch's private
``torch.distributed._tools``).

``MemoryTracer(setup, sample_batch, world_size).trace(strategy, micro_batch_size, micro_batches)`` builds the
candidate the way a dry-run does — a fresh copy of the user's model (``ModelContext.fresh``), the strategy's
real transformations (``atorch.apply.apply_strategy``), the optimizer from the user's factory, the
``AcceleratedOptimizer`` (``ModelContext.finish``, ``build_result``) — and runs two steps of ``atorch.training.
train_step`` (forward, loss, backward, optimizer step; the second step runs with the optimizer state there, as
in steady state), all on fake tensors (``FakeTensorMode``: shapes and dtypes, no storage, no arithmetic) and on
torch's ``"fake"`` process group of the job's world size (collectives return at once). torch's ``MemTracker``
counts the live tensor bytes of this rank (rank 0: the larger shard where a split is uneven) over build and both
steps; its peak is what the dry-run measures (``atorch.dryrun.memory.PeakMemory``: the peak increase of live
tensor bytes over a baseline taken before the build). ``MemTracker`` attributes the peak to parameters, buffers,
gradients, activations, temporaries and optimizer state; FSDP2's unsharded parameters and gradients show as
activations / temporaries (it gathers them in its hooks).

What the trace cannot see, and is added here or left to the analytical model (``cost_model.predict``):

* DDP's reducer (C++, allocated outside the dispatcher; its constructor also reads parameter storages, which
  fake tensors have none of): the build runs with ``communicate=False`` (apply.py's named communication steps
  left out: the broadcast of the initial weights, DDP's constructor, DeepSpeed's engine, the pipeline
  schedule), and DDP's buckets are added as ``cost_model.DDP_PERSISTENT`` × the trainable parameter bytes
  (measured: one gradient-sized copy, alive from construction on).
* Not traced (the analytical figure stays): pipeline parallel (``pipeline_parallel``,
  ``mixed_parallel`` with a pipeline dimension, ``ds_3d_parallel``: the schedule is built by a communicating
  step), DeepSpeed's ZeRO
  (``implementation: deepspeed``: its engine communicates in its constructor and keeps flat buffers of its
  own), tensor parallel replicated over data-parallel ranks without sharding (its replication is a
  communicating step), fp8. The allocator's caching and NCCL's own buffers are outside both the trace and the
  dry-run's counter.
* gloo's one tensor-sized collective buffer (``_gloo_buffers``): its reduce-scatter reduces a copy of the input
  (measured), which the fake group does not make; on a CPU device the trace makes it, for the collective's
  duration (FSDP2's post-backward of its largest unit can be the peak: the held-out VGG's and LSTM's FSDP2 +
  autocast rows were 6-9% under without it).

Inside a job that already has a real default process group (the search runs on rank 0 of a torchrun job while
the other ranks wait for its word), ``fake_world`` swaps torch's process-group registry (``c10d._world``) for a
fresh one holding a fake default group of the wanted size, and swaps it back afterwards: the job's groups are
never used, destroyed or renamed (the fake groups get names far from the job's, and only they are unregistered
from torch's name registry on the way out). ``trace_candidates`` runs the traces in a child made with
``os.fork``: the child has the user's objects (model, loss, optimizer factory) as they are, so nothing is
pickled, and its results come back as JSON lines through a pipe. Why a child: torch can crash on a fake program
(seen: segfaults in fake FSDP2 builds with recompute and autocast once another candidate had run in the same
fake mode — each trace now has a mode of its own — and in ``release()`` of fake FSDP2 modules), which in the
job's own process would end the job; in a child it costs one family (recorded "tracing crashed"), the next
child goes on after it. A fresh interpreter instead of a fork would need the user's objects pickled (never) or
rebuilt, and ~3 s for ``import torch``; the fork costs milliseconds. Once the process has used CUDA (every GPU
job, before its search) a forked child cannot (``not_forkable``), and the traces run in the job's process, each
family started only within the time limit. ``trace`` (one candidate, in this process) is what the tests use.

Counting: torch's ``MemTracker`` keys storages by their Python objects; on fake tensors a view or an in-place
result comes back as a new one, so every nn.Linear's saved ``W.t()`` counted as a new weight (Llama, one rank:
traced 18.4 MiB, measured 16.3). The tracker here leaves the outputs of aliasing operations (views, in-place)
out, keeps only the rank's peak (its per-module peaks cost a third of a trace), and follows several forwards of
the root module (micro-batches, steps). DTensor runs each new operation once more on global-shape fake tensors to
derive its output's metadata; in a real run those hold no memory, and here they are left out too
(``_shadows_uncounted``: AdamW's step on FSDP2's parameters counted three unsharded copies of the largest one).
fp16 autocast is traced as bf16 autocast (``memory_twin``: the same bytes; fp16's loss scaler reads
``found_inf.item()``, which fake tensors cannot answer).

Cost (this 2-core machine, shared with four other jobs): one trace is build + two steps (at most two
micro-batches each) of Python on fake tensors: 0.2-0.6 s for the held-out CNN / LSTM, 2-7 s for the 3-4-block
transformers of bench/cost_model.py (a third less since the per-module peaks are skipped). ``trace_candidates``
traces each memory family (the strategy, and whether micro-batches accumulate) at its smallest and largest
micro-batch size only and interpolates linearly in between (activations are linear in the micro-batch), within
``DEFAULT_TIME_LIMIT_S`` for all of them; families not reached keep the analytical figure.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from atorch.model_context import UserSetup
from atorch.opt_lib import registry
from atorch.parallel_layout import ParallelLayout
from atorch.strategy import Strategy

# Group names in the fake registry start this far above the job's own group count, so no fake group is ever
# registered under (and then unregistered from) a name one of the job's groups holds.
_NAME_OFFSET = 1_000_000
_worlds_opened = 0
DEFAULT_TIME_LIMIT_S = 120.0  # for all of a search's traces; the rest stays analytical
TRACE_STEPS = 2  # the second step runs with the optimizer state there (steady state)
MAX_TRACED_MICRO_BATCHES = 2  # past the second micro-batch, accumulation repeats the same peak


class TraceError(RuntimeError):
    """A candidate could not be traced (the analytical figure is used for it)."""


@dataclass(frozen=True)
class TracedMemory:
    """Peak live tensor bytes of rank 0 over build and two steps, and what made them."""

    peak: int  # traced peak + ``untraced``
    parameters: int = 0
    buffers: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    temporary: int = 0
    other: int = 0
    untraced: int = 0  # added analytically: DDP's buckets
    seconds: float = 0.0  # how long the trace took
    traced: bool = True  # False: interpolated in the micro-batch size between two traces

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def memory_twin(strategy: Strategy) -> Strategy:
    """The strategy traced for ``strategy``: each method's ``traced_as`` config (fp16 autocast is traced as bf16
    autocast. Both keep the same bytes (16-bit casts and activations, fp32 weights and state); fp16's loss scaler
    adds a few scalars, and its overflow check reads a value (``found_inf.item()``) that fake tensors do not have)."""
    twins = {item.name: registry.get_method(item.name).traced_as(item.config) for item in strategy.methods}
    if all(twins[item.name] is item.config for item in strategy.methods):
        return strategy
    return Strategy.load([(name, twins[name].model_dump(mode="json")) for name, _ in strategy.to_list()])


def _shards_data(strategy: Strategy) -> bool:
    """Whether a method shards the model over the data dimension (FSDP2): no DDP, no replica step."""
    return any(registry.get_method(item.name).shards_data(item.config) for item in strategy.methods)


def untraced_reason(strategy: Strategy, world_size: int) -> str | None:
    """Why ``strategy`` is left to the analytical model, or None if it can be traced (each method says for itself:
    Method.trace_problem; the layout's pipeline and tensor-replica steps communicate)."""
    from atorch.opt_lib.pipeline_parallel import UNTRACED_SCHEDULE

    layout = strategy.layout(world_size)
    if layout.size("pipeline") > 1:
        return UNTRACED_SCHEDULE
    for item in strategy.in_apply_order():
        reason = registry.get_method(item.name).trace_problem(item.config, layout)
        if reason is not None:
            return reason
    if layout.size("tensor") > 1 and layout.data_size > 1 and not _shards_data(strategy):
        return "tensor-parallel replicas are joined by a communicating step"
    return None


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """Run the block with torch's ``"fake"`` process group of ``world_size`` ranks as the default group (rank 0).

    A job's real groups (if any) stand aside and come back untouched: see the module's docstring.
    """
    import torch.distributed.distributed_c10d as c10d
    from torch._C._distributed_c10d import _register_process_group, _unregister_process_group
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from atorch.parallel_layout import forget_meshes

    global _worlds_opened
    _worlds_opened += 1
    saved = c10d._world
    fresh = c10d._World()
    fresh.group_count = saved.group_count + _NAME_OFFSET * _worlds_opened  # never a name used before
    c10d._world = fresh
    forget_meshes()
    try:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        yield
    finally:
        fake_names = list(fresh.pg_names.values())
        c10d._world = saved
        forget_meshes()
        for name in fake_names:
            _unregister_process_group(name)
        for pg, name in saved.pg_names.items():  # a name hashed from ranks alone could have been taken: restore it
            if name in fake_names:
                _register_process_group(name, pg)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """atorch's INFO lines of every build (one per method) would repeat for each traced candidate."""
    log = logging.getLogger("atorch")
    level = log.level
    log.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        log.setLevel(level)


def _map_tensors(data: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    from atorch.strategy_search.costing.fake_step import map_tensors

    return map_tensors(data, fn)


class MemoryTracer:
    """Traces candidates of one job: the user's setup, one sample batch (as the model receives it), world size."""

    def __init__(self, setup: UserSetup, sample_batch: Any, world_size: int,
                 device: torch.device | None = None) -> None:
        from atorch.strategy_search.costing.analyser import batch_shape

        self.world_size = world_size
        self.device = device or torch.device("cpu")
        self.user_setup = setup
        self.sample = sample_batch
        self.sample_size = batch_shape(sample_batch)[0]
        self._fresh_mode()
        self._cache: dict[tuple[str, int], TracedMemory | str] = {}
        self._keep: list[Any] | None = None  # in a forked child: every build, kept until the child exits

    def _fresh_mode(self) -> None:
        """A fake mode, and a fake copy of the user's model in it, for one trace: the user's model is never
        touched (its copy's parameters are fake; not counted: the dry-run's baseline is taken with the user's
        model there; the build copies it again, as it does for real). One mode per trace: a fake FSDP2 build
        with recompute and autocast crashed torch (segfault) after another candidate had run in the same mode."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        from atorch.strategy_search.costing.fake_step import fake_copy

        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        model = fake_copy(self.user_setup.model, self.mode, self.device)
        self.setup = replace(self.user_setup, model=model, dataset=None)

    # ----- one candidate -----------------------------------------------------------------------------------
    def trace(self, strategy: Strategy, micro_batch_size: int, micro_batches: int = 1) -> TracedMemory:
        """Trace one candidate (inside ``fake_world``, or opening one for this call). Raises TraceError."""
        reason = untraced_reason(strategy, self.world_size)
        if reason is not None:
            raise TraceError(reason)
        strategy = memory_twin(strategy)
        if dist.is_initialized() and dist.get_backend() == "fake" and dist.get_world_size() == self.world_size:
            return self._trace(strategy, micro_batch_size, micro_batches)
        with fake_world(self.world_size):
            return self._trace(strategy, micro_batch_size, micro_batches)

    def _batch(self, size: int) -> Any:
        """A fake micro-batch of ``size`` samples shaped like the sample batch."""
        def resize(t: torch.Tensor) -> torch.Tensor:
            if t.dim() >= 1 and t.shape[0] == self.sample_size:
                return torch.empty((size, *t.shape[1:]), dtype=t.dtype, device=self.device)
            return self.mode.from_tensor(t) if not t.is_meta else torch.empty_like(t, device=self.device)

        return _map_tensors(self.sample, resize)

    def _trace(self, strategy: Strategy, micro_batch_size: int, micro_batches: int) -> TracedMemory:
        from torch.distributed._tools.mem_tracker import _MemRefType

        from atorch.apply import apply_strategy
        from atorch.build import build_result, preflight
        from atorch.distributed import DistEnv
        from atorch.model_context import ModelContext
        from atorch.strategy_search.costing.fake_kernels import FakeKernelGaps
        from atorch.training import train_step

        start = time.perf_counter()
        self._fresh_mode()
        env = DistEnv(rank=0, world_size=self.world_size, local_rank=0, device=self.device, backend="fake")
        layout = strategy.layout(self.world_size)
        setup = replace(self.setup, dataloader_args={**self.setup.dataloader_args,
                                                     "batch_size": micro_batch_size * layout.data_size})
        skipped, problems = preflight(setup, env, strategy, layout)
        if problems:
            raise TraceError("; ".join(problems))
        layout.mesh(self.device.type)  # outside the fake mode: the mesh is made from real rank tensors
        tracker = _tracker()
        result = None
        try:
            buffers = _gloo_buffers() if self.device.type == "cpu" else contextlib.nullcontext()
            with _quiet(), warnings.catch_warnings(), self.mode, FakeKernelGaps(), tracker, buffers, \
                    _shadows_uncounted(tracker):
                warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor")  # torch's own checks
                ctx = ModelContext(setup, env, layout).fresh()
                ctx.skipped = dict(skipped)
                apply_strategy(ctx, strategy, communicate=False)
                ctx.finish()
                result = build_result(ctx, setup)
                for _ in range(TRACE_STEPS):
                    count = min(micro_batches, MAX_TRACED_MICRO_BATCHES)
                    train_step(result, [self._batch(micro_batch_size) for _ in range(count)])
                ddp = _ddp_buckets(ctx, strategy, layout)
        except TraceError:
            raise
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise TraceError(f"{type(exc).__name__}: {first}") from exc
        finally:
            # Not ``result.close()``: emptying fake modules crashes torch (seen with FSDP2); fake tensors hold no
            # memory. In a forked child nothing is freed at all (``_keep``): freeing fake FSDP2 state crashed it too.
            if self._keep is not None:
                self._keep.append(result)
            result = None
        snap = tracker.get_tracker_snapshot("peak").get(self.device, {})
        total = int(snap.get("Total", 0))
        return TracedMemory(
            peak=total + ddp, parameters=snap.get(_MemRefType.PARAM, 0), buffers=snap.get(_MemRefType.BUFFER, 0),
            gradients=snap.get(_MemRefType.GRAD, 0), optimizer_state=snap.get(_MemRefType.OPT, 0),
            activations=snap.get(_MemRefType.ACT, 0), temporary=snap.get(_MemRefType.TEMP, 0),
            other=snap.get(_MemRefType.OTH, 0), untraced=ddp, seconds=time.perf_counter() - start)

    # ----- a search's candidates ---------------------------------------------------------------------------
    def trace_candidates(self, candidates: Sequence[Any], time_limit_s: float = DEFAULT_TIME_LIMIT_S,
                         isolate: bool = True) -> dict[str, TracedMemory | str]:
        """Every candidate's traced memory (by ``candidate.key``), or the reason it is not traced.

        A family (the strategy, and whether micro-batches accumulate) is traced at its smallest and largest
        micro-batch size; the sizes between are interpolated linearly. With ``isolate`` (where a child can be
        forked: ``not_forkable``) the traces run in a forked child: a crash inside torch on some fake program
        (seen: a segfault) costs that family, not the job, and the child is stopped after ``time_limit_s``.
        Without, they run here, and no family is started after ``time_limit_s``. The families not reached are left
        to the analytical model. Nothing is pickled: the child has the parent's objects.
        """
        families: dict[str, list[Any]] = {}
        for cand in candidates:
            families.setdefault(_family(memory_twin(cand.strategy), cand.micro_batches), []).append(cand)
        plans = {family: sorted({c.micro_batch_size for c in members}) for family, members in families.items()}
        if isolate and not_forkable() is None:
            ends = _in_children(self, families, plans, time_limit_s)
        else:
            ends, deadline = {}, time.monotonic() + time_limit_s
            with fake_world(self.world_size):
                for family, members in families.items():
                    ends[family] = {m: f"not traced within {time_limit_s:g} s" for m in plans[family]} \
                        if time.monotonic() >= deadline else self._family_ends(family, members, plans[family])
        out: dict[str, TracedMemory | str] = {}
        for family, members in families.items():
            sizes, found = plans[family], ends[family]
            for cand in members:
                out[cand.key] = found.get(cand.micro_batch_size) or _interpolate(
                    cand.micro_batch_size, sizes[0], found[sizes[0]], sizes[-1], found[sizes[-1]])
        return out

    def _family_ends(self, family: str, members: list[Any], sizes: list[int]) -> dict[int, TracedMemory | str]:
        return {m: self._cached(family, members, m) for m in sorted({sizes[0], sizes[-1]})}

    def _cached(self, family: str, members: list[Any], size: int) -> TracedMemory | str:
        key = (family, size)
        if key not in self._cache:
            cand = next(c for c in members if c.micro_batch_size == size)
            try:
                self._cache[key] = self.trace(cand.strategy, size, cand.micro_batches)
            except TraceError as exc:
                self._cache[key] = str(exc)
        return self._cache[key]


def not_forkable() -> str | None:
    """Why fake builds cannot run in a forked child of this process (None: they can). Once the process has used
    CUDA (a GPU job: its NCCL group, its device), torch refuses CUDA in a forked child ("Cannot re-initialize CUDA in
    forked subprocess"), which the fake builds on a CUDA device reach: on an H200 every memory trace of four budget
    searches failed so, and the first one's build check, and the searches ran on the analytical figures alone.
    There the builds run in this process, without a crash's isolation (a spawned interpreter would need the user's
    objects pickled: never)."""
    if not hasattr(os, "fork"):
        return "this platform has no os.fork"
    if torch.cuda.is_initialized():
        return "this process has initialized CUDA, which a forked child cannot use"
    return None


def _in_children(tracer: MemoryTracer, families: dict[str, list[Any]], plans: dict[str, list[int]],
                 time_limit_s: float) -> dict[str, dict[int, TracedMemory | str]]:
    """Trace the families in forked children, one JSON line per family back through a pipe; a child that dies
    loses the family it was in (recorded with the signal) and the next child goes on after it."""
    deadline = time.monotonic() + time_limit_s
    order = list(families)
    ends: dict[str, dict[int, TracedMemory | str]] = {}
    while len(ends) < len(order):
        todo = [f for f in order if f not in ends]
        if time.monotonic() >= deadline:
            for family in todo:
                ends[family] = {m: f"not traced within {time_limit_s:g} s" for m in plans[family]}
            break
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: trace, report, leave without running the parent's exit handlers
            os.close(read)
            gc.disable()  # the child frees nothing: it exits with os._exit when done
            torch.set_num_threads(1)  # OpenMP's pool does not survive a fork: a parallel kernel would hang
            tracer._keep = []
            code = 0
            try:
                with os.fdopen(write, "w") as out, fake_world(tracer.world_size):
                    for family in todo:
                        out.write(json.dumps({"start": family}) + "\n")
                        out.flush()
                        found = tracer._family_ends(family, families[family], plans[family])
                        out.write(json.dumps({"family": family, "ends": {
                            str(m): v if isinstance(v, str) else v.to_json() for m, v in found.items()}}) + "\n")
                        out.flush()
            except BaseException:  # noqa: BLE001  (the parent records what was not reported)
                code = 1
            os._exit(code)
        os.close(write)
        started = _collect(read, pid, deadline, ends)
        _, status = os.waitpid(pid, 0)
        if started is not None and started not in ends:  # the child died (or ran out of time) inside this family
            # killed by _collect at the deadline: out of time, not a crash
            why = f"not traced within {time_limit_s:g} s" if time.monotonic() >= deadline \
                else f"tracing crashed (signal {-os.waitstatus_to_exitcode(status)})" if os.WIFSIGNALED(status) \
                else "tracing failed"
            ends[started] = {m: why for m in plans[started]}
        elif started is None and len(ends) < len(order):
            for family in todo:  # the child could not start at all
                ends[family] = {m: "tracing could not start" for m in plans[family]}
    return ends


def _collect(fd: int, pid: int, deadline: float, ends: dict[str, dict[int, TracedMemory | str]]) -> str | None:
    """Read the child's lines until it closes the pipe (or the deadline: then it is killed); the last family
    it started."""
    import select
    import signal

    started, buffer = None, b""
    with os.fdopen(fd, "rb") as pipe:
        while True:
            left = deadline - time.monotonic()
            ready = select.select([pipe], [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:
                os.kill(pid, signal.SIGKILL)
                return started
            chunk = os.read(pipe.fileno(), 1 << 16)
            if not chunk:
                return started
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                message = json.loads(line)
                if "start" in message:
                    started = message["start"]
                else:
                    ends[message["family"]] = {int(m): v if isinstance(v, str) else TracedMemory(**v)
                                               for m, v in message["ends"].items()}


def _tracker() -> Any:
    """torch's MemTracker, made to follow several forwards of the root module (micro-batches, steps): it refuses a
    root's second forward; its per-module statistics (which this module does not read) are reset there instead."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class _Tracker(MemTracker):
        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            name = self._mod_tracker.get_known_fqn(module)
            if module in self.memory_tracking and not self._mod_tracker.is_bw and \
                    set(self._mod_tracker.parents) - {name} == {"Global"}:
                self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

        _aliasing = False

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            # A view or an in-place operation allocates nothing: its output is an input's memory. MemTracker
            # tells storages apart by their Python objects, and on fake tensors an alias comes back as a new one:
            # every nn.Linear's ``W.t()``, saved for backward, was counted as a new weight (Llama, one rank:
            # traced 18.4 MiB against 16.3 measured).
            schema = getattr(func, "_schema", None)
            if schema is None or not any(r.alias_info is not None for r in schema.returns):
                return super().__torch_dispatch__(func, types, args, kwargs)
            self._aliasing = True
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._aliasing = False

        shadows = 0  # > 0 inside DTensor's metadata propagation (see _shadows_uncounted)

        def _track(self, reftype: Any, t: torch.Tensor) -> None:
            if not self._aliasing and not self.shadows:
                super()._track(reftype, t)

        def _update_peak_stats(self, peak_state: Any) -> None:
            # Only the rank's peak is read here; MemTracker's per-module peaks (a walk over every module after
            # every operation: a third of a trace's time on a 4-block Llama) are skipped.
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

    return _Tracker()


@contextlib.contextmanager
def _shadows_uncounted(tracker: Any) -> Iterator[None]:
    """DTensor derives an operation's output metadata by running it on global-shape fake tensors
    (``ShardingPropagator._propagate_tensor_meta_non_cached``). In a real run those are fake and hold no memory;
    in the trace everything is fake, and the tracker counted them: AdamW's ``param.addcdiv_(exp_avg, denom)``
    on FSDP2's sharded parameters made three unsharded copies of the largest parameter at the step (the held-out
    VGG's FSDP2 + autocast rows: traced 1.88 MiB at the step, measured 1.68 MiB at the peak of another phase)."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    real = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self: Any, *args: Any, **kwargs: Any) -> Any:
        tracker.shadows += 1
        try:
            return real(self, *args, **kwargs)
        finally:
            tracker.shadows -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = real  # type: ignore[method-assign]


@contextlib.contextmanager
def _gloo_buffers() -> Iterator[None]:
    """The collective buffers gloo allocates as tensors, made in the trace too (the fake group allocates none).

    ``ProcessGroupGloo``'s reduce-scatter all-reduces a copy of its input and copies the rank's chunk out: one
    input-sized tensor for the collective's duration (measured with ``PeakMemory`` around
    ``dist.reduce_scatter_single`` on 2 gloo ranks: +1.000 MiB for a 1 MiB input, sync or async; all-gather,
    all-reduce and broadcast add nothing). FSDP2 reduce-scatters each unit's gradients with it, so on a CPU
    (gloo) the post-backward of the largest unit holds that copy besides the reduce-scatter input and output
    (the held-out VGG's FSDP2 + autocast peak: traced 1.88 MiB without it, measured 1.68 MiB in another phase).
    NCCL keeps no such tensor: CPU devices only. FSDP2 calls ``dist.reduce_scatter_single`` at each use, so the
    module attribute is what is swapped."""
    real = dist.reduce_scatter_single

    def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        copy = input.clone()  # gloo's copy of the input, live while the collective runs
        try:
            return real(output, input, *args, **kwargs)
        finally:
            del copy

    dist.reduce_scatter_single = reduce_scatter_single  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.reduce_scatter_single = real  # type: ignore[assignment]


def family_of(cand: Any) -> str:
    """The family ``trace_candidates`` traces ``cand`` in: its traced strategy, and whether it accumulates."""
    return _family(memory_twin(cand.strategy), cand.micro_batches)


def _family(strategy: Strategy, micro_batches: int) -> str:
    return json.dumps([strategy.to_list(), micro_batches > 1], sort_keys=True, default=str)


def _interpolate(size: int, low: int, at_low: TracedMemory | str, high: int,
                 at_high: TracedMemory | str) -> TracedMemory | str:
    if isinstance(at_low, str):
        return at_low
    if isinstance(at_high, str):
        return at_high
    w = (size - low) / (high - low)
    fields = {k: round(getattr(at_low, k) + w * (getattr(at_high, k) - getattr(at_low, k)))
              for k in ("peak", "parameters", "buffers", "gradients", "optimizer_state", "activations", "temporary",
                        "other", "untraced")}
    return TracedMemory(**fields, seconds=0.0, traced=False)


def _ddp_buckets(ctx: Any, strategy: Strategy, layout: ParallelLayout) -> int:
    """DDP's reducer buckets, which the trace cannot see (see the module's docstring); 0 where DDP is not used."""
    from atorch.strategy_search.costing.cost_model import DDP_PERSISTENT

    if _shards_data(strategy) or layout.data_size <= 1 or layout.size("tensor") > 1 or layout.size("pipeline") > 1:
        return 0
    model: nn.Module = ctx.model
    return round(DDP_PERSISTENT * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad))
