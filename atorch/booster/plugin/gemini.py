"""GeminiPlugin: ZeRO-3 with parameter / optimizer offload, translated into atorch's fsdp (+ CPU offload)."""

from __future__ import annotations

import warnings
from typing import Any

from atorch.booster.plugin.base import Plugin, precision_methods
from atorch.opt_lib.fp8 import FP8
from atorch.opt_lib.parallel_mode import ParallelMode
from atorch.opt_lib.sharding import FSDP, Zero2
from atorch.opt_lib.tensor_parallel import TensorParallel

# Older Gemini's placement policies (Colossal-AI < 0.3.1), which scripts still pass; the current one knows
# 'static' and 'auto' only. Both are read as the placement they named.
_LEGACY_PLACEMENT = {
    "cpu": "atorch offloads parameters, gradients and optimizer state to CPU memory, as it did (FSDP2 cpu_offload; "
           "today's spelling: placement_policy='static', offload_param_frac=1.0, offload_optim_frac=1.0)",
    "cuda": "atorch keeps parameters and optimizer state on the device, as it did (no offload; today's spelling: "
            "placement_policy='static' with the offload fractions at 0.0)",
}


class GeminiPlugin(Plugin):
    """Colossal-AI's ``GeminiPlugin`` (chunked ZeRO-3 with heterogeneous memory), translated into atorch's
    FSDP2 sharding with CPU offload.

    Translation (argument -> atorch):
    - ``shard_param_frac=1.0`` (default) / ``0.0`` -> ``fsdp`` (parameters sharded) / ``zero2`` (parameters whole)
    - ``offload_param_frac`` or ``offload_optim_frac`` = 1.0 -> ``cpu_offload: true`` (parameters, gradients and
      optimizer state in CPU memory)
    - ``placement_policy`` 'static' / 'auto' -> the same translation (FSDP2 places by the fractions above); an
      older Gemini's 'cpu' / 'cuda' -> with a warning, offload everything / nothing, as they did (numerics unchanged)
    - ``precision`` fp16 / bf16 (fp32 also accepted) -> ``amp_native`` (``master_weights=False``: ``half``)
    - ``tp_size`` > 1 -> ``parallel_mode`` tensor dimension + ``tensor_parallel`` (FSDP2 over the data dimension)
    - ``max_norm``, ``norm_type``, loss-scale arguments -> as in LowLevelZeroPlugin
    - ``enable_gradient_accumulation`` -> accepted: ``booster.no_sync`` accumulates under every data-parallel plugin
    - ``chunk_config_dict``, ``chunk_init_device``, ``search_range_m``, ``hidden_dim``, ``min_chunk_size_m``,
      ``memstats``, ``max_prefetch``, ``pin_memory``, ``warmup_non_model_data_ratio``, ``steady_cuda_cap_ratio``,
      ``gpu_margin_mem_ratio``, ``enable_async_reduce``, ``force_outputs_fp32``, ``strict_ddp_mode``, ``verbose`` ->
      accepted: chunk and placement tuning of Gemini's own memory manager; FSDP2 shards per block
    - fractions strictly between 0 and 1, ``extra_dp_size`` > 1, ``enable_flash_attention`` (CPU),
      ``enable_fused_normalization``, ``enable_jit_fused``, ``enable_sequence_parallelism``,
      ``enable_all_optimization``, ``use_fp8`` with ``tp_size`` > 1, ``fp8_communication`` -> refused with the
      reason

    Any torch optimizer is accepted (Colossal-AI requires HybridAdam / FusedAdam / CPUAdam).
    """

    def __init__(self, chunk_config_dict: Any = None, chunk_init_device: Any = None, placement_policy: str = "static",
                 enable_gradient_accumulation: bool = False, max_prefetch: int = 0, shard_param_frac: float = 1.0,
                 offload_optim_frac: float = 0.0, offload_param_frac: float = 0.0,
                 warmup_non_model_data_ratio: float = 0.8, steady_cuda_cap_ratio: float = 0.9, precision: str = "fp16",
                 master_weights: bool = True, pin_memory: bool = False, force_outputs_fp32: bool = False,
                 strict_ddp_mode: bool = False, search_range_m: int = 32, hidden_dim: int | None = None,
                 min_chunk_size_m: float = 32, memstats: Any = None, gpu_margin_mem_ratio: float = 0.0,
                 initial_scale: float = 2**16, min_scale: float = 1, growth_factor: float = 2,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2,
                 max_scale: float = 2**32, max_norm: float = 0.0, norm_type: float = 2.0, tp_size: int = 1,
                 extra_dp_size: int = 1, enable_all_optimization: bool = False,
                 enable_fused_normalization: bool = False, enable_flash_attention: bool = False,
                 enable_sequence_parallelism: bool = False, enable_jit_fused: bool = False,
                 enable_async_reduce: bool = True, use_fp8: bool = False, verbose: bool = False,
                 fp8_communication: bool = False) -> None:
        super().__init__()
        self._precision(precision)
        self._refuse_unless(placement_policy in ("static", "auto", *_LEGACY_PLACEMENT), "placement_policy",
                            placement_policy, "use 'static' or 'auto'")
        for name, frac in (("shard_param_frac", shard_param_frac), ("offload_optim_frac", offload_optim_frac),
                           ("offload_param_frac", offload_param_frac)):
            self._refuse_unless(frac in (0.0, 1.0), name, frac, "atorch shards and offloads whole tensors: use 0.0 "
                                "or 1.0")
        self._refuse_unless(extra_dp_size == 1, "extra_dp_size", extra_dp_size,
                            "atorch shards over all data-parallel ranks; leave it out")
        self._refuse_unless(tp_size >= 1, "tp_size", tp_size, "use a positive size")
        self._refuse_kernel_options(enable_flash_attention, enable_fused_normalization, enable_jit_fused,
                                    enable_all_optimization, fp8_communication)
        self._refuse_unless(not enable_sequence_parallelism, "enable_sequence_parallelism",
                            enable_sequence_parallelism, "atorch's tensor_parallel has no sequence parallelism yet")
        self._refuse_unless(max_norm >= 0, "max_norm", max_norm, "use 0 (no clipping) or a positive norm")
        self._scaler(initial_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale)
        self.precision, self.master_weights, self.tp_size, self.use_fp8 = precision, master_weights, tp_size, use_fp8
        self.sharding = FSDP.name if shard_param_frac == 1.0 else Zero2.name
        self.offload = offload_param_frac == 1.0 or offload_optim_frac == 1.0 or placement_policy == "cpu"
        if placement_policy in _LEGACY_PLACEMENT:  # neither changes numerics: only where tensors live
            warnings.warn(f"GeminiPlugin(placement_policy={placement_policy!r}) is an older Gemini's name; "
                          f"{_LEGACY_PLACEMENT[placement_policy]}", UserWarning, stacklevel=2)
        self.max_norm, self.norm_type = float(max_norm), float(norm_type)
        self._accepted_without_effect(
            locals(),
            ("enable_gradient_accumulation",),
            "booster.no_sync accumulates under every data-parallel plugin",
        )
        self._accepted_without_effect(
            locals(),
            ("chunk_config_dict", "chunk_init_device", "search_range_m", "hidden_dim",
            "min_chunk_size_m", "memstats", "max_prefetch", "pin_memory", "warmup_non_model_data_ratio",
            "steady_cuda_cap_ratio", "gpu_margin_mem_ratio", "enable_async_reduce",
            "force_outputs_fp32", "strict_ddp_mode", "verbose"),
            "chunk and placement tuning of Gemini's own memory manager; FSDP2 shards per block",
        )
        if placement_policy == "auto":
            self.no_effect["placement_policy"] = ("auto", "no adaptive placement: FSDP2 places by shard_param_frac and "
                                                  "offload_*_frac, as 'static'")
        self._check()

    def supported_precisions(self) -> list[str]:
        return ["fp16", "bf16"]

    def methods(self) -> list[Any]:
        dims = ([["tensor", self.tp_size]] if self.tp_size > 1 else []) + [["data", -1]]  # tensor varies fastest
        methods: list[Any] = [(ParallelMode.name, {"dims": dims}),
                              *precision_methods(self.precision, self.master_weights)]
        if self.use_fp8:
            methods.append(FP8.name)
        if self.tp_size > 1:
            methods.append(TensorParallel.name)
        methods.append((self.sharding, {"cpu_offload": True} if self.offload else {}))
        return methods
