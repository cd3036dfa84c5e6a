"""Statistics of a model from one sample batch, measured on fake tensors: what the cost model plans with.

``analyse(model, sample_batch, model_input_format, loss_func)`` runs one forward and one backward of a
copy of the model whose parameters and buffers are fake tensors (``FakeTensorMode``: shapes, dtypes and
devices, no storage, no arithmetic), so it costs neither real compute nor real memory and works for a
model on the meta device. From that one step it reads:

* parameter / gradient / buffer bytes and parameter counts (trainable and frozen), from the module;
* FLOPs per sample of the forward and of forward+backward, counted by ``torch.utils.flop_counter`` on
  the ops actually dispatched (matmuls, convolutions, attention; elementwise ops are not counted), divided
  by the batch size;
* activation bytes: the tensors autograd saves for backward (``saved_tensors_hooks``), each storage
  counted once, parameters and buffers left out; attributed to the innermost repeated block (transformer
  layer, residual block) running when the tensor was saved, so a block's figure is what that block keeps
  alive between its forward and its backward at the measured batch;
* the repeated block classes (``opt_lib.blocks.block_classes``), their count and size, the bytes of
  floating-point tensors passed into them (what activation checkpointing keeps of a block), the largest single
  tensor a block saves (what its backward holds a gradient of at a time), the layer with the most parameter
  bytes and the largest single saved activation;
* aten operations dispatched in forward and in backward (``fwd_ops``, ``bwd_ops``: every operation a
  ``TorchDispatchMode`` sees, views and in-place ones included, detaches not; the same whatever the
  batch size), and how many of the forward's were run inside the repeated blocks (``block_fwd_ops``:
  what recompute runs again) or were matmuls, convolutions or attention (``fwd_lowp_ops``: what
  autocast casts inputs for);
  the cost model charges each a fixed latency (per-operation overhead dominates small models);
* a fingerprint of the module tree (class names, parameter and buffer names, shapes, dtypes, trainable
  flags; not values) that identifies "the same model" across runs: the search's study key.

The user's model is never touched: the copy is made with the fake tensors in the deepcopy memo, so no
parameter is moved or copied and no hook is left on the original.

The same fake step checks the user's setup before anything is built: ``diagnosis`` (a mistake of the user's
found there stops the analysis too, as a ``StepError``); the fake copy and batch are ``fake_step``'s.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import itertools
import json
import math
import re
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from atorch.class_ref import class_path
from atorch.errors import SetupError
from atorch.log import get_logger
from atorch.model_context import call_model
from atorch.opt_lib.blocks import block_classes
from atorch.opt_lib.expert_parallel import expert_banks
from atorch.strategy_search.costing import fake_kernels
from atorch.strategy_search.costing.diagnosis import StepError, describe, first_line, forward_and_loss, loss_of
from atorch.strategy_search.costing.fake_kernels import FakeKernelGaps
from atorch.strategy_search.costing.fake_step import fake_setup, nbytes, quiet_fake_tensor_log, tensor_leaves

logger = get_logger(__name__)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class BlockStats(_Frozen):
    """One repeated block class: how many there are, the largest instance's size, and all instances' together.

    Instances of one class may differ (T5's decoder blocks hold cross-attention, its encoder blocks do not).
    """

    class_path: str
    count: int
    param_bytes: int  # parameter bytes of one block (the largest instance)
    activation_bytes: int  # bytes saved for backward by one block at the measured batch (largest instance)
    param_bytes_total: int
    activation_bytes_total: int
    input_bytes_total: int = 0  # the tensors passed into the blocks at the measured batch (what recompute keeps)
    attention: bool = False  # the block runs attention (scaled dot-product or a softmax)
    largest_saved_bytes: int = 0  # the largest single tensor one block saves for backward (largest instance)


class LayerStats(_Frozen):
    """The module holding the most parameter bytes of its own (not counting its children)."""

    name: str
    class_path: str
    param_bytes: int


class ActivationStats(_Frozen):
    """The largest single tensor saved for backward, and the module that was running when it was saved."""

    module: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int


class ModelStats(_Frozen):
    """What the analyser measured. Activation figures are for ``batch_size`` samples (the sample batch)."""

    fingerprint: str
    batch_size: int
    seq_len: int | None  # dim 1 of the first integer tensor of 2+ dims in the batch (token ids), if any
    param_count: int
    trainable_param_count: int
    param_bytes: int
    trainable_param_bytes: int
    frozen_param_bytes: int
    grad_bytes: int  # one gradient per trainable parameter, in the parameter's dtype
    buffer_bytes: int
    fwd_flops_per_sample: float
    fwd_bwd_flops_per_sample: float
    fwd_ops: int = 0  # aten operations dispatched by one forward (loss included)
    bwd_ops: int = 0  # ... by one backward
    block_fwd_ops: int = 0  # forward operations run inside the repeated blocks (recompute runs them again)
    fwd_lowp_ops: int = 0  # forward matmuls / convolutions / attention: what autocast runs in 16 bits
    param_tensors: int = 0  # trainable parameter tensors (the optimizer's per-tensor work)
    # their bytes in ``parameters()`` order: DeepSpeed's ZeRO partitions them in this order (cost_model.py)
    trainable_tensor_bytes: tuple[int, ...] = ()
    activation_bytes: int  # all tensors saved for backward in one step at the measured batch
    activation_bytes_outside_blocks: int
    # saved for backward by the same step's forward under bf16 autocast, 16-bit weight casts left out (the
    # cost model counts those apart: they do not grow with the batch); None where it could not run
    amp_activation_bytes: int | None = None
    # (key/value heads, bytes of their k_proj / v_proj) for attentions with fewer key/value heads than query heads:
    # tensor parallel keeps those projections whole on every rank at a tensor size above the head count
    tp_kv_param_bytes: tuple[tuple[int, int], ...] = ()
    # layers tensor parallel's automatic plan splits, and their parameter tensors (DTensors under tensor parallel:
    # each adds DTensor's dispatch to every micro-batch / optimizer step, which the cost model counts)
    tp_split_layers: int = 0
    tp_split_params: int = 0
    blocks: tuple[BlockStats, ...]
    # every block instance in module order, (parameter bytes, bytes saved for backward at the measured batch): FSDP2
    # reduces each unit's gradients after its backward, last block first (cost_model: the reduction phase)
    block_sequence: tuple[tuple[int, int], ...] = ()
    largest_layer: LayerStats | None
    largest_activation: ActivationStats | None
    # trainable parameters outside the blocks used after the last one (the output head; tied embeddings too): FSDP2
    # holds their unsharded gradients from the start of backward, with the root unit's gathered parameters, to its end
    head_param_bytes: int = 0
    # mixture of experts (``moe_structure``): every expert's parameters are in memory, a token visits top-k of them
    experts: int = 0  # experts per MoE layer (0: no MoE layer)
    experts_per_token: int = 0
    expert_param_count: int = 0  # parameters of all experts of all MoE layers
    moe_layers: int = 0  # MoE layers (expert banks): each dispatches its tokens with all-to-alls under expert parallel
    # expert-bank parameter bytes tensor parallel's automatic plan leaves whole (transformers' stacked experts: the
    # plan splits the attention and dense layers; every rank of the tensor group keeps every expert)
    tp_whole_expert_bytes: int = 0
    # parameter bytes inside the repeated blocks that the automatic plan leaves whole, experts aside (norms; and the
    # convolutions, or an attention the plan cannot split, of a hybrid block such as MobileViT's): every rank of the
    # tensor group keeps them
    tp_whole_block_bytes: int = 0
    # one token's keys and values over every causal attention layer of a transformers decoder, at the parameters'
    # bytes per element: what context parallel all-gathers per token (0: no such attention) ...
    kv_bytes_per_token: int = 0
    # ... and the same repeated to the query heads (grouped-query attention): what its attention saves for backward
    attention_kv_bytes_per_token: int = 0
    # how the step was measured: "fake" tensors, or "real" tensors on the sample batch where the fake run failed
    measured_on: str = "fake"

    @property
    def active_param_count(self) -> int:
        """Parameters one token runs through: the experts' at top-k of ``experts``, the rest whole."""
        if not self.experts:
            return self.param_count
        return self.param_count - self.expert_param_count + self.expert_param_count * self.experts_per_token // \
            self.experts

    @property
    def activation_bytes_per_sample(self) -> float:
        return self.activation_bytes / self.batch_size


# ----- fingerprint -------------------------------------------------------------------------------------

def fingerprint(model: nn.Module) -> str:
    """A stable hash of what the model is: the module tree (classes and each module's settings, as its
    ``extra_repr`` shows them: features, eps, dropout p, ...), parameter/buffer names, shapes, dtypes,
    trainable flags, and a transformers ``config`` where there is one (its fields plus the attention
    implementation, which ``to_dict`` leaves out).

    Values are not read, so two instances of one config (and a meta-device instance) share a fingerprint.
    """
    tree = {
        "modules": [[name, class_path(type(m)), _no_address(m.extra_repr())] for name, m in model.named_modules()],
        "params": [[n, list(p.shape), str(p.dtype), p.requires_grad] for n, p in model.named_parameters()],
        "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in model.named_buffers()],
        "config": _config_json(getattr(model, "config", None)),
    }
    return hashlib.sha256(json.dumps(tree, separators=(",", ":")).encode()).hexdigest()


_CONFIG_NOT_KEYED = ("_name_or_path", "_commit_hash")  # where it was loaded from, not what it is


def _config_json(config: Any) -> Any:
    """A transformers-style config as JSON (None when the model has none)."""
    if config is None or not callable(getattr(config, "to_dict", None)):
        return None
    data = {k: v for k, v in config.to_dict().items() if k not in _CONFIG_NOT_KEYED}
    data["attn_implementation"] = getattr(config, "_attn_implementation", None)
    return identity_json(data)


def _no_address(text: str) -> str:
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def identity_json(value: Any) -> Any:
    """``value`` as plain, stable JSON for a cache key: containers recursively (dict keys sorted), tensors as
    shape and dtype (never values), classes and functions by qualified name, other objects by their
    class and repr with memory addresses removed (so a closure or a fresh instance keys the same each run)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, torch.Tensor):
        return {"tensor": list(value.shape), "dtype": str(value.dtype)}
    if isinstance(value, dict):
        return {str(k): identity_json(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [identity_json(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(json.dumps(identity_json(v)) for v in value)
    if isinstance(value, functools.partial):
        return {"partial": identity_json(value.func), "args": identity_json(value.args),
                "kwargs": identity_json(value.keywords)}
    if isinstance(value, nn.Module):  # a loss module: its class and settings
        return {"module": class_path(type(value)), "settings": _no_address(value.extra_repr())}
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return {"object": class_path(type(value)), "repr": _no_address(repr(value))}


# ----- the batch's shape ------------------------------------------------------------------------------

def batch_shape(batch: Any) -> tuple[int, int | None]:
    leaves = list(tensor_leaves(batch))
    if not leaves or leaves[0].dim() == 0:
        raise ValueError("analyse: the sample batch holds no tensor with a batch dimension")
    seq = next((t.shape[1] for t in leaves if t.dim() >= 2 and not t.is_floating_point()), None)
    return int(leaves[0].shape[0]), None if seq is None else int(seq)


# FlopCounterMode counts the CUDA attention kernels; the CPU flash kernel does the same matmuls.
def _sdpa_cpu(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward(grad_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                       **kwargs: Any) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_shape, query_shape, key_shape, value_shape)


_EXTRA_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward,
    **fake_kernels.EXTRA_FLOPS,
}


# ----- operation counting ------------------------------------------------------------------------------

# The operations autocast runs in 16 bits (casting their inputs): matmuls, convolutions, attention.
_AUTOCAST_LOWP = {
    torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm, torch.ops.aten.matmul,
    torch.ops.aten.linear, torch.ops.aten.convolution, torch.ops.aten.addbmm,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, torch.ops.aten._scaled_dot_product_efficient_attention,
    torch.ops.aten._scaled_dot_product_flash_attention, torch.ops.aten.scaled_dot_product_attention,
}


_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, torch.ops.aten._scaled_dot_product_efficient_attention,
    torch.ops.aten._scaled_dot_product_flash_attention, torch.ops.aten.scaled_dot_product_attention,
    torch.ops.aten._scaled_dot_product_attention_math, torch.ops.aten._softmax, torch.ops.aten.softmax,
    torch.ops.aten._safe_softmax,
}


class _OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while active (and those inside the repeated blocks)."""

    def __init__(self, saved: _SavedTensors | None = None) -> None:
        super().__init__()
        self.saved = saved
        self.count = 0
        self.in_blocks = 0
        self.lowp = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Not counted: fake tensors' own queries (prim.device), and autograd's detaches (the analyser's
        # saved-tensor hooks add some that the real step does not run).
        if func.namespace != "aten" or func.overloadpacket is torch.ops.aten.detach:
            return func(*args, **(kwargs or {}))
        self.count += 1
        if func.overloadpacket in _AUTOCAST_LOWP:
            self.lowp += 1
        if self.saved is not None and any(name in self.saved.blocks for name in self.saved.stack):
            self.in_blocks += 1
            if func.overloadpacket in _ATTENTION:
                self.saved.attention.update(name for name in self.saved.stack if name in self.saved.blocks)
        return func(*args, **(kwargs or {}))


# ----- saved-tensor accounting -------------------------------------------------------------------------

class _SavedTensors:
    """Counts the storages autograd saves for backward, by innermost running block, skipping model state."""

    def __init__(self, model: nn.Module, blocks: dict[str, str]) -> None:
        # storage address -> the storage, held: model state (and autocast's weight casts, _WeightCasts)
        self.state = {t.untyped_storage()._cdata: t.untyped_storage()
                      for t in itertools.chain(model.parameters(), model.buffers())}
        # Every storage counted is held (the value) until the analysis ends: storages are told apart by their
        # address, and one freed mid-step (a temporary saved by a graph that was then dropped) would hand its
        # address to a later one, which was then taken for it and not counted: the same model's activations varied
        # by up to 7% from one analysis to the next (a DeepSeek-V3's routing branches).
        self.seen: dict[int, torch.UntypedStorage] = {}
        self.blocks = blocks  # module name -> block class path
        self.stack: list[str] = []
        self.total = 0
        self.by_block: dict[str, int] = {name: 0 for name in blocks}
        self.inputs: dict[str, int] = {name: 0 for name in blocks}
        self.largest_in: dict[str, int] = {name: 0 for name in blocks}
        self.attention: set[str] = set()  # blocks that ran attention (seen by _OpCounter)
        self.largest: ActivationStats | None = None
        # forward order: each module's last entry and the last block's end (``head_param_bytes``)
        self.calls = 0
        self.entered: dict[str, int] = {}
        self.blocks_done_at = -1
        self.model = model

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.state or key in self.seen:
            return t
        self.seen[key] = storage
        size = storage.nbytes()
        self.total += size
        block = next((name for name in reversed(self.stack) if name in self.blocks), None)
        if block is not None:
            self.by_block[block] += size
            self.largest_in[block] = max(self.largest_in[block], size)
        if self.largest is None or size > self.largest.bytes:
            module = self.stack[-1] if self.stack else ""
            self.largest = ActivationStats(module=module, shape=tuple(t.shape), dtype=str(t.dtype), bytes=size)
        return t

    def track(self, model: nn.Module, stack: ExitStack) -> None:
        """Keep ``self.stack`` = the names of the modules running now (hooks on the copy only)."""
        for name, module in model.named_modules():
            pre = module.register_forward_pre_hook(lambda _, args, kwargs, n=name: self._enter(n, args, kwargs),
                                                   with_kwargs=True)
            post = module.register_forward_hook(lambda *_, n=name: self._leave(n), always_call=True)
            stack.callback(pre.remove)
            stack.callback(post.remove)

    def _enter(self, name: str, args: Any, kwargs: Any) -> None:
        self.stack.append(name)
        self.calls += 1
        self.entered[name] = self.calls
        if name in self.inputs:  # the first call's inputs (a block run twice is counted once)
            self.inputs[name] = self.inputs[name] or sum(
                nbytes(t) for t in tensor_leaves([args, list(kwargs.values())]) if t.is_floating_point())

    def _leave(self, name: str) -> None:
        if self.stack and self.stack[-1] == name:
            self.stack.pop()
        if name in self.blocks:
            self.blocks_done_at = self.calls

    def head_param_bytes(self) -> int:
        """Bytes of the trainable parameters outside the repeated blocks that the forward uses after its last block
        (the output head; with tied embeddings the embedding too): their gradients come first in backward. 0 without
        blocks."""
        if self.blocks_done_at < 0:
            return 0
        modules = dict(self.model.named_modules())
        # a parameter a block holds (a head tied to an embedding that is a unit of its own) is that unit's
        in_blocks = {id(p) for name in self.blocks for p in modules[name].parameters()}
        inside = tuple(f"{name}." for name in self.blocks)
        seen: dict[int, int] = {}
        for name, module in modules.items():
            if self.entered.get(name, 0) > self.blocks_done_at and name not in self.blocks and \
                    not name.startswith(inside):
                for param in module.parameters(recurse=False):
                    if param.requires_grad and id(param) not in in_blocks:  # (a frozen head has no gradient)
                        seen.setdefault(id(param), nbytes(param))
        return sum(seen.values())


def _block_instances(model: nn.Module) -> dict[str, str]:
    """Outermost modules of the repeated block classes: name -> class path."""
    wanted = set(block_classes(model))
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        path = class_path(type(module))
        if (path in wanted or type(module).__name__ in wanted) and not any(
                name.startswith(outer + ".") for outer in found):
            found[name] = path
    return found


# ----- the analysis ------------------------------------------------------------------------------------

def _step(work: nn.Module, batch: Any, model_input_format: str | None, loss_func: Callable[..., Any] | None,
          mode: FakeTensorMode, saved: _SavedTensors) -> tuple[int, int, _OpCounter, _OpCounter]:
    """One forward and backward on fake tensors: (forward FLOPs, backward FLOPs) of the whole batch and
    the operation counters of the two."""
    fwd_ops, bwd_ops = _OpCounter(saved), _OpCounter()
    with ExitStack() as hooks:
        saved.track(work, hooks)
        with mode, FakeKernelGaps(), FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOPS) as fwd, fwd_ops, \
                torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            loss = forward_and_loss(work, batch, model_input_format, loss_func)
    if loss is None:
        return fwd.get_total_flops(), 0, fwd_ops, bwd_ops
    with mode, FakeKernelGaps(), FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOPS) as bwd, bwd_ops:
        loss.backward()
    return fwd.get_total_flops(), bwd.get_total_flops(), fwd_ops, bwd_ops


