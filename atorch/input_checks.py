"""Up-front checks of the user's dataset, loss, model, optimizer / scheduler arguments and launch environment.

Each function returns problem strings (empty when all is well), each naming the fix; auto_accelerate
reports them together with every other problem before anything is built, in both modes. The model runs here only
on fake tensors (the analyser's fake-tensor step: shapes, no storage), on one collated sample batch; the user's
own factories (optim_func, prepare_input, ...) are never called, only torch's optimizer and scheduler classes are
built once on a stand-in parameter, and a DataLoader is constructed (no worker starts) to run torch's own checks.
The list, for users: docs/result.md ("Mistakes atorch names"); the battery: tests/test_misuse.py.
"""

from __future__ import annotations

import difflib
import inspect
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data._utils.collate import default_collate

from atorch import layer_drop
from atorch.log import get_logger
from atorch.opt_lib.registry import get_method

logger = get_logger(__name__)

# Wrappers that atorch applies itself; a model already inside one would be wrapped twice.
_WRAPPER_NAMES = {
    "DistributedDataParallel": "DistributedDataParallel",
    "DataParallel": "DataParallel",
    "FullyShardedDataParallel": "FSDP",
    "FSDPModule": "fully_shard (FSDP2)",
    "DeepSpeedEngine": "a DeepSpeed engine",
}


def input_problems(setup: Any, save_strategy_to_file: Any = None, casts: bool = False) -> list[str]:
    """Problems of the loss_func, dataset / dataloader_args (against the model) and save path of a UserSetup.

    ``casts``: the strategy given casts inputs or parameters (autocast, half): the sample step's dtypes are not
    compared."""
    loss_problems = _loss_func_problems(setup.loss_func)
    frozen = trainable_problems(setup)
    problems = frozen + loss_problems + _callable_problems(setup) + optimizer_problems(setup)
    run_loss = not loss_problems and (setup.loss_func is None or callable(setup.loss_func))
    problems += _dataset_problems(setup, run_loss=run_loss, casts=casts)
    problems += save_path_problems(save_strategy_to_file)
    return problems


def trainable_problems(setup: Any) -> list[str]:
    """A model with an optimizer but nothing to train: no parameter at all, or every one frozen."""
    if setup.optim_func is None or not isinstance(setup.model, nn.Module):
        return []  # no optimizer (evaluation, or the user updates the parameters): nothing need train
    params = list(setup.model.parameters())
    if not params:
        return [f"the model ({type(setup.model).__name__}) has no parameters, so the optimizer has nothing to train: "
                "register its layers as attributes or in nn.ModuleList / nn.ModuleDict (layers kept in a plain "
                "Python list or dict are invisible to torch), or pass optim_func=None for a model you only evaluate"]
    if not any(p.requires_grad for p in params):
        return [f"every parameter of the model ({len(params)} tensors) is frozen (requires_grad=False), so nothing "
                "would train and backward would fail: unfreeze the part to train (e.g. "
                "model.head.requires_grad_(True)) before auto_accelerate, or pass optim_func=None for a model you "
                "only evaluate"]
    return []


