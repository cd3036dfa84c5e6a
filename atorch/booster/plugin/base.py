"""What every plugin shares: argument checks, the strategy it translates into, and its dataloader.

A plugin is a TRANSLATION: its constructor arguments become an atorch strategy (a list of methods with
configs) that ``auto_accelerate`` applies, with the same engine as every other atorch entry point. Nothing
of a method is implemented here.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from atorch.errors import StrategyError
from atorch.opt_lib.precision import AmpNative, Half
from atorch.parallel_layout import ParallelLayout
from atorch.strategy import Strategy

PRECISIONS = ("fp16", "bf16", "fp32")


_ANNOUNCED: set[tuple[str, str]] = set()  # (plugin class, argument) already named in this process


def precision_methods(precision: str, master_weights: bool = True) -> list[Any]:
    """A plugin's ``precision``: fp16/bf16 with fp32 master weights is autocast over fp32 weights (amp_native,
    fp16 with a GradScaler); without master weights the whole model is cast ('half'); fp32 adds nothing."""
    if precision == "fp32":
        return []
    if master_weights:
        return [(AmpNative.name, {"dtype": precision})]
    return [(Half.name, {"dtype": precision})]


class Plugin:
    """The base of atorch's Colossal-AI plugins (Colossal-AI's Plugin ABC, as a translation)."""

    control_precision_flag = True  # the plugin's own `precision` argument decides, not Booster(mixed_precision=)

    def __init__(self) -> None:
        self.problems: list[str] = []  # filled by the subclass, raised by _check()
        self.max_norm = 0.0
        self.norm_type = 2.0
        self.accelerate_kwargs: dict[str, Any] = {}  # extra auto_accelerate keywords (find_unused_parameters)
        self.scaler_settings: dict[str, Any] = {}  # GradScaler settings for fp16 (init_scale, growth_factor, ...)
        self.no_effect: dict[str, tuple[Any, str]] = {}  # argument set by the user -> (value, why it changes nothing)

    # ----- argument checks (collected, then raised together) ---------------------------------------
    def _refuse_unless(self, ok: bool, name: str, value: Any, why: str) -> None:
        if not ok:
            self.problems.append(f"{name}={value!r}: {why}")

    def _refuse_kernel_options(self, enable_flash_attention: bool, enable_fused_normalization: bool,
                               enable_jit_fused: bool, enable_all_optimization: bool, fp8_communication: bool) -> None:
        """Colossal-AI's fused-kernel and compression switches, which atorch has no counterpart for (on CPU)."""
        self._refuse_unless(not (enable_flash_attention and not torch.cuda.is_available()), "enable_flash_attention",
                            enable_flash_attention, "flash attention kernels need a CUDA GPU; leave it out on CPU")
        for name, flag in (("enable_fused_normalization", enable_fused_normalization),
                           ("enable_jit_fused", enable_jit_fused),
                           ("enable_all_optimization", enable_all_optimization)):
            self._refuse_unless(not flag, name, flag, "atorch has no fused-kernel replacement for these layers; "
                                "leave it out")
        self._refuse_unless(not fp8_communication, "fp8_communication", fp8_communication,
                            "atorch has no fp8 gradient compression; leave it out")

    def _accepted_without_effect(self, given: dict[str, Any], names: tuple[str, ...], why: str) -> None:
        """Arguments Colossal-AI's plugin uses and atorch accepts without effect: those the user set (a value other
        than the signature's default) are named once at boost time (``announce_no_effect``)."""
        import inspect

        defaults = inspect.signature(type(self).__init__).parameters
        for name in names:
            if name in given and name in defaults and given[name] is not defaults[name].default \
                    and given[name] != defaults[name].default:
                self.no_effect[name] = (given[name], why)

    def announce_no_effect(self) -> None:
        """Log each accepted-but-ineffective argument once per process and plugin class."""
        from atorch.log import get_logger

        for name, (value, why) in self.no_effect.items():
            key = (type(self).__name__, name)
            if key not in _ANNOUNCED:
                _ANNOUNCED.add(key)
                get_logger(__name__).warning("%s(%s=%r) has no effect in atorch: %s", key[0], name, value, why)

    def _check(self) -> None:
        if self.problems:
            raise StrategyError(self.problems, what=f"{type(self).__name__} cannot be used with these arguments")

    def _precision(self, precision: Any, allowed: tuple[str, ...] = PRECISIONS) -> None:
        if precision not in allowed:
            self.problems.append(f"precision={precision!r} is not one of {', '.join(allowed)}; pass one of them")

    def _scaler(self, initial_scale: float, growth_factor: float, backoff_factor: float, growth_interval: int,
                hysteresis: int, min_scale: float, max_scale: float, hysteresis_default: int = 2) -> None:
        """Colossal-AI's loss-scale arguments, onto torch's GradScaler (used with precision 'fp16')."""
        self.scaler_settings = {"init_scale": float(initial_scale), "growth_factor": float(growth_factor),
                                "backoff_factor": float(backoff_factor), "growth_interval": int(growth_interval)}
        self._refuse_unless(hysteresis == hysteresis_default, "hysteresis", hysteresis,
                            "torch's GradScaler lowers the scale at the first overflow (no hysteresis); leave it out")
        self._refuse_unless(min_scale == 1, "min_scale", min_scale,
                            "torch's GradScaler has no lower bound for the scale; leave it out")
        self._refuse_unless(max_scale == 2**32, "max_scale", max_scale,
                            "torch's GradScaler has no upper bound for the scale; leave it out")

    # ----- Colossal-AI's capability queries ----------------------------------------------------------
    def supported_devices(self) -> list[str]:
        return ["cpu", "cuda"]

    def supported_precisions(self) -> list[str]:
        return list(PRECISIONS)

    def control_precision(self) -> bool:
        return self.control_precision_flag

    def control_device(self) -> bool:
        return True

    def control_checkpoint_io(self) -> bool:
        return True

    def support_no_sync(self) -> bool:
        return self.no_sync_refusal() is None

    def support_lora(self) -> bool:
        return True

    def no_sync_refusal(self) -> str | None:
        """Why gradient accumulation without synchronisation cannot be used (None: it can)."""
        return None

    # ----- the translation ---------------------------------------------------------------------------
    def methods(self) -> list[Any] | None:
        """The strategy (load_strategy list) this plugin means; None: found by the automatic search."""
        raise NotImplementedError

    def strategy(self, extra: list[Any] | None = None) -> Strategy | None:
        methods = self.methods()
        return None if methods is None else Strategy.load([*methods, *(extra or [])])

    def layout(self, world_size: int) -> ParallelLayout:
        strategy = self.strategy()
        if strategy is None:
            return ParallelLayout.data_parallel(world_size)
        problems = self.world_problems(world_size) or strategy.problems(world_size)
        if problems:
            raise StrategyError(problems, what=f"{type(self).__name__} does not fit {world_size} process(es)")
        return strategy.adjusted(world_size).layout(world_size)

    def is_pipeline(self) -> bool:
        return False

    def world_problems(self, world_size: int) -> list[str]:
        """Problems of these arguments at this world size, said in the plugin's terms."""
        return []

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The model handed to the engine (called by boost before the strategy is read)."""
        return model

    def prepare_dataloader(
        self, dataset: Dataset, batch_size: int, shuffle: bool = False, seed: int = 1024, drop_last: bool = False,
        pin_memory: bool = False, num_workers: int = 0, distributed_sampler_cls: type | None = None, **kwargs: Any,
    ) -> DataLoader:
        """Colossal-AI's dataloader: ``batch_size`` samples per data-parallel rank, a DistributedSampler over
        the DATA-parallel ranks of this plugin's layout (ranks of one tensor or pipeline group read the same
        batches), every worker seeded with ``seed``. As in Colossal-AI the sampler's epoch is left to the user
        (``dataloader.sampler.set_epoch(epoch)``)."""
        from atorch.distributed import init_distributed

        env = init_distributed()
        layout = self.layout(env.world_size)
        sampler_cls = distributed_sampler_cls or DistributedSampler
        sampler = sampler_cls(dataset, num_replicas=layout.data_size, rank=layout.data_rank(env.rank),
                              shuffle=shuffle)

        def seed_worker(_: int) -> None:
            torch.manual_seed(seed)
            random.seed(seed)
            try:
                import numpy as np

                np.random.seed(seed)
            except ImportError:  # numpy is optional
                pass

        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, worker_init_fn=seed_worker,
                          drop_last=drop_last, pin_memory=pin_memory, num_workers=num_workers, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.methods()})"
