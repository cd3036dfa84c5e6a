"""Up-front checks of the user's dataset, loss, model and launch environment.

Each function returns problem strings (empty when all is well), each naming the fix; auto_accelerate
reports them together with every other problem before anything is built. The model runs here only on fake
tensors (the analyser's fake-tensor step: shapes, no storage), on one collated sample batch.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data._utils.collate import default_collate

from atorch.log import get_logger

logger = get_logger(__name__)

# Wrappers that atorch applies itself; a model already inside one would be wrapped twice.
_WRAPPER_NAMES = {
    "DistributedDataParallel": "DistributedDataParallel",
    "DataParallel": "DataParallel",
    "FullyShardedDataParallel": "FSDP",
    "FSDPModule": "fully_shard (FSDP2)",
    "DeepSpeedEngine": "a DeepSpeed engine",
}


def input_problems(setup: Any, save_strategy_to_file: Any = None) -> list[str]:
    """Problems of the loss_func, dataset / dataloader_args (against the model) and save path of a UserSetup."""
    loss_problems = _loss_func_problems(setup.loss_func)
    problems = loss_problems + _dataset_problems(setup, run_loss=not loss_problems)
    problems += save_path_problems(save_strategy_to_file)
    return problems


def wrapped_model_problems(model: Any) -> list[str]:
    """A model already inside a data-parallel / sharding wrapper (which atorch would apply again)."""
    if not isinstance(model, nn.Module):
        return []  # reported by the type check
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


def _dataset_problems(setup: Any, run_loss: bool = True) -> list[str]:
    dataset, args = setup.dataset, setup.dataloader_args
    if dataset is None or not isinstance(args, dict):
        return []
    if isinstance(dataset, DataLoader):
        return [
            "dataset is a torch DataLoader; pass its dataset instead (dataset=loader.dataset) and put "
            "batch_size (the global batch), collate_fn, num_workers, ... in dataloader_args: atorch builds "
            "each rank's DataLoader itself"
        ]
    problems = [
        f"dataloader_args['{key}'] cannot be used: atorch samples each rank's share itself; give a sampler "
        "class as distributed_sampler_cls (called as cls(dataset, num_replicas=, rank=, shuffle=))"
        for key in ("sampler", "batch_sampler") if key in args
    ]
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
        problems += _batch_problems(setup, run_loss)
    return problems


def _sample_batch(dataset: Any, collate_fn: Callable[[list[Any]], Any]) -> Any:
    """One batch of (up to) two samples, collated as the dataloader will; None if it cannot be read
    here (an unusual dataset or sampler index: the check is skipped, never guessed)."""
    try:
        if isinstance(dataset, IterableDataset):
            samples = []
            for sample in dataset:
                samples.append(sample)
                if len(samples) == 2:
                    break
        else:
            samples = [dataset[i] for i in range(min(2, len(dataset)))]
        return collate_fn(samples) if samples else None
    except Exception as exc:  # the dataset's own error, if real, shows when training reads it
        logger.debug("sample batch not checked: %s", exc)
        return None


def _describe(batch: Any) -> str:
    if isinstance(batch, Mapping):
        return f"a dict with keys {sorted(map(str, batch))}"
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return f"a {type(batch).__name__} of {len(batch)} element(s)"
    return f"a {type(batch).__name__}"


def _batch_problems(setup: Any, run_loss: bool = True) -> list[str]:
    """One collated batch against model_input_format and the model's forward: its structure against forward's
    signature, then one forward and the loss on fake tensors. Not with a prepare_input (the user's function is
    not called here: it may count its calls or need the training device)."""
    collate_fn = setup.dataloader_args.get("collate_fn") or default_collate
    batch = _sample_batch(setup.dataset, collate_fn)
    if batch is None:
        return []
    problems = _structure_problems(setup, batch)
    if problems or (setup.loss_func is None and setup.model_input_format is None):
        # Neither a loss_func nor an input format: the user's own loop calls the model (result.loss_func is
        # None, so the documented loop cannot run); the dataset may feed it in any way.
        return problems
    from atorch.strategy_search.analyser import step_problems

    return step_problems(setup.model, batch, setup.model_input_format, setup.loss_func if run_loss else None)


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