def _callable_problems(setup: Any) -> list[str]:
    """prepare_input, distributed_sampler_cls and lr_scheduler_cls against how atorch calls them."""
    problems = []
    if setup.prepare_input is not None:
        if not callable(setup.prepare_input):
            problems.append("prepare_input must be callable as prepare_input(data, device), got "
                            f"{type(setup.prepare_input).__name__}")
        elif (sig := _signature(setup.prepare_input)) is not None and not _binds(sig, object(), object()):
            problems.append(f"prepare_input{_plain(sig)} cannot be called as prepare_input(data, device): atorch "
                            "passes the batch and the training device; give it these two parameters and return "
                            "the batch on that device")
    sampler = setup.distributed_sampler_cls
    if sampler is not None:
        if not isinstance(sampler, type) and not callable(sampler):
            problems.append(f"distributed_sampler_cls must be a sampler class, got an instance of "
                            f"{type(sampler).__name__}; pass the class (e.g. DistributedSampler): atorch calls it as "
                            "cls(dataset, num_replicas=, rank=, shuffle=) on each rank")
        elif (sig := _signature(sampler)) is not None and not _binds(sig, object(), num_replicas=1, rank=0,
                                                                     shuffle=False):
            problems.append(f"distributed_sampler_cls {getattr(sampler, '__name__', sampler)}{_plain(sig)} cannot be "
                            "called as cls(dataset, num_replicas=, rank=, shuffle=), as atorch calls it on each rank")
    param_func = setup.optim_param_func
    if param_func is not None:
        if not callable(param_func):
            problems.append(f"optim_param_func must be callable as optim_param_func(model) -> parameters or parameter "
                            f"groups, got {type(param_func).__name__}")
        elif (sig := _signature(param_func)) is not None and not _binds(sig, object()):
            problems.append(f"optim_param_func{_plain(sig)} cannot be called as optim_param_func(model): atorch "
                            "passes your model and gives what it returns to optim_func; give it one parameter")
    sched = setup.lr_scheduler_cls
    if sched is not None and isinstance(setup.lr_scheduler_args, dict):
        name = getattr(sched, "__name__", type(sched).__name__)
        if isinstance(sched, torch.optim.lr_scheduler.LRScheduler) or not callable(sched):
            problems.append(f"lr_scheduler_cls must be a scheduler class, got an instance of {type(sched).__name__}; "
                            "pass the class and its arguments in lr_scheduler_args (atorch builds it on its "
                            "optimizer)")
        elif (sig := _signature(sched)) is not None:
            found = _kwargs_problems("lr_scheduler_args", setup.lr_scheduler_args, sig, name,
                                     "cls(optimizer, **lr_scheduler_args)", first=1)
            if not found and isinstance(sched, type) and sched.__module__.startswith("torch.optim"):
                try:  # torch's schedulers check their arguments when built: on a stand-in optimizer
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        sched(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), **setup.lr_scheduler_args)
                except (ValueError, TypeError) as exc:
                    found.append(f"lr_scheduler_args {setup.lr_scheduler_args} are refused by {name}: "
                                 f"{type(exc).__name__}: {exc}; fix lr_scheduler_args")
            problems += found
    return problems


def _binds(sig: inspect.Signature, *args: Any, **kwargs: Any) -> bool:
    try:
        sig.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


# Keys of other libraries' optimizer configs, and what torch's optimizers call them.
_KEY_ALIASES = {"learning_rate": "lr", "learningrate": "lr", "lr_rate": "lr", "epsilon": "eps", "beta1": "betas",
                "beta2": "betas", "beta_1": "betas", "beta_2": "betas", "decay": "weight_decay", "wd": "weight_decay",
                "l2": "weight_decay", "nesterov_momentum": "nesterov", "batchsize": "batch_size", "bs": "batch_size",
                "workers": "num_workers", "n_workers": "num_workers", "num_worker": "num_workers",
                "steps": "step_size", "step": "step_size", "t_max": "T_max", "tmax": "T_max"}


def _closest(key: str, names: list[str]) -> str | None:
    alias = _KEY_ALIASES.get(key.lower())
    if alias in names:
        return alias
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    return close[0] if close else None


