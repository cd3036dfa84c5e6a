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
  floating-point tensors passed into them (what activation checkpointing keeps of a block), the layer with
  the most parameter bytes and the largest single saved activation;
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

The same fake step checks the user's setup before anything is built (``step_problems``, run by
input_checks on one collated sample batch in both modes): a failure that is the user's mistake (a loss in
torch's ``(input, target)`` order, a batch that does not match ``model_input_format``, a shape mismatch) is a
``StepError`` naming the batch's structure and shapes and the fix; so is a loss that is not a scalar tensor with
a grad path to the parameters, a step that mixes dtypes torch's kernels refuse (their fake kernels do not), token
ids beyond an embedding, and (with ``loss_func`` run on zeros shaped as the output and the real sample batch)
targets out of range or a loss that reads values. A failure of the fake run itself (a forward that reads values,
an op without a fake kernel) is not reported there, and the search measures what the analysis could not predict.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import inspect
import itertools
import json
import logging
import math
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from atorch.class_ref import class_path
from atorch.errors import SetupError
from atorch.log import get_logger
from atorch.model_context import call_model
from atorch.opt_lib.blocks import block_classes
from atorch.strategy_search import fake_kernels
from atorch.strategy_search.fake_kernels import FakeKernelGaps

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
    largest_layer: LayerStats | None
    largest_activation: ActivationStats | None
    # mixture of experts (``moe_structure``): every expert's parameters are in memory, a token visits top-k of them
    experts: int = 0  # experts per MoE layer (0: no MoE layer)
    experts_per_token: int = 0
    expert_param_count: int = 0  # parameters of all experts of all MoE layers
    moe_layers: int = 0  # MoE layers (expert banks): each dispatches its tokens with all-to-alls under expert parallel
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


# ----- the fake copy and the batch ---------------------------------------------------------------------