class _WeightCasts(TorchDispatchMode):
    """Marks autocast's 16-bit copies of parameters as model state, so ``_SavedTensors`` leaves them out."""

    def __init__(self, saved: _SavedTensors) -> None:
        super().__init__()
        self.saved = saved

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor) and \
                args[0].untyped_storage()._cdata in self.saved.state:
            # held, so its address is not handed to an activation
            self.saved.state[out.untyped_storage()._cdata] = out.untyped_storage()
        return out


def _amp_saved_bytes(work: nn.Module, batch: Any, model_input_format: str | None,
                     loss_func: Callable[..., Any] | None, mode: FakeTensorMode, device: torch.device) -> int | None:
    """Bytes one forward saves for backward under bf16 autocast (weight casts left out), or None."""
    saved = _SavedTensors(work, {})
    try:
        with mode, FakeKernelGaps(), _WeightCasts(saved), torch.autocast(device.type, dtype=torch.bfloat16), \
                torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            loss_of(call_model(work, batch, model_input_format), batch, loss_func)
    except Exception:  # noqa: BLE001  (a model autocast cannot run: the cost model's calibrated factor is used)
        return None
    return saved.total


def fake_forward_problem(model: nn.Module, sample_batch: Any, model_input_format: str | None = None,
                         loss_func: Callable[..., Any] | None = None) -> str | None:
    """None when one training-mode forward and loss of ``model`` run on ``sample_batch`` as fake tensors (no
    storage, no arithmetic: a fraction of a real forward), else the first line of what they raised."""
    mode, work, batch, _ = fake_setup(model, sample_batch)
    try:
        with quiet_fake_tensor_log(), mode, FakeKernelGaps():
            forward_and_loss(work, batch, model_input_format, loss_func)
    except Exception as exc:  # noqa: BLE001  (reported: the caller decides what it rules out)
        # the model's own error, not the wording that blames the call (that is the analysis' to judge, on its batch)
        return first_line(exc.__cause__ if isinstance(exc, StepError) and exc.__cause__ else exc, work)
    return None


