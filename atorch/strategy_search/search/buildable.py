"""Which method families of a search space build on the user's model, checked once before the first dry-run.

A transformation that refuses the model (tensor parallel on a model it cannot split, a replacement that does not
fit) refuses it whatever the micro-batch, precision or other methods: one build of each method at each parallel
layout says so, and a failure rules that (method, layout) out of the search (``SearchState.unbuildable_at``: its
candidates are told "skipped" with the reason, never seeded, promoted or dry-run) and is listed in the search
report. The build is the dry-run's own (``atorch.apply.apply_strategy`` on a fresh copy of the model, without its
communicating steps) on fake tensors in a fake process group of the job's size (``tracing.fake_world``), so it
costs no memory and no collective: on the small models of the tests, well under a second per build.

Each layout's methods are covered by the fewest candidates, the simplest first (fewest methods): a build that
fails names the method whose step raised (``exc.atorch_method``, set by ``apply_strategy``); the methods of a
candidate that built are known to build there. Candidates the fake build cannot stand for
(``tracing.untraced_reason``: pipeline schedules, DeepSpeed's engine, which communicate as they are built) are left
to the dry-runs, where one failure rules out its family the same way. The builds run in a forked child where one
can be forked (``tracing.not_forkable``: not once the process has used CUDA): torch can crash on a fake program
(tracing.py), and that must cost the check, not the job. In a job of several processes the builds are dealt to
them (``build_shares``; ``automatic.check_on_every_rank`` gathers the findings): on the held-out Persimmon of
``bench/search.py``, 9 builds in 1.0 s on 2 ranks against 1.1-2.3 s on one.
"""

from __future__ import annotations

import json
import os
import re
import select
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from atorch.log import get_logger
from atorch.model_context import UserSetup

logger = get_logger(__name__)
CHECK_TIME_S = 20.0  # for every build of the check; the families not reached are left to the dry-runs
REAL_BUILD_BYTES = 256 * 2**20  # a model's parameters up to this size are copied for a real build (see below)


# The build check's rules are (method, layout) pairs; this one is (MICRO_BATCH_RULE, "n"): every candidate whose
# per-rank micro-batch is n samples or fewer (a model that cannot train on so few: BatchNorm's statistics over
# one value per channel), whatever its methods and layout.
MICRO_BATCH_RULE = "micro_batch_size"
# Failures of a dry-run's step that come from its micro-batch size alone (the same rule then covers its size).
MICRO_BATCH_FAILURES = re.compile(r"Expected more than 1 value per channel when training")


def ruled_out_by(rules: dict[tuple[str, str], str], names: Collection[str], layout: str,
                 micro_batch_size: int | None) -> str:
    """Why a candidate (its method names, layout key and per-rank micro-batch size) is ruled out by the check's
    ``rules`` ((method, layout) -> why, and the micro-batch rule), or ""."""
    for (method, at), why in rules.items():
        if method == MICRO_BATCH_RULE:
            if micro_batch_size is not None and micro_batch_size <= int(at):
                return why
        elif method in names and at == layout:
            return why
    return ""


def rule_label(rule: tuple[str, str], why: str) -> str:
    """A rule as a log line names it."""
    method, at = rule
    return why if method == MICRO_BATCH_RULE else f"{method} at {at} ({why})"


def micro_batch_rule(size: int, problem: str, runs: int | None = None) -> tuple[tuple[str, str], str]:
    """The rule (and why) for a per-rank micro-batch of ``size`` that fails with ``problem`` (where ``runs`` run)."""
    where = f", where {runs} run" if runs is not None else ""
    return (MICRO_BATCH_RULE, str(size)), (
        f"a micro-batch of {size} sample{'s' if size > 1 else ''} per rank fails in the model's training step"
        f"{where}: {problem}; every candidate at {size} or fewer per rank is left out")


def too_small_micro_batches(setup: UserSetup, batch_of: Any, analysed: int, sizes: Sequence[int]) -> dict[
        tuple[str, str], str]:
    """The micro-batch rule for the space's per-rank micro-batch ``sizes`` below the ``analysed`` batch, on fake
    tensors before any dry-run: the smallest sizes, in turn, until one runs (usually the first, one fake forward);
    none when the analysed batch itself fails on fake tensors (then a size's failure would say nothing).
    ``batch_of(n)``: a sample batch of n samples."""
    from atorch.strategy_search.costing.analyser import fake_forward_problem

    below = sorted({s for s in sizes if s < analysed})
    found: dict[tuple[str, str], str] = {}
    if not below:
        return found
    run = lambda n: fake_forward_problem(setup.model, batch_of(n), setup.model_input_format,  # noqa: E731
                                         setup.loss_func)
    for size in below:
        problem = run(size)
        if problem is None:
            break
        if not found and run(analysed) is not None:
            return {}
        found = dict([micro_batch_rule(size, problem, analysed)])
    return found


