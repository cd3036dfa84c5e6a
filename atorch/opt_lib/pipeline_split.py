"""Splitting a model into pipeline stages at its repeated-block boundaries, with no model rewrite.

Each stage is a deep copy of the whole model from which the blocks it does not own are deleted (the
block list keeps its original child names, so parameter names stay those of the user's model), and the
modules with parameters before the blocks (embeddings) or after them (final norm, head) that the stage
does not own become stand-ins that keep their signature (StandIn). Every stage runs the model's own
forward on the micro-batch: a later stage's first block takes the previous stage's hidden states in
place of what was computed before it (HiddenInjector); an earlier stage ends where the model calls the
next stage's first block (StageProbe). So whatever the model does around and between its blocks (masks,
positions, embedding scales) stays the model's own code. An ``nn.Sequential`` without such a block list
is split at its children; an encoder-decoder model (T5, BART) into its encoder and decoder. Before
training, the stages are run one after the other on one sample and compared with the whole model
(check_split): a model whose forward a split cannot carry is refused with the reason."""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from atorch.class_ref import matches
from atorch.errors import SetupError
from atorch.model_context import call_model
from atorch.opt_lib.blocks import block_classes
from atorch.opt_lib.pipeline_router import (
    RouterCarry,
    balance_function,
    router_loss_on,
    router_loss_problem,
    statistics_match,
)


@dataclass(frozen=True)
class BlockList:
    """Where the repeated blocks are: the container's name, its child names in order, and what surrounds it."""

    container: str
    names: tuple[str, ...]
    pre: tuple[str, ...]  # modules registered before the blocks, on the path to the root
    post: tuple[str, ...]  # modules registered after them
    # "blocks"; "children" (an nn.Sequential split at its children); "encoder-decoder" (names: the encoder
    # and the decoder, one stage each)
    kind: str = "blocks"


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
                      "splits models whose blocks are held in one nn.ModuleList or nn.Sequential (an "
                      "encoder-decoder model such as T5 or BART is not split yet: use data parallel, fsdp or "
                      "tensor_parallel)")
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


def find_units(model: nn.Module) -> tuple[BlockList | None, str | None]:
    """Where pipeline_parallel splits the model: at its repeated blocks; or, for a plain nn.Sequential whose
    blocks are not alone in one list (a CNN's layers), at its own children, which it calls one after the
    other."""
    blocks, why = find_blocks(model)
    if blocks is None and type(model).forward is nn.Sequential.forward and len(model._modules) >= 2:
        return BlockList("", tuple(model._modules), (), (), kind="children"), None
    if blocks is None and getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        names = {id(m): n for n, m in model.named_modules()}
        get_encoder, get_decoder = getattr(model, "get_encoder", None), getattr(model, "get_decoder", None)
        if callable(get_encoder) and callable(get_decoder):
            encoder, decoder = names.get(id(get_encoder())), names.get(id(get_decoder()))
            if encoder and decoder:
                return BlockList("", (encoder, decoder), (), (), kind="encoder-decoder"), None
    return blocks, why


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
    if blocks.kind == "encoder-decoder":
        assert stages == 2, "an encoder-decoder model is split into its encoder and its decoder"
        return [blocks.names[:1], blocks.names[1:]]
    holder = model.get_submodule(blocks.container) if blocks.container else model
    # A child without parameters (an activation) costs one, so that no stage is left with nothing to do.
    costs = [max(module_cost(holder.get_submodule(n)), 0 if blocks.container else 1) for n in blocks.names]
    first = sum(module_cost(model.get_submodule(n)) for n in blocks.pre)
    last = sum(module_cost(model.get_submodule(n)) for n in blocks.post)
    counts = balanced_split(costs, first, last, stages)
    owned, start = [], 0
    for count in counts:
        owned.append(blocks.names[start:start + count])
        start += count
    return owned


