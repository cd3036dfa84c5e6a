"""A repeated-block model as the layer list of DeepSpeed's pipeline engine (``deepspeed.pipe``).

DeepSpeed's ``PipelineModule`` runs a model as a plain sequence of layers, each taking the previous
layer's output (a tensor) and returning the next. The conversion finds the repeated blocks
(pipeline_split.find_blocks) and lists, in order:

- transformers decoder LMs of the GPT-2 form (``transformer.wte/wpe/drop/h/ln_f`` + ``lm_head``) or the
  Llama form (``model.embed_tokens/layers/norm/rotary_emb`` + ``lm_head``; Qwen2 and Mistral share it):
  the token embedding, GPT-2's position embedding and dropout, each block (wrapped to make its causal
  mask, positions and, for Llama, rotary cos/sin from the hidden states, as the model's forward would),
  the final norm and the output head. A head tied to the token embedding (GPT-2's ``wte``/``lm_head``) is
  one ``TiedLayerSpec`` used twice: DeepSpeed keeps the copies equal and sums their gradients.
- ``nn.Sequential`` models (nested Sequentials included): the modules before the blocks, the blocks and
  the modules after them, as the Sequential calls them.

The wrapped modules are the model's own (no copy): a stage keeps only the layers it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from atorch.opt_lib.pipeline_split import BlockList, balanced_split, find_blocks, is_transformers
from atorch.opt_lib.pipeline_split import module_cost as cost_of  # multiply-adds per token (an embedding lookup: none)

PRE, BLOCK, POST = "pre", "block", "post"
TIED_KEY = "embedding"


@dataclass
class PipeLayers:
    """The layer specs in order, with the cost and kind of each (for the balanced split)."""

    specs: list[Any]
    costs: list[int]
    kinds: list[str]
    family: str  # "gpt2", "llama" or "sequential"
    tied: bool = False
    loss_function: Any = None  # transformers: the model's own loss function
    vocab_size: int = 0
    names: list[str] = field(default_factory=list)  # what each layer is, for messages and tests


# ----- the layer modules --------------------------------------------------------------------------------
class TokenEmbedding(nn.Module):
    """input_ids -> token embeddings; used again as the output head when the head is tied to it."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids)