def analyse(model: nn.Module, sample_batch: Any, model_input_format: str | None = None,
            loss_func: Callable[..., Any] | None = None) -> ModelStats:
    """Measure ``model`` on one ``sample_batch`` (called as ``model_input_format`` says) with fake tensors.

    ``loss_func(batch, output)`` gives the scalar to differentiate; without it, the model's output when it
    is a tensor, else its ``.loss``, else its first tensor that requires grad (summed). A model on the
    meta device is analysed as if on the sample batch's device.
    """
    batch_size, seq_len = batch_shape(sample_batch)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    blocks = _block_instances(model)

    mode, work, batch, batch_device = fake_setup(model, sample_batch)
    saved = _SavedTensors(work, blocks)
    measured_on = "fake"
    try:
        with quiet_fake_tensor_log():
            fwd_flops, bwd_flops, fwd_ops, bwd_ops = _step(work, batch, model_input_format, loss_func, mode, saved)
    except StepError:
        raise
    except Exception as exc:
        # The fake run's own limits (a forward that reads values, an operation without a fake kernel): measured
        # on real tensors instead, one step on the sample batch, so the search never plans blind.
        fake_failure = first_line(exc)
        work, batch, mode, saved = _real_setup(model, sample_batch, blocks, fake_failure)
        measured_on = "real"
        try:
            with torch.random.fork_rng(devices=[]):
                fwd_flops, bwd_flops, fwd_ops, bwd_ops = _step(work, batch, model_input_format, loss_func, mode,
                                                               saved)
        except StepError:
            raise
        except Exception as real_exc:
            raise SetupError(
                f"analyse: one training step of {type(model).__name__} fails: on fake tensors {fake_failure}; on "
                f"real tensors, on the sample batch ({describe(sample_batch)}), {first_line(real_exc, work)}"
            ) from real_exc
        logger.info("analysed %s on real tensors (one step on the sample batch): the fake-tensor run failed: %s",
                    type(model).__name__, fake_failure)

    work.zero_grad(set_to_none=True)
    amp_saved = _amp_saved_bytes(work, batch, model_input_format, loss_func, mode, batch_device)
    experts, per_token, expert_params = moe_structure(model)
    moe_layers = len(expert_banks(model)) if experts else 0
    from atorch.opt_lib.tensor_parallel import automatic_plan, bytes_left_whole

    plan = automatic_plan(model)  # once: its derivation walks every module (MoE models: every expert too)
    whole_experts = bytes_left_whole(model, [m for _, m in expert_banks(model)], plan) if experts else 0

    by_class: dict[str, list[tuple[int, int, int, bool]]] = {}
    instances = dict(model.named_modules())
    sequence = []
    for name, path in blocks.items():
        block_params = sum(nbytes(p) for p in instances[name].parameters())
        sequence.append((block_params, saved.by_block[name]))
        by_class.setdefault(path, []).append(
            (block_params, saved.by_block[name], saved.inputs[name], name in saved.attention,
             saved.largest_in[name]))
    block_stats = tuple(
        BlockStats(class_path=path, count=len(sizes), param_bytes=max(s[0] for s in sizes),
                   activation_bytes=max(s[1] for s in sizes), param_bytes_total=sum(s[0] for s in sizes),
                   activation_bytes_total=sum(s[1] for s in sizes), input_bytes_total=sum(s[2] for s in sizes),
                   attention=any(s[3] for s in sizes), largest_saved_bytes=max(s[4] for s in sizes))
        for path, sizes in sorted(by_class.items()))

    largest_layer = None
    for name, module in model.named_modules():
        own = sum(nbytes(p) for p in module.parameters(recurse=False))
        if own and (largest_layer is None or own > largest_layer.param_bytes):
            largest_layer = LayerStats(name=name, class_path=class_path(type(module)), param_bytes=own)

    from atorch.opt_lib.tensor_parallel import kv_projection_bytes, split_layer_counts

    tp_layers, tp_params = split_layer_counts(model, plan)
    whole_in_blocks = 0 if plan is None else max(
        0, bytes_left_whole(model, [instances[name] for name in blocks], plan) - whole_experts)

    trainable_bytes = sum(nbytes(p) for p in trainable)
    param_bytes = sum(nbytes(p) for p in params)
    kv_bytes = attention_kv_bytes(model)
    return ModelStats(
        fingerprint=fingerprint(model),
        batch_size=batch_size,
        seq_len=seq_len,
        param_count=sum(p.numel() for p in params),
        trainable_param_count=sum(p.numel() for p in trainable),
        param_bytes=param_bytes,
        trainable_param_bytes=trainable_bytes,
        frozen_param_bytes=param_bytes - trainable_bytes,
        grad_bytes=trainable_bytes,
        buffer_bytes=sum(nbytes(b) for b in model.buffers()),
        fwd_flops_per_sample=fwd_flops / batch_size,
        fwd_bwd_flops_per_sample=(fwd_flops + bwd_flops) / batch_size,
        fwd_ops=fwd_ops.count,
        bwd_ops=bwd_ops.count,
        block_fwd_ops=fwd_ops.in_blocks,
        fwd_lowp_ops=fwd_ops.lowp,
        param_tensors=len(trainable),
        trainable_tensor_bytes=tuple(nbytes(p) for p in trainable),
        activation_bytes=saved.total,
        activation_bytes_outside_blocks=saved.total - sum(saved.by_block.values()),
        amp_activation_bytes=amp_saved,
        tp_kv_param_bytes=kv_projection_bytes(model),
        tp_split_layers=tp_layers,
        tp_split_params=tp_params,
        blocks=block_stats,
        block_sequence=tuple(sequence),
        largest_layer=largest_layer,
        largest_activation=saved.largest,
        head_param_bytes=saved.head_param_bytes(),
        experts=experts,
        experts_per_token=per_token,
        expert_param_count=expert_params,
        moe_layers=moe_layers,
        tp_whole_expert_bytes=whole_experts,
        tp_whole_block_bytes=whole_in_blocks,
        kv_bytes_per_token=kv_bytes[0],
        attention_kv_bytes_per_token=kv_bytes[1],
        measured_on=measured_on,
    )


