"""Checkpoints of an accelerated result: a sharded save/load that resumes training exactly, and a
consolidated single-file export of the model weights.

A checkpoint is a directory:
  ``.metadata``, ``__<rank>_<n>.distcp``  torch.distributed.checkpoint (DCP) files, tensors only:
      ``model.<fqn>``              model parameters and buffers (DTensor shards under fsdp/zero2)
      ``optim.<fqn>.<key>``        optimizer state of each parameter (exp_avg, step, ...)
      ``rng.cpu.<rank>``, ``rng.cuda.<rank>``  each process's random generator state
  ``atorch_checkpoint.json``  everything else, as JSON: step, extras, optimizer hyper-parameters,
      LR scheduler and grad scaler state, and the name/shape/dtype of every tensor saved.

Names are clean FQNs (no DDP ``module.``, no activation-checkpoint wrapper part, no pipeline stage
prefix: see keys.py) and tensors are global (DTensor shards under fsdp / tensor parallel),
so a checkpoint does not depend on the layout or the number of processes that wrote it: DCP reshards
on load, and a pipeline stage saves and loads only the entries it holds.
ZeRO-1 (ZeroRedundancyOptimizer) is handled without consolidating on one rank: each rank writes
the optimizer state of the parameters it owns under the same keys, and on load reads the entries
of the parameters it owns then. Nothing here pickles or runs code on load: DCP's ``.metadata`` (a
pickle torch writes) is read by reader.py, which builds only DCP's own types. A save writes
into a directory beside ``path`` and renames it into place once complete (atomic_dir.py), so a
crash leaves the previous checkpoint; the JSON file is written last, so a directory without it is
reported as incomplete rather than loaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from itertools import chain
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from atorch.checkpointing import atomic_dir, qkv
from atorch.checkpointing.keys import CheckpointNames
from atorch.distributed import agreed_problems, all_gather_json
from atorch.errors import CheckpointError
from atorch.log import get_logger

logger = get_logger(__name__)

META_FILE = "atorch_checkpoint.json"
FORMAT = "atorch-checkpoint"
FORMAT_VERSION = 1
_LISTED = 6  # names shown per kind of mismatch


# ----- public API ---------------------------------------------------------------------------
def save_checkpoint(
    path: str | os.PathLike, result: Any, step: int | None = None, extra: dict[str, Any] | None = None
) -> None:
    """Save model, optimizer, LR scheduler, grad scaler and RNG state of ``result`` to directory ``path``.

    Call on every process (it is collective); ``path`` must be on a file system all of them see.
    ``step`` and ``extra`` (JSON values: numbers, strings, lists, dicts with string keys) come
    back from ``load_checkpoint``. An existing checkpoint at ``path`` is replaced atomically: the new
    one is written beside it and renamed into place once complete, so a crash leaves the old one.
    """
    write_checkpoint(path, result, step, extra)


def write_checkpoint(path: str | os.PathLike, result: Any, step: int | None = None,
                     extra: dict[str, Any] | None = None, files: dict[str, bytes] | None = None) -> None:
    """``save_checkpoint``, with ``files`` (name -> contents, rank 0's) written into the checkpoint too."""
    import torch.distributed.checkpoint as dcp  # imported on use: it takes seconds
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    where = f"cannot save checkpoint to {os.fspath(path)}"
    _refuse_deepspeed(result, "save_checkpoint")
    problems = []
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        problems.append(f"step must be an int or None, got {step!r}")
    if extra is not None and not isinstance(extra, dict):
        problems.append(f"extra must be a dict (of JSON values) or None, got {type(extra).__name__}")
    problems += json_problems(extra or {}, "extra")
    model, optim = result.model, inner_optimizer(result.optim)
    names = CheckpointNames(model)  # the user's names under every layout (pipeline stages included)
    fqns = names.params()
    if is_zero1(optim):
        model_sd = names.outward(get_model_state_dict(model), {})[0]
        optim_state = {fqns[p]: dict(s) for p, s in optim.optim.state.items()}
    elif optim.state:
        model_sd, osd = get_state_dict(model, optim)
        model_sd, optim_state = names.outward(model_sd, osd["state"])
    else:  # nothing stepped yet: get_state_dict would initialise the state with a dummy step
        model_sd, optim_state = names.outward(get_model_state_dict(model), {})
    tensors, scalars, split_problems = _split(model_sd, optim_state)
    problems += split_problems
    # GPT-2's fused q|k|v rows, reordered by tensor_parallel, are written whole in the user's order.
    tensors = qkv.to_user_order(tensors, qkv.reordered_layers(model, names.user))
    tensors.update(_rng_tensors())
    scheduler = result.lr_scheduler.state_dict() if result.lr_scheduler is not None else None
    scaler = getattr(result.optim, "grad_scaler", None)
    scaler_state = scaler.state_dict() if scaler is not None else None
    groups = param_groups_json(optim.param_groups, fqns)
    problems += json_problems(scheduler, "lr_scheduler.state_dict()") + json_problems(groups, "param_groups")
    problems += json_problems(scaler_state, "grad_scaler.state_dict()")
    directory = atomic_dir.real_target(path)
    problems += atomic_dir.replace_problems(directory, (META_FILE, ".metadata"))
    raise_agreed(where, problems)

    # Every rank's tensor names, (non-tensor) optimizer values and parameters, so the JSON describes all
    # (a pipeline stage holds only its own).
    gathered = all_gather_json({"tensors": _describe(tensors), "scalars": scalars, "groups": groups})
    groups = _merged_groups([g["groups"] for g in gathered])
    meta = {
        "format": FORMAT, "version": FORMAT_VERSION, "step": step, "extra": extra or {},
        "world_size": _world_size(),
        "tensors": dict(sorted(chain.from_iterable(g["tensors"].items() for g in gathered))),
        "optimizer": {
            "class": type(optim.optim if is_zero1(optim) else optim).__name__,
            "param_groups": groups,
            "scalars": {k: v for g in gathered for k, v in g["scalars"].items()},
        },
        "lr_scheduler": scheduler,
        "grad_scaler": scaler_state,
        "skipped_steps": int(getattr(result.optim, "skipped_steps", 0)),  # steps dropped for inf/nan gradients
    }
    # Written into a staging directory beside the target, put in place once every rank's files are.
    staging = _on_rank0(where, lambda: atomic_dir.prepare(directory))
    dcp.save(tensors, checkpoint_id=staging)  # each rank's files synced; rank 0 writes .metadata last

    def describe() -> None:  # the description last: without it a directory is not a checkpoint
        for name, data in {**(files or {}), META_FILE: json.dumps(meta, indent=1).encode()}.items():
            atomic_dir.write_durably(staging / name, data)

    _on_rank0(where, describe)  # also waits for every rank's DCP files
    replaced = _on_rank0(where, lambda: atomic_dir.commit(staging, directory))
    if this_rank() == 0:  # the new checkpoint is in place: the others go on while the old one is removed
        atomic_dir.remove_replaced(replaced)
    logger.info("checkpoint saved to %s (%d tensors, step %s)", directory, len(meta["tensors"]), step)


def _on_rank0(where: str, work: Any) -> Any:
    """Rank 0 runs ``work`` (file-system changes) while the others wait: its result (a path) on every rank,
    or its error raised on every rank."""
    value, problems = None, []
    if this_rank() == 0:
        try:
            value = work()
        except OSError as exc:
            problems.append(f"on rank 0: {exc}; check the path's permissions and free space")
    answer = all_gather_json({"path": os.fspath(value) if isinstance(value, Path) else None, "problems": problems})[0]
    if answer["problems"]:
        raise CheckpointError(where, answer["problems"])
    return Path(answer["path"]) if answer["path"] is not None else None


def load_checkpoint(path: str | os.PathLike, result: Any) -> dict[str, Any]:
    """Restore a checkpoint written by ``save_checkpoint`` into ``result`` in place.

    Call on every process. The strategy, the number of processes and the precision may differ
    from the saving run (DCP reshards, and casts to this run's dtypes). Returns
    ``{"step": ..., "extra": {...}}`` as given to save_checkpoint.
    The random generators are restored as they were at the save, so create data iterators (which
    draw a seed) before loading when bitwise-identical dropout matters.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    where = f"cannot load checkpoint {os.fspath(path)}"
    _refuse_deepspeed(result, "load_checkpoint")
    directory = atomic_dir.resolve(Path(path))  # or the previous one, when a save of it was interrupted
    meta = _read_meta(directory, where)
    from atorch.checkpointing.reader import load_tensors, read_metadata  # imports DCP: seconds

    read_metadata(directory / ".metadata")  # refused here, on every rank, before any collective
    saved: dict[str, dict[str, Any]] = meta["tensors"]
    model, optim = result.model, inner_optimizer(result.optim)
    names = CheckpointNames(model)  # the user's names under every layout (pipeline stages included)
    fqns = names.params()
    zero = is_zero1(optim)
    has_optim_state = any(k.startswith("optim.") for k in saved) or bool(meta["optimizer"]["scalars"])
    live_optim: dict[str, dict[str, Any]] = {}
    if zero:
        live_model = get_model_state_dict(model)
        model_sd, optim_targets = names.outward(live_model, {})[0], _zero_targets(optim, fqns, saved)
    elif has_optim_state:
        live_model, osd = get_state_dict(model, optim)  # allocates the state (sharded like the params)
        live_optim = osd["state"]
        model_sd, optim_targets = names.outward(live_model, live_optim)
    else:
        live_model = get_model_state_dict(model)
        model_sd, optim_targets = names.outward(live_model, {})
    tensors, _, problems = _split(model_sd, optim_targets)
    # What every rank needs: under pipeline parallel each stage loads only its part of the checkpoint.
    everywhere = all_gather_json({"model": sorted(model_sd), "groups": [[fqns[p] for p in g["params"]]
                                                                         for g in optim.param_groups]})
    problems += _model_mismatches(tensors, saved, {n for e in everywhere for n in e["model"]})
    if not problems:  # with another model, differences in its optimizer are only noise
        live_class = type(optim.optim if zero else optim).__name__
        problems += _optimizer_mismatches(tensors, saved, zero, meta["optimizer"]["class"], live_class)
        problems += _group_problems(meta["optimizer"]["param_groups"], [e["groups"] for e in everywhere])
    if result.lr_scheduler is not None and meta["lr_scheduler"] is None:
        problems.append("the checkpoint has no LR scheduler state but this run has an lr_scheduler; "
                        "save with the scheduler, or build this run without lr_scheduler_cls")
    raise_agreed(where, problems)

    tensors.update(_rng_targets(saved))
    tensors, reordered = qkv.user_order_targets(tensors, qkv.reordered_layers(model, names.user))
    load_tensors(tensors, directory)  # DCP, its metadata unpickled by a reader that builds only DCP's types
    qkv.to_live_order(tensors, reordered)
    _restore_rng(tensors)
    # Take the loaded values from the flat dict (whether DCP filled the tensors in place or not).
    model_sd = {fqn: tensors[f"model.{fqn}"] for fqn in model_sd}
    optim_targets = {fqn: {k: tensors.get(f"optim.{fqn}.{k}", v) for k, v in entry.items()}
                     for fqn, entry in optim_targets.items()}
    groups = meta["optimizer"]["param_groups"]
    scalars = meta["optimizer"]["scalars"]
    scalars = {live: scalars[names.optim_key(live)] for live in live_optim if names.optim_key(live) in scalars}
    live_sd, live_state = names.inward(live_model, live_optim, model_sd, optim_targets)
    if zero:
        set_model_state_dict(model, live_sd)
        load_zero_state(optim, fqns, optim_targets, meta["optimizer"]["scalars"], groups)
    elif has_optim_state:
        state = {fqn: {**entry, **scalars.get(fqn, {})} for fqn, entry in live_state.items()}
        typed = names.live_groups(_typed_groups(groups, optim.param_groups), optim.param_groups)
        set_state_dict(model, optim, model_state_dict=live_sd, optim_state_dict={"state": state, "param_groups": typed})
    else:
        set_model_state_dict(model, live_sd)
        _set_hyperparameters(optim.param_groups, groups)
    if result.lr_scheduler is not None:
        result.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    elif meta["lr_scheduler"] is not None:
        logger.warning("checkpoint %s has LR scheduler state; this run has no scheduler, so it is ignored", path)
    if hasattr(result.optim, "skipped_steps"):
        result.optim.skipped_steps = int(meta.get("skipped_steps", 0))
    scaler = getattr(result.optim, "grad_scaler", None)
    if scaler is not None and meta["grad_scaler"]:
        scaler.load_state_dict(meta["grad_scaler"])
    elif scaler is not None or meta["grad_scaler"]:
        logger.warning("grad scaler state %s (precision differs from the saving run)",
                       "not in the checkpoint: the scaler starts fresh" if scaler is not None else "ignored")
    logger.info("checkpoint loaded from %s (step %s)", directory, meta["step"])
    return {"step": meta["step"], "extra": meta["extra"]}


def export_consolidated(path: str | os.PathLike, result: Any) -> None:
    """Write the whole (unsharded) model state dict of ``result`` to the file ``path``.

    Collective: call on every process; rank 0 writes. Keys are the original model's names (no
    wrapper prefixes), values plain contiguous CPU tensors in the dtype trained (bf16 under
    ``half``). The format is ``torch.save`` of a dict of tensors, read with
    ``torch.load(path, weights_only=True)`` and ``model.load_state_dict(sd, strict=True)``; it
    needs no extra package and keeps tied weights loadable (safetensors refuses shared tensors).
    """
    model = result.model
    if getattr(result.optim, "engine", None) is not None:
        model = model.module  # DeepSpeed ZeRO-1/2 keeps whole parameters in the engine's module
    state = _whole_state(model)  # whole on rank 0, empty elsewhere
    problems = []
    if this_rank() == 0:
        problems = [f"'{k}' is a {type(v).__name__}, not a tensor; a consolidated export holds tensors only"
                    for k, v in state.items() if not isinstance(v, torch.Tensor)]
    raise_agreed(f"cannot export {os.fspath(path)}", problems)
    if this_rank() == 0:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        torch.save(_standalone(state), tmp)
        os.replace(tmp, target)
        logger.info("consolidated model state (%d tensors) written to %s", len(state), target)
    barrier()


# ----- optimizer and model state ------------------------------------------------------------
def _whole_state(model: Any) -> dict[str, Any]:
    """The whole model state under the user's names (and GPT-2's fused q|k|v rows in the user's order) on
    rank 0, empty elsewhere. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    names = CheckpointNames(model)
    layers = qkv.reordered_layers(model, names.user)
    if names.pipelined:  # each stage's entries, from the ranks holding them
        from atorch.checkpointing.gather import gather_to_rank0
        from atorch.state_names import named_state

        flat = qkv.to_user_order({f"model.{n}": t for n, t in named_state(model)}, layers)
        return gather_to_rank0((k[len("model."):], v) for k, v in flat.items())
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    flat = qkv.to_user_order({f"model.{k}": v for k, v in state.items()}, layers if state else {})
    return {k[len("model."):]: v for k, v in flat.items()}


