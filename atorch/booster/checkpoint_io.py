"""The Booster's checkpoint IO: model weights in the Hugging Face layout (so a saved folder loads into
a plain, unboosted model, and with ``from_pretrained`` for transformers models), optimizer state by
parameter name, LR scheduler state as JSON.

Every function is collective (call it on every rank) and takes the accelerated objects
(``result.model`` / ``result.optim``) or plain ones. Sharded state (fsdp / zero2 / tensor-parallel
DTensors, ZeRO-1 owners, pipeline stages) is gathered whole onto rank 0, which writes; loading reads
on every rank and each takes its part. Names are the user's (no ``module.``, no wrapper parts), so a
checkpoint saved under one strategy or process count loads under another. Nothing is pickled.
"""

from __future__ import annotations

import copy
import json
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from atorch.booster.hf_files import SAFE_EXT, TensorFiles, with_prefix, write_file, write_sharded
from atorch.checkpointing.gather import gather_to_rank0, like_live, put_whole
from atorch.checkpointing.state_io import (
    CheckpointError,
    barrier,
    inner_optimizer,
    is_zero1,
    json_problems,
    listed_names,
    load_zero_state,
    param_groups_json,
    raise_agreed,
    this_rank,
    typed_like,
)
from atorch.distributed import all_gather_json
from atorch.log import get_logger
from atorch.state_names import named_state, state_roots, tied_names

logger = get_logger(__name__)

MODEL_FILES = ("model.safetensors", "pytorch_model.bin")
OPTIM_FORMAT = "atorch-optimizer"
OPTIM_META = "__atorch_optimizer__"  # in a single-file optimizer checkpoint: its JSON description as uint8
SCHEDULER_FORMAT = "atorch-lr-scheduler"


# ----- model ---------------------------------------------------------------------------------------------
def save_model(model: nn.Module, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
               prefix: str | None = None, size_per_shard: int = 1024, use_safetensors: bool = False) -> None:
    """Save the whole model's weights: one file at ``checkpoint`` (safetensors when the name ends with
    ``.safetensors`` or ``use_safetensors``), or with ``shard=True`` a directory of shards of at most
    ``size_per_shard`` MiB plus the index JSON (and ``config.json`` for a transformers model)."""
    where = f"cannot save the model to {checkpoint}"
    _check_save_args(where, gather_dtensor, size_per_shard)
    state = gather_to_rank0(_refuse_objects(where, named_state(model)))
    def write() -> None:
        safe = use_safetensors or str(checkpoint).endswith(SAFE_EXT)
        if shard:
            directory = Path(checkpoint)
            weights = with_prefix("model.safetensors" if safe else "pytorch_model.bin", prefix)
            write_sharded(directory, state, weights, size_per_shard)
            _write_hf_config(model, directory, state)
        else:
            target = Path(checkpoint)
            target.parent.mkdir(parents=True, exist_ok=True)
            write_file(target, state, safe=safe)
        logger.info("model saved to %s (%d tensors)", checkpoint, len(state))

    _write_on_rank0(where, write)


def load_model(model: nn.Module, checkpoint: str, strict: bool = True) -> None:
    """Load weights saved by ``save_model`` (or by ``save_pretrained``) into ``model`` under its strategy.

    The format is detected: an index file, a directory with exactly one index file, ``model.safetensors``
    or ``pytorch_model.bin`` in a directory, or the file itself. Values are cast to the model's dtypes.
    """
    where = f"cannot load the model from {checkpoint}"
    live = named_state(model)
    files = _agreed_files(checkpoint, MODEL_FILES, where)
    held = files.names() if files is not None else set()
    source = _sources({n for n, _ in live}, held, tied_names(model))
    problems = []
    wanted = set().union(*all_gather_json(sorted({n for n, _ in live})))  # every rank's names
    missing = sorted({n for n, _ in live} - set(source))
    unexpected = sorted(held - wanted - {a for g in tied_names(model) for a in g})
    if strict and missing:
        problems.append(f"the checkpoint has no weights for {listed_names(missing)}; it was saved from a different "
                        "model (load with strict=False to keep the current values of these)")
    if strict and unexpected:
        problems.append(f"the checkpoint has weights this model lacks: {listed_names(unexpected)}; it was saved from "
                        "a different model (load with strict=False to ignore them)")
    whole: dict[str, torch.Tensor] = {}
    try:
        for name, tensor in live:
            if name in source and name not in whole:
                whole[name] = files.get(source[name])  # type: ignore[union-attr]
                if tuple(whole[name].shape) != tuple(tensor.shape):
                    problems.append(f"'{name}' is {list(whole[name].shape)} in the checkpoint, "
                                    f"{list(tensor.shape)} here; it was saved from a model of another configuration")
    except CheckpointError as exc:  # a damaged file: raised on every rank, none is left waiting
        problems += exc.problems
    raise_agreed(where, problems)
    for name, tensor in live:
        if name in whole:
            put_whole(tensor, whole[name])
    barrier()
    logger.info("model loaded from %s (%d tensors on this rank)", checkpoint, len(whole))