def _kwargs_problems(label: str, args: dict[str, Any], sig: inspect.Signature, name: str, call: str,
                     first: int) -> list[str]:
    """``args`` as keyword arguments of ``sig`` after ``first`` positional ones: unknown keys (with the closest
    known one) and missing required parameters."""
    params = list(sig.parameters.values())
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    names = [p.name for p in params[first:] if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                           inspect.Parameter.KEYWORD_ONLY)]
    problems = []
    unknown = [k for k in args if k not in names] if not takes_any else []
    passed = params[0].name if first and params else None
    if passed in unknown:  # optim_args['params'], lr_scheduler_args['optimizer']: atorch passes it
        unknown.remove(passed)
        problems.append(f"{label}[{passed!r}] cannot be given: atorch passes it itself ({call}, built on the "
                        f"accelerated model); remove {passed!r} from {label}")
    for key in unknown:
        close = _closest(str(key), names)
        problems.append(f"{label}[{key!r}] is not an argument of {name} (atorch calls {call}); "
                        + (f"did you mean {close!r}? " if close else "")
                        + f"{name} takes: {', '.join(names) or 'no keyword arguments'}")
    if not unknown and not problems and not _binds(sig, *([object()] * first), **args):
        missing = [p.name for p in params[first:] if p.default is inspect.Parameter.empty and p.name not in args
                   and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
        what = f"misses required argument(s) {missing}" if missing else "does not fit its signature"
        problems.append(f"{label} {args} {what}: atorch calls {call}, i.e. {name}{_plain(sig)}; "
                        f"add {' and '.join(repr(m) for m in missing) or 'the arguments it needs'} to {label}")
    return problems


_DEVICE_KEYS = {"fused", "foreach", "capturable", "differentiable"}


def optimizer_problems(setup: Any) -> list[str]:
    """optim_args against optim_func's signature; a torch optimizer class is also built once on a stand-in
    parameter (its own checks: lr >= 0, betas, ...). A user's function is never called here."""
    func, args = setup.optim_func, setup.optim_args
    if func is None or not callable(func) or not isinstance(args, dict):
        return []
    name = getattr(func, "__name__", type(func).__name__)
    sig = _signature(func)
    if sig is None:
        return []
    problems = _kwargs_problems("optim_args", args, sig, name, "optim_func(params, **optim_args)", first=1)
    if problems or not (isinstance(func, type) and issubclass(func, torch.optim.Optimizer)
                        and func.__module__.startswith("torch.optim")) or set(args) & _DEVICE_KEYS:
        return problems  # (a device-dependent option is checked where the parameters are)
    try:
        func([nn.Parameter(torch.zeros(1))], **args)
    except (ValueError, TypeError) as exc:
        problems.append(f"optim_args {args} are refused by {name}: {type(exc).__name__}: {exc}; fix the value in "
                        "optim_args")
    return problems


def wrapped_model_problems(model: Any) -> list[str]:
    """A model already inside a data-parallel / sharding wrapper (which atorch would apply again)."""
    if not isinstance(model, nn.Module):
        return []  # reported by the type check
    if type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
        return ["the model is a torch.compile()d module; pass the module itself (model._orig_mod, or the model "
                "before torch.compile): atorch rewrites the plain module (data parallel, sharding, precision) and a "
                "compiled wrapper would hide it; compile the result's model afterwards if you wish"]
    for name, module in model.named_modules():
        for cls in type(module).__mro__:
            if cls.__name__ in _WRAPPER_NAMES:
                where = "the model" if not name else f"module '{name}' of the model"
                return [
                    f"{where} is already wrapped in {_WRAPPER_NAMES[cls.__name__]}; pass the plain nn.Module: "
                    "atorch applies data parallel / sharding itself, as the strategy says"
                ]
    return []


def _signature(func: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):  # builtins and some C callables have none: nothing to check
        return None


def _plain(sig: inspect.Signature) -> inspect.Signature:
    """The signature without annotations: short, and the same whether annotations are strings or not."""
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return sig.replace(parameters=params, return_annotation=inspect.Signature.empty)


def _loss_func_problems(loss_func: Any) -> list[str]:
    if loss_func is None or not callable(loss_func):
        return []
    sig = _signature(loss_func)
    if sig is None:
        return []
    try:
        sig.bind(object(), object())
    except TypeError:
        name = getattr(loss_func, "__name__", type(loss_func).__name__)
        return [f"loss_func {name}{_plain(sig)} cannot be called as loss_func(data, output): atorch passes the batch "
                "and the model's output; give it exactly these two required positional parameters"]
    return []


def _dataset_problems(setup: Any, run_loss: bool = True, casts: bool = False) -> list[str]:
    dataset, args = setup.dataset, setup.dataloader_args
    if dataset is None or not isinstance(args, dict):
        return []
    if isinstance(dataset, DataLoader):
        return [
            "dataset is a torch DataLoader; pass its dataset instead (dataset=loader.dataset) and put "
            "batch_size (the global batch), collate_fn, num_workers, ... in dataloader_args: atorch builds "
            "each rank's DataLoader itself"
        ]
    if isinstance(dataset, Iterator) and not isinstance(dataset, IterableDataset):
        return [f"dataset is a one-pass iterator ({type(dataset).__name__}, e.g. a generator): it would be used up "
                "by the first epoch (and by atorch's sample batch); pass a Dataset, or an IterableDataset whose "
                "__iter__ starts the stream anew on every call"]
    size = dataset_len(dataset)
    if size == 0:
        return ["dataset is empty (len(dataset) == 0): the dataloader would yield no batch and a training loop "
                "over it would do nothing; pass the dataset with its samples (check its path or filter)"]
    problems = [
        f"dataloader_args['{key}'] cannot be used: atorch samples each rank's share itself; give a sampler "
        "class as distributed_sampler_cls (called as cls(dataset, num_replicas=, rank=, shuffle=))"
        for key in ("sampler", "batch_sampler") if key in args
    ]
    if not problems and (sig := _signature(DataLoader)) is not None:
        problems += _kwargs_problems("dataloader_args", args, sig, "torch's DataLoader",
                                     "DataLoader(dataset, **dataloader_args)", first=1)
    if not problems and "collate_fn" in args and args["collate_fn"] is not None and not callable(args["collate_fn"]):
        problems.append(f"dataloader_args['collate_fn'] must be callable (a list of samples -> a batch), got "
                        f"{type(args['collate_fn']).__name__}")
    batch_size = args.get("batch_size", 1)
    if not problems and not isinstance(dataset, IterableDataset) and isinstance(batch_size, int) \
            and not isinstance(batch_size, bool) and batch_size > 0:
        try:  # torch's own checks of its arguments (num_workers, prefetch_factor, ...); no worker starts here
            DataLoader(dataset, **{k: v for k, v in args.items() if k != "shuffle"})
        except (ValueError, TypeError) as exc:
            problems.append(f"dataloader_args {args} are refused by torch's DataLoader: {type(exc).__name__}: {exc}")
    if isinstance(dataset, IterableDataset):
        if args.get("shuffle"):
            problems.append("dataloader_args['shuffle']=True with an IterableDataset: a stream is read in order "
                            "(atorch gives each rank every n-th sample); shuffle inside the dataset and drop "
                            "'shuffle'")
        if setup.distributed_sampler_cls is not None:
            problems.append("distributed_sampler_cls with an IterableDataset: a stream has no sampler (atorch "
                            "gives each rank every n-th sample); drop distributed_sampler_cls")
    known_format = setup.model_input_format in (None, "unpack_sequence", "unpack_dict", "input_target")
    if not problems and known_format and setup.prepare_input is None and isinstance(setup.model, nn.Module):
        problems += _batch_problems(setup, run_loss, casts)
    return problems


class _BatchProblem(Exception):
    """Reading or collating the sample batch failed as the dataloader would (the message is the problem)."""


def _sample_batch(dataset: Any, collate_fn: Callable[[list[Any]], Any], own_indices: bool = False) -> Any:
    """One batch of (up to) two samples, collated as the dataloader will; None if it cannot be read here (a
    dataset indexed by a sampler of the user's: the check is skipped, never guessed). Raises _BatchProblem when
    dataset[0] or the collate_fn fails: the dataloader would fail the same way."""
    try:
        if isinstance(dataset, IterableDataset):
            samples = []
            for sample in dataset:
                samples.append(sample)
                if len(samples) == 2:
                    break
        else:
            samples = [dataset[i] for i in range(min(2, len(dataset)))]
    except Exception as exc:  # noqa: BLE001
        if own_indices:  # a sampler of the user's may index otherwise
            logger.debug("sample batch not checked: %s", exc)
            return None
        how = "iterating the dataset" if isinstance(dataset, IterableDataset) else "reading dataset[0] and dataset[1]"
        raise _BatchProblem(f"{how} ({type(dataset).__name__}) raised {type(exc).__name__}: {exc}; the dataloader "
                            "reads samples the same way (integer indices 0..len-1): fix the dataset's "
                            f"{'__iter__' if isinstance(dataset, IterableDataset) else '__getitem__ / __len__'}"
                            ) from exc
    if not samples:
        return None
    try:
        return collate_fn(samples)
    except Exception as exc:  # noqa: BLE001
        name = getattr(collate_fn, "__name__", type(collate_fn).__name__)
        fix = ("samples of different shapes (sequences of different lengths) need a collate_fn that pads them, "
               "e.g. transformers' DataCollatorWithPadding or torch.nn.utils.rnn.pad_sequence"
               if "equal size" in str(exc) or "same size" in str(exc) else "fix the collate_fn or the samples")
        raise _BatchProblem(f"collating two samples with {name} (as the dataloader will) raised "
                            f"{type(exc).__name__}: {' '.join(str(exc).split())}; {fix}") from exc


def _describe(batch: Any) -> str:
    if isinstance(batch, Mapping):
        return f"a dict with keys {sorted(map(str, batch))}"
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return f"a {type(batch).__name__} of {len(batch)} element(s)"
    return f"a {type(batch).__name__}"


def _batch_problems(setup: Any, run_loss: bool = True, casts: bool = False) -> list[str]:
    """One collated batch against model_input_format and the model's forward: its structure against forward's
    signature, then one forward and the loss on fake tensors. Not with a prepare_input (the user's function is
    not called here: it may count its calls or need the training device)."""
    collate_fn = setup.dataloader_args.get("collate_fn") or default_collate
    try:
        batch = _sample_batch(setup.dataset, collate_fn, own_indices=setup.distributed_sampler_cls is not None)
    except _BatchProblem as exc:
        return [str(exc)]
    if batch is None:
        return []
    problems = _structure_problems(setup, batch)
    if problems or (setup.loss_func is None and setup.model_input_format is None):
        # Neither a loss_func nor an input format: the user's own loop calls the model (result.loss_func is
        # None, so the documented loop cannot run); the dataset may feed it in any way.
        return problems
    from atorch.strategy_search.costing.diagnosis import step_problems

    return step_problems(setup.model, batch, setup.model_input_format, setup.loss_func if run_loss else None,
                         casts=casts)


def dataset_len(dataset: Any) -> int | None:
    """len(dataset), or None where it has none (a stream) or it fails."""
    try:
        return len(dataset)
    except Exception:  # noqa: BLE001  (TypeError for a stream without len; a user's __len__ failing: not judged)
        return None


def _structure_problems(setup: Any, batch: Any) -> list[str]:
    fmt = setup.model_input_format
    is_dict = isinstance(batch, Mapping)
    is_seq = isinstance(batch, (list, tuple)) and not is_dict
    if fmt == "unpack_dict" and not is_dict:
        return [f"model_input_format='unpack_dict' calls model(**batch), but a batch is {_describe(batch)}; "
                "use model_input_format='unpack_sequence' (model(*batch)) or None (model(batch)), or make the "
                "dataset / collate_fn yield dicts"]
    if fmt == "input_target" and not (is_seq and len(batch) >= 1):
        return [f"model_input_format='input_target' calls model(batch[0]), but a batch is {_describe(batch)}; "
                "make the dataset / collate_fn yield (input, target) pairs"]
    if fmt == "unpack_sequence" and not is_seq:
        return [f"model_input_format='unpack_sequence' calls model(*batch), but a batch is {_describe(batch)}; "
                + ("use model_input_format='unpack_dict' (model(**batch))" if is_dict else
                   "use model_input_format=None (model(batch))")
                + ", or make the dataset / collate_fn yield tuples"]
    sig = _signature(setup.model.forward)
    if sig is None:
        return []
    try:
        if fmt == "unpack_dict":
            sig.bind(**{str(k): None for k in batch})
        elif fmt == "unpack_sequence":
            sig.bind(*batch)
        elif fmt == "input_target":
            sig.bind(batch[0])
        else:
            sig.bind(batch)
    except TypeError as exc:
        call = {"unpack_dict": "model(**batch)", "unpack_sequence": "model(*batch)",
                "input_target": "model(batch[0])"}.get(fmt, "model(batch)")
        return [f"model_input_format={fmt!r} calls {call} with {_describe(batch)}, which "
                f"{type(setup.model).__name__}.forward{_plain(sig)} does not accept ({exc}); change the dataset / "
                "collate_fn or model_input_format to match forward"]
    return []


def save_path_problems(path: Any) -> list[str]:
    """save_strategy_to_file must be writable where it is written (rank 0), checked before training."""
    if path is None or path == "":
        return []
    if not isinstance(path, (str, os.PathLike)):
        return [f"save_strategy_to_file must be a path (str or os.PathLike), got {type(path).__name__}"]
    if _rank() != 0:
        return []  # only rank 0 writes it
    target = Path(path)
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.exists():
        return [f"save_strategy_to_file {str(path)!r}: directory '{parent}' does not exist; create it first"]
    if not parent.is_dir():
        return [f"save_strategy_to_file {str(path)!r}: '{parent}' is not a directory"]
    if target.is_dir():
        return [f"save_strategy_to_file {str(path)!r} is a directory; give a file path such as "
                f"'{target / 'strategy.json'}'"]
    if not os.access(target if target.exists() else parent, os.W_OK):
        return [f"save_strategy_to_file {str(path)!r} is not writable; choose a path this process may write"]
    return []


def _rank() -> int:
    if dist.is_initialized():
        return dist.get_rank()
    value = os.environ.get("RANK", "0")
    return int(value) if value.isdigit() else 0


def launch_problems(environ: Mapping[str, str] | None = None) -> list[str]:
    """The torchrun environment, before a process group is created from it.

    Without MASTER_ADDR/MASTER_PORT a process would start alone (a one-process group) even though
    WORLD_SIZE says it has peers: every process would train by itself.
    """
    if dist.is_initialized():
        return []  # the user created the process group; the environment is not read
    env = os.environ if environ is None else environ
    problems: list[str] = []
    values: dict[str, int] = {}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        raw = env.get(name)
        if raw in (None, ""):
            continue
        if not raw.strip().isdigit():
            problems.append(f"environment variable {name}={raw!r} is not a non-negative integer; "
                            "launch with torchrun, which sets it")
        else:
            values[name] = int(raw)
    world = values.get("WORLD_SIZE", 1)
    if "WORLD_SIZE" in values and world < 1:
        problems.append("environment variable WORLD_SIZE=0; launch with torchrun --nproc_per_node=N")
    if world > 1:
        missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not env.get(n)]
        if missing:
            problems.append(
                f"WORLD_SIZE={world} but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set, "
                "so the processes cannot meet (each would train alone); launch with torchrun "
                "(torchrun --nproc_per_node=N train.py), which sets them, or set MASTER_ADDR and MASTER_PORT"
            )
        if "RANK" not in values and not any(p.startswith("environment variable RANK") for p in problems):
            problems.append(f"WORLD_SIZE={world} but RANK is not set; launch with torchrun, which sets it")
    if "RANK" in values and values["RANK"] >= world:
        problems.append(f"RANK={values['RANK']} is not below WORLD_SIZE={world}; launch with torchrun")
    if "LOCAL_RANK" in values:
        local_world = values.get("LOCAL_WORLD_SIZE", world)
        if values["LOCAL_RANK"] >= local_world:
            problems.append(f"LOCAL_RANK={values['LOCAL_RANK']} is not below "
                            f"{'LOCAL_WORLD_SIZE' if 'LOCAL_WORLD_SIZE' in values else 'WORLD_SIZE'}={local_world}; "
                            "launch with torchrun")
        if "RANK" in values and values["LOCAL_RANK"] > values["RANK"]:
            problems.append(f"LOCAL_RANK={values['LOCAL_RANK']} is above RANK={values['RANK']}; "
                            "launch with torchrun")
    return problems


