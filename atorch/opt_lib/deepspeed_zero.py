"""ZeRO stages 1 and 2 (zero1, zero2), what they share: their config base, DeepSpeed's engine (their
``implementation="deepspeed"``) and where zero1 runs on FSDP2 instead (``runs_on_fsdp2``)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import Any

import torch
from pydantic import model_validator

from atorch.layer_drop import layer_drop_problems, layer_drop_settings
from atorch.lifecycle import import_off_the_stack
from atorch.log import get_logger
from atorch.opt_lib.base import MethodConfig, Preparation
from atorch.opt_lib.op_build_lock import build_directory, wait_for_build_lock

logger = get_logger(__name__)

DEEPSPEED_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's default reduce/all-gather bucket size
# ZeRO-1/2 assert that the all-gather bucket is a multiple of their NCCL start alignment (2 elements: 4 bytes of
# 16-bit values; stage_1_and_2.py, nccl_start_alignment_factor)
DEEPSPEED_BUCKET_ALIGNMENT = 2
# Why a candidate on DeepSpeed's engine is left to the analytical memory model (strategy_search.costing.tracing).
UNTRACED_ENGINE = "DeepSpeed's engine communicates as it is built"


def deepspeed_reason() -> str | None:
    """Why DeepSpeed cannot be used here, or None."""
    if importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed is not installed (pip install 'atorch[deepspeed]')"
    return None


def deepspeed_preparation() -> Preparation | None:
    """DeepSpeed's one-time work before a dry-run's clock starts (None where DeepSpeed is not installed)."""
    if deepspeed_reason() is not None:
        return None
    return Preparation("DeepSpeed's import and its compiled ops (shm_comm on CPU; compiled once per machine, "
                       "30-70 s, then loaded from its cache)", prepare_deepspeed)


class ZeroConfig(MethodConfig):
    """Base of zero1/zero2 configs: ATorch's ``use_ds_zero`` is read as ``implementation``."""

    def preparation(self) -> Preparation | None:
        return deepspeed_preparation() if getattr(self, "implementation", None) == "deepspeed" else None

    @model_validator(mode="before")
    @classmethod
    def _use_ds_zero(cls, value: Any) -> Any:
        if isinstance(value, dict) and "use_ds_zero" in value:
            value = dict(value)
            use_ds = value.pop("use_ds_zero")
            if not isinstance(use_ds, bool):
                raise ValueError(f"use_ds_zero must be True or False, got {use_ds!r}")
            if use_ds:
                value.setdefault("implementation", "deepspeed")
        return value


def _use_cpu_accelerator_off_cuda() -> None:
    if not torch.cuda.is_available():  # as init_distributed: CPU and gloo without CUDA
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


# What DeepSpeed's first engine imports, seconds each (measured with DeepSpeed 0.19.8): the engine, and the
# optimizer check's import of its Muon optimizer, which torch.compile-decorates (importing torch._inductor).
_FIRST_ENGINE_IMPORTS = ("deepspeed", "deepspeed.runtime.engine", "deepspeed.runtime.zero.muon.muon_optimizer")


def prepare_deepspeed() -> None:
    """Import what DeepSpeed's first engine imports, and build (the first time on this machine) or load
    the ops it loads: ``deepspeed.comm`` loads its shared-memory collectives (shm_comm) on the CPU
    accelerator. Done here, the engine's start later finds them imported and built."""
    _use_cpu_accelerator_off_cuda()
    for module in _FIRST_ENGINE_IMPORTS:  # in a thread: torch.compile's imports pin the stack that imports them
        with contextlib.suppress(ModuleNotFoundError):
            if importlib.util.find_spec(module) is not None:  # moved in another DeepSpeed: imported by the engine
                import_off_the_stack(module)
    builder = wait_for_deepspeed_ops()
    if builder is not None:
        builder.load(verbose=False)


def wait_for_deepspeed_ops() -> Any:
    """Wait until no build lock stands on the op DeepSpeed's engine loads (shm_comm on the CPU accelerator),
    removing one a killed build left (torch waits silently, for ever, on it); the op's builder, or None where
    DeepSpeed loads none. Called before every ``deepspeed.initialize``: the first engine of a process loads it,
    in a dry-run (after ``prepare_deepspeed``) or in a strategy the user gave."""
    _use_cpu_accelerator_off_cuda()
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    wait_for_build_lock(build_directory(builder.name))
    return builder


