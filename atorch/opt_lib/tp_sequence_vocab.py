"""tensor_parallel's ``loss_parallel`` and ``sequence_parallel`` options (DTensor styles, as in torchtitan's plans).

``loss_parallel``: the input embedding is split over the vocabulary (row-wise: each rank looks up its rows,
the partial results are summed) and the LM head column-wise with its logits kept sharded over the
vocabulary (a DTensor), so no rank ever holds full-vocabulary logits; cross-entropy then runs on the
shards inside ``torch.distributed.tensor.parallel.loss_parallel()``, which ``train_step`` enters around
forward, loss and backward. A tied head (GPT-2's ``wte`` / ``lm_head``) stays tied: both shard the same
weight along the vocabulary (dim 0), so they share one DTensor parameter.

``sequence_parallel``: between the tensor-parallel regions the residual stream is a DTensor sharded over
the sequence (dim 1), so norms and dropout run on 1/t of the tokens; the attention / MLP modules
all-gather it on entry and their row-wise layers reduce-scatter back to sequence shards (instead of an
all-reduce). Embedding outputs enter the stream as sequence shards; the head gathers them back.

Both need a model that exposes its token embedding and head as transformers models do
(``get_input_embeddings`` / ``get_output_embeddings``).

Under pipeline parallel (sequence_parallel only) each stage's copy of the model gets the same layouts, and the
stages exchange the residual stream as it is between blocks: each rank sends its local sequence shard
(b, s/t, h) to the same tensor rank of the next stage, which rebuilds the sequence-sharded DTensor its first
block takes. That is what Megatron-LM (its p2p tensor shape is seq/tp under sequence parallel) and torchtitan
(its blocks' outputs are local sequence shards) send: 1/t of the bytes per transfer, and no all-gather at a
stage boundary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from atorch.opt_lib.expert_parallel import expert_banks

SEQ_DIM = 1
_MARK = "_atorch_loss_parallel"  # set on the model: train_step runs the step inside loss_parallel()


def _norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm | nn.RMSNorm) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def _embedding_and_head(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    from atorch.opt_lib.tp_styles import model_layer

    embedding, head = model_layer(model, "get_input_embeddings"), model_layer(model, "get_output_embeddings")
    return (embedding if isinstance(embedding, nn.Embedding) else None,
            head if isinstance(head, nn.Linear) else None)


def _name_of(model: nn.Module, target: nn.Module | None) -> str | None:
    return next((n for n, m in model.named_modules() if m is target), None) if target is not None else None


def _inner_modules(names: list[str]) -> set[str]:
    """The modules holding split layers (attention, MLP): their input is gathered from sequence shards."""
    return {n.rpartition(".")[0] for n in names}


def problems(model: nn.Module, config: Any, t: int) -> list[str]:
    """What keeps loss_parallel / sequence_parallel from this model at tensor size t (checked before building)."""
    if not (config.loss_parallel or config.sequence_parallel):
        return []
    found = []
    embedding, head = _embedding_and_head(model)
    options = " and ".join(k for k in ("loss_parallel", "sequence_parallel") if getattr(config, k))
    if embedding is None or (config.loss_parallel and head is None):
        return [f"{options} need a model exposing its token embedding (nn.Embedding) and LM head (nn.Linear) "
                "through get_input_embeddings() / get_output_embeddings(), as transformers models do; "
                f"set {options} to false for this model"]
    if config.loss_parallel:
        for what, size in (("embedding", embedding.num_embeddings), ("LM head", head.out_features)):
            if size % t:
                found.append(f"loss_parallel: the {what}'s vocabulary of {size} does not divide over tensor size {t}; "
                             f"pad the vocabulary to a multiple of {t} (e.g. model.resize_token_embeddings("
                             f"{-(-size // t) * t})) or set loss_parallel to false")
        if head.bias is not None:
            found.append("loss_parallel: the LM head has a bias; not supported yet, set loss_parallel to false")
    return found


def _to_sequence_shards(mesh: Any) -> Any:
    """Forward hook: a whole (replicated) output enters the residual stream as sequence shards (no communication);
    of a tuple (hidden states, router logits), the first."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def shards(output: torch.Tensor) -> Any:
        if isinstance(output, DTensor):
            return output.redistribute(mesh, (Shard(SEQ_DIM),))
        return DTensor.from_local(output, mesh, (Replicate(),), run_check=False).redistribute(mesh, (Shard(SEQ_DIM),))

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (shards(output[0]), *output[1:])
        return shards(output)

    return hook


