"""Splitting a model into pipeline stages at its repeated-block boundaries, with no model rewrite.

Each stage is a deep copy of the whole model from which the blocks it does not own are deleted (the
block list keeps its original child names, so parameter names stay those of the user's model), and
the modules before the blocks (embeddings, dropout) or after them (final norm, head) are replaced
when the stage does not own them: a later stage feeds its input in place of the embeddings, an
earlier stage returns the hidden states in place of the head's output.

Stages are balanced by cost: a block or a head costs its parameter count (the multiply-adds per
token of its matrix products), an embedding lookup costs nothing; the split minimises the most
expensive stage (so a large output head leaves fewer blocks to the last stage).
"""

from __future__ import annotations

import copy
import inspect
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from atorch.class_ref import matches
from atorch.opt_lib.blocks import block_classes


@dataclass(frozen=True)
class BlockList:
    """Where the repeated blocks are: the container's name, its child names in order, and what surrounds it."""

    container: str
    names: tuple[str, ...]
    pre: tuple[str, ...]  # modules registered before the blocks, on the path to the root
    post: tuple[str, ...]  # modules registered after them


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def find_blocks(model: nn.Module) -> tuple[BlockList | None, str | None]:
    """The model's block list, or why the model cannot be split."""
    classes = block_classes(model)
    blocks = [name for name, m in model.named_modules() if classes and matches(m, classes) and name]
    if len(blocks) < 2:
        return None, ("no repeated blocks found; pipeline_parallel splits models whose repeated blocks "
                      "(transformer layers) are held in one nn.ModuleList or nn.Sequential")
    # A declared block class met once elsewhere (transformers ViT declares its embeddings unsplittable too)
    # is not a repeated block: keep the one list that holds two or more of them.
    counts = Counter(name.rpartition(".")[0] for name in blocks)
    if sum(c >= 2 for c in counts.values()) == 1:
        container = next(parent for parent, c in counts.items() if c >= 2)
        blocks = [name for name in blocks if name.rpartition(".")[0] == container]
    parents = {name.rpartition(".")[0] for name in blocks}
    if len(parents) != 1:
        return None, (f"the repeated blocks sit in {len(parents)} lists ({sorted(parents)}); pipeline_parallel "
                      "splits models whose blocks are held in one nn.ModuleList or nn.Sequential")
    container = parents.pop()
    holder = model.get_submodule(container) if container else model
    names = tuple(name.rpartition(".")[2] for name in blocks)
    if not isinstance(holder, (nn.ModuleList, nn.Sequential)) or list(holder._modules) != list(names):
        return None, (f"'{container}' holds more than the repeated blocks; pipeline_parallel splits models whose "
                      "blocks are held alone in one nn.ModuleList or nn.Sequential")
    pre: list[str] = []
    post: list[str] = []
    path = container.split(".") if container else []
    for depth in reversed(range(len(path))):  # innermost first
        parent = ".".join(path[:depth])
        on_path = path[depth]
        children = list((model.get_submodule(parent) if parent else model)._modules)
        index = children.index(on_path)
        pre += [_join(parent, c) for c in children[:index]]
        post += [_join(parent, c) for c in children[index + 1:]]
    return BlockList(container, names, tuple(pre), tuple(post)), None


def module_cost(module: nn.Module) -> int:
    """Multiply-adds per token: the parameters of its matrix products (an embedding lookup costs nothing)."""
    return sum(p.numel() for m in module.modules() if not isinstance(m, nn.Embedding)
               for p in m.parameters(recurse=False))


