"""HybridParallelPlugin: tensor × pipeline × data (ZeRO), translated into atorch's parallel methods."""

from __future__ import annotations

from typing import Any

from atorch.booster.plugin.base import Plugin, precision_methods
from atorch.opt_lib.activation_checkpoint import ActivationCheckpoint
from atorch.opt_lib.fp8 import FP8
from atorch.opt_lib.parallel_mode import ParallelMode
from atorch.opt_lib.pipeline_parallel import PipelineParallel
from atorch.opt_lib.sharding import Zero2
from atorch.opt_lib.tensor_parallel import TensorParallel
from atorch.opt_lib.zero1 import Zero1

_PP_STYLES = {"1f1b": "1f1b", "interleaved": "interleaved_1f1b", "zbv": "zbv"}


class HybridParallelPlugin(Plugin):
    """Colossal-AI's ``HybridParallelPlugin``, translated into an atorch strategy on one mesh.

    Translation (argument -> atorch):
    - ``tp_size``, ``pp_size`` (data: the rest; ``dp_outside`` orders the mesh) -> ``parallel_mode`` dims tensor ×
      pipeline × data (the first varies fastest: Colossal-AI's rank order)
    - ``tp_size`` > 1 -> ``tensor_parallel`` (plans derived from the model; ``tp_plan`` (atorch) gives them by name)
    - ``pp_size`` > 1, ``pp_style`` 1f1b / interleaved / zbv, ``num_model_chunks`` -> ``pipeline_parallel`` schedule
      1f1b / interleaved_1f1b / zbv, ``virtual_stages``
    - ``num_microbatches`` / ``microbatch_size`` -> ``micro_batches`` (from the boosted dataloader's batch size for
      ``microbatch_size``)
    - ``zero_stage`` 0 / 1 / 2 -> DDP (stages and tensor-parallel shards: gradients averaged) / ``zero1`` / ``zero2``;
      with ``tp_size`` > 1 and data-parallel ranks: 0 or 2 (and 2 with ``pp_size`` > 1 too)
    - ``precision`` fp16 / bf16 / fp32 -> ``amp_native`` fp16 / bf16 / none (fp16 with ``pp_size`` > 1: the last
      stage scales the loss, every stage unscales its gradients, an overflow anywhere skips the step everywhere)
    - ``cpu_offload`` -> ``zero2``'s ``cpu_offload`` (zero_stage 2 only)
    - ``gradient_checkpoint_config`` (any) -> ``checkpoint`` of every repeated block
    - ``max_norm`` > 0 -> clip to the global norm (over stages too) in ``optimizer.step()``
    - ``use_fp8`` -> ``fp8``
    - ``find_unused_parameters`` -> ``auto_accelerate(find_unused_parameters=...)``
    - ``ddp_bucket_cap_mb``, ``gradient_as_bucket_view``, ``static_graph``, ``check_reduction``,
      ``zero_bucket_size_in_m``, ``overlap_communication``, ``overlap_allgather``, ``overlap_p2p``,
      ``enable_metadata_cache``, ``scheduler_nodes``, ``make_vocab_size_divisible_by``, ``inner_ring_size``,
      ``parallel_output`` -> accepted: speed knobs of the engine (embeddings and outputs stay whole)
    - ``enable_sequence_parallelism`` with ``sequence_parallelism_mode`` 'split_gather' (the default) and
      ``tp_size`` > 1 -> ``tensor_parallel`` with ``sequence_parallel``
    - ``custom_policy``, ``sp_size`` > 1, other sequence-parallel modes, ``num_layers_per_stage``,
      ``enable_flash_attention`` (CPU), ``enable_fused_normalization``, ``enable_jit_fused``,
      ``enable_all_optimization``, ``communication_dtype``, ``fp8_communication``, ``broadcast_buffers=False`` ->
      refused with the reason

    Under ``pp_size`` > 1 training goes through ``booster.execute_pipeline`` (the loss is returned on every rank).
    """

    def __init__(self, tp_size: int, pp_size: int, sp_size: int | None = None, precision: str = "fp16",
                 zero_stage: int = 0, enable_all_optimization: bool = False, enable_fused_normalization: bool = False,
                 enable_flash_attention: bool = False, enable_jit_fused: bool = False,
                 enable_sequence_parallelism: bool = False, sequence_parallelism_mode: str | None = None,
                 parallel_output: bool = True, num_microbatches: int | None = None,
                 microbatch_size: int | None = None, initial_scale: float = 2**16, min_scale: float = 1,
                 growth_factor: float = 2, backoff_factor: float = 0.5, growth_interval: int = 1000,
                 hysteresis: int = 2, max_scale: float = 2**32, max_norm: float = 0, broadcast_buffers: bool = True,
                 ddp_bucket_cap_mb: int = 25, find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False, zero_bucket_size_in_m: int = 12,
                 cpu_offload: bool = False, communication_dtype: Any = None, overlap_communication: bool = True,
                 custom_policy: Any = None, pp_style: str = "1f1b", num_model_chunks: int = 1,
                 scheduler_nodes: Any = None, num_layers_per_stage: Any = None,
                 gradient_checkpoint_config: Any = None, enable_metadata_cache: bool = True,
                 make_vocab_size_divisible_by: int = 64, dp_outside: bool = True, overlap_p2p: bool = True,
                 overlap_allgather: bool = False, fp8_communication: bool = False, use_fp8: bool = False,
                 inner_ring_size: int | None = None, tp_plan: dict[str, str] | None = None) -> None:
        super().__init__()
        for name, size in (("tp_size", tp_size), ("pp_size", pp_size)):
            self._refuse_unless(isinstance(size, int) and size >= 1, name, size, "use a positive int")
        self._precision(precision)
        self._refuse_unless(zero_stage in (0, 1, 2), "zero_stage", zero_stage, "use 0, 1 or 2")
        pp = pp_size if isinstance(pp_size, int) else 1
        self._refuse_unless(pp == 1 or num_microbatches is not None or microbatch_size is not None,
                            "num_microbatches", num_microbatches,
                            "pp_size > 1 needs num_microbatches or microbatch_size; give one of them")
        self._refuse_unless(pp_style in _PP_STYLES, "pp_style", pp_style, f"use one of {', '.join(_PP_STYLES)}")
        chunks_ok = {"1f1b": num_model_chunks == 1, "interleaved": num_model_chunks > 1,
                     "zbv": num_model_chunks == 2}.get(pp_style, True)
        self._refuse_unless(chunks_ok, "num_model_chunks", num_model_chunks,
                            "use 1 with pp_style '1f1b', more than 1 with 'interleaved', 2 with 'zbv'")
        self._refuse_unless(custom_policy is None, "custom_policy", custom_policy,
                            "atorch derives tensor-parallel plans from the model (ShardFormer policies do not apply); "
                            "leave it out, or give tp_plan={'layers.*.fc1': 'colwise', 'layers.*.fc2': 'rowwise'}")
        # Colossal-AI's 'split_gather' (its default mode) is tensor_parallel's sequence_parallel: norms and
        # dropout on sequence shards inside the tensor group; the other modes split attention itself.
        split_gather = enable_sequence_parallelism and sequence_parallelism_mode in (None, "split_gather")
        sp_ok = sp_size in (None, 1) and (split_gather and isinstance(tp_size, int) and tp_size > 1
                                          or not enable_sequence_parallelism and sequence_parallelism_mode is None)
        self._refuse_unless(sp_ok, "enable_sequence_parallelism / sequence_parallelism_mode / sp_size",
                            (enable_sequence_parallelism, sequence_parallelism_mode, sp_size),
                            "atorch's sequence parallelism is mode 'split_gather' with tp_size > 1 (tensor_parallel's "
                            "sequence_parallel); use that, or leave them out")
        self.sequence_parallel = split_gather
        self._refuse_unless(num_layers_per_stage is None, "num_layers_per_stage", num_layers_per_stage,
                            "atorch splits stages at the repeated blocks, balanced by cost; leave it out")
        self._refuse_kernel_options(enable_flash_attention, enable_fused_normalization, enable_jit_fused,
                                    enable_all_optimization, fp8_communication)
        self._refuse_unless(communication_dtype is None, "communication_dtype", communication_dtype,
                            "atorch reduces gradients in their own dtype; leave it out")
        self._refuse_unless(broadcast_buffers, "broadcast_buffers", broadcast_buffers,
                            "atorch's DDP always broadcasts buffers; leave it out")
        self._refuse_unless(not (cpu_offload and zero_stage != 2), "cpu_offload", cpu_offload,
                            "offload needs zero_stage=2 (FSDP2 with cpu_offload)")
        self._refuse_unless(max_norm >= 0, "max_norm", max_norm, "use 0 (no clipping) or a positive norm")
        self._scaler(initial_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale)
        self.tp_size, self.pp_size, self.zero_stage, self.precision = tp_size, pp_size, zero_stage, precision
        self.num_microbatches, self.microbatch_size = num_microbatches, microbatch_size
        self.pp_style, self.num_model_chunks, self.dp_outside = pp_style, num_model_chunks, dp_outside
        self.cpu_offload, self.use_fp8, self.tp_plan = cpu_offload, use_fp8, tp_plan
        self.checkpoint = gradient_checkpoint_config is not None
        self.max_norm = float(max_norm)
        self.accelerate_kwargs = {"find_unused_parameters": bool(find_unused_parameters)}
        self._accepted_without_effect(
            locals(),
            ("ddp_bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "check_reduction",
            "zero_bucket_size_in_m", "overlap_communication", "overlap_allgather", "overlap_p2p",
            "enable_metadata_cache", "scheduler_nodes", "make_vocab_size_divisible_by",
            "inner_ring_size", "parallel_output"),
            "a speed knob of Colossal-AI's engine (embeddings and outputs stay whole)",
        )
        self._check()

    def is_pipeline(self) -> bool:
        return self.pp_size > 1

    def no_sync_refusal(self) -> str | None:
        if self.pp_size > 1:
            return ("with pp_size > 1 the pipeline schedule accumulates over micro-batches itself: pass a bigger batch "
                    "to execute_pipeline (or raise num_microbatches) instead of no_sync")
        return None

    def world_problems(self, world_size: int) -> list[str]:
        model_parallel = self.tp_size * self.pp_size
        if world_size % model_parallel:
            return [f"tp_size × pp_size = {model_parallel} does not divide the {world_size} processes; use sizes "
                    "whose product divides the world size"]
        data = world_size // model_parallel
        if self.tp_size == 1 or data == 1:
            return []
        # tensor × data: zero_stage 0 replicates the shards (gradients averaged over the data ranks), 2 shards
        # them with FSDP2, and so does 1 (zero1 across a tensor dimension runs as zero2: atorch/opt_lib/zero1.py).
        if self.pp_size > 1 and self.zero_stage == 0:
            return [f"tp_size={self.tp_size} × pp_size={self.pp_size} with {data} data-parallel ranks needs "
                    "zero_stage=1 or 2 (FSDP2 per stage over the data dimension): replicated tensor-parallel stages "
                    f"are not supported; set zero_stage=2, or tp_size × pp_size = {world_size}"]
        return []

    def resolve_micro_batches(self, per_rank_batch: int | None) -> None:
        """``microbatch_size`` becomes a micro-batch count once the per-rank batch is known (boost)."""
        from atorch.errors import SetupError

        if self.pp_size == 1 or self.num_microbatches is not None:
            return
        if per_rank_batch is None:
            raise SetupError("HybridParallelPlugin(microbatch_size=...) needs the per-rank batch size to count "
                             "micro-batches: pass the dataloader to booster.boost, or give num_microbatches")
        if per_rank_batch % self.microbatch_size:
            raise SetupError(f"microbatch_size={self.microbatch_size} does not divide the per-rank batch of "
                             f"{per_rank_batch}; use a divisor of it")
        self.num_microbatches = per_rank_batch // self.microbatch_size

    def methods(self) -> list[Any]:
        # Colossal-AI's rank order (tensor fastest; data outside pipeline unless dp_outside=False) in
        # parallel_mode's order, where the first listed dimension varies fastest.
        outer = [["pipeline", self.pp_size], ["data", -1]]
        dims = [["tensor", self.tp_size]] + (outer if self.dp_outside else outer[::-1])
        dims = [d for d in dims if d[0] == "data" or d[1] > 1]
        methods: list[Any] = [(ParallelMode.name, {"dims": dims}), *precision_methods(self.precision)]
        if self.use_fp8:
            methods.append(FP8.name)
        if self.tp_size > 1:
            methods.append((TensorParallel.name, {**({"plan": self.tp_plan} if self.tp_plan else {}),
                                                **({"sequence_parallel": True} if self.sequence_parallel else {})}))
        if self.pp_size > 1:
            config: dict[str, Any] = {"schedule": _PP_STYLES[self.pp_style]}
            if self.num_microbatches is not None:
                config["micro_batches"] = self.num_microbatches
            if self.pp_style != "1f1b":
                config["virtual_stages"] = self.num_model_chunks
            methods.append((PipelineParallel.name, config))
        if self.checkpoint:
            methods.append(ActivationCheckpoint.name)
        if self.zero_stage == 1:
            methods.append(Zero1.name)
        elif self.zero_stage == 2:
            methods.append((Zero2.name, {"cpu_offload": True} if self.cpu_offload else {}))
        return methods