def _moe_layers(model: nn.Module) -> list[str]:
    """The modules holding a MoE layer's expert bank (its router, experts and any shared expert)."""
    return [name.rpartition(".")[0] for name, _ in expert_banks(model)]


def _gather_sequence(local: bool) -> Any:
    """Forward pre-hook: sequence-sharded DTensor inputs are all-gathered (a DTensor, or plain with local=True)."""
    from torch.distributed.tensor import DTensor, Replicate

    def gather(value: Any) -> Any:
        if isinstance(value, DTensor) and any(p.is_shard() for p in value.placements):
            value = value.redistribute(value.device_mesh, (Replicate(),))
            return value.to_local() if local else value
        return value

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(gather(a) for a in args), {k: gather(v) for k, v in kwargs.items()}

    return hook


def styles(model: nn.Module, config: Any, split: dict[str, str], mesh: Any) -> dict[str, Any]:
    """The ParallelStyles for the split layers (``split``: name -> style name, tp_styles.py) and, with the options, for
    the embeddings, norms and head. Hooks that move activations between layouts are registered here too."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from atorch.opt_lib.tp_styles import parallel_style

    sp, lp = config.sequence_parallel, config.loss_parallel
    # A MoE layer computes on the whole sequence on every tensor rank (its router and experts are kept whole, or
    # split over the expert dimension): its input is gathered, its output re-enters the stream as sequence shards,
    # and the layers split inside it (a shared expert) keep their styles without sequence parallel.
    moe = _moe_layers(model) if sp else []

    def in_moe(name: str) -> bool:
        return any(name == m or name.startswith(m + ".") for m in moe)

    result: dict[str, Any] = {name: parallel_style(style, sp and not in_moe(name)) for name, style in split.items()}
    embedding, head = _embedding_and_head(model)  # (None, None) for pipeline stages: their heads are below
    embedding_name, head_name = _name_of(model, embedding), _name_of(model, head)
    modules = dict(model.named_modules())
    inner = _inner_modules(list(split))
    if lp:
        result[embedding_name] = RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Shard(SEQ_DIM) if sp else Replicate(),
                                                 use_local_output=not sp)
        result[head_name] = ColwiseParallel(input_layouts=Shard(SEQ_DIM) if sp else Replicate(),
                                            output_layouts=Shard(-1), use_local_output=False)
    if not sp:
        return result
    for name in inner:
        modules[name].register_forward_pre_hook(_gather_sequence(local=False), with_kwargs=True)
    if not lp:  # the LM head (of each stage's copy of the model that runs it) takes the whole sequence
        for root in _roots(model):
            root_head = _embedding_and_head(root)[1]
            if root_head is not None:
                root_head.register_forward_pre_hook(_gather_sequence(local=True), with_kwargs=True)
    _sequence_shards_between_stages(model, mesh)
    for name in moe:
        modules[name].register_forward_pre_hook(_gather_sequence(local=True), with_kwargs=True)
        modules[name].register_forward_hook(_to_sequence_shards(mesh))
    for name, module in modules.items():
        inside = any(name.startswith(i + ".") for i in inner if i) or name in inner or in_moe(name)
        if _norm(module) and not inside:
            result[name] = SequenceParallel(sequence_dim=SEQ_DIM)
        # Embeddings kept whole (position embeddings; the token embedding without loss_parallel) feed the stream.
        elif isinstance(module, nn.Embedding) and not inside and not (lp and name == embedding_name):
            module.register_forward_hook(_to_sequence_shards(mesh))
    return result


def finish(model: nn.Module, config: Any, tied: bool, t: int) -> None:
    """After parallelize_module: re-tie a tied head, mark the model for loss_parallel, check sequence lengths."""
    embedding, head = _embedding_and_head(model)
    if config.loss_parallel and tied:
        head.weight = embedding.weight  # both Shard(0) over the vocabulary: one DTensor parameter again
    if config.loss_parallel:
        setattr(model, _MARK, True)
        from atorch.opt_lib.forward_context import run_forward_in

        run_forward_in(model, _forward_context, "loss_parallel forward")
        model.register_forward_hook(_plain_loss_output)
    if config.sequence_parallel:
        for root in _roots(model):
            root.register_forward_pre_hook(_check_sequence(t), with_kwargs=True)


def _roots(model: nn.Module) -> list[nn.Module]:
    """The copies of the model that run: the model itself, or under pipeline parallel this rank's stages' copies."""
    from atorch.state_names import state_roots

    return state_roots(model)


def _sequence_shards_between_stages(model: nn.Module, mesh: Any) -> None:
    """Under pipeline parallel, a non-last stage sends the local sequence shard of the residual stream and a later
    stage rebuilds the DTensor from it (see the module's docstring): a pipeline schedule sends plain tensors."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from atorch.state_names import StagedModel

    def to_send(hidden: torch.Tensor) -> torch.Tensor:
        if not isinstance(hidden, DTensor):  # a stream kept whole on this stage: each rank keeps its own shard
            hidden = DTensor.from_local(hidden, mesh, (Replicate(),), run_check=False)
        return hidden.redistribute(mesh, (Shard(SEQ_DIM),)).to_local()

    def received(local: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(local, mesh, (Shard(SEQ_DIM),), run_check=False)

    if isinstance(model, StagedModel):
        for stage in model.stages:  # StageModules, not wrapped yet (sharding comes after)
            stage.to_send, stage.received = to_send, received


def is_tied(model: nn.Module) -> bool:
    embedding, head = _embedding_and_head(model)
    return embedding is not None and head is not None and head.weight is embedding.weight


def _check_sequence(t: int) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2 and tokens.shape[SEQ_DIM] % t:
            from atorch.errors import SetupError

            raise SetupError(f"sequence_parallel: a sequence length of {tokens.shape[SEQ_DIM]} does not divide over "
                             f"tensor size {t}; pad the sequences to a multiple of {t} (e.g. the tokenizer's "
                             f"pad_to_multiple_of={t}) or set sequence_parallel to false")

    return hook


def _loss_parallel_active() -> bool:
    from torch.distributed.tensor import DTensor

    handlers = getattr(DTensor._op_dispatcher, "_custom_op_handlers", {})
    return torch.ops.aten._log_softmax.default in handlers


@contextlib.contextmanager
def _forward_context() -> Iterator[None]:
    """The model's forward under loss_parallel: inside the step's context; forward-only calls get their own."""
    if _loss_parallel_active():
        yield
        return
    if torch.is_grad_enabled():
        from atorch.errors import SetupError

        raise SetupError("loss_parallel: the loss and its backward must run inside torch.distributed.tensor.parallel."
                         "loss_parallel() (the logits are sharded over the vocabulary); use atorch.train_step(result, "
                         "[batch]), or wrap forward, loss and backward in `with loss_parallel():`")
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        yield


def _plain_loss_output(module: nn.Module, args: Any, output: Any) -> Any:
    """A loss computed inside the model (transformers, labels given) is a replicated DTensor: handed out plain
    (to_local keeps the graph, so backward still reaches the sharded logits)."""
    from torch.distributed.tensor import DTensor

    loss = getattr(output, "loss", None)
    if isinstance(loss, DTensor):
        output.loss = loss.to_local()
    return output


def step_context(model: Any) -> contextlib.AbstractContextManager:
    """Around a training step's forward, loss and backward: loss_parallel() for a model built with it."""
    if getattr(model, _MARK, False):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def plain(loss: torch.Tensor) -> torch.Tensor:
    """A loss computed by the user on sharded logits is a replicated DTensor: its local value is the loss."""
    from torch.distributed.tensor import DTensor

    return loss.to_local() if isinstance(loss, DTensor) else loss


def whole(value: Any) -> Any:
    """Logits sharded over the vocabulary (loss_parallel), gathered for a caller that asked for the whole output."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value
