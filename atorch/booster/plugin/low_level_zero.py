"""LowLevelZeroPlugin: ZeRO stage 1 / 2, translated into atorch's zero1 / zero2."""

from __future__ import annotations

from typing import Any

from atorch.booster.plugin.base import Plugin, precision_methods
from atorch.opt_lib.fp8 import FP8
from atorch.opt_lib.parallel_mode import ParallelMode
from atorch.opt_lib.sharding import Zero2
from atorch.opt_lib.zero1 import Zero1


class LowLevelZeroPlugin(Plugin):
    """Colossal-AI's ``LowLevelZeroPlugin``, translated into an atorch strategy.

    Translation (argument -> atorch):
    - ``stage=1`` / ``stage=2`` -> ``zero1`` (ZeroRedundancyOptimizer under DDP) / ``zero2`` (FSDP2, no reshard
      after forward)
    - ``precision`` fp16 / bf16 (fp32 master weights) -> ``amp_native`` with that dtype (fp16: a GradScaler)
    - ``master_weights=False`` -> ``half`` (the whole model in fp16/bf16)
    - ``precision='fp32'`` -> no precision method
    - ``initial_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval`` -> the GradScaler's settings
    - ``max_norm`` > 0, ``norm_type`` -> gradients clipped to the global norm in ``optimizer.step()`` (atorch's
      clipping)
    - ``cpu_offload`` -> ``zero2``'s ``cpu_offload`` (stage 2 only)
    - ``use_fp8`` -> ``fp8`` (skipped with the reason where unsupported)
    - ``reduce_bucket_size_in_m``, ``overlap_communication``, ``overlap_allgather``, ``verbose``, ``cast_inputs`` ->
      accepted: the engine's own bucketing and overlap; inputs are cast whenever the model is
    - ``hysteresis``, ``min_scale``, ``max_scale`` (not default), ``communication_dtype``, ``fp8_communication``,
      ``extra_dp_size`` > 1 -> refused with the reason
    """

    def __init__(self, stage: int = 1, precision: str = "fp16", initial_scale: float = 2**32, min_scale: float = 1,
                 growth_factor: float = 2, backoff_factor: float = 0.5, growth_interval: int = 1000,
                 hysteresis: int = 2, max_scale: float = 2**32, max_norm: float = 0.0, norm_type: float = 2.0,
                 reduce_bucket_size_in_m: int = 12, communication_dtype: Any = None,
                 overlap_communication: bool = True, overlap_allgather: bool = False, cpu_offload: bool = False,
                 master_weights: bool = True, verbose: bool = False, cast_inputs: bool = True,
                 fp8_communication: bool = False, use_fp8: bool = False, extra_dp_size: int = 1) -> None:
        super().__init__()
        self._refuse_unless(stage in (1, 2), "stage", stage, "use 1 (optimizer state sharded) or 2 (also gradients)")
        self._precision(precision)
        self._refuse_unless(not (cpu_offload and stage == 1), "cpu_offload", cpu_offload,
                            "stage 1 (ZeroRedundancyOptimizer) cannot offload; use stage=2 with cpu_offload=True")
        self._refuse_unless(communication_dtype is None, "communication_dtype", communication_dtype,
                            "atorch reduces gradients in their own dtype (fp32 under autocast); leave it out")
        self._refuse_unless(not fp8_communication, "fp8_communication", fp8_communication,
                            "atorch has no fp8 gradient compression; leave it out")
        self._refuse_unless(extra_dp_size == 1, "extra_dp_size", extra_dp_size,
                            "atorch's ZeRO shards over all data-parallel ranks; leave it out")
        self._refuse_unless(max_norm >= 0, "max_norm", max_norm, "use 0 (no clipping) or a positive norm")
        self._refuse_unless(cast_inputs or master_weights, "cast_inputs", cast_inputs,
                            "with master_weights=False the whole model is in half precision and needs its inputs cast")
        self._scaler(initial_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale)
        self.stage, self.precision, self.master_weights = stage, precision, master_weights
        self.cpu_offload, self.use_fp8 = cpu_offload, use_fp8
        self.max_norm, self.norm_type = float(max_norm), float(norm_type)
        self._accepted_without_effect(
            locals(),
            ("reduce_bucket_size_in_m", "overlap_communication", "overlap_allgather", "verbose",
            "cast_inputs"),
            "the engine's own bucketing and overlap; inputs are cast whenever the model is",
        )
        self._check()

    def methods(self) -> list[Any]:
        methods: list[Any] = [ParallelMode.name, *precision_methods(self.precision, self.master_weights)]
        if self.use_fp8:
            methods.append(FP8.name)
        if self.stage == 1:
            methods.append(Zero1.name)
        else:
            methods.append((Zero2.name, {"cpu_offload": True} if self.cpu_offload else {}))
        return methods