def unused_parameter_problems(setup: Any, strategy: Any, data_size: int) -> list[str]:
    """Trainable parameters that get no gradient, under DDP without find_unused_parameters: DDP waits for their
    gradients and fails at the next step ("Expected to have finished reduction in the prior iteration")."""
    if data_size < 2 or setup.find_unused_parameters or setup.optim_func is None \
            or not isinstance(setup.model, nn.Module) \
            or any(get_method(item.name).keeps_replicas_without_ddp(item.config) for item in strategy.methods):
        return []
    if dropped := layer_drop.layer_drop_settings(setup.model):
        # a sample step may keep every layer (Wav2Vec2's 0.1 drops one of two layers in a fifth of its steps): the
        # setting is the cause, named whatever one step shows
        return [f"{layer_drop.shown(dropped)} skips whole layers at random in training, so a step can leave "
                f"their parameters without gradient, and DDP over {data_size} data-parallel processes waits for "
                "every gradient: training would fail at the step after ('Expected to have finished reduction in the "
                f"prior iteration'); pass find_unused_parameters=True, or set {dropped[0][0]} = 0"]
    if setup.dataset is None or setup.prepare_input is not None \
            or setup.loss_func is None and setup.model_input_format is None:
        return []
    try:
        batch = _sample_batch(setup.dataset, setup.dataloader_args.get("collate_fn") or default_collate,
                              own_indices=setup.distributed_sampler_cls is not None)
    except _BatchProblem:
        return []
    if batch is None:
        return []
    from atorch.strategy_search.costing.diagnosis import unused_parameters

    unused = unused_parameters(setup.model, batch, setup.model_input_format, setup.loss_func)
    if not unused:
        return []
    shown = ", ".join(repr(n) for n in unused[:6]) + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
    return [f"trainable parameters get no gradient in a step on the sample batch ({shown}: not used by forward or "
            f"the loss), and DDP over {data_size} data-parallel processes waits for every gradient, so training would "
            "fail at the second step ('Expected to have finished reduction in the prior iteration'); pass "
            "find_unused_parameters=True, or freeze what is not trained (module.requires_grad_(False))"]