def balanced_split(costs: list[int], first_extra: int, last_extra: int, stages: int) -> list[int]:
    """Block counts per stage (each at least one, in order) minimising the most expensive stage;
    the first stage also pays ``first_extra``, the last ``last_extra``."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the least max cost of splitting the first i blocks into s stages; choice for the path back.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                cost = prefix[i] - prefix[j] + (first_extra if s == 1 else 0) + (last_extra if s == stages else 0)
                value = max(best[s - 1][j], cost)
                if value < best[s][i]:
                    best[s][i], choice[s][i] = value, j
    counts, i = [], n
    for s in range(stages, 0, -1):
        j = choice[s][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def plan_stages(model: nn.Module, blocks: BlockList, stages: int) -> list[tuple[str, ...]]:
    """The block names each stage owns, balanced by cost."""
    holder = model.get_submodule(blocks.container) if blocks.container else model
    costs = [module_cost(holder.get_submodule(n)) for n in blocks.names]
    first = sum(module_cost(model.get_submodule(n)) for n in blocks.pre)
    last = sum(module_cost(model.get_submodule(n)) for n in blocks.post)
    counts = balanced_split(costs, first, last, stages)
    owned, start = [], 0
    for count in counts:
        owned.append(blocks.names[start:start + count])
        start += count
    return owned


class ZeroEmbedding(nn.Module):
    """Stands in for an embedding a later stage does not own: adds nothing (GPT-2 adds the position
    embedding to the input embedding, which a later stage takes as its input)."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dim = dim
        self.register_buffer("like", torch.zeros(0, dtype=dtype), persistent=False)  # follows .to(dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.like.new_zeros((*ids.shape, self.dim))


class PassThrough(nn.Module):
    """Stands in for a module before the blocks that a later stage does not own, in a model whose forward
    takes no ``inputs_embeds`` (transformers ViT): the stage gets the hidden states as the model's input,
    and this returns them. What the model's forward reads of the module (ViT: the patch projection's
    dtype) comes from a copy of it on the meta device, kept outside the module tree (no parameters)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "shadow", copy.deepcopy(module).to("meta"))

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            shadow = self.__dict__.get("shadow")
            if shadow is None:
                raise
            return getattr(shadow, name)


class StageEnd(Exception):  # noqa: N818 - a signal, not an error
    """Ends a stage's forward with the hidden states it passes on (raised by StageExit)."""

    def __init__(self, hidden: Any) -> None:
        super().__init__("end of pipeline stage")
        self.hidden = hidden