def tied_head(module: TokenEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """The tied embedding as the output head: logits = hidden @ Wᵀ (GPT-2's lm_head has no bias)."""
    return F.linear(hidden, module.embedding.weight)


class PositionEmbedding(nn.Module):
    """GPT-2: adds the learned position embedding of positions 0..s-1, then the embedding dropout."""

    def __init__(self, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wpe, self.drop = wpe, drop

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        return self.drop(hidden + self.wpe(positions).to(hidden.dtype))


class DecoderBlock(nn.Module):
    """One transformers decoder block on hidden states alone: the causal mask, positions and rotary cos/sin
    are made from the hidden states as the model's forward makes them (nothing but a tensor crosses a
    stage boundary, and a float tensor sent between stages would need a gradient)."""

    def __init__(self, block: nn.Module, config: Any, rotary: nn.Module | None) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary  # Llama's rotary embedding (buffers only); None for GPT-2
        object.__setattr__(self, "config", config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                  past_key_values=None, position_ids=positions)
        extra = {} if self.rotary is None else {"position_embeddings": self.rotary(hidden, position_ids=positions)}
        out = self.block(hidden, attention_mask=mask, position_ids=positions, **extra)
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    """An untied output head (Llama's lm_head)."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


class Layer(nn.Module):
    """A module of a Sequential model (or a final norm) taken as one pipeline layer."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


class SequentialBlock(Layer):
    """A repeated block of a Sequential model (its own class: DeepSpeed recomputes blocks by class name)."""


# DeepSpeed's activation checkpointing recomputes only these layers: a reentrant checkpoint of the token
# embedding (integer input_ids, nothing requiring a gradient) would return an output without a gradient.
CHECKPOINTABLE = ("DecoderBlock", "SequentialBlock")


# ----- the conversion -----------------------------------------------------------------------------------
def _family(model: nn.Module) -> str | None:
    base = getattr(model, "transformer", None) or getattr(model, "model", None)
    if base is None or getattr(model, "lm_head", None) is None:
        return None
    if all(hasattr(base, a) for a in ("wte", "wpe", "drop", "h", "ln_f")):
        return "gpt2"
    if all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "llama"
    return None


def conversion_problem(model: nn.Module) -> str | None:
    """Why ``model`` cannot be converted to DeepSpeed pipeline layers, or None."""
    blocks, why = find_blocks(model)
    if blocks is None:
        return why
    if is_transformers(model):
        if _family(model) is None:
            return (f"ds_3d_parallel converts transformers decoder LMs of the GPT-2 or Llama form (embeddings, "
                    f"blocks, final norm, lm_head); {type(model).__name__} is neither: use pipeline_parallel")
        return None
    if not _sequential_path(model, blocks):
        return ("ds_3d_parallel runs a model as a sequence of layers: it converts transformers GPT-2/Llama-form "
                f"decoders and nn.Sequential models, not {type(model).__name__} (its forward may do more than "
                "call its modules in order): use pipeline_parallel")
    return None


def _sequential_path(model: nn.Module, blocks: BlockList) -> bool:
    """Every module on the way from the root to the block list is an nn.Sequential with Sequential's own forward
    (which calls its modules in order; a subclass's forward may do anything else)."""
    path = blocks.container.split(".") if blocks.container else []
    module = model
    for depth in range(len(path) + 1):
        if not isinstance(module, nn.Sequential) or type(module).forward is not nn.Sequential.forward:
            return False
        if depth < len(path):
            module = module.get_submodule(path[depth])
    return True


def build_layers(model: nn.Module) -> PipeLayers:
    """The model as DeepSpeed pipeline layer specs (checked by ``conversion_problem`` first)."""
    from deepspeed.pipe import LayerSpec

    problem = conversion_problem(model)
    if problem is not None:
        raise ValueError(problem)
    if not is_transformers(model):
        return _sequential_layers(model, LayerSpec)
    return _decoder_layers(model)


def _sequential_layers(model: nn.Module, layer_spec: Any) -> PipeLayers:
    blocks, _ = find_blocks(model)
    assert blocks is not None
    holder = model.get_submodule(blocks.container) if blocks.container else model
    # pre: outermost first (find_blocks lists innermost first per level); post: innermost first.
    pre = _ordered_pre(blocks)
    layers = PipeLayers([], [], [], "sequential")
    for kind, modules in ((PRE, [(n, model.get_submodule(n)) for n in pre]),
                          (BLOCK, [(f"{blocks.container}.{n}".lstrip("."), holder.get_submodule(n))
                                   for n in blocks.names]),
                          (POST, [(n, model.get_submodule(n)) for n in blocks.post])):
        for name, module in modules:
            _add(layers, layer_spec(SequentialBlock if kind == BLOCK else Layer, module), cost_of(module), kind, name)
    return layers


def _ordered_pre(blocks: BlockList) -> list[str]:
    """find_blocks lists the modules before the blocks level by level from the innermost; call order is
    outermost level first, each level in registration order."""
    depth = {name: name.count(".") for name in blocks.pre}
    return sorted(blocks.pre, key=lambda n: (depth[n], blocks.pre.index(n)))


def _add(layers: PipeLayers, spec: Any, cost: int, kind: str, name: str) -> None:
    layers.specs.append(spec)
    layers.costs.append(cost)
    layers.kinds.append(kind)
    layers.names.append(name)


def _decoder_layers(model: nn.Module) -> PipeLayers:
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    family = _family(model)
    assert family is not None
    base = model.transformer if family == "gpt2" else model.model
    embed = base.wte if family == "gpt2" else base.embed_tokens
    head = model.lm_head
    tied = head.weight is embed.weight
    layers = PipeLayers([], [], [], family, tied=tied, loss_function=model.loss_function,
                        vocab_size=model.config.vocab_size)
    attr = f"{TIED_KEY}.weight"
    if tied:
        _add(layers, TiedLayerSpec(TIED_KEY, TokenEmbedding, embed, tied_weight_attr=[attr]), 0, PRE, "embedding")
    else:
        _add(layers, LayerSpec(TokenEmbedding, embed), 0, PRE, "embedding")
    if family == "gpt2":
        _add(layers, LayerSpec(PositionEmbedding, base.wpe, base.drop), 0, PRE, "position embedding")
    blocks = base.h if family == "gpt2" else base.layers
    rotary = None if family == "gpt2" else base.rotary_emb
    for index, block in enumerate(blocks):
        _add(layers, LayerSpec(DecoderBlock, block, model.config, rotary), cost_of(block), BLOCK, f"block {index}")
    norm = base.ln_f if family == "gpt2" else base.norm
    _add(layers, LayerSpec(Layer, norm), cost_of(norm), POST, "final norm")
    if tied:
        spec = TiedLayerSpec(TIED_KEY, TokenEmbedding, embed, forward_fn=tied_head, tied_weight_attr=[attr])
        _add(layers, spec, head.weight.numel(), POST, "head (tied)")
    else:
        _add(layers, LayerSpec(Head, head), cost_of(head), POST, "head")
    return layers


def stage_bounds(layers: PipeLayers, stages: int) -> list[int]:
    """Layer index bounds of each stage (DeepSpeed's ``parts``), balanced by cost: the layers before the
    blocks go to the first stage, those after them to the last, the blocks are split minimising the most
    expensive stage (pipeline_split.balanced_split)."""
    pre = layers.kinds.count(PRE)
    block_costs = [c for c, k in zip(layers.costs, layers.kinds, strict=True) if k == BLOCK]
    first = sum(c for c, k in zip(layers.costs, layers.kinds, strict=True) if k == PRE)
    last = sum(c for c, k in zip(layers.costs, layers.kinds, strict=True) if k == POST)
    counts = balanced_split(block_costs, first, last, stages)
    bounds = [0]
    for index, count in enumerate(counts):
        bounds.append(bounds[-1] + count + (pre if index == 0 else 0))
    bounds[-1] = len(layers.specs)
    return bounds
