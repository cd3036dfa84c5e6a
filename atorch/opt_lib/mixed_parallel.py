"""mixed_parallel: tensor × pipeline (× data) on one mesh, ATorch's form of 3-D parallelism.

``[("parallel_mode", ([("tensor", t), ("pipeline", p), ("data", d)], None)), ("mixed_parallel", config)]``
applies ``tensor_parallel`` on the 'tensor' dimension and ``pipeline_parallel`` on the 'pipeline' dimension
(each only where the layout has that dimension), with the same configs as those methods; the data
dimension is replicated per stage, or sharded with ``fsdp``, ``zero2`` or ``zero1`` (FSDP2 per stage; needed with a
tensor dimension, where zero1 runs as zero2: zero1.py). Under the tensor config's ``sequence_parallel`` the stages
exchange sequence shards (tp_sequence_vocab.py).
ATorch's keys are accepted: ``tensor_config``, and ``pipe_config`` with ``chunks`` (micro-batches) and
``pipe_schedule`` ("GPipe", "1F1B", "Interleaved1F1B").
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from atorch.opt_lib.base import Method, MethodConfig, StrategyCheck
from atorch.opt_lib.parallel_mode import ParallelMode
from atorch.opt_lib.pipeline_parallel import PIPELINE, PipelineParallel, PipelineParallelConfig
from atorch.opt_lib.registry import register
from atorch.opt_lib.tensor_parallel import TENSOR, TensorParallel, TensorParallelConfig

_SCHEDULE_NAMES = {"GPipe": "gpipe", "FillDrain": "gpipe", "1F1B": "1f1b", "Interleaved1F1B": "interleaved_1f1b"}


class MixedParallelConfig(MethodConfig):
    """The configs of tensor_parallel and pipeline_parallel, applied on the dimensions the layout has."""

    tensor: TensorParallelConfig = Field(default_factory=TensorParallelConfig,
                                         description="tensor_parallel's config (on the 'tensor' dimension)")
    pipeline: PipelineParallelConfig = Field(default_factory=PipelineParallelConfig,
                                             description="pipeline_parallel's config (on the 'pipeline' dimension)")

    @model_validator(mode="before")
    @classmethod
    def _atorch_keys(cls, value: Any) -> Any:
        if not isinstance(value, dict) or not ({"tensor_config", "pipe_config"} & set(value)):
            return value
        value = dict(value)
        if "tensor_config" in value:
            value["tensor"] = value.pop("tensor_config")
        if "pipe_config" in value:
            pipe = dict(value.pop("pipe_config"))
            if "chunks" in pipe:
                pipe["micro_batches"] = pipe.pop("chunks")
            if "pipe_schedule" in pipe:
                name = pipe.pop("pipe_schedule")
                pipe["schedule"] = _SCHEDULE_NAMES.get(name, name)
            value["pipeline"] = pipe
        return value


def _dims(configs: dict[str, Any]) -> dict[str, int]:
    mode = configs.get(ParallelMode.name)
    return dict(mode.dims) if mode is not None else {}


def expand_mixed(cfg: dict[str, Any]) -> dict[str, Any]:
    """Method configs with mixed_parallel replaced by the tensor_parallel / pipeline_parallel it stands for."""
    mixed = cfg.get("mixed_parallel")
    if mixed is None:
        return cfg
    return {**{k: v for k, v in cfg.items() if k != "mixed_parallel"}, **_stood_for(mixed, cfg)}


def _stood_for(mixed: MixedParallelConfig, cfg: dict[str, Any]) -> dict[str, Any]:
    dims = _dims(cfg)
    parts = ((TensorParallel.name, mixed.tensor, TENSOR), (PipelineParallel.name, mixed.pipeline, PIPELINE))
    return {name: config for name, config, dim in parts if dim in dims}


@register
class MixedParallel(Method):
    name = "mixed_parallel"
    group = "parallel"
    summary = "Tensor × pipeline (× data) on one mesh: tensor_parallel and pipeline_parallel on their dimensions."

    def optimizer_need(self, config: MethodConfig) -> str | None:
        return "runs the optimizer step inside train_step's schedule"

    def keeps_replicas_without_ddp(self, config: MethodConfig) -> bool:
        return True

    def schedule_micro_batches(self, config: MethodConfig) -> int:
        return int(getattr(getattr(config, "pipeline", None), "micro_batches", None) or 0)
    Config = MixedParallelConfig
    mesh_dims = (TENSOR, PIPELINE)
    needs_train_step = True  # its pipeline dimension runs a schedule

    def check(self, config: MixedParallelConfig, check: StrategyCheck) -> list[str]:  # type: ignore[override]
        dims = _dims(check.configs)
        if TENSOR not in dims and PIPELINE not in dims:
            return ["needs a 'tensor' and/or 'pipeline' dimension: add ('parallel_mode', ([('tensor', 2), "
                    "('pipeline', 2), ('data', -1)], None))"]
        problems = TensorParallel().check(config.tensor, check) if TENSOR in dims else []
        return problems + (PipelineParallel().check(config.pipeline, check) if PIPELINE in dims else [])

    def model_problems(self, ctx: Any, config: MixedParallelConfig) -> list[str]:  # type: ignore[override]
        problems = TensorParallel().model_problems(ctx, config.tensor) if TENSOR in ctx.layout.names else []
        if PIPELINE in ctx.layout.names:
            problems += PipelineParallel().model_problems(ctx, config.pipeline)
        return problems

    # ----- behaviour (atorch.apply.apply_strategy) -----------------------------------------------------------
    def stands_for(self, config: MethodConfig, configs: dict[str, MethodConfig]) -> dict[str, MethodConfig]:
        return _stood_for(config, configs)  # type: ignore[arg-type]