class StageExit:
    """Ends a non-last stage's forward right after its last block: the rest of the model's forward (final
    norm, pooling, head) belongs to the last stage, and code between them (ViT's head takes only the
    [CLS] position) must not run on the hidden states passed on. The last block's output is kept; the
    next module of those after the blocks to be called raises StageEnd with it. Armed only while
    StageModule runs the stage's forward (not in a checkpoint's recompute during backward, nor when the
    stage module is called directly); the block's hook only records."""

    def __init__(self) -> None:
        self.armed = False
        self.output: Any = None

    def arm(self, armed: bool) -> None:
        self.armed, self.output = armed, None

    def block_done(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.armed:
            self.output = output

    def post_called(self, module: nn.Module, args: Any) -> None:
        if self.output is not None:
            hidden, self.output = self.output, None
            raise StageEnd(hidden)


def takes_inputs_embeds(model: nn.Module) -> bool:
    return "inputs_embeds" in inspect.signature(model.forward).parameters


def is_transformers(model: nn.Module) -> bool:
    return callable(getattr(model, "get_input_embeddings", None)) and hasattr(model, "config")


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def build_stage(model: nn.Module, blocks: BlockList, owned: tuple[str, ...], first: bool, last: bool) -> nn.Module:
    """A deep copy of ``model`` holding only the blocks ``owned`` and the modules around them this stage runs."""
    stage = copy.deepcopy(model)
    holder = stage.get_submodule(blocks.container) if blocks.container else stage
    kept = [(n, holder._modules[n]) for n in blocks.names if n in owned]
    replacement = type(holder)() if isinstance(holder, nn.ModuleList) else nn.Sequential()
    for name, block in kept:
        replacement.add_module(name, block)  # original names: iteration and slicing work, names stay the user's
    _replace(stage, blocks.container, replacement)
    if not first:
        # A transformers model without inputs_embeds gets the hidden states as its input (ViT).
        passed = is_transformers(model) and not takes_inputs_embeds(model)
        for name in blocks.pre:
            module = stage.get_submodule(name)
            if passed and (_has_params(module) or isinstance(module, nn.Dropout)):
                _replace(stage, name, PassThrough(module))
            elif isinstance(module, nn.Embedding):
                _replace(stage, name, ZeroEmbedding(module.embedding_dim, module.weight.dtype))
            elif _has_params(module) or isinstance(module, nn.Dropout):
                _replace(stage, name, nn.Identity())
    if not last:
        for name in blocks.post:
            module = stage.get_submodule(name)
            if _has_params(module) or isinstance(module, nn.Dropout):
                _replace(stage, name, nn.Identity())
        if kept:
            stage_exit = StageExit()
            kept[-1][1].register_forward_hook(stage_exit.block_done)
            for name in blocks.post:
                stage.get_submodule(name).register_forward_pre_hook(stage_exit.post_called)
            stage.atorch_stage_exit = stage_exit  # read by StageModule
    return stage


def hidden_of(output: Any) -> torch.Tensor:
    """The tensor a stage passes on: the model's output, its logits, or its last hidden state."""
    if isinstance(output, torch.Tensor):
        return output
    for key in ("logits", "last_hidden_state"):
        value = getattr(output, key, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"a pipeline stage must return a tensor (or an output with .logits), got {type(output).__name__}")


# Keys of a transformers batch the stages do not take: the last stage's loss reads the labels.
TARGET_KEYS = ("labels",)


class StageModule(nn.Module):
    """One pipeline stage: the first takes the batch as the model does; a later one takes the previous
    stage's hidden states (transformers models: as ``inputs_embeds``, with the batch's other keyword
    inputs such as attention_mask); every stage returns one tensor."""

    def __init__(self, module: nn.Module, index: int, first: bool, last: bool, no_split: Any) -> None:
        super().__init__()
        self.module = module
        self.index, self.first, self.last = index, first, last
        self.transformers = is_transformers(module)
        self.embeds_kw = self.transformers and takes_inputs_embeds(module)
        self.stage_exit: StageExit | None = getattr(module, "atorch_stage_exit", None)
        self.autocast_dtype: torch.dtype | None = None
        if no_split:
            self._no_split_modules = list(no_split)  # block detection (checkpoint, fsdp) as on the whole model

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.autocast_dtype is None:
            out = self._run(args, kwargs)
        else:
            with torch.autocast(next(self.module.parameters()).device.type, dtype=self.autocast_dtype):
                out = self._run(args, kwargs)
        # The zero-bubble schedules detach a stage's output in place, which a view (a head replaced by
        # Identity returns a slice of the hidden states) does not allow.
        return out.clone() if out._is_view() else out

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        if self.stage_exit is None:
            return self._call(args, kwargs)
        self.stage_exit.arm(True)
        try:
            return self._call(args, kwargs)
        except StageEnd as end:
            return hidden_of(end.hidden)
        finally:
            self.stage_exit.arm(False)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        if self.transformers:
            kwargs = {k: v for k, v in kwargs.items() if k not in TARGET_KEYS}
            if not self.first:
                main = getattr(self.module, "main_input_name", "input_ids")  # ViT: pixel_values
                kwargs = {k: v for k, v in kwargs.items() if k not in ("input_ids", "inputs_embeds", main)}
                if not self.embeds_kw:  # the hidden states in place of the model's input (see PassThrough)
                    return hidden_of(self.module(args[0], **kwargs))
                return hidden_of(self.module(inputs_embeds=args[0], **kwargs))
            return hidden_of(self.module(*args, **kwargs))
        return hidden_of(self.module(*args, **kwargs) if self.first else self.module(args[0]))


def split_setup_problems(ctx: Any, method: str) -> list[str]:
    """What a method that splits the model into pipeline stages needs of the user's setup."""
    from atorch.meta_init import is_meta

    problems = []
    if is_meta(ctx.model):
        problems.append(f"a model on the meta device is not supported with {method} yet; build it on CPU")
    if ctx.setup.loss_func is None:
        problems.append(f"{method} runs loss_func on the last stage: give loss_func(data, output)")
    if ctx.setup.optim_param_func is not None:
        problems.append(f"optim_param_func is not supported with {method} yet; leave it out")
    return problems
