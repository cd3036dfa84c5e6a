"""TorchFSDPPlugin: torch FSDP's arguments, translated into atorch's fsdp / zero2 (FSDP2)."""

from __future__ import annotations

from typing import Any

import torch

from atorch.booster.plugin.base import Plugin
from atorch.opt_lib.parallel_mode import ParallelMode
from atorch.opt_lib.sharding import FSDP, Zero2

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


class TorchFSDPPlugin(Plugin):
    """Colossal-AI's ``TorchFSDPPlugin``, translated into atorch's ``fsdp`` (FSDP2 ``fully_shard``).

    Translation (argument -> atorch):
    - ``sharding_strategy`` FULL_SHARD (default) / SHARD_GRAD_OP / NO_SHARD -> ``fsdp`` / ``zero2`` / plain DDP;
      HYBRID_SHARD refused
    - ``cpu_offload=CPUOffload(offload_params=True)`` -> ``cpu_offload: true``
    - ``auto_wrap_policy`` ModuleWrapPolicy / transformer_auto_wrap_policy / size_based_auto_wrap_policy ->
      ``atorch_wrap_cls`` / ``atorch_wrap_cls`` / ``wrap_min_num_params``; None: the detected blocks
    - ``mixed_precision=MixedPrecision(param_dtype=bf16/fp16)`` -> ``amp_native`` with that dtype (gradients reduced
      in fp32)
    - ``ignored_modules`` -> ``ignored_modules`` of ``fsdp``
    - ``sync_module_states`` -> accepted: atorch always starts every rank from rank 0's weights
    - ``backward_prefetch`` -> accepted: FSDP2 prefetches by itself
    - ``process_group`` (not the world), ``param_init_fn``, ``fp8_communication`` -> refused with the reason

    Unlike Colossal-AI it runs on CPU, keeps the optimizer's parameter groups, and supports ``no_sync``.
    """

    def __init__(self, process_group: Any = None, sharding_strategy: Any = None, cpu_offload: Any = None,
                 auto_wrap_policy: Any = None, backward_prefetch: Any = None, mixed_precision: Any = None,
                 ignored_modules: Any = None, param_init_fn: Any = None, sync_module_states: bool = False,
                 fp8_communication: bool = False) -> None:
        super().__init__()
        import torch.distributed as dist

        world = dist.group.WORLD if dist.is_initialized() else None
        self._refuse_unless(process_group is None or process_group is world, "process_group", process_group,
                            "atorch shards over the data dimension of its own layout; leave it out")
        self._refuse_unless(param_init_fn is None, "param_init_fn", param_init_fn,
                            "atorch initialises models built on the meta device itself (identically on every rank); "
                            "leave it out")
        self._refuse_unless(not fp8_communication, "fp8_communication", fp8_communication,
                            "atorch has no fp8 gradient compression; leave it out")
        strategy_name = getattr(sharding_strategy, "name", sharding_strategy) or "FULL_SHARD"
        self._refuse_unless(strategy_name in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"), "sharding_strategy",
                            sharding_strategy, "use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD (hybrid sharding needs a "
                            "2-D mesh: use HybridParallelPlugin or atorch's parallel_mode)")
        self.sharding = {"FULL_SHARD": FSDP.name, "SHARD_GRAD_OP": Zero2.name}.get(strategy_name)
        # sync_module_states: atorch always starts every rank from rank 0's weights (a no-op when they are equal).
        self.config: dict[str, Any] = {}
        if cpu_offload is not None and getattr(cpu_offload, "offload_params", bool(cpu_offload)):
            self.config["cpu_offload"] = True
        if ignored_modules:
            self.config["ignored_modules"] = list(ignored_modules)
        self.config.update(self._wrap_policy(auto_wrap_policy))
        self.precision = self._mixed_precision(mixed_precision)
        self._refuse_unless(self.sharding is not None or not self.config, "sharding_strategy", "NO_SHARD",
                            "cpu_offload / ignored_modules / auto_wrap_policy need sharding; use FULL_SHARD")
        self._accepted_without_effect(
            locals(),
            ("sync_module_states",),
            "atorch always starts every rank from rank 0's weights",
        )
        self._accepted_without_effect(
            locals(),
            ("backward_prefetch",),
            "FSDP2 prefetches by itself",
        )
        self._check()

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """torch FSDP takes ignored module instances; atorch takes names (or classes), the same on every rank."""
        ignored = self.config.get("ignored_modules")
        if ignored and any(isinstance(m, torch.nn.Module) for m in ignored):
            names = {id(module): name for name, module in model.named_modules()}
            missing = [m for m in ignored if isinstance(m, torch.nn.Module) and id(m) not in names]
            if missing:
                from atorch.errors import SetupError

                raise SetupError(f"ignored_modules holds {len(missing)} module(s) that are not in the boosted model")
            self.config["ignored_modules"] = [names[id(m)] if isinstance(m, torch.nn.Module) else m for m in ignored]
        return model

    def _wrap_policy(self, policy: Any) -> dict[str, Any]:
        if policy is None:
            return {}
        classes = getattr(policy, "_module_classes", None)  # torch's ModuleWrapPolicy
        keywords = getattr(policy, "keywords", None) or {}  # functools.partial of torch's policy functions
        if classes:
            return {"atorch_wrap_cls": list(classes)}
        if "transformer_layer_cls" in keywords:
            return {"atorch_wrap_cls": list(keywords["transformer_layer_cls"])}
        if "min_num_params" in keywords:
            return {"wrap_min_num_params": int(keywords["min_num_params"])}
        self.problems.append(f"auto_wrap_policy={policy!r}: atorch takes module classes (ModuleWrapPolicy, "
                             "partial(transformer_auto_wrap_policy, transformer_layer_cls=...)) or a size "
                             "(partial(size_based_auto_wrap_policy, min_num_params=...)); pass one of those")
        return {}

    def _mixed_precision(self, mp: Any) -> str:
        if mp is None:
            return "fp32"
        param, reduce = getattr(mp, "param_dtype", None), getattr(mp, "reduce_dtype", None)
        if param is None or param == torch.float32:
            return "fp32"
        self._refuse_unless(param in _DTYPES, "mixed_precision.param_dtype", param, "use torch.bfloat16 or float16")
        self._refuse_unless(reduce in (None, torch.float32), "mixed_precision.reduce_dtype", reduce,
                            "atorch reduces gradients in fp32 under autocast; leave reduce_dtype out")
        return _DTYPES.get(param, "fp32")

    def supported_precisions(self) -> list[str]:
        return ["fp16", "bf16"]

    def methods(self) -> list[Any]:
        from atorch.booster.plugin.base import precision_methods

        methods: list[Any] = [ParallelMode.name, *precision_methods(self.precision)]
        if self.sharding is not None:
            methods.append((self.sharding, dict(self.config)))
        return methods