class _Shadowed(nn.Module):
    """A module holding a copy of another on the meta device, outside its module tree (no parameters, no
    state): attributes it does not have are read from the copy, as the model's forward may read them."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "shadow", copy.deepcopy(module).to("meta"))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            shadow = self.__dict__.get("shadow")
            if shadow is None:
                raise
            return getattr(shadow, name)


class StandIn(_Shadowed):
    """Stands in for a module with parameters that a stage does not run for real. The model calls it
    exactly as it calls the original (any signature, keywords included): its forward runs on a copy on
    the meta device, kept outside the module tree (no parameters), and it returns zeros of the
    original's output shapes on the stage's device. Before a later stage's first block these zeros only
    feed code whose result the block's input replaces (see HiddenInjector); after a non-last stage's
    last block the stage ends before it is reached (StageProbe). What the model's forward reads of the
    module (ViT: the patch projection's dtype) comes from the copy."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.get_default_dtype())
        self.register_buffer("like", torch.zeros(0, dtype=dtype), persistent=False)  # follows .to(device, dtype)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        def to_meta(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to("meta")

        like = self.like
        if any(p.is_floating_point() and p.dtype != like.dtype for p in self.shadow.parameters()):
            self.shadow.to(like.dtype)  # the stage was cast ('half'): its inputs now come in that dtype
        with torch.no_grad():
            args, kwargs = tree_map_only(torch.Tensor, to_meta, (args, kwargs))
            out = self.shadow(*args, **kwargs)
        return tree_map_only(torch.Tensor, lambda t: torch.zeros(
            t.shape, dtype=like.dtype if t.is_floating_point() else t.dtype, device=like.device), out)


class HiddenInjector:
    """Gives a later stage's first block the hidden states received from the previous stage in place of
    what the stage computed before it (from stand-ins' zeros). The model's own forward runs around the
    blocks unchanged (masks, positions, rotary embeddings from the batch; Gemma's embedding scale and
    BERT's embedding norm apply to the zeros and are replaced). Keyed by the tensor it replaces, so that
    activation recompute (checkpoint), which calls the block again with the same inputs during backward,
    gets the same hidden states."""

    def __init__(self, keyword: str = "hidden_states") -> None:
        self.keyword = keyword  # the argument replaced (an encoder-decoder's decoder: encoder_hidden_states)
        self.pending: torch.Tensor | None = None  # set by StageModule for one forward
        # Where no hidden states were given, made from the tensor they would replace (tensor_parallel's build
        # check runs a later stage alone on one sample: tp_check.py); None: the stage computes on as it is.
        self.stand_in: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.given: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        positional = bool(args) and self.keyword == "hidden_states"
        key = args[0] if positional else kwargs.get(self.keyword)
        if not isinstance(key, torch.Tensor):
            if self.pending is None:
                return None
            raise SetupError(f"pipeline_parallel: the model calls its block {type(module).__name__} without the "
                             f"hidden states as its first argument or as '{self.keyword}', so a later stage cannot "
                             "feed it the previous stage's output; use a pipeline size of 1 for this model")
        if self.pending is None and self.stand_in is not None and key not in self.given:
            self.pending = self.stand_in(key)
        if self.pending is not None:
            if tuple(self.pending.shape) != tuple(key.shape):
                raise SetupError(f"pipeline_parallel: a stage received hidden states of shape "
                                 f"{tuple(self.pending.shape)}, but the model feeds its block "
                                 f"{type(module).__name__} a tensor of shape {tuple(key.shape)}")
            self.given[key], self.pending = self.pending, None
        hidden = self.given.get(key)
        if hidden is None:
            return None
        return ((hidden, *args[1:]), kwargs) if positional else (args, {**kwargs, self.keyword: hidden})


class StageEnd(Exception):  # noqa: N818 - a signal, not an error
    """Ends a stage's forward with the hidden states it passes on (raised by StageProbe)."""

    def __init__(self, hidden: Any) -> None:
        super().__init__("end of pipeline stage")
        self.hidden = hidden


class StageProbe(_Shadowed):
    """Stands in a non-last stage's block list for the next stage's first block: the model calls it with the
    hidden states that block would get (after whatever the forward does between blocks), and it ends the
    stage's forward with them (StageEnd; StageModule returns them). The rest of the forward (final norm,
    pooling, head) belongs to the last stage. What the model reads of the block before calling it (a layer's
    attention type) comes from a copy on the meta device, outside the module tree (no parameters)."""

    def __init__(self, block: nn.Module, keyword: str = "hidden_states") -> None:
        super().__init__(block)
        self.keyword = keyword  # what is passed on (an encoder-decoder's decoder: encoder_hidden_states)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args and self.keyword == "hidden_states" else kwargs.get(self.keyword)
        if not isinstance(hidden, torch.Tensor):
            raise SetupError(f"pipeline_parallel: the model calls its block {type(self.shadow).__name__} without "
                             f"the hidden states as its first argument or as '{self.keyword}', so a stage cannot "
                             "pass them on; use a pipeline size of 1 for this model")
        raise StageEnd(hidden)


def is_transformers(model: nn.Module) -> bool:
    return callable(getattr(model, "get_input_embeddings", None)) and hasattr(model, "config")


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def build_stage(model: nn.Module, blocks: BlockList, owned: tuple[str, ...], first: bool, last: bool) -> nn.Module:
    """A deep copy of ``model`` holding only the blocks ``owned`` and the modules around them this stage runs
    (the others, if they hold parameters, become stand-ins: see StandIn)."""
    stage = copy.deepcopy(model)
    if blocks.kind == "encoder-decoder":
        return _encoder_decoder_stage(stage, blocks, first)
    if not blocks.container:  # an nn.Sequential split at its children: a later stage takes the hidden states
        for name in blocks.names:
            if name not in owned:
                del stage._modules[name]
        stage.atorch_split_children = True  # read by StageModule
        return stage
    holder = stage.get_submodule(blocks.container)
    kept = [(n, holder._modules[n]) for n in blocks.names if n in owned]
    replacement = type(holder)() if isinstance(holder, nn.ModuleList) else nn.Sequential()
    for name, block in kept:
        replacement.add_module(name, block)  # original names: iteration and slicing work, names stay the user's
    if not last:  # the next stage's first block: where this stage ends
        after = blocks.names[blocks.names.index(kept[-1][0]) + 1]
        replacement.add_module(after, StageProbe(holder._modules[after]))
    _replace(stage, blocks.container, replacement)
    for name in (() if first else blocks.pre) + (() if last else blocks.post):
        module = stage.get_submodule(name)
        if _has_params(module):
            _replace(stage, name, StandIn(module))
    if not first:
        injector = HiddenInjector()
        kept[0][1].register_forward_pre_hook(injector.pre_hook, with_kwargs=True)
        stage.atorch_injector = injector  # read by StageModule
    return stage


def _encoder_decoder_stage(stage: nn.Module, blocks: BlockList, first: bool) -> nn.Module:
    """The encoder's stage ends where the model calls the decoder, with the encoder's output; the decoder's
    stage runs the model with a stand-in encoder, its decoder taking the received encoder output."""
    encoder, decoder = blocks.names
    if first:
        _replace(stage, decoder, StageProbe(stage.get_submodule(decoder), keyword="encoder_hidden_states"))
        for name, module in list(stage.named_children()):  # the output head (lm_head): not run here
            if name != encoder.split(".")[0] and name != decoder.split(".")[0] and _has_params(module) \
                    and not any(p is q for p in module.parameters() for q in stage.get_submodule(encoder).parameters()):
                _replace(stage, name, StandIn(module))
        return stage
    _replace(stage, encoder, StandIn(stage.get_submodule(encoder)))
    injector = HiddenInjector(keyword="encoder_hidden_states")
    stage.get_submodule(decoder).register_forward_pre_hook(injector.pre_hook, with_kwargs=True)
    stage.atorch_injector = injector  # read by StageModule
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
# The keyword under which the schedule hands a batch that is not a dict to every stage.
BATCH_KEY = "atorch_batch"


def decoder_inputs_from_labels(model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
    """An encoder-decoder's decoder inputs made from the labels, as its forward makes them when given labels alone
    (T5, BART, Whisper: the labels shifted right after the decoder's start token, -100 read as padding): the stages
    do not take the labels, so a batch of labels alone would reach the decoder without any input. {} where the
    batch has its own decoder inputs, or the model is not an encoder-decoder."""
    config = getattr(model, "config", None)
    labels = batch.get("labels")
    if (not getattr(config, "is_encoder_decoder", False) or not isinstance(labels, torch.Tensor)
            or batch.get("decoder_input_ids") is not None or batch.get("decoder_inputs_embeds") is not None):
        return {}
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if callable(prepare):
        return {"decoder_input_ids": prepare(labels=labels)}
    start, pad = getattr(config, "decoder_start_token_id", None), getattr(config, "pad_token_id", None)
    if start is None or pad is None:
        return {}
    shifted = labels.new_full(labels.shape, start)
    shifted[:, 1:] = labels[:, :-1]
    return {"decoder_input_ids": shifted.masked_fill(shifted == -100, pad)}


def stage_kwargs(data: Any, input_format: str | None) -> dict[str, Any]:
    """The batch as the keyword inputs of every stage's forward (the schedule splits them into
    micro-batches and gives them to each stage, not only to the first)."""
    return dict(data) if input_format == "unpack_dict" else {BATCH_KEY: data}


class StageModule(nn.Module):
    """One pipeline stage. Every stage takes the micro-batch (as keywords, see stage_kwargs) and calls the
    model the way the user's ``model_input_format`` says; a later stage also takes the previous stage's
    hidden states, which its first block receives in place of what the stage computed before it (see
    HiddenInjector). An nn.Sequential split at its children takes the hidden states as its input instead.
    Every stage returns one tensor, or with a router loss to carry a pair (see ``_routed``)."""

    def __init__(self, module: nn.Module, index: int, first: bool, last: bool, no_split: Any,
                 input_format: str | None = None) -> None:
        super().__init__()
        self.module = module
        self.index, self.first, self.last = index, first, last
        self.input_format = input_format
        self.transformers = is_transformers(module)
        self.children_split = bool(getattr(module, "atorch_split_children", False))  # a Sequential's children
        self.injector: HiddenInjector | None = getattr(module, "atorch_injector", None)
        self.router: RouterCarry | None = getattr(module, "atorch_router", None)  # set by split_into_stages
        self.autocast_dtype: torch.dtype | None = None
        # Where the stages exchange another form of the hidden states than the blocks pass on (tensor_parallel's
        # sequence_parallel: the local sequence shard of a DTensor): ``to_send`` makes what a non-last stage sends,
        # ``received`` what a later stage's first block takes. None: the hidden states as they are.
        self.to_send: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.received: Callable[[torch.Tensor], torch.Tensor] | None = None
        if no_split:
            self._no_split_modules = list(no_split)  # block detection (checkpoint, fsdp) as on the whole model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.autocast_dtype is None:
            return self._routed(args, kwargs)
        with torch.autocast(next(self.module.parameters()).device.type, dtype=self.autocast_dtype):
            return self._routed(args, kwargs)

    def _routed(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The stage's output; with a router loss to carry (see pipeline_router), a pair: the hidden states and the
        routing so far, or on the last stage the logits and the load-balancing loss."""
        router = self.router
        if router is None:
            return self._finished(self._run(args, kwargs))
        received = None
        if not self.first and len(args) > 1:  # (hidden states, routing so far); a check runs a later stage alone
            received, args = args[1], (args[0], *args[2:])
        batch = kwargs.get(BATCH_KEY, kwargs)
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        router.recorded = []
        try:
            out = self._finished(self._run(args, kwargs))
            return out, (router.loss if self.last else router.passed_on)(received, mask, out)
        finally:
            router.recorded = None

    @staticmethod
    def _finished(out: torch.Tensor) -> torch.Tensor:
        # The zero-bubble schedules detach a stage's output in place, which a view (a slice of the hidden
        # states) does not allow.
        return out.clone() if out._is_view() else out

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        try:
            return self._call(args, kwargs)
        except StageEnd as end:  # a non-last stage reached the next stage's first block (StageProbe)
            return end.hidden if self.to_send is None else self.to_send(end.hidden)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        if args and self.received is not None and not self.first:
            args = (self.received(args[0]), *args[1:])
        if self.children_split and not self.first:
            return hidden_of(self.module(args[0]))
        if BATCH_KEY in kwargs:
            batch, input_format = kwargs[BATCH_KEY], self.input_format
        else:
            batch, input_format = kwargs, "unpack_dict"
        if self.transformers and isinstance(batch, dict):
            batch = {**{k: v for k, v in batch.items() if k not in TARGET_KEYS},
                     **decoder_inputs_from_labels(self.module, batch)}
        if self.first or self.injector is None:
            return hidden_of(call_model(self.module, batch, input_format))
        self.injector.pending = args[0]
        try:
            return hidden_of(call_model(self.module, batch, input_format))
        finally:
            self.injector.pending = None


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) and no gradients; each module's own mode restored after (a frozen norm stays so)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, mode in modes:
            module.training = mode


def in_call_order(model: nn.Module, blocks: BlockList, sample: Any, input_format: str | None) -> BlockList:
    """The modules around the blocks sorted by when the forward calls them on a sample: before the first
    block (the stages before need them) or after it. Registration order can differ: OPT registers its
    final norm before its layers."""
    around = blocks.pre + blocks.post
    if not blocks.container or not around:
        return blocks
    calls: list[str | None] = []
    hooks = [model.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: calls.append(n)) for n in around]
    first = model.get_submodule(_join(blocks.container, blocks.names[0]))
    hooks.append(first.register_forward_pre_hook(lambda m, a: calls.append(None)))
    try:
        with _evaluating(model):
            StageModule(model, 0, True, True, None, input_format)(**stage_kwargs(sample, input_format))
    finally:
        for hook in hooks:
            hook.remove()
    if None not in calls:
        return blocks
    before = set(calls[:calls.index(None)])
    after = set(calls[calls.index(None):])
    pre = tuple(n for n in around if n in before or (n in blocks.pre and n not in after))
    return BlockList(blocks.container, blocks.names, pre, tuple(n for n in around if n not in pre))


def _tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of the stages against the whole model: the same operations in the same order,
    but kernels may pick another reduction order for another shape (a few ulps per layer)."""
    return 256 * torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def check_split(model: nn.Module, blocks: BlockList, owned: list[tuple[str, ...]], sample: Any,
                input_format: str | None) -> str | None:
    """Run the stages one after the other on one sample, as the schedule does, and compare with the whole
    model (eval mode: no dropout). The reason the split does not compute the model, or None. Every rank
    reaches the same verdict from the same weights, so no rank is left waiting for a failed stage."""
    kwargs = stage_kwargs(sample, input_format)
    try:
        with _evaluating(model):
            whole = StageModule(model, 0, True, True, None, input_format)(**kwargs)
            hidden: torch.Tensor | None = None
            for i, names in enumerate(owned):
                stage = build_stage(model, blocks, names, i == 0, i == len(owned) - 1)
                hidden = StageModule(stage, i, i == 0, i == len(owned) - 1, None, input_format)(
                    *(() if hidden is None else (hidden,)), **kwargs)
                del stage
    except Exception as exc:  # any failure of a stage is a reason to refuse, not a crash on one rank
        return f"running the stages one after the other on one sample failed: {type(exc).__name__}: {exc}"
    assert hidden is not None
    if hidden.shape != whole.shape:
        return f"the last stage returns shape {tuple(hidden.shape)}, the whole model {tuple(whole.shape)}"
    gap = (hidden.double() - whole.double()).abs().max().item()
    scale = max(whole.double().abs().max().item(), 1.0)
    tol = _tolerance(whole.dtype) * scale
    if not gap <= tol:
        return (f"the stages do not compute the model: on one sample their output differs from the whole "
                f"model's by {gap:.3g} (tolerance {tol:.3g}), so the model's forward does more between its "
                "blocks than a split at the blocks can carry")
    return None


def split_setup_problems(ctx: Any, method: str, carries_router_loss: bool = False) -> list[str]:
    """What a method that splits the model into pipeline stages needs of the user's setup. ``carries_router_loss``:
    the method's stages pass a mixture of experts' routing on to the last stage (see pipeline_router)."""
    from atorch.meta_init import is_meta

    problems = []
    if is_meta(ctx.model):
        problems.append(f"a model on the meta device is not supported with {method} yet; build it on CPU")
    if ctx.setup.loss_func is None:
        problems.append(f"{method} runs loss_func on the last stage: give loss_func(data, output)")
    if ctx.setup.optim_param_func is not None:
        problems.append(f"optim_param_func is not supported with {method} yet; leave it out")
    if router_loss_on(ctx.model):
        why = router_loss_problem(ctx.model)
        if not carries_router_loss:
            why = f"{method} computes the loss from the last stage's logits alone"
        elif why is None and ctx.layout.size("context") > 1 and not statistics_match(
                balance_function(ctx.model), ctx.model.num_experts, ctx.model.num_experts_per_tok):
            why = (f"beside context ranks the stages sum their routing statistics over the sequence's shares, and "
                   f"{type(ctx.model).__name__}'s load_balancing_loss_func is not that statistic")
        if why is not None:
            problems.append(f"the router's load-balancing loss (output_router_logits=True), a statistic over every "
                            f"layer's routing that the stages each hold a part of, cannot be kept: {why}; set "
                            "model.config.output_router_logits = False (the routers then train through the "
                            "language-model loss alone), or split the model over data, expert or tensor ranks "
                            "instead")
    return problems