def _write_on_rank0(where: str, write: Callable[[], None]) -> None:
    """Rank 0 writes; a failure there (disk full, no permission) is raised on every rank, and no rank
    goes on before the files are complete."""
    problems = []
    if this_rank() == 0:
        try:
            write()
        except OSError as exc:
            problems.append(f"writing failed: {exc}")
    raise_agreed(where, problems)


def _check_save_args(where: str, gather_dtensor: bool, size_per_shard: int) -> None:
    problems = []
    if not gather_dtensor:
        problems.append("gather_dtensor=False (each rank writing its own shards) is not supported; the folder "
                        "holds whole tensors so that it loads anywhere: use atorch.save_checkpoint for sharded "
                        "resumable checkpoints")
    if not isinstance(size_per_shard, (int, float)) or size_per_shard <= 0:
        problems.append(f"size_per_shard must be a positive number of MiB, got {size_per_shard!r}")
    raise_agreed(where, problems)


def _refuse_objects(where: str, entries: list[tuple[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    problems = [f"'{n}' is a {type(v).__name__}, not a tensor; only tensors are saved" for n, v in entries
                if not isinstance(v, torch.Tensor)]
    raise_agreed(where, problems)
    return entries


def _agreed_files(checkpoint: str, defaults: tuple[str, ...], where: str) -> TensorFiles | None:
    """The checkpoint's files, opened on every rank; an error on one rank is raised on all."""
    problems, files = [], None
    try:
        files = TensorFiles(checkpoint, defaults, where)
        files.names()
    except CheckpointError as exc:
        problems = exc.problems
    raise_agreed(where, problems)
    return files


def _sources(needed: set[str], held: set[str], tied: list[tuple[str, ...]]) -> dict[str, str]:
    """For each needed name, the saved name to read: itself, or a name it is tied to (an HF checkpoint
    stores a tied lm_head only once)."""
    out = {}
    for name in needed:
        if name in held:
            out[name] = name
            continue
        partner = next((a for g in tied if name in g for a in g if a in held), None)
        if partner is not None:
            out[name] = partner
    return out


def _write_hf_config(model: nn.Module, directory: Path, state: dict[str, torch.Tensor]) -> None:
    """config.json (and generation_config.json), as save_pretrained writes them, for a transformers model."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return
    root = state_roots(model)[0]
    if not isinstance(root, PreTrainedModel):
        return
    config = copy.deepcopy(root.config)
    floating = next((t.dtype for t in state.values() if t.is_floating_point()), None)
    if floating is not None:
        config.dtype = floating  # as save_pretrained records the dtype the weights are in
    config.architectures = [type(root).__name__]
    config.save_pretrained(directory)
    generation = getattr(root, "generation_config", None)
    if generation is not None and callable(getattr(root, "can_generate", None)) and root.can_generate():
        generation.save_pretrained(directory)


# ----- optimizer -----------------------------------------------------------------------------------------
def save_optimizer(optimizer: Any, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                   prefix: str | None = None, size_per_shard: int = 1024) -> None:
    """Save the optimizer's state, gathered whole, keyed ``state.<parameter name>.<key>``: one file
    (``.bin`` / ``.pt`` names get torch.save of tensors, others safetensors) or, with ``shard=True``, a
    directory of safetensors shards plus ``optimizer.safetensors.index.json``. The hyper-parameters
    (param_groups by parameter name) and non-tensor state values are JSON."""
    where = f"cannot save the optimizer to {checkpoint}"
    _check_save_args(where, gather_dtensor, size_per_shard)
    _refuse_engine(optimizer, where)
    inner = inner_optimizer(optimizer)
    names = _names_of(optimizer)
    zero = is_zero1(inner)
    state_of = inner.optim.state if zero else inner.state
    entries, scalars, problems = [], {}, []
    for param, name in names.items():
        for key, value in state_of.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                entries.append((f"state.{name}.{key}", value))
            elif value is None or isinstance(value, (bool, int, float, str)):
                scalars.setdefault(name, {})[key] = value
            else:
                problems.append(f"optimizer state '{name}'['{key}'] is a {type(value).__name__}; only tensors, "
                                "numbers, strings and None can be saved")
    groups = param_groups_json(inner.param_groups, names)
    problems += json_problems(groups, "param_groups")
    raise_agreed(where, problems)
    state = gather_to_rank0(entries)
    everyone = all_gather_json({"groups": groups, "scalars": scalars})
    meta = {"format": OPTIM_FORMAT, "version": 1, "class": type(inner.optim if zero else inner).__name__,
            "param_groups": _merged_groups([e["groups"] for e in everyone]),
            "scalars": {k: v for e in everyone for k, v in e["scalars"].items()}}
    def write() -> None:
        target = Path(checkpoint)
        if shard:
            write_sharded(target, state, with_prefix("optimizer.safetensors", prefix), size_per_shard, metadata=meta)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            encoded = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
            write_file(target, {**state, OPTIM_META: encoded}, safe=target.suffix not in (".bin", ".pt", ".pth"))
        logger.info("optimizer state saved to %s (%d tensors)", checkpoint, len(state))

    _write_on_rank0(where, write)


def load_optimizer(optimizer: Any, checkpoint: str) -> None:
    """Load optimizer state saved by ``save_optimizer``; the strategy and process count may differ
    (state is matched by parameter name and re-sharded onto this rank's parameters)."""
    where = f"cannot load the optimizer from {checkpoint}"
    _refuse_engine(optimizer, where)
    files = _agreed_files(checkpoint, ("optimizer.safetensors.index.json",), where)
    assert files is not None
    meta = files.metadata if files.index is not None else _single_file_meta(files, where)
    problems = []
    if meta.get("format") != OPTIM_FORMAT:
        problems.append(f"{files.path} is not an optimizer checkpoint written by save_optimizer")
    raise_agreed(where, problems)
    inner = inner_optimizer(optimizer)
    zero = is_zero1(inner)
    names = _names_of(optimizer)
    live_class = type(inner.optim if zero else inner).__name__
    saved_groups = meta["param_groups"]
    problems = _group_mismatch(saved_groups, inner.param_groups, names)
    if meta["class"] != live_class:
        problems.append(f"the state is from {meta['class']}, this optimizer is {live_class}; use the same class")
    raise_agreed(where, problems)
    by_name: dict[str, dict[str, str]] = {}
    for key in files.names() - {OPTIM_META}:
        name, state_key = key.removeprefix("state.").rsplit(".", 1)
        by_name.setdefault(name, {})[state_key] = key
    local = inner.optim if zero else inner
    targets: dict[str, dict[str, Any]] = {}
    stateless = []
    saved_as = _sources(set(names.values()), set(by_name), getattr(names, "tied", []))  # a tied copy: its partner's
    for group in local.param_groups:
        for param in group["params"]:
            name = names[param]
            keys = by_name.get(saved_as.get(name, name), {})
            targets[name] = {k: like_live(param, files.get(key)) for k, key in keys.items()}
            if by_name and not targets[name] and name not in meta["scalars"]:
                stateless.append(name)
    if stateless:  # frozen parameters have none; a trained one without state starts afresh
        logger.warning("optimizer checkpoint %s has no state for %s; it starts from none", checkpoint,
                       listed_names(stateless))
    scalars = meta["scalars"]
    if zero:
        load_zero_state(inner, names, targets, scalars, saved_groups)
    else:
        live_sd = inner.state_dict()
        index = 0
        state = {}
        for group in inner.param_groups:
            for param in group["params"]:
                entry = {**targets.get(names[param], {}), **scalars.get(names[param], {})}
                if entry:
                    state[index] = entry
                index += 1
        groups = [{**{k: typed_like(v, lg.get(k)) for k, v in sg.items() if k != "params"}, "params": ids["params"]}
                  for sg, lg, ids in zip(saved_groups, inner.param_groups, live_sd["param_groups"], strict=True)]
        inner.load_state_dict({"state": state, "param_groups": groups})
    barrier()
    logger.info("optimizer state loaded from %s", checkpoint)


def _names_of(optimizer: Any) -> dict[torch.Tensor, str]:
    """Parameter names: recorded on an accelerated optimizer when it was built; for a plain optimizer,
    positions (``group<g>.<i>``), which match a model of the same structure."""
    names = getattr(optimizer, "param_names", None)
    if names is not None:
        return names
    groups = inner_optimizer(optimizer).param_groups  # ZeRO-1: every parameter, not only this rank's
    return {p: f"group{g}.{i}" for g, group in enumerate(groups) for i, p in enumerate(group["params"])}


def _refuse_engine(optimizer: Any, where: str) -> None:
    if getattr(optimizer, "engine", None) is not None:
        raise CheckpointError(where, ["this optimizer is owned by a DeepSpeed engine, which keeps its state in its "
                                      "own partitioned layout; use result.model.save_checkpoint / load_checkpoint "
                                      "(DeepSpeed's API), or train with the default implementation"])


def _merged_groups(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The groups of every rank (pipeline stages each hold some parameters): hyper-parameters from rank 0,
    parameter names united in rank order."""
    merged = [dict(g, params=list(g["params"])) for g in per_rank[0]]
    for groups in per_rank[1:]:
        for into, group in zip(merged, groups, strict=False):
            into["params"] += [p for p in group["params"] if p not in into["params"]]
    return merged


def _group_mismatch(
    saved: list[dict[str, Any]], live: list[dict[str, Any]], names: dict[torch.Tensor, str]
) -> list[str]:
    if len(saved) != len(live):
        return [f"the checkpoint's optimizer has {len(saved)} parameter group(s), this one {len(live)}; "
                "build the optimizer with the same groups"]
    for index, (sg, lg) in enumerate(zip(saved, live, strict=True)):
        live_names = {names[p] for p in lg["params"]}
        extra = live_names - set(_sources(live_names, set(sg["params"]), getattr(names, "tied", [])))
        if extra and not all(n.startswith("group") for n in extra):
            return [f"parameter group {index} holds parameters the checkpoint's does not: {listed_names(extra)}; "
                    "build the optimizer over the same model and groups"]
    return []


def _single_file_meta(files: TensorFiles, where: str) -> dict[str, Any]:
    if OPTIM_META not in files.names():
        raise CheckpointError(where, [f"{files.path} holds no optimizer description: not written by save_optimizer"])
    return json.loads(bytes(files.get(OPTIM_META).tolist()).decode())


# ----- LR scheduler --------------------------------------------------------------------------------------
def save_lr_scheduler(lr_scheduler: Any, checkpoint: str) -> None:
    """The scheduler's state_dict as JSON (rank 0 writes)."""
    where = f"cannot save the LR scheduler to {checkpoint}"
    encoded = _to_json(lr_scheduler.state_dict())
    problems = json_problems(encoded, "lr_scheduler.state_dict()")
    raise_agreed(where, problems)
    def write() -> None:
        target = Path(checkpoint)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps({"format": SCHEDULER_FORMAT, "state": encoded}, indent=1))
        os.replace(tmp, target)

    _write_on_rank0(where, write)


def load_lr_scheduler(lr_scheduler: Any, checkpoint: str) -> None:
    where = f"cannot load the LR scheduler from {checkpoint}"
    problems, data = [], None
    try:
        data = json.loads(Path(checkpoint).read_text())
        if not isinstance(data, dict) or data.get("format") != SCHEDULER_FORMAT:
            problems.append(f"{checkpoint} is not an LR scheduler state written by save_lr_scheduler")
    except (OSError, ValueError) as exc:
        problems.append(f"{checkpoint} is not readable JSON ({exc}); give the file save_lr_scheduler wrote")
    raise_agreed(where, problems)
    lr_scheduler.load_state_dict(_from_json(data["state"]))  # type: ignore[index]


def _to_json(value: Any) -> Any:
    """JSON for a scheduler's state: tuples, Counters (MultiStepLR's milestones) and dicts with
    non-string keys are tagged so that they come back as they were."""
    if isinstance(value, Counter):
        return {"__counter__": [[_to_json(k), v] for k, v in value.items()]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _to_json(v) for k, v in value.items()}
        return {"__items__": [[_to_json(k), _to_json(v)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"__tuple__": [_to_json(v) for v in value]}
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__counter__"}:
            return Counter({_from_json(k): v for k, v in value["__counter__"]})
        if set(value) == {"__items__"}:
            return {_from_json(k): _from_json(v) for k, v in value["__items__"]}
        if set(value) == {"__tuple__"}:
            return tuple(_from_json(v) for v in value["__tuple__"])
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


# ----- LoRA ----------------------------------------------------------------------------------------------
def save_lora_as_pretrained(model: nn.Module, checkpoint: str, use_safetensors: bool = False) -> None:
    """Write the LoRA adapter (gathered whole, whatever the strategy) as a peft folder: adapter_config.json
    and adapter_model.safetensors / .bin, loadable with ``PeftModel.from_pretrained``. Rank 0 writes."""
    from atorch.booster.lora import peft_root

    where = f"cannot save the LoRA adapter to {checkpoint}"
    root, problems = None, []
    try:
        root = peft_root(model, where)
    except CheckpointError as exc:
        problems = exc.problems
    raise_agreed(where, problems)
    entries = [(n, t) for n, t in named_state(model) if "lora_" in n or getattr(t, "requires_grad", False)]
    state = gather_to_rank0(_refuse_objects(where, entries))
    def write() -> None:
        root.save_pretrained(checkpoint, state_dict=state, safe_serialization=use_safetensors)  # type: ignore[union-attr]
        logger.info("LoRA adapter saved to %s", checkpoint)

    _write_on_rank0(where, write)