@dataclass
class BuildCheck:
    """The check's findings: (method, layout) -> why it does not build; how many builds ran; what is unchecked."""

    unbuildable: dict[tuple[str, str], str] = field(default_factory=dict)
    builds: int = 0
    seconds: float = 0.0
    unchecked: list[str] = field(default_factory=list)  # "method at layout: why"
    ranks: int = 1  # the processes the builds were dealt to (check_on_every_rank)

    def to_json(self) -> list[dict[str, str]]:
        """The ruled-out families as the study keeps them (its ``unbuildable`` attribute; the report lists them)."""
        return [{"method": m, "layout": at, "reason": why} for (m, at), why in self.unbuildable.items()]

    def to_wire(self) -> dict[str, Any]:
        """Everything found, as JSON: a follower rank's share sent to the leader (``from_wire``)."""
        return {"unbuildable": self.to_json(), "builds": self.builds, "seconds": self.seconds,
                "unchecked": list(self.unchecked)}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> BuildCheck:
        return cls({(r["method"], r["layout"]): r["reason"] for r in data["unbuildable"]}, int(data["builds"]),
                   float(data["seconds"]), list(data["unchecked"]))

    def merge(self, other: BuildCheck) -> None:
        """Add another rank's findings (both may have found one method failing at a layout: it is kept once);
        ``seconds`` stays the caller's."""
        self.unbuildable.update(other.unbuildable)
        self.builds += other.builds
        self.unchecked.extend(u for u in other.unchecked if u not in self.unchecked)


def _build_one(setup: UserSetup, batch: Any, world_size: int, device: torch.device, cand: Any,
               fake: bool = True) -> str | None:
    """Build ``cand`` (inside ``fake_world``) on fake tensors, or with ``fake=False`` on a real copy of the model
    (the fake group's collectives return at once either way): None when it builds, else the method and the
    reason, tab-separated."""
    import contextlib
    import warnings

    from atorch.apply import apply_strategy
    from atorch.build import preflight
    from atorch.distributed import DistEnv
    from atorch.function_caches import forget_fake_fills
    from atorch.model_context import ModelContext
    from atorch.strategy_search.costing.fake_kernels import FakeKernelGaps
    from atorch.strategy_search.costing.tracing import MemoryTracer, memory_twin

    strategy = memory_twin(cand.strategy)
    env = DistEnv(rank=0, world_size=world_size, local_rank=0, device=device, backend="fake")
    layout = strategy.layout(world_size)
    modes: list[Any] = []  # entered around the build only (the mesh is made from real rank tensors)
    if fake:
        tracer = MemoryTracer(setup, batch, world_size, device)  # a fake copy of the model, a fake mode of its own
        base = tracer.setup
        modes = [tracer.mode, FakeKernelGaps()]
    else:
        forget_fake_fills(setup.model)  # the real build's one-sample check must not read what a fake build cached
        base = setup
    # the user's dataset kept: a method's one-sample check (tensor parallel's split block) takes its sample there
    built_setup = replace(base, dataset=setup.dataset, dataloader_args={
        **base.dataloader_args, "batch_size": cand.micro_batch_size * layout.data_size})
    skipped, problems = preflight(built_setup, env, strategy, layout)
    if problems:
        return "preflight\t" + "; ".join(problems)
    layout.mesh(device.type)
    try:
        with warnings.catch_warnings(), contextlib.ExitStack() as stack:
            warnings.simplefilter("ignore")
            for mode in modes:
                stack.enter_context(mode)
            ctx = ModelContext(built_setup, env, layout).fresh()
            ctx.skipped = dict(skipped)
            apply_strategy(ctx, strategy, communicate=False, runs_checks=True)
    except Exception as exc:  # noqa: BLE001  (the method that raised is named by apply_strategy)
        lines = str(exc).strip().splitlines()
        # a header ending in ':' (StrategyError's "<what> (n problem(s)):") says nothing without its first problem
        first = " ".join(line.strip() for line in lines[:2]) if lines and lines[0].endswith(":") else \
            (lines[0] if lines else "")
        return f"{getattr(exc, 'atorch_method', 'build')}\t{type(exc).__name__}: {first}"[:600]
    return None


def _plan(cands: Sequence[Any], world_size: int) -> dict[str, list[Any]]:
    """Per layout, the candidates to build, the simplest first: each method of the layout in one of them."""
    from atorch.strategy_search.costing.tracing import untraced_reason
    from atorch.strategy_search.search.candidates import layout_key

    by_layout: dict[str, list[Any]] = {}
    for cand in cands:
        if untraced_reason(cand.strategy, world_size) is None:
            by_layout.setdefault(layout_key(dict(cand.point)), []).append(cand)
    return {at: sorted(members, key=lambda c: (len(c.strategy.methods), c.micro_batches, -c.micro_batch_size))
            for at, members in by_layout.items()}


def build_shares(cands: Sequence[Any], world_size: int, ranks: int) -> list[list[Any]]:
    """The check's builds (``cover``) dealt round-robin to ``ranks`` processes, each rank checking its share at the
    same time: the check's wall time is about its largest share's, not the sum (a follower is idle meanwhile). A
    share's builds are the ones the whole check makes where every build succeeds; where one fails, the whole check
    skips the later builds of the failed method at that layout, which a share on another rank makes and finds
    failing as well: the same findings, a few more builds."""
    shares: list[list[Any]] = [[] for _ in range(max(1, ranks))]
    for index, cand in enumerate(cover(cands, world_size)):
        shares[index % len(shares)].append(cand)
    return shares