def attention_kv_bytes(model: nn.Module) -> tuple[int, int]:
    """One token's keys and values over every causal attention layer of a transformers decoder (key/value heads ×
    head size, from each attention module's config), and the same repeated to the query heads, at the model's bytes
    per parameter; (0, 0) for other models."""
    from atorch.opt_lib.context_parallel import attention_modules

    params = list(model.parameters())
    if not params:
        return 0, 0
    element = sum(nbytes(p) for p in params) / sum(p.numel() for p in params)
    kv = repeated = 0
    for module in attention_modules(model):
        config = module.config
        heads = getattr(config, "num_attention_heads", None)
        if not module.is_causal or not isinstance(heads, int) or heads <= 0:
            continue
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // heads
        kv += 2 * int(kv_heads) * int(head_dim)
        repeated += 2 * heads * int(head_dim)
    return round(kv * element), round(repeated * element)


def _real_setup(model: nn.Module, sample_batch: Any, blocks: dict[str, str],
                fake_failure: str) -> tuple[nn.Module, Any, Any, _SavedTensors]:
    """A real copy of the model (train mode) for one measured step, where the fake run failed."""
    if any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())) or any(
            t.is_meta for t in tensor_leaves(sample_batch)):
        raise SetupError(
            f"analyse: one training step of {type(model).__name__} could not run on fake tensors ({fake_failure}), "
            "and the model is on the meta device, so it cannot be measured on real tensors either; build it on a "
            "real device for the automatic search, or give load_strategy")
    work = copy.deepcopy(model)
    work.train()
    return work, sample_batch, contextlib.nullcontext(), _SavedTensors(work, blocks)


# Config fields transformers' mixture-of-experts families name their expert count and top-k with.
_EXPERT_COUNT = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_EXPERTS_PER_TOKEN = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "top_k", "router_top_k")


def moe_structure(model: nn.Module) -> tuple[int, int, int]:
    """(experts per MoE layer, experts each token visits, parameters of all experts): the modules named
    ``experts`` (transformers' convention for a layer's expert bank, stacked or a ModuleList), the counts from
    the model's config where it has one, else from the bank's shape (top-k then unknown: 0). (0, 0, 0): no MoE."""
    banks = [m for _, m in expert_banks(model)]
    if not banks:
        return 0, 0, 0
    params = sum(p.numel() for bank in banks for p in bank.parameters())
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config  # multimodal models keep the decoder's apart
    count = next((int(v) for k in _EXPERT_COUNT if isinstance(v := getattr(config, k, None), int) and v > 0), 0)
    if not count:
        first = banks[0]
        count = len(first) if isinstance(first, nn.ModuleList) else next(
            (p.shape[0] for p in first.parameters() if p.dim() == 3), 0)
    per_token = next((int(v) for k in _EXPERTS_PER_TOKEN if isinstance(v := getattr(config, k, None), int) and v > 0),
                     0)
    return count, min(per_token, count), params