def inner_optimizer(optim: Any) -> torch.optim.Optimizer:
    return getattr(optim, "optimizer", optim)  # AcceleratedOptimizer wraps the real one


def is_zero1(optim: Any) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optim, ZeroRedundancyOptimizer)


def _refuse_deepspeed(result: Any, what: str) -> None:
    if getattr(result.optim, "engine", None) is None:
        return
    raise CheckpointError(f"{what} does not support DeepSpeed", [
        "this result trains with DeepSpeed ZeRO (implementation 'deepspeed'), whose engine keeps the optimizer state "
        "in its own partitioned layout; save and resume with DeepSpeed's API instead: "
        "result.model.save_checkpoint(dir) / result.model.load_checkpoint(dir) (a pickle-based format: load "
        "only directories you wrote), or train with the default implementation to use atorch checkpoints; "
        "export_consolidated works with DeepSpeed for the model weights",
    ])


def _split(
    model_sd: dict[str, Any], optim_state: dict[str, dict[str, Any]]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], list[str]]:
    """Flat DCP tensors; the optimizer's non-tensor values (JSON); problems with other values."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    problems = []
    for fqn, value in model_sd.items():
        if isinstance(value, torch.Tensor):
            tensors[f"model.{fqn}"] = value
        else:
            problems.append(f"model state '{fqn}' is a {type(value).__name__}, not a tensor")
    for fqn, entry in optim_state.items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{fqn}.{key}"] = value
            elif value is None or isinstance(value, (bool, int, float, str)):
                scalars.setdefault(fqn, {})[key] = value
            else:
                problems.append(f"optimizer state '{fqn}'['{key}'] is a {type(value).__name__}; "
                                "only tensors, numbers, strings and None can be saved")
    return tensors, scalars, problems


def _describe(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    return {k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for k, t in tensors.items()}


def _zero_targets(zero: Any, fqns: dict[torch.Tensor, str], saved: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Tensors to load the saved state of the parameters this rank owns now into."""
    by_param: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for key, info in saved.items():
        if key.startswith("optim."):
            fqn, name = key[len("optim."):].rsplit(".", 1)
            by_param.setdefault(fqn, []).append((name, info))
    targets: dict[str, dict[str, torch.Tensor]] = {}
    for param in chain.from_iterable(g["params"] for g in zero.optim.param_groups):
        for name, info in by_param.get(fqns[param], []):
            # 0-d values ("step") stay on the CPU, as ZeroRedundancyOptimizer keeps them
            device = param.device if info["shape"] else torch.device("cpu")
            tensor = torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]), device=device)
            targets.setdefault(fqns[param], {})[name] = tensor
    return targets