def cover(cands: Sequence[Any], world_size: int) -> list[Any]:
    """The candidates the check builds where every build succeeds: per layout, the simplest first, each one that
    brings a method its layout has not had yet."""
    builds: list[Any] = []
    for members in _plan(cands, world_size).values():
        seen: set[str] = set()
        for cand in members:
            if set(cand.strategy.names()) - seen:
                builds.append(cand)
                seen |= set(cand.strategy.names())
    return builds


def check_families(setup: UserSetup, batch: Any, world_size: int, device: torch.device, cands: Sequence[Any],
                   time_limit_s: float = CHECK_TIME_S) -> BuildCheck:
    """Build one candidate per method and layout of ``cands`` (fewest builds, simplest first) on fake tensors;
    a method whose build step raises is unbuildable at that layout."""
    from atorch.strategy_search.costing.tracing import fake_world, not_forkable

    begin = time.monotonic()
    plan = _plan(cands, world_size)
    found = BuildCheck()
    # A fake build can fail where the real one does not (seen: module_replace's swap of fake parameters): a failure
    # is confirmed by a real build of the same candidate where the model is small enough to copy once more; else
    # it is left to the dry-runs, never ruled out on the fake build alone.
    real_ok = sum(p.numel() * p.element_size() for p in setup.model.parameters()) <= REAL_BUILD_BYTES

    def run_all(emit: Any) -> None:
        deadline = time.monotonic() + time_limit_s
        with fake_world(world_size):
            for at, members in plan.items():
                settled: set[str] = set()  # methods known to build, or not, at this layout
                for cand in members:
                    names = set(cand.strategy.names()) - settled
                    if not names or any((m, at) in found.unbuildable for m in cand.strategy.names()):
                        continue
                    if time.monotonic() >= deadline:
                        emit({"unchecked": f"{', '.join(sorted(names))} at {at}: not checked within "
                                           f"{time_limit_s:g} s"})
                        break
                    why = _build_one(setup, batch, world_size, device, cand)
                    if why is not None and not real_ok:
                        emit({"unchecked": f"{' + '.join(sorted(names))} at {at}: the fake build failed "
                                           f"({why.split(chr(9), 1)[-1]}); the model is too large for a real build "
                                           "here: left to the dry-runs"})
                        settled |= names
                        continue
                    if why is not None:  # a fake tensor's gap is not the method's: a real build decides
                        why = _build_one(setup, batch, world_size, device, cand, fake=False)
                    emit({"layout": at, "names": sorted(cand.strategy.names()), "failed": why})
                    if why is None:
                        settled |= names
                    else:
                        method = why.split("\t", 1)[0]
                        settled.add(method)
                        if method in cand.strategy.names():
                            found.unbuildable[(method, at)] = why.split("\t", 1)[1]

    def take(event: dict[str, Any]) -> None:
        if "unchecked" in event:
            found.unchecked.append(event["unchecked"])
            return
        found.builds += 1
        if event["failed"] is not None:
            method, why = event["failed"].split("\t", 1)
            if method in event["names"]:
                found.unbuildable[(method, event["layout"])] = why
            else:  # a failure no method step owns (preflight): the dry-runs decide that candidate
                found.unchecked.append(f"{' + '.join(event['names'])} at {event['layout']}: {why}")

    if not_forkable() is None:
        _in_child(run_all, take, time_limit_s + 30.0)
    else:  # (a GPU job: CUDA is not usable in a forked child)
        run_all(take)
    found.seconds = time.monotonic() - begin
    return found


def _in_child(run_all: Any, take: Any, limit_s: float) -> None:
    """``run_all`` in a forked child, its events back as JSON lines; a child that dies or overruns loses the rest
    (those families are left to the dry-runs)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: check, report, leave without the parent's exit handlers
        os.close(read)
        # one intra-op thread: OpenMP's pool does not survive a fork, and a parallel kernel in the child of a parent
        # that had used it hangs (seen: the one-sample check's first Linear, after the job's own matmuls)
        torch.set_num_threads(1)
        code = 0
        try:
            with os.fdopen(write, "w") as out:
                def emit(event: dict[str, Any]) -> None:
                    out.write(json.dumps(event) + "\n")
                    out.flush()

                run_all(emit)
        except BaseException:  # noqa: BLE001  (the parent keeps what was reported)
            code = 1
        os._exit(code)
    os.close(write)
    deadline = time.monotonic() + limit_s
    buffer = b""
    with os.fdopen(read, "rb") as pipe:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([pipe], [], [], left)[0]:
                os.kill(pid, 9)
                break
            chunk = os.read(pipe.fileno(), 65536)
            if not chunk:
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                take(json.loads(line))
    os.waitpid(pid, 0)
