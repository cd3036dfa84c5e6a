"""The user's mistakes, found by one step of the user's model and loss on fake tensors before anything is built.

``step_problems`` (run by input_checks on one collated sample batch, in both modes: this module imports no search)
and the analysis (``analyser.analyse``, whose forward and loss are ``forward_and_loss``) judge the same step: a
failure that is the user's mistake (a loss in torch's ``(input, target)`` order, a batch that does not match
``model_input_format``, a shape mismatch) is a ``StepError`` naming the batch's structure and shapes and the fix;
so is a loss that is not a scalar tensor with a grad path to the parameters, a step that mixes dtypes torch's
kernels refuse (their fake kernels do not), token ids beyond an embedding, and (with ``loss_func`` run on zeros
shaped as the output and the real sample batch) targets out of range or a loss that reads values. A failure of the
fake run itself (a forward that reads values, an op without a fake kernel) is not reported here, and the search
measures what the analysis could not predict. ``unused_parameters``: the trainable parameters one step leaves
without a gradient.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils._python_dispatch import TorchDispatchMode

from atorch.errors import SetupError
from atorch.log import get_logger
from atorch.model_context import call_model
from atorch.strategy_search.costing.fake_kernels import FakeKernelGaps
from atorch.strategy_search.costing.fake_step import (
    fake_setup,
    map_tensors,
    nbytes,
    quiet_fake_tensor_log,
    tensor_leaves,
)

logger = get_logger(__name__)


# ----- the user's step: forward and loss, and what is wrong with them ----------------------------------

def loss_of(output: Any, batch: Any, loss_func: Callable[..., Any] | None) -> torch.Tensor | None:
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
        loss = next((t for t in tensor_leaves(list(output.values()) if isinstance(output, dict) else output)
                     if t.requires_grad), None)
    if loss is None or not loss.requires_grad:
        return None
    return loss if loss.numel() == 1 else loss.float().sum()


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
            tensors = [t for t in tensor_leaves(list(args)) if t.is_floating_point() or name not in _NORM_OPS]
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


def first_line(exc: BaseException, module: nn.Module | None = None, limit: int = 300) -> str:
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
        params = inspect.signature(model.forward).parameters
        sig = f"{type(model).__name__}.forward{inspect.signature(model.forward)}"
    except (TypeError, ValueError):
        params, sig = {}, f"{type(model).__name__}.forward"
    unnamed = _unnamed_keys(batch, params) if model_input_format == "unpack_dict" and is_dict else ""
    return (f"{unnamed}Make the dataset's samples match {sig} as {_CALLS.get(model_input_format, 'model(batch)')} "
            "calls it (number, order and shapes of the inputs), or change model_input_format")


def _unnamed_keys(batch: Mapping, params: Mapping[str, inspect.Parameter]) -> str:
    """The batch's keys that forward does not name (a ``**kwargs`` forward, transformers' models, swallows them
    and fails later for want of the input they were meant to be), each with the parameter it may be a typo of."""
    named = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not named:
        return ""
    unknown = [str(k) for k in batch if k not in params]
    if not unknown:
        return ""
    close = {k: difflib.get_close_matches(k, named, n=1, cutoff=0.7) for k in unknown}
    keys = ", ".join(f"{k!r}" + (f" (did you mean {close[k][0]!r}?)" if close[k] else "") for k in unknown)
    return f"The batch's key(s) {keys} name no parameter of forward. "


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


def forward_and_loss(work: nn.Module, batch: Any, model_input_format: str | None,
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
            f"{type(work).__name__}.forward raised {first_line(exc, work)}. "
            f"{_forward_hint(work, batch, model_input_format)}") from exc
    try:
        return loss_of(output, batch, loss_func)
    except Exception as exc:
        if not _users_mistake(exc):
            raise
        name = _loss_name(loss_func)
        what = "the model's own loss" if loss_func is None else "loss_func" + (
            f" ({name})" if name != "loss_func" else "")
        raise StepError(
            f"{what} fails on a sample batch: atorch calls loss_func(data, output), data being the batch "
            f"({describe(batch)}) and output the model's output ({describe(output)}); "
            f"{str(exc) if isinstance(exc, _NotATensor) else 'it raised ' + first_line(exc)}. "
            f"{_loss_hint(loss_func, batch, output, exc)}".rstrip(". ")) from exc


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
        with quiet_fake_tensor_log(), torch.random.fork_rng(devices=[]):
            mode, work, batch, _ = fake_setup(model, sample_batch)
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
        logger.debug("the sample step was not checked on fake tensors: %s", first_line(exc))
    return []


def unused_parameters(model: nn.Module, sample_batch: Any, model_input_format: str | None = None,
                      loss_func: Callable[..., Any] | None = None) -> list[str] | None:
    """Names of the trainable parameters that get no gradient in one step on ``sample_batch`` (fake tensors:
    forward, the loss, backward), or None where the step cannot run here (the other checks report a mistake)."""
    try:
        with quiet_fake_tensor_log(), torch.random.fork_rng(devices=[]):
            mode, work, batch, _ = fake_setup(model, sample_batch)
            with mode, FakeKernelGaps():
                loss = loss_of(call_model(work, batch, model_input_format), batch, loss_func)
                if loss is None:
                    return None
                loss.backward()
    except Exception as exc:  # noqa: BLE001  (not checked: the step's own problems are reported elsewhere)
        logger.debug("unused parameters not checked: %s", first_line(exc))
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
        logger.debug("the sample backward did not run on fake tensors: %s", first_line(exc))
        return None
    return any(p.grad is not None for p in work.parameters())


def _param_dtypes(model: nn.Module) -> str:
    dtypes = sorted({_dtype(p.dtype) for p in model.parameters() if p.is_floating_point()})
    return " and ".join(dtypes) if dtypes else "none (no floating parameters)"


def _dtype_hint(model: nn.Module, batch: Any, exc: BaseException | None = None) -> str:
    params = {p.dtype for p in model.parameters() if p.is_floating_point()}
    inputs = sorted({_dtype(t.dtype) for t in tensor_leaves(batch) if t.is_floating_point() and t.dtype not in params})
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
    for fake, real in zip(list(tensor_leaves(batch)), list(tensor_leaves(sample_batch)), strict=False):
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
                f"{type(work).__name__}.forward raised {first_line(exc, work)}. Do not move tensors or modules to "
                "'cuda' inside forward or the dataset (atorch places the model and result.prepare_input the batch "
                "on result.args.device); create new tensors on an input's device (device=x.device)") from exc
        if isinstance(exc, _MixedDtypes) or any(w in str(exc).lower() for w in _DTYPE_WORDS):
            what = (f"would run {exc}, which torch refuses ('mat1 and mat2 must have the same dtype')"
                    if isinstance(exc, _MixedDtypes) else f"raised {first_line(exc, work)}")
            raise StepError(
                f"dtype mismatch: the model's forward fails on a sample batch in the model's own dtypes: "
                f"model_input_format={model_input_format!r} calls {_CALLS.get(model_input_format, 'model(batch)')} "
                f"with the batch, {describe(batch)}, and {type(work).__name__}.forward {what}. "
                f"{_dtype_hint(work, batch, exc)}") from exc
        raise StepError(
            f"the model's forward fails on a sample batch: model_input_format={model_input_format!r} calls "
            f"{_CALLS.get(model_input_format, 'model(batch)')} with the batch, {describe(batch)}, and "
            f"{type(work).__name__}.forward raised {first_line(exc, work)}. "
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
        outs = list(real_output.values()) if isinstance(real_output, Mapping) else real_output
        leaves = [t for t in tensor_leaves(outs) if t.requires_grad]
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
        if not any(t.requires_grad for t in tensor_leaves(list(output.values()) if isinstance(output, Mapping)
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
        f"({describe(batch)}) and output the model's output ({describe(output)}); it raised {first_line(exc)}. "
        f"{hint}".rstrip(". ")) from exc


_REAL_OUTPUT_LIMIT = 64 * 2**20  # bytes of real stand-ins of the output made for the loss check


def _real_loss(loss_func: Callable[..., Any], sample_batch: Any,
               output: Any) -> tuple[Any, Exception | None, Any] | None:
    """loss_func on the real sample batch and zeros shaped as the fake output (requiring grad where it does):
    (loss, None, stand-ins), (None, exception, stand-ins), or None where it cannot run here (a meta batch, a large
    output)."""
    leaves = list(tensor_leaves(sample_batch))
    outs = list(tensor_leaves(list(output.values()) if isinstance(output, Mapping) else output))
    if any(t.is_meta for t in leaves) or not outs or sum(nbytes(t) for t in outs) > _REAL_OUTPUT_LIMIT:
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
        with torch.enable_grad(), torch.random.fork_rng(devices=[]), quiet_fake_tensor_log():
            return loss_func(sample_batch, real_output), None, real_output
    except Exception as exc:  # noqa: BLE001  (judged by the caller)
        return None, exc, real_output