def load_zero_state(zero: Any, fqns: dict[torch.Tensor, str], targets: dict[str, Any],
               scalars: dict[str, dict[str, Any]], groups: list[dict[str, Any]]) -> None:
    _set_hyperparameters(zero.param_groups, groups)
    _set_hyperparameters(zero.optim.param_groups, groups)
    local = zero.optim
    params = chain.from_iterable(g["params"] for g in local.param_groups)
    state = {}
    for index, param in enumerate(params):
        entry = {**targets.get(fqns[param], {}), **scalars.get(fqns[param], {})}
        if entry:
            state[index] = entry
    local_sd = local.state_dict()
    local_sd["state"] = state
    local.load_state_dict(local_sd)  # casts the state to each parameter's dtype and device


def param_groups_json(groups: list[dict[str, Any]], fqns: dict[torch.Tensor, str]) -> list[dict[str, Any]]:
    out = []
    for group in groups:
        entry = {k: _plain(v) for k, v in group.items() if k != "params"}
        entry["params"] = [fqns[p] for p in group["params"]]
        out.append(entry)
    return out


def _plain(value: Any) -> Any:
    """A JSON form of a hyper-parameter: 1-element tensors (a tensor lr) become numbers."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def typed_like(saved: Any, live: Any) -> Any:
    """A value read from JSON, given the type the live optimizer uses (tuple betas, tensor lr)."""
    if isinstance(live, torch.Tensor) and not isinstance(saved, torch.Tensor):
        return torch.tensor(saved, dtype=live.dtype, device=live.device)
    if isinstance(live, tuple) and isinstance(saved, list):
        return tuple(saved)
    return saved


def _typed_groups(saved: list[dict[str, Any]], live: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: typed_like(v, lg.get(k)) for k, v in sg.items()} for sg, lg in zip(saved, live, strict=True)]


def _set_hyperparameters(live: list[dict[str, Any]], saved: list[dict[str, Any]]) -> None:
    for live_group, saved_group in zip(live, saved, strict=True):
        for key, value in saved_group.items():
            if key != "params":
                live_group[key] = typed_like(value, live_group.get(key))


# ----- checks -------------------------------------------------------------------------------
def json_problems(value: Any, what: str) -> list[str]:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        return [f"{what} is not JSON ({exc}); keep to numbers, strings, None, lists and dicts with string keys"]
    return []


def _read_meta(directory: Path, where: str) -> dict[str, Any]:
    meta_path = directory / META_FILE
    if not directory.is_dir():
        raise CheckpointError(where, [f"no such directory; give the directory save_checkpoint wrote ({META_FILE} "
                                      "and DCP files)"])
    if not meta_path.is_file():
        found = "DCP files but " if (directory / ".metadata").is_file() else ""
        raise CheckpointError(where, [f"{found}no {META_FILE}: not an atorch checkpoint, or its save did not "
                                      "finish; use a directory written by atorch.save_checkpoint"])
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(where, [f"{meta_path} is not readable JSON ({exc})"]) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(where, [f"{meta_path} is not an atorch checkpoint description"])
    if meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(where, [f"checkpoint format version {meta.get('version')} is not supported "
                                      f"(this atorch reads version {FORMAT_VERSION})"])
    return meta


def listed_names(names: Iterable[str]) -> str:
    names = sorted(names)
    more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return ", ".join(names[:_LISTED]) + more


def _model_mismatches(
    targets: dict[str, torch.Tensor], saved: dict[str, dict[str, Any]], needed_everywhere: set[str]
) -> list[str]:
    """How the model of this run differs from the one saved (names, then shapes). ``needed_everywhere``:
    the names any rank loads (a pipeline stage holds only some)."""
    needed = {k[len("model."):] for k in targets if k.startswith("model.")}
    held = {k[len("model."):] for k in saved if k.startswith("model.")}
    problems = []
    if needed - held:
        problems.append(f"the checkpoint has no weights for {listed_names(needed - held)}; "
                        "it was saved from a different model")
    if held - needed_everywhere:
        problems.append(f"the checkpoint has weights this model lacks: {listed_names(held - needed_everywhere)}; "
                        "it was saved from a different model")
    reshaped = [n for n in sorted(needed & held) if list(targets["model." + n].shape) != saved["model." + n]["shape"]]
    if reshaped:
        listed = [f"{n} {saved['model.' + n]['shape']} there, {list(targets['model.' + n].shape)} here"
                  for n in reshaped[:_LISTED]]
        more = f" and {len(reshaped) - _LISTED} more" if len(reshaped) > _LISTED else ""
        transposed = all(saved["model." + n]["shape"][::-1] == list(targets["model." + n].shape) for n in reshaped)
        why = ("the weights are transposed: module_replace (transformers Conv1D -> nn.Linear) was used in one run "
               "and not in the other; load with the saving run's module_replace setting" if transposed else
               "it was saved from a model of another configuration")
        problems.append(f"weights of other shapes: {'; '.join(listed)}{more}; {why}")
    return problems


def _optimizer_mismatches(targets: dict[str, torch.Tensor], saved: dict[str, dict[str, Any]], zero: bool,
                          saved_class: str, live_class: str) -> list[str]:
    if zero:  # a ZeRO-1 rank takes whatever state its parameters have, so the class must match
        if saved_class == live_class:
            return []
        return [f"the checkpoint's optimizer state is from {saved_class}, this run uses {live_class}; "
                "use the same optimizer class to resume"]
    missing = {k[len("optim."):] for k in targets if k.startswith("optim.") and k not in saved}
    if not missing:
        return []
    return [f"the checkpoint has no optimizer state {listed_names(missing)}: it was saved with {saved_class}, "
            f"this run uses {live_class}; use the same optimizer class to resume"]


def _merged_groups(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Param groups (hyper-parameters as on the first rank) holding the parameters of every rank."""
    out = [{**g, "params": list(g["params"])} for g in per_rank[0]]
    for groups in per_rank[1:]:
        for target, group in zip(out, groups, strict=False):
            have = set(target["params"])
            target["params"] += [n for n in group["params"] if n not in have]
    return out