def bucket_elements(params: Any) -> int:
    """DeepSpeed's reduce and all-gather bucket for these parameters: no bigger than the trainable ones (its default
    is allocated whole however small the model), rounded up to its alignment (a model of an odd parameter count,
    e.g. a 3-class head, failed DeepSpeed's assertion)."""
    trainable = sum(p.numel() for p in params if p.requires_grad)
    aligned = -(-max(trainable, 1) // DEEPSPEED_BUCKET_ALIGNMENT) * DEEPSPEED_BUCKET_ALIGNMENT
    return int(min(DEEPSPEED_BUCKET_ELEMENTS, aligned))


def start_deepspeed(ctx: Any, stage: int) -> None:
    """Hand model and optimizer to a DeepSpeed engine, which then owns backward, step and sync."""
    if ctx.env.device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", str(ctx.env.local_rank))  # a plain `python` run: DeepSpeed asserts on it
    import deepspeed

    forget_destroyed_groups()
    wait_for_deepspeed_ops()
    bucket = bucket_elements(ctx.model.parameters())
    config = {
        "train_micro_batch_size_per_gpu": max(ctx.local_batch_size(), 1),
        "gradient_accumulation_steps": 1,
        # DeepSpeed's buckets default to 5e8 elements each, allocated whole however small the model
        # (2 GB of fp32 for a 1 MB model): no bucket needs to exceed the model itself.
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
        "steps_per_print": 2**31 - 1,
        # DeepSpeed clips gradients to norm 1.0 unless told otherwise; the user's optimizer
        # decides, as it does under every other method.
        "gradient_clipping": 0.0,
        # The user's optimizer runs as given (SGD, Adagrad, ...), not only DeepSpeed's tested list.
        "zero_allow_untested_optimizer": True,
    }
    engine, optimizer, _, _ = deepspeed.initialize(
        model=ctx.model, optimizer=ctx.optimizer, config=config, dist_init_required=False
    )
    ctx.model, ctx.optimizer, ctx.engine = engine, optimizer, engine
    ctx.sharded_gradients = True
    logger.info("DeepSpeed ZeRO-%d over %d processes", stage, ctx.env.world_size)


def forget_destroyed_groups() -> None:
    """DeepSpeed caches process groups in module globals (its world and data-parallel groups) from its
    first engine on. A group destroyed since (a search's trial group) would be handed to the next engine
    and fail there, so cached groups that no longer exist are dropped and DeepSpeed makes them anew."""
    from deepspeed.utils import groups
    from torch.distributed import distributed_c10d as c10d

    alive = c10d._world.pg_map
    for name, value in list(vars(groups).items()):
        if isinstance(value, c10d.ProcessGroup) and value not in alive:
            setattr(groups, name, None)
        elif isinstance(value, dict) and any(
            isinstance(g, c10d.ProcessGroup) and g not in alive for g in value.values()
        ):
            value.clear()


def deepspeed_problems(ctx: Any, config: Any) -> list[str]:
    """What keeps the DeepSpeed implementation from running here."""
    if config.implementation != "deepspeed":
        return []
    reason = deepspeed_reason()
    problems = [f"implementation 'deepspeed': {reason}; or use the default implementation"] if reason else []
    if ctx.layout.data_size != ctx.env.world_size:
        problems.append("implementation 'deepspeed' needs every process data parallel; remove other parallel_mode dims")
    # DeepSpeed's engine reduces gradients in buckets sized by the parameters each rank's step used
    return problems + layer_drop_problems(ctx.model, DEEPSPEED_BUCKETS)


# what DeepSpeed's engine does with the gradients of the model's layers (atorch.layer_drop)
DEEPSPEED_BUCKETS = "DeepSpeed's engine reduces the gradients in buckets of the parameters a step used"


def deepspeed_searchable(model: Any) -> bool:
    """Whether the search offers the DeepSpeed implementation for ``model``: installed, and every rank's step uses
    the same parameters (no random layer skipping)."""
    return deepspeed_reason() is None and not layer_drop_settings(model)


def runs_on_fsdp2(configs: Any) -> bool:
    """True where zero1 (torch implementation) runs as FSDP2 over the data dimension, as zero2 does: with a 'tensor'
    or an 'expert' dimension, whose DTensor parameters ZeroRedundancyOptimizer cannot partition. ``configs``: a
    Strategy or the method configs by name."""
    zero1, mode = configs.get("zero1"), configs.get("parallel_mode")
    return (zero1 is not None and zero1.implementation == "torch" and mode is not None
            and bool({"tensor", "expert"} & set(dict(mode.dims))))
