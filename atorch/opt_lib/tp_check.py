"""tensor_parallel's build check: one split block of each class against its unsplit copy, on one sample.

A plan can build and train while computing something else (a fused layer split column-wise that the model
splits again gives each rank the wrong halves: no error, wrong numbers). So every build runs one repeated
block of each class holding a split layer (a hybrid model's attention and Mamba layers alike) twice on the
input it receives for the dataset's first sample: unsplit, copied before the split, and split, on the tensor
group. The output and the gradient of every
parameter (for a fixed random projection of the output) must agree within a tolerance derived from the
parameters' dtype; otherwise the build is refused with the figures. Cost: one forward of the model up to
the last checked block, then each checked block's forward and backward twice. Under pipeline parallel the
blocks are those of the stage holding this rank's first split block, reached by running that stage alone (a
later stage on stand-in hidden states).

The check draws no numbers from the user's random generators and leaves no gradients behind.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from atorch.log import get_logger
from atorch.state_names import StagedModel

logger = get_logger(__name__)

# Relative (norm-wise) error allowed, per unit roundoff of the parameters' dtype: the split computes the same
# sums in another order (a few roundings per op over a block, ~1e-6 in fp32); a plan that changes the
# computation is off by the order of the values themselves (Phi-3's split fused MLP: ~1).
ULPS = 1024
MAX_TOLERANCE = 0.1


class _Captured(Exception):
    """Stops the model's forward once the checked block's input is held."""


def tolerance(dtype: torch.dtype) -> float:
    return min(MAX_TOLERANCE, ULPS * torch.finfo(dtype).eps)


def blocks_to_check(model: nn.Module, split: list[str]) -> list[str]:
    """The first block of each repeated block class holding a split layer, in the model's order (a hybrid model's
    attention and Mamba layers are both checked: a plan can fit one and not the other); [""] (the model itself)
    if no repeated block holds one."""
    from atorch.class_ref import matches
    from atorch.opt_lib.blocks import block_classes

    classes = block_classes(model)
    found: dict[type, str] = {}
    for name, module in model.named_modules():
        if (name and classes and type(module) not in found and matches(module, classes)
                and any(s.startswith(name + ".") for s in split)):
            found[type(module)] = name
    return list(found.values()) or [""]


def _detached(value: Any) -> Any:
    """A copy of a captured input: tensors detached, caches dropped (the block would write into them)."""
    def copy_leaf(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().clone()
        return None if type(leaf).__name__.endswith("Cache") else leaf

    return pytree.tree_map(copy_leaf, value)


def _first_sample(ctx: Any) -> Any:
    from atorch.data import build_dataloader

    args = {**ctx.setup.dataloader_args, "batch_size": 1, "shuffle": False, "num_workers": 0}
    args.pop("sampler", None)
    batch = next(iter(build_dataloader(ctx.setup.dataset, args, 1, 0)))
    return ctx.input_preparer()(batch)


def _stage_run(ctx: Any, name: str) -> Callable[[Any], Any] | str:
    """Under pipeline parallel (ctx.model: this rank's stages), how to run the stage holding block ``name`` on
    one sample, or why it cannot be. A later stage has no previous stage to receive hidden states from: its first
    block gets a fixed random tensor of their shape instead (the same on every rank of the tensor group, the
    user's random stream untouched); what the stage computes around the blocks (masks, positions) is its own."""
    from atorch.opt_lib.pipeline_split import stage_kwargs

    if not name.startswith("stages."):
        return "no repeated block of this rank's stages holds a split layer"
    stage = ctx.model.get_submodule(".".join(name.split(".")[:2]))  # "stages.<i>": a StageModule
    if stage.children_split and not stage.first:
        return "a later stage of an nn.Sequential split at its children takes only the previous stage's output"
    injector = None if stage.first else stage.injector

    def stand_in(like: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        return torch.randn(like.shape, generator=generator, dtype=torch.float32).to(like.device, like.dtype)

    def run(sample: Any) -> Any:
        if injector is None:
            return stage(**stage_kwargs(sample, stage.input_format))
        injector.stand_in = stand_in
        try:  # no hidden states given (None): the stand-in is made at the first block
            return stage(None, **stage_kwargs(sample, stage.input_format))
        finally:
            injector.stand_in = None

    return run


class BlockCheck:
    """Made before the split (the block's input and an unsplit copy), run after it."""

    def __init__(self, name: str, reference: nn.Module, inputs: tuple[tuple, dict],
                 autocast: tuple[str, torch.dtype] | None = None) -> None:
        self.name, self.reference, self.inputs = name, reference, inputs
        # (device type, dtype) of the autocast the block ran under when its input was captured (a precision
        # method applied before the split wraps the forward): both runs of the check compute under it too, else
        # a 16-bit input meets fp32 weights (seen on Swin under amp_native(bf16))
        self.autocast = autocast

    def _computing(self) -> Any:
        import contextlib

        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.autocast[0], dtype=self.autocast[1])

    @classmethod
    def prepare(cls, ctx: Any, split: list[str]) -> list[BlockCheck]:
        """Capture the checked blocks' inputs for the first sample (``blocks_to_check``); [] (said in the log)
        where that cannot be done."""
        from atorch.model_context import call_model

        if ctx.setup.dataset is None:
            logger.info("tensor_parallel: build not checked against the unsplit model (no dataset to take a sample)")
            return []
        names = blocks_to_check(ctx.model, split)
        if isinstance(ctx.model, StagedModel):  # one stage is run: the blocks of the first one's stage
            names = [n for n in names if n.split(".")[:2] == names[0].split(".")[:2]]
        run = _stage_run(ctx, names[0]) if isinstance(ctx.model, StagedModel) else \
            (lambda sample: call_model(ctx.model, sample, ctx.setup.model_input_format))
        if isinstance(run, str):
            logger.info("tensor_parallel: build not checked against the unsplit model (%s)", run)
            return []
        held: dict[str, tuple[tuple, dict]] = {}
        device_type = ctx.env.device.type
        autocast: dict[str, tuple[str, torch.dtype] | None] = {}

        def hook_for(name: str) -> Callable[..., None]:
            def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
                if name not in held:
                    held[name] = (_detached(args), _detached(kwargs))
                    autocast[name] = ((device_type, torch.get_autocast_dtype(device_type))
                                      if torch.is_autocast_enabled(device_type) else None)
                if len(held) == len(names):
                    raise _Captured  # every checked block's input is held: the rest of the forward is not needed
            return hook

        handles = [ctx.model.get_submodule(n).register_forward_pre_hook(hook_for(n), with_kwargs=True) for n in names]
        modes = {m: m.training for m in ctx.model.modules()}
        ctx.model.eval()  # no dropout: no random numbers drawn, and the two runs compare
        try:  # (the dataloader's iterator draws its base seed from torch's generator: forked)
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                run(_first_sample(ctx))
        except _Captured:
            pass
        finally:
            for handle in handles:
                handle.remove()
            for module, training in modes.items():
                module.train(training)
        for name in names:
            if name not in held:
                logger.info("tensor_parallel: build not checked against the unsplit model (%s was not called)", name)
        return [cls(n, copy.deepcopy(ctx.model.get_submodule(n)), held[n], autocast[n]) for n in names if n in held]

    def called_modules(self) -> set[str]:
        """The modules (names inside the block) that the unsplit block's forward calls on the check's input."""
        called: set[str] = set()
        block = self.reference
        handles = [m.register_forward_pre_hook(lambda _m, _a, n=name: called.add(n))
                   for name, m in block.named_modules() if name]
        training = block.training
        block.eval()
        try:
            with self._computing(), torch.no_grad(), torch.random.fork_rng(devices=[]):
                block(*self.inputs[0], **self.inputs[1])
        finally:
            block.train(training)
            for handle in handles:
                handle.remove()
        return called

    def _fails(self, exc: Exception, trace: _Trace) -> list[str]:
        label = self.name or "the model"
        return [f"the split {label} fails on one sample in {trace.where(exc, self.name)}: {type(exc).__name__}: "
                f"{_first_line(exc)}; the plan does not fit this model's computation: give fused layers the "
                "gather-output styles ('colwise_gather_output', 'rowwise_split_input') or leave them out of the plan"]

    def runs(self, model: nn.Module) -> list[str]:
        """Whether the split block computes the sample's forward at all (a build without communication: its
        numbers mean nothing there); problems, empty when it runs."""
        block = model.get_submodule(self.name)
        trace = _Trace(block)
        training = block.training
        block.eval()
        try:
            with trace, self._computing(), torch.no_grad():
                block(*self.inputs[0], **self.inputs[1])
        except Exception as exc:  # noqa: BLE001  (a plan that does not fit the layer's computation)
            return self._fails(exc, trace)
        finally:
            block.train(training)
        return []

    def run(self, model: nn.Module, group: Any, skip: tuple[str, ...] = ()) -> list[str]:
        """Compare the split block with the unsplit copy; problems (empty when they agree). ``skip``: parameter
        name prefixes (in the block) whose split layout is not the unsplit one (GPT-2's reordered c_attn)."""
        import torch.distributed as dist

        block = model.get_submodule(self.name)
        label = self.name or "the model"
        trace = _Trace(block)
        try:
            with trace, self._computing():
                split = _output_and_grads(block, self.inputs)
        except Exception as exc:  # a plan that does not fit the layer's computation fails here, not in training
            return self._fails(exc, trace)
        with self._computing():
            reference = _output_and_grads(self.reference, self.inputs)
        dtype = self.autocast[1] if self.autocast is not None else next(self.reference.parameters()).dtype
        errors = {"output": _relative(split[0], reference[0])}
        grads = {n: g for n, g in reference[1].items() if n in split[1] and not n.startswith(skip)}
        # A gradient that is zero in exact arithmetic (a key bias: softmax ignores a shift shared by all keys)
        # is rounding noise on both sides: each is measured against the block's mean gradient size at least.
        mean = math.sqrt(sum(g.double().square().sum().item() for g in grads.values())
                         / max(sum(g.numel() for g in grads.values()), 1))
        errors.update({f"gradient of {n}": _relative(split[1][n], g, floor=mean * math.sqrt(g.numel()))
                       for n, g in grads.items()})
        worst = torch.tensor([max(errors.values())], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)  # every rank of the group decides alike
        limit = tolerance(dtype)
        if worst.item() <= limit:
            logger.info("tensor_parallel: build checked on one sample: %s matches the unsplit block (relative error "
                        "%.1e, tolerance %.1e for %s)", label, worst.item(), limit, dtype)
            return []
        what, error = max(errors.items(), key=lambda item: item[1])
        try:  # collective: every rank is here (they agreed on the failure)
            with self._computing():
                first = _first_difference(block, self.reference, self.inputs, limit, self.name)
        except Exception as exc:  # noqa: BLE001 - the figures above are the finding; locating it is a help
            logger.info("tensor_parallel: the first differing module was not found (%s: %s)", type(exc).__name__, exc)
            first = ""
        if errors["output"] <= limit and not first:  # the numbers agree, a gradient does not
            owner = ".".join(p for p in (self.name, what.removeprefix("gradient of ").rpartition(".")[0]) if p)
            return [f"the split {label} computes the unsplit output on one sample but not its gradients: {what} "
                    f"differs by {error:.2e} (relative; tolerance {limit:.1e} for {dtype}); a parameter kept whole "
                    "that sees only this rank's part of the heads or width gets only that part's gradient: give "
                    f"{owner or 'its module'} the style 'replicated_with_grad_allreduce' (its gradient summed over "
                    "the tensor group) or split it with its layers"]
        return [f"the split {label} computes other numbers than the unsplit one on one sample: {what} differs by "
                f"{error:.2e} (relative; tolerance {limit:.1e} for {dtype}){first}; the plan changes the computation "
                "(a fused layer split column-wise that the model splits again?): give such layers the gather-output "
                "styles ('colwise_gather_output', 'rowwise_split_input') or leave them out of the plan"]


def _full(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _output_and_grads(block: nn.Module, inputs: tuple[tuple, dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The block's first floating output (whole) and each parameter's gradient (whole) for a fixed projection."""
    args, kwargs = inputs
    training = block.training
    block.eval()
    try:
        output = block(*args, **kwargs)
    finally:
        block.train(training)
    out = next(_full(t) for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point())
    generator = torch.Generator().manual_seed(0)  # the same projection on every rank, the user's stream untouched
    weights = torch.randn(out.shape, generator=generator, dtype=torch.float32).to(out.device, out.dtype)
    named = [(n, p) for n, p in block.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad((out * weights).sum(), [p for _, p in named], allow_unused=True)
    return out.detach(), {n: _full(g) for (n, _), g in zip(named, grads, strict=True) if g is not None}


def _relative(value: torch.Tensor, reference: torch.Tensor, floor: float = 0.0) -> float:
    """Norm-wise relative error, against the reference's norm or ``floor`` if larger."""
    if value.shape != reference.shape:
        return float("inf")
    scale = max(reference.double().norm().item(), floor, torch.finfo(torch.float32).tiny)
    return (value.double() - reference.double()).norm().item() / scale


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else "(no message)"


class _Trace:
    """Which of a block's modules is running (forward hooks on each), to name where a split block fails."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.stack: list[tuple[str, nn.Module]] = []
        self.handles: list[Any] = []

    def __enter__(self) -> _Trace:
        def enter(name: str) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any) -> None:
                self.stack.append((name, module))
            return hook

        def leave(module: nn.Module, args: Any, output: Any) -> None:  # returns nothing: the output is kept
            self.stack.pop()

        for name, module in self.block.named_modules():
            self.handles += [module.register_forward_pre_hook(enter(name)), module.register_forward_hook(leave)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()

    def where(self, exc: BaseException, prefix: str) -> str:
        """The innermost module running when ``exc`` was raised, and the model's own line that raised it."""
        import traceback

        if self.stack:
            name, module = self.stack[-1]
            full = ".".join(p for p in (prefix, name) if p) or "the model"
            place = f"{full} ({type(module).__name__}) forward"
        else:
            place = "the backward pass"
        import os

        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # atorch/
        ours = tuple(os.path.dirname(path) + os.sep for path in (torch.__file__, package + os.sep))
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(ours)]
        if frames:
            frame = frames[-1]
            place += f", at {frame.filename.rpartition('/')[2]}:{frame.lineno} `{(frame.line or '').strip()}`"
        return place


def _outputs(block: nn.Module, inputs: tuple[tuple, dict]) -> list[tuple[str, nn.Module, torch.Tensor]]:
    """Each sub-module's first floating output (whole), in call order, for one forward."""
    seen: list[tuple[str, nn.Module, torch.Tensor]] = []

    def record(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            leaf = next((t for t in pytree.tree_leaves(output)
                         if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
            if leaf is not None:
                seen.append((name, module, _full(leaf).detach()))
        return hook

    handles = [m.register_forward_hook(record(n)) for n, m in block.named_modules() if n]
    args, kwargs = inputs
    try:
        with torch.no_grad():
            block(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _first_difference(split: nn.Module, reference: nn.Module, inputs: tuple[tuple, dict], limit: float,
                      prefix: str) -> str:
    """', first at <module> (<type>): its output differs by x' for the first sub-module (in call order) whose
    output has the unsplit shape and differs beyond ``limit`` (column-split layers hand out shards: not compared)."""
    found = []
    for block in (split, reference):
        training = block.training
        block.eval()
        try:
            found.append(_outputs(block, inputs))
        finally:
            block.train(training)
    theirs = {name: out for name, _, out in found[1]}
    for name, module, out in found[0]:
        if name in theirs and theirs[name].shape == out.shape and (error := _relative(out, theirs[name])) > limit:
            full = ".".join(p for p in (prefix, name) if p)
            return f", first at {full} ({type(module).__name__}): its output differs by {error:.2e}"
    return ""