def _group_problems(saved: list[dict[str, Any]], live_per_rank: list[list[list[str]]]) -> list[str]:
    """``live_per_rank``: each rank's parameter names per group (their union is the model's)."""
    count = len(live_per_rank[0])
    if len(saved) != count:
        return [f"the checkpoint's optimizer has {len(saved)} parameter group(s), this one {count}; "
                "build the optimizer with the same groups (optim_param_func)"]
    for index, sg in enumerate(saved):
        if set(sg["params"]) != {n for groups in live_per_rank for n in groups[index]}:
            return [f"parameter group {index} holds other parameters than in the checkpoint; "
                    "build the optimizer with the same groups (optim_param_func)"]
    return []


# ----- random generators --------------------------------------------------------------------
def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {f"rng.cpu.{this_rank()}": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"rng.cuda.{this_rank()}"] = torch.cuda.get_rng_state()
    return out


def _rng_targets(saved: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
    """This rank's generator states, when the checkpoint has one for this rank."""
    out = {}
    for kind in ("cpu", "cuda"):
        key = f"rng.{kind}.{this_rank()}"
        if key in saved and (kind == "cpu" or torch.cuda.is_available()):
            out[key] = torch.empty(saved[key]["shape"], dtype=torch.uint8)
    return out


def _restore_rng(tensors: dict[str, torch.Tensor]) -> None:
    cpu, cuda = tensors.get(f"rng.cpu.{this_rank()}"), tensors.get(f"rng.cuda.{this_rank()}")
    if cpu is not None:
        torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


# ----- files and collectives ----------------------------------------------------------------
def _standalone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU tensors that own exactly their data (a saved view would carry its whole storage);
    tensors sharing memory (tied weights) stay shared."""
    out: dict[str, torch.Tensor] = {}
    seen: dict[tuple[Any, ...], torch.Tensor] = {}
    for key, tensor in state.items():
        tensor = tensor.detach().cpu()
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                 tuple(tensor.stride()), tensor.dtype)
        if ident not in seen:
            whole = tensor.is_contiguous() and tensor.storage_offset() == 0 and (
                tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())
            seen[ident] = tensor if whole else tensor.clone(memory_format=torch.contiguous_format)
        out[key] = seen[ident]
    return out


def this_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if _world_size() > 1:
        dist.barrier()


def raise_agreed(where: str, problems: list[str]) -> None:
    """Raise on every rank if any rank found a problem, so none is left waiting in a collective."""
    merged = agreed_problems(problems)
    if merged:
        raise CheckpointError(where, merged)