def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def fake_copy(model: nn.Module, mode: FakeTensorMode, device: torch.device) -> nn.Module:
    """A deep copy whose parameters and buffers are fresh fake tensors on ``device``, the sample batch's
    (tied ones stay tied): the search analyses the user's CPU model on the batch of the device it trains on."""
    memo: dict[int, Any] = {}
    with mode:
        for t in itertools.chain(model.parameters(), model.buffers()):
            if id(t) in memo:
                continue
            fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            memo[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
    return copy.deepcopy(model, memo)


def map_tensors(data: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, dict):
        return type(data)((k, map_tensors(v, fn)) for k, v in data.items())
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(map_tensors(v, fn) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(map_tensors(v, fn) for v in data)
    return data


def _leaves(data: Any) -> Iterator[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(data, found.append)
    return iter(found)


def batch_shape(batch: Any) -> tuple[int, int | None]:
    leaves = list(_leaves(batch))
    if not leaves or leaves[0].dim() == 0:
        raise ValueError("analyse: the sample batch holds no tensor with a batch dimension")
    seq = next((t.shape[1] for t in leaves if t.dim() >= 2 and not t.is_floating_point()), None)
    return int(leaves[0].shape[0]), None if seq is None else int(seq)


def _loss_of(output: Any, batch: Any, loss_func: Callable[..., Any] | None) -> torch.Tensor | None:
    """The scalar to run backward from: loss_func(batch, output) (ATorch's order), else the model's own loss."""
    if loss_func is not None:
        loss = loss_func(batch, output)
        if not isinstance(loss, torch.Tensor):
            raise _NotATensor(f"it returned a {type(loss).__name__}, not a tensor: return the loss as a scalar "
                              "tensor (the one backward starts from)")
    elif isinstance(output, torch.Tensor):
        loss = output
    elif getattr(output, "loss", None) is not None:  # transformers ModelOutput with labels
        loss = output.loss
    else:
        loss = next((t for t in _leaves(list(output.values()) if isinstance(output, dict) else output)
                     if t.requires_grad), None)
    if loss is None or not loss.requires_grad:
        return None
    return loss if loss.numel() == 1 else loss.float().sum()


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
        self.state = {t.untyped_storage()._cdata for t in itertools.chain(model.parameters(), model.buffers())}
        self.seen: set[int] = set()
        self.blocks = blocks  # module name -> block class path
        self.stack: list[str] = []
        self.total = 0
        self.by_block: dict[str, int] = {name: 0 for name in blocks}
        self.inputs: dict[str, int] = {name: 0 for name in blocks}
        self.attention: set[str] = set()  # blocks that ran attention (seen by _OpCounter)
        self.largest: ActivationStats | None = None

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.state or key in self.seen:
            return t
        self.seen.add(key)
        size = storage.nbytes()
        self.total += size
        block = next((name for name in reversed(self.stack) if name in self.blocks), None)
        if block is not None:
            self.by_block[block] += size
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
        if name in self.inputs:  # the first call's inputs (a block run twice is counted once)
            self.inputs[name] = self.inputs[name] or sum(
                _nbytes(t) for t in _leaves([args, list(kwargs.values())]) if t.is_floating_point())

    def _leave(self, name: str) -> None:
        if self.stack and self.stack[-1] == name:
            self.stack.pop()


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


# ----- the user's step: forward and loss, and what is wrong with them ----------------------------------

class StepError(SetupError):
    """The user's model and loss_func cannot run one step on the sample batch the way atorch calls them (loss
    argument order, batch structure against model_input_format, shapes): a mistake in the setup, named with
    its fix, not a gap of the fake-tensor analysis (which the search answers by measuring instead)."""


# Failures of the fake run itself, not of the user's step: values read in forward, ops without a fake kernel.
_ANALYSIS_GAPS = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException,
                  UnsupportedFakeTensorException, GuardOnDataDependentSymNode, NotImplementedError)
_GAP_WORDS = ("fake", "meta", "storage", "data pointer", "data-dependent", "symbolic", "symint")
# A RuntimeError is the user's when it is about shapes (torch's shape checks raise RuntimeError). Not dtypes: a
# strategy may cast for the real step (autocast of a bf16 model's fp32 inputs, 'half' casting the batch).
_SHAPE_WORDS = ("shape", "size", "dimension", "must match", "mat1", "reduction dim", "out of range",
                "out of bounds")
_DTYPE_WORDS = ("dtype", "scalar type", "same type", "can't be cast", "result type", "input type", "weight type",
                "bias type")
# A forward that needs a GPU this machine lacks (a .cuda() / device="cuda" inside it): the user's.
_NO_GPU_WORDS = ("not compiled with cuda", "no cuda gpus", "found no nvidia driver", "not linked with support for cuda")
_CALLS = {None: "model(batch)", "unpack_sequence": "model(*batch)", "unpack_dict": "model(**batch)",
          "input_target": "model(batch[0])"}
# Parameter names of a loss in torch's (input, target) order.
_INPUT_NAMES = {"input", "inputs", "pred", "preds", "prediction", "predictions", "logits", "output", "outputs",
                "y_pred", "y_hat", "yhat"}
_TARGET_NAMES = {"target", "targets", "label", "labels", "y", "y_true", "truth"}


class _NotATensor(TypeError):
    """loss_func returned something other than a tensor (the message is the fix)."""


class _LossShape(ValueError):
    """loss_func returned a tensor that is not a scalar, or one without a grad path (the message is the fix)."""


class _MixedDtypes(RuntimeError):
    """An operation the real kernels refuse on floating tensors of different dtypes (the message names them)."""


# Operations whose CPU/CUDA kernels refuse floating arguments of different dtypes, though their fake kernels
# accept them (the fake run would pass and the real step raise "mat1 and mat2 must have the same dtype").
_SAME_DTYPE_OPS = {"mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot", "convolution", "_convolution",
                   "native_layer_norm", "native_group_norm", "native_batch_norm", "_native_batch_norm_legit",
                   "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional"}
_NORM_OPS = {"native_layer_norm", "native_group_norm", "native_batch_norm", "_native_batch_norm_legit",
             "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional"}
_HALF = (torch.float16, torch.bfloat16)


class _DtypeWatch(TorchDispatchMode):
    """Raises _MixedDtypes at the first operation of ``_SAME_DTYPE_OPS`` given floating tensors of different
    dtypes (a 16-bit input to a float32 norm is allowed, as torch's kernels allow it)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in _SAME_DTYPE_OPS:
            # matmuls and convolutions refuse any mix (integer features too); norms take integer-free arguments
            tensors = [t for t in _leaves(list(args)) if t.is_floating_point() or name not in _NORM_OPS]
            dtypes = {t.dtype for t in tensors}
            if len(dtypes) > 1 and not (name in _NORM_OPS and tensors[0].dtype in _HALF
                                        and dtypes - {tensors[0].dtype} == {torch.float32}):
                raise _MixedDtypes(f"aten.{name} on {' and '.join(sorted(_dtype(d) for d in dtypes))} tensors")
        return func(*args, **(kwargs or {}))


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _raised_in_torch_distributed(exc: BaseException) -> bool:
    """Raised inside torch.distributed: a forward that needs the process group (the check runs before it
    exists) or a collective on fake tensors; the real step runs with both."""
    tb = exc.__traceback__
    while tb is not None:
        if "torch/distributed/" in tb.tb_frame.f_code.co_filename.replace("\\", "/"):
            return True
        tb = tb.tb_next
    return False


def _users_mistake(exc: BaseException, dtypes: bool = False) -> bool:
    """Whether a failure of the fake step is the user's mistake; ``dtypes``: a dtype error is too (the model runs
    in its own dtypes: no strategy given that casts)."""
    if isinstance(exc, (_MixedDtypes, _LossShape)):
        return True
    if any(word in str(exc).lower() for word in _NO_GPU_WORDS):
        return True
    if isinstance(exc, _ANALYSIS_GAPS) or _raised_in_torch_distributed(exc):
        return False
    text = str(exc).lower()
    if any(word in text for word in _GAP_WORDS):
        return False
    if any(word in text for word in _DTYPE_WORDS):
        return dtypes and isinstance(exc, (RuntimeError, TypeError))
    if isinstance(exc, (TypeError, ValueError, IndexError, KeyError, AttributeError)):
        return True
    return isinstance(exc, RuntimeError) and any(word in text for word in _SHAPE_WORDS)


def describe(data: Any, limit: int = 6) -> str:
    """A batch or an output, as structure, shapes and dtypes: ``tuple(tensor (8, 16) float32, ...)``."""
    if isinstance(data, torch.Tensor):
        return f"tensor {tuple(data.shape)} {str(data.dtype).removeprefix('torch.')}"
    if isinstance(data, Mapping):
        items = [f"{k!r}: {describe(v, limit)}" for k, v in list(data.items())[:limit]]
        more = ", ..." if len(data) > limit else ""
        return f"{type(data).__name__}({', '.join(items)}{more})"
    if isinstance(data, (list, tuple)):
        items = [describe(v, limit) for v in data[:limit]]
        return f"{type(data).__name__}({', '.join(items)}{', ...' if len(data) > limit else ''})"
    return type(data).__name__


def _first_line(exc: BaseException, module: nn.Module | None = None, limit: int = 300) -> str:
    """The exception in one line, ``module``'s repr in it (``model(**tuple)`` prints it) as its class name."""
    text = str(exc) if module is None else str(exc).replace(repr(module), type(module).__name__)
    text = " ".join(text.split()).rstrip(".")
    text = text if len(text) <= limit else text[:limit] + " ..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _forward_hint(model: nn.Module, batch: Any, model_input_format: str | None) -> str:
    is_dict, is_seq = isinstance(batch, Mapping), isinstance(batch, (list, tuple))
    if is_dict and model_input_format != "unpack_dict":
        return "The batch is a dict: use model_input_format='unpack_dict' (model(**batch))"
    if model_input_format == "unpack_dict" and not is_dict:
        return ("model(**batch) needs a dict batch: use model_input_format='unpack_sequence' (model(*batch)) or "
                "None (model(batch)), or make the dataset / collate_fn yield dicts")
    if model_input_format is None and is_seq:
        return (f"model_input_format=None passes the whole {type(batch).__name__} as one argument; if it holds the "
                "model's inputs and the target (a dataset of (x, y) samples), use "
                "model_input_format='input_target' (model(batch[0]), e.g. an nn.Sequential) or "
                "'unpack_sequence' (model(*batch)) with a forward that takes them all and ignores the target; "
                "loss_func(data, output) then reads the target from data")
    try:
        sig = f"{type(model).__name__}.forward{inspect.signature(model.forward)}"
    except (TypeError, ValueError):
        sig = f"{type(model).__name__}.forward"
    return (f"Make the dataset's samples match {sig} as {_CALLS.get(model_input_format, 'model(batch)')} calls it "
            "(number, order and shapes of the inputs), or change model_input_format")


def _loss_name(loss_func: Any) -> str:
    if isinstance(loss_func, nn.Module):
        prefix = "nn." if type(loss_func).__module__.startswith("torch.nn") else ""
        return f"{prefix}{type(loss_func).__name__}()"
    name = getattr(loss_func, "__name__", type(loss_func).__name__)
    if getattr(loss_func, "__module__", "") == "torch.nn.functional":
        return f"F.{name}"
    return "loss_func" if name == "<lambda>" else name


def _torch_order(loss_func: Any) -> bool:
    """Whether loss_func looks like torch's loss(input, target): a torch loss module or function, or a
    function whose first two parameters are named so."""
    if isinstance(loss_func, nn.Module) or str(getattr(loss_func, "__module__", "")).startswith("torch"):
        return True
    try:
        names = list(inspect.signature(loss_func).parameters)[:2]
    except (TypeError, ValueError):
        return False
    return len(names) == 2 and names[0].lower() in _INPUT_NAMES and names[1].lower() in _TARGET_NAMES


def _target_expr(batch: Any) -> str:
    if isinstance(batch, Mapping) and batch:
        return "data['labels']" if "labels" in batch else f"data[{list(batch)[-1]!r}]"
    if isinstance(batch, (list, tuple)) and len(batch) >= 2:
        return f"data[{len(batch) - 1}]"
    return "<the target, from data>"


def _loss_hint(loss_func: Any, batch: Any, output: Any, exc: BaseException) -> str:
    name = _loss_name(loss_func)
    if isinstance(exc, _NotATensor):
        return ""
    if _torch_order(loss_func):
        out = "output.logits" if hasattr(output, "logits") else "output"
        call = f"{name}({out}, {_target_expr(batch)})" if name != "loss_func" else "..."
        return (f"It looks like torch's (input, target) order; wrap it: "
                f"`loss_func=lambda data, output: {call}`")
    if isinstance(exc, TypeError) and "argument" in str(exc):
        return "Give loss_func exactly two parameters, (data, output), in this order"
    if isinstance(exc, (RuntimeError, ValueError)) and any(w in str(exc).lower() for w in _SHAPE_WORDS):
        return ("The shapes loss_func combines do not fit (see the batch and the output above): e.g. F.cross_entropy "
                "takes logits (N, C) with targets (N,), so flatten a sequence's logits and labels (logits.view(-1, "
                "C), labels.view(-1)) or move the class dimension second (logits.transpose(1, 2))")
    return "Make loss_func take the batch first and the model's output second, and return a scalar tensor"


def _forward_and_loss(work: nn.Module, batch: Any, model_input_format: str | None,
                      loss_func: Callable[..., Any] | None) -> torch.Tensor | None:
    """The forward and the loss of one step, as atorch calls them; a failure that is the user's mistake is
    raised as a StepError naming the fix, any other (the fake run's limits) as it came."""
    try:
        output = call_model(work, batch, model_input_format)
    except Exception as exc:
        if not _users_mistake(exc):
            raise
        raise StepError(
            f"the model's forward fails on a sample batch: model_input_format={model_input_format!r} calls "
            f"{_CALLS.get(model_input_format, 'model(batch)')} with the batch, {describe(batch)}, and "
            f"{type(work).__name__}.forward raised {_first_line(exc, work)}. "
            f"{_forward_hint(work, batch, model_input_format)}") from exc
    try:
        return _loss_of(output, batch, loss_func)
    except Exception as exc:
        if not _users_mistake(exc):
            raise
        name = _loss_name(loss_func)
        what = "the model's own loss" if loss_func is None else "loss_func" + (
            f" ({name})" if name != "loss_func" else "")
        raise StepError(
            f"{what} fails on a sample batch: atorch calls loss_func(data, output), data being the batch "
            f"({describe(batch)}) and output the model's output ({describe(output)}); "
            f"{str(exc) if isinstance(exc, _NotATensor) else 'it raised ' + _first_line(exc)}. "
            f"{_loss_hint(loss_func, batch, output, exc)}".rstrip(". ")) from exc


def _fake_setup(model: nn.Module, sample_batch: Any) -> tuple[FakeTensorMode, nn.Module, Any, torch.device]:
    """A fake mode, the model's fake copy (train mode) and the batch as fake tensors, on the batch's device."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    batch_device = next((t.device for t in _leaves(sample_batch) if not t.is_meta), torch.device("cpu"))
    work = fake_copy(model, mode, batch_device)
    work.train()
    with mode:
        batch = map_tensors(sample_batch, lambda t: torch.empty_strided(
            t.shape, t.stride(), dtype=t.dtype, device=batch_device) if t.is_meta else mode.from_tensor(t))
    return mode, work, batch, batch_device


def step_problems(model: nn.Module, sample_batch: Any, model_input_format: str | None = None,
                  loss_func: Callable[..., Any] | None = None, *, casts: bool = False) -> list[str]:
    """What is wrong with calling ``model`` and ``loss_func`` on ``sample_batch`` as atorch will: one forward
    and the loss on fake tensors (no real memory, no arithmetic; the user's model is not touched). Empty when
    the step runs, or when the fake run cannot tell (a forward that reads values: the real step will).

    Beyond the call itself: the loss must be a scalar tensor with a grad path to the model's trainable
    parameters, and the step must run in the model's own dtypes (floating inputs of another dtype than the
    parameters are refused by torch's matmul / convolution / norm kernels, though not by their fake kernels);
    ``casts``: a strategy given casts inputs or parameters (autocast, half), so dtypes are not checked. A
    loss_func that reads values (``.item()``, numpy) is run on real stand-ins of the output (zeros of its shapes
    and dtypes) with the real sample batch, as is any loss_func whose output is small, which also finds targets
    out of the output's range."""
    try:
        with _quiet_fake_tensor_log(), torch.random.fork_rng(devices=[]):
            mode, work, batch, _ = _fake_setup(model, sample_batch)
            watch = contextlib.nullcontext() if casts else _DtypeWatch()
            ids = _token_ids(batch, sample_batch)
            with mode, FakeKernelGaps(), watch, _embedding_range(work, ids):
                output = _checked_forward(work, batch, model_input_format, casts)
                loss, loss_exc = None, None
                if loss_func is not None:
                    try:
                        with warnings.catch_warnings(record=True) as caught:
                            warnings.simplefilter("always")
                            loss = loss_func(batch, output)
                        _broadcast_check(loss_func, batch, output, caught)
                        if any(p.grad is not None for p in work.parameters()):
                            raise StepError(
                                f"{_loss_what(loss_func)} runs backward itself (the model's parameters have "
                                "gradients after it returns): your loop's loss.backward() (or optim.backward(loss)) "
                                "would then go through the graph a second time and fail; return the loss without "
                                "calling backward on it")
                    except StepError:
                        raise
                    except Exception as exc:  # noqa: BLE001  (judged below, with the real stand-ins)
                        loss_exc = exc
                reached = _reaches_parameters(work, loss)
            if loss_func is not None:
                trainable = any(p.requires_grad for p in model.parameters())
                _checked_loss(loss_func, batch, output, loss, loss_exc, sample_batch, casts, trainable)
                if trainable and reached is False:
                    _raise_new_leaf(loss_func, batch, output)
    except StepError as exc:
        return [str(exc)]
    except Exception as exc:  # noqa: BLE001  (the fake run's own limits: not the user's mistake)
        logger.debug("the sample step was not checked on fake tensors: %s", _first_line(exc))
    return []


def unused_parameters(model: nn.Module, sample_batch: Any, model_input_format: str | None = None,
                      loss_func: Callable[..., Any] | None = None) -> list[str] | None:
    """Names of the trainable parameters that get no gradient in one step on ``sample_batch`` (fake tensors:
    forward, the loss, backward), or None where the step cannot run here (the other checks report a mistake)."""
    try:
        with _quiet_fake_tensor_log(), torch.random.fork_rng(devices=[]):
            mode, work, batch, _ = _fake_setup(model, sample_batch)
            with mode, FakeKernelGaps():
                loss = _loss_of(call_model(work, batch, model_input_format), batch, loss_func)
                if loss is None:
                    return None
                loss.backward()
    except Exception as exc:  # noqa: BLE001  (not checked: the step's own problems are reported elsewhere)
        logger.debug("unused parameters not checked: %s", _first_line(exc))
        return None
    return [name for name, p in work.named_parameters() if p.requires_grad and p.grad is None]


def _broadcast_check(loss_func: Any, batch: Any, output: Any, caught: list[warnings.WarningMessage]) -> None:
    """torch's losses warn when target and input differ in shape and broadcast (an (N, 1) output against an (N,)
    target): the loss then averages N x N pairs, silently wrong. Named as the user's mistake; other warnings are
    passed on."""
    for warning in caught:
        text = str(warning.message)
        if "incorrect results due to broadcasting" in text:
            raise StepError(
                f"{_loss_what(loss_func)} broadcasts the target against the output: data is the batch "
                f"({describe(batch)}), output the model's output ({describe(output)}), and torch warns: "
                f"{' '.join(text.split())} Make the shapes equal, e.g. output.squeeze(-1) or the target "
                ".view_as(output)")
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


def _reaches_parameters(work: nn.Module, loss: Any) -> bool | None:
    """Whether backward from the (fake) scalar ``loss`` gives any parameter of ``work`` a gradient; None where
    it cannot tell (no such loss, or the fake backward fails)."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        return None
    try:
        loss.backward()
    except Exception as exc:  # noqa: BLE001  (the fake run's limits)
        logger.debug("the sample backward did not run on fake tensors: %s", _first_line(exc))
        return None
    return any(p.grad is not None for p in work.parameters())


def _param_dtypes(model: nn.Module) -> str:
    dtypes = sorted({_dtype(p.dtype) for p in model.parameters() if p.is_floating_point()})
    return " and ".join(dtypes) if dtypes else "none (no floating parameters)"


def _dtype_hint(model: nn.Module, batch: Any, exc: BaseException | None = None) -> str:
    params = {p.dtype for p in model.parameters() if p.is_floating_point()}
    inputs = sorted({_dtype(t.dtype) for t in _leaves(batch) if t.is_floating_point() and t.dtype not in params})
    if any(w in str(exc) for w in ("int64", "int32", "uint8", "bool", "unsigned char", "Long", "Byte")):
        return (f"Integer tensors reach a matmul or convolution with {_param_dtypes(model)} parameters: features "
                f"stored as integers (the batch: {describe(batch)}) must be floating; convert them in the dataset or "
                "collate_fn (x.float()), or feed token ids through an nn.Embedding")
    if not inputs:
        return (f"The batch's floating tensors match the parameters' dtype ({_param_dtypes(model)}): a tensor made "
                "inside forward has another dtype; create it with dtype= the parameters' (or .to(x.dtype))")
    target = _param_dtypes(model)
    numpy = "; numpy arrays become float64 tensors: torch.from_numpy(a).float()" if "float64" in inputs else ""
    amp = (". For 16-bit compute keep the model in float32 and give load_strategy with amp_native (autocast)"
           if params & set(_HALF) else "")
    return (f"The batch holds {' and '.join(inputs)} tensors, the model's parameters are {target}: cast the data to "
            f"the parameters' dtype in the dataset or collate_fn (e.g. x.to(torch.{target.split(' ')[0]}){numpy}), "
            f"or the model to the data's dtype{amp}")


def _token_ids(batch: Any, sample_batch: Any) -> list[tuple[torch.Tensor, int, int]]:
    """(fake tensor, element count, largest value) of the batch's integer tensors, read before the fake mode."""
    found = []
    for fake, real in zip(list(_leaves(batch)), list(_leaves(sample_batch)), strict=False):
        if real.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8) and not real.is_meta \
                and real.numel():
            found.append((fake, real.numel(), int(real.max())))
    return found


def _root(t: torch.Tensor) -> torch.Tensor:
    base = getattr(t, "_base", None)
    return t if base is None else base


@contextmanager
def _embedding_range(work: nn.Module, ints: list[tuple[torch.Tensor, int, int]]) -> Iterator[None]:
    """Token ids of the sample batch at or above an nn.Embedding's size (a tokenizer larger than the model's
    vocabulary): fake tensors do not look at values, the real step raises 'index out of range in self'. The ids an
    embedding gets are matched to the batch's integer tensors by identity (or as a view of one): ids made inside
    forward (positions) are not the batch's, and embeddings with a forward of their own are not checked."""
    names = {id(m): name for name, m in work.named_modules()}

    def check(module: nn.Module, args: tuple[Any, ...]) -> None:
        ids = args[0] if args else None
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point():
            return
        root = _root(ids)  # ids may be a view of the batch's tensor (input_ids.view(-1, n))
        same = [top for f, _, top in ints if f is ids or _root(f) is root]
        if not same:
            return
        top = min(same)
        if top >= module.num_embeddings:
            raise StepError(
                f"the batch holds token id {top} but the model's embedding '{names.get(id(module), '?')}' has "
                f"{module.num_embeddings} rows (ids 0..{module.num_embeddings - 1}); the real step would raise "
                "'index out of range in self'. Use the tokenizer that matches the model (or one whose vocabulary "
                "fits), or enlarge the embedding (transformers: model.resize_token_embeddings(len(tokenizer)))")

    # nn.Embedding's own lookup only: a subclass with a forward of its own may take the ids for something else
    # (BART's learned positions read input_ids for their shape and look up positions)
    handles = [m.register_forward_pre_hook(check) for m in work.modules()
               if isinstance(m, nn.Embedding) and type(m).forward is nn.Embedding.forward] if ints else []
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _checked_forward(work: nn.Module, batch: Any, model_input_format: str | None, casts: bool) -> Any:
    try:
        return call_model(work, batch, model_input_format)
    except StepError:
        raise
    except Exception as exc:
        if not _users_mistake(exc, dtypes=not casts):
            raise
        if any(word in str(exc).lower() for word in _NO_GPU_WORDS):
            raise StepError(
                f"the model's forward needs a CUDA GPU, which this process does not have: "
                f"{type(work).__name__}.forward raised {_first_line(exc, work)}. Do not move tensors or modules to "
                "'cuda' inside forward or the dataset (atorch places the model and result.prepare_input the batch "
                "on result.args.device); create new tensors on an input's device (device=x.device)") from exc
        if isinstance(exc, _MixedDtypes) or any(w in str(exc).lower() for w in _DTYPE_WORDS):
            what = (f"would run {exc}, which torch refuses ('mat1 and mat2 must have the same dtype')"
                    if isinstance(exc, _MixedDtypes) else f"raised {_first_line(exc, work)}")
            raise StepError(
                f"dtype mismatch: the model's forward fails on a sample batch in the model's own dtypes: "
                f"model_input_format={model_input_format!r} calls {_CALLS.get(model_input_format, 'model(batch)')} "
                f"with the batch, {describe(batch)}, and {type(work).__name__}.forward {what}. "
                f"{_dtype_hint(work, batch, exc)}") from exc
        raise StepError(
            f"the model's forward fails on a sample batch: model_input_format={model_input_format!r} calls "
            f"{_CALLS.get(model_input_format, 'model(batch)')} with the batch, {describe(batch)}, and "
            f"{type(work).__name__}.forward raised {_first_line(exc, work)}. "
            f"{_forward_hint(work, batch, model_input_format)}") from exc


def _loss_what(loss_func: Any) -> str:
    name = _loss_name(loss_func)
    return "loss_func" + (f" ({name})" if name != "loss_func" else "")


def _checked_loss(loss_func: Callable[..., Any], batch: Any, output: Any, loss: Any, exc: BaseException | None,
                  sample_batch: Any, casts: bool, trainable: bool) -> None:
    """The loss of the fake step (or its failure ``exc``) judged; then, where the fake run could not tell or the
    output is small, the loss on real stand-ins of the output and the real sample batch."""
    if output is None:
        raise StepError("the model's forward returned None (a missing return statement?), so loss_func(data, output) "
                        "gets no output; return the model's output from forward")
    if exc is not None and _users_mistake(exc, dtypes=not casts):
        _raise_loss(loss_func, batch, output, exc)
    if exc is None:
        _judge_loss(loss_func, batch, output, loss, trainable)
    real = _real_loss(loss_func, sample_batch, output)
    if real is None:
        return
    real_loss, real_exc, real_output = real
    if real_exc is not None:
        # Where the fake loss ran, only what values decide is new here (targets out of range); zeros may upset a
        # loss in other ways (a distribution's checks) that real outputs would not.
        value_error = any(w in str(real_exc).lower() for w in ("out of bounds", "out of range"))
        if (exc is not None or value_error) and _users_mistake(real_exc, dtypes=not casts):
            _raise_loss(loss_func, sample_batch, output, real_exc)
        return
    if exc is not None:  # the fake run could not tell (a value read): the real stand-ins do
        _judge_loss(loss_func, sample_batch, output, real_loss, trainable)
        leaves = [t for t in _leaves(list(real_output.values()) if isinstance(real_output, Mapping) else real_output)
                  if t.requires_grad]
        if trainable and leaves and isinstance(real_loss, torch.Tensor) and real_loss.requires_grad and all(
                g is None for g in torch.autograd.grad(real_loss, leaves, allow_unused=True)):
            _raise_new_leaf(loss_func, sample_batch, output)


def _raise_new_leaf(loss_func: Any, batch: Any, output: Any) -> None:
    _raise_loss(loss_func, batch, output, _LossShape(
        "its result requires grad but does not depend on the model's parameters (backward reaches none of them): "
        "it was made as a new leaf (torch.tensor(value, requires_grad=True), .requires_grad_() on a detached value) "
        "instead of computed from `output`. Compute it from `output` with torch operations and return that tensor"))


def _judge_loss(loss_func: Any, batch: Any, output: Any, loss: Any, trainable: bool) -> None:
    """A scalar tensor with a grad path, else a StepError naming the fix."""
    if loss is None:
        why = ("the model's output has loss=None: a transformers model computes .loss only when the batch has "
               "'labels'" if getattr(output, "loss", 0) is None else "a missing return?")
        _raise_loss(loss_func, batch, output, _NotATensor(
            f"it returned None, not a tensor ({why}): return the loss as a scalar tensor"))
    if not isinstance(loss, torch.Tensor):
        _raise_loss(loss_func, batch, output, _NotATensor(
            f"it returned a {type(loss).__name__}, not a tensor: return the loss as a scalar tensor (the one "
            "backward starts from)"))
    if loss.numel() != 1:
        _raise_loss(loss_func, batch, output, _LossShape(
            f"it returned a tensor of shape {tuple(loss.shape)}, not a scalar: backward needs one number. Reduce "
            "it, e.g. with .mean() (a loss built with reduction='none' gives one value per sample or token)"))
    if trainable and not loss.requires_grad:
        if not any(t.requires_grad for t in _leaves(list(output.values()) if isinstance(output, Mapping)
                                                     else output)):
            raise StepError(
                f"the model's output does not require grad ({describe(output)}) although the model has trainable "
                "parameters: its forward cuts the graph (torch.no_grad() or torch.inference_mode() around it or "
                "inside it, a @torch.no_grad() decorator, .detach()); remove that, so that the loss can train "
                "the model")
        _raise_loss(loss_func, batch, output, _LossShape(
            "its result does not require grad, although the model's output does: the loss is cut off from the "
            "model (.item(), float(), .detach(), torch.tensor(...) of a value, numpy, or torch.no_grad()), so "
            "backward would fail and nothing would train. Compute it from `output` with torch operations and "
            "return that tensor"))


def _raise_loss(loss_func: Any, batch: Any, output: Any, exc: BaseException) -> None:
    what = _loss_what(loss_func)
    if isinstance(exc, (_NotATensor, _LossShape)):
        raise StepError(
            f"{what} fails on a sample batch: atorch calls loss_func(data, output), data being the batch "
            f"({describe(batch)}) and output the model's output ({describe(output)}); {exc}") from None
    if isinstance(exc, _MixedDtypes) or any(w in str(exc).lower() for w in _DTYPE_WORDS):
        hint = ("Check the dtypes loss_func combines: class-index targets must be int64 (.long()), floating "
                "targets the output's dtype")
    elif isinstance(exc, (AttributeError, KeyError)) and not _torch_order(loss_func):
        hint = (f"loss_func reads {'an attribute' if isinstance(exc, AttributeError) else 'a key'} that the output or "
                "the batch does not have (see their structure above): read what they hold, or make the dataset / "
                "model provide it")
    elif isinstance(exc, IndexError) and any(w in str(exc) for w in ("list index", "tuple index")):
        hint = ("loss_func reads an element the batch does not have (see the batch above): make the dataset yield "
                "what loss_func reads (the target), or read it where it is")
    elif "out of bounds" in str(exc).lower() or "out of range" in str(exc).lower():
        classes = tuple(output.shape)[-1:] if isinstance(output, torch.Tensor) else ()
        hint = ("The batch's targets hold values outside what the output allows: class indices must be below the "
                f"number of classes{f' ({classes[0]}, the output last dimension)' if classes else ''}; check the "
                "labels and the model's number of outputs")
    else:
        hint = _loss_hint(loss_func, batch, output, exc)
    raise StepError(
        f"{what} fails on a sample batch: atorch calls loss_func(data, output), data being the batch "
        f"({describe(batch)}) and output the model's output ({describe(output)}); it raised {_first_line(exc)}. "
        f"{hint}".rstrip(". ")) from exc


_REAL_OUTPUT_LIMIT = 64 * 2**20  # bytes of real stand-ins of the output made for the loss check


def _real_loss(loss_func: Callable[..., Any], sample_batch: Any,
               output: Any) -> tuple[Any, Exception | None, Any] | None:
    """loss_func on the real sample batch and zeros shaped as the fake output (requiring grad where it does):
    (loss, None, stand-ins), (None, exception, stand-ins), or None where it cannot run here (a meta batch, a large
    output)."""
    leaves = list(_leaves(sample_batch))
    outs = list(_leaves(list(output.values()) if isinstance(output, Mapping) else output))
    if any(t.is_meta for t in leaves) or not outs or sum(_nbytes(t) for t in outs) > _REAL_OUTPUT_LIMIT:
        return None
    device = next((t.device for t in leaves), torch.device("cpu"))

    def standin(t: torch.Tensor) -> torch.Tensor:
        real = torch.zeros(tuple(t.shape), dtype=t.dtype, device=device)
        return real.requires_grad_(t.requires_grad and t.is_floating_point())

    try:
        if isinstance(output, Mapping) and type(output) is not dict:  # transformers' ModelOutput
            real_output = copy.copy(output)
            for key, value in output.items():
                real_output[key] = map_tensors(value, standin)
        else:
            real_output = map_tensors(output, standin)
    except Exception:  # noqa: BLE001  (an output type that cannot be rebuilt: not checked)
        return None
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=[]), _quiet_fake_tensor_log():
            return loss_func(sample_batch, real_output), None, real_output
    except Exception as exc:  # noqa: BLE001  (judged by the caller)
        return None, exc, real_output


@contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """torch logs every meta kernel that fails (a shape mistake) with its traceback; the error says it once."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        fake_log.setLevel(level)


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
            loss = _forward_and_loss(work, batch, model_input_format, loss_func)
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
            self.saved.state.add(out.untyped_storage()._cdata)
        return out


def _amp_saved_bytes(work: nn.Module, batch: Any, model_input_format: str | None,
                     loss_func: Callable[..., Any] | None, mode: FakeTensorMode, device: torch.device) -> int | None:
    """Bytes one forward saves for backward under bf16 autocast (weight casts left out), or None."""
    saved = _SavedTensors(work, {})
    try:
        with mode, FakeKernelGaps(), _WeightCasts(saved), torch.autocast(device.type, dtype=torch.bfloat16), \
                torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            _loss_of(call_model(work, batch, model_input_format), batch, loss_func)
    except Exception:  # noqa: BLE001  (a model autocast cannot run: the cost model's calibrated factor is used)
        return None
    return saved.total


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

    mode, work, batch, batch_device = _fake_setup(model, sample_batch)
    saved = _SavedTensors(work, blocks)
    measured_on = "fake"
    try:
        with _quiet_fake_tensor_log():
            fwd_flops, bwd_flops, fwd_ops, bwd_ops = _step(work, batch, model_input_format, loss_func, mode, saved)
    except StepError:
        raise
    except Exception as exc:
        # The fake run's own limits (a forward that reads values, an operation without a fake kernel): measured
        # on real tensors instead, one step on the sample batch, so the search never plans blind.
        fake_failure = _first_line(exc)
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
                f"real tensors, on the sample batch ({describe(sample_batch)}), {_first_line(real_exc, work)}"
            ) from real_exc
        logger.info("analysed %s on real tensors (one step on the sample batch): the fake-tensor run failed: %s",
                    type(model).__name__, fake_failure)

    work.zero_grad(set_to_none=True)
    amp_saved = _amp_saved_bytes(work, batch, model_input_format, loss_func, mode, batch_device)
    experts, per_token, expert_params = moe_structure(model)
    moe_layers = len(_expert_banks(model)) if experts else 0

    by_class: dict[str, list[tuple[int, int, int, bool]]] = {}
    instances = dict(model.named_modules())
    for name, path in blocks.items():
        block_params = sum(_nbytes(p) for p in instances[name].parameters())
        by_class.setdefault(path, []).append(
            (block_params, saved.by_block[name], saved.inputs[name], name in saved.attention))
    block_stats = tuple(
        BlockStats(class_path=path, count=len(sizes), param_bytes=max(s[0] for s in sizes),
                   activation_bytes=max(s[1] for s in sizes), param_bytes_total=sum(s[0] for s in sizes),
                   activation_bytes_total=sum(s[1] for s in sizes), input_bytes_total=sum(s[2] for s in sizes),
                   attention=any(s[3] for s in sizes))
        for path, sizes in sorted(by_class.items()))

    largest_layer = None
    for name, module in model.named_modules():
        own = sum(_nbytes(p) for p in module.parameters(recurse=False))
        if own and (largest_layer is None or own > largest_layer.param_bytes):
            largest_layer = LayerStats(name=name, class_path=class_path(type(module)), param_bytes=own)

    from atorch.opt_lib.tensor_parallel import kv_projection_bytes, split_layer_counts

    tp_layers, tp_params = split_layer_counts(model)

    trainable_bytes = sum(_nbytes(p) for p in trainable)
    param_bytes = sum(_nbytes(p) for p in params)
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
        buffer_bytes=sum(_nbytes(b) for b in model.buffers()),
        fwd_flops_per_sample=fwd_flops / batch_size,
        fwd_bwd_flops_per_sample=(fwd_flops + bwd_flops) / batch_size,
        fwd_ops=fwd_ops.count,
        bwd_ops=bwd_ops.count,
        block_fwd_ops=fwd_ops.in_blocks,
        fwd_lowp_ops=fwd_ops.lowp,
        param_tensors=len(trainable),
        trainable_tensor_bytes=tuple(_nbytes(p) for p in trainable),
        activation_bytes=saved.total,
        activation_bytes_outside_blocks=saved.total - sum(saved.by_block.values()),
        amp_activation_bytes=amp_saved,
        tp_kv_param_bytes=kv_projection_bytes(model),
        tp_split_layers=tp_layers,
        tp_split_params=tp_params,
        blocks=block_stats,
        largest_layer=largest_layer,
        largest_activation=saved.largest,
        experts=experts,
        experts_per_token=per_token,
        expert_param_count=expert_params,
        moe_layers=moe_layers,
        measured_on=measured_on,
    )


def _real_setup(model: nn.Module, sample_batch: Any, blocks: dict[str, str],
                fake_failure: str) -> tuple[nn.Module, Any, Any, _SavedTensors]:
    """A real copy of the model (train mode) for one measured step, where the fake run failed."""
    if any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())) or any(
            t.is_meta for t in _leaves(sample_batch)):
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


def _expert_banks(model: nn.Module) -> list[nn.Module]:
    return [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "experts"]


def moe_structure(model: nn.Module) -> tuple[int, int, int]:
    """(experts per MoE layer, experts each token visits, parameters of all experts): the modules named
    ``experts`` (transformers' convention for a layer's expert bank, stacked or a ModuleList), the counts from
    the model's config where it has one, else from the bank's shape (top-k then unknown: 0). (0, 0, 0): no MoE."""
    banks = _expert_banks(model)
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
