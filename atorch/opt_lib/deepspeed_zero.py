"""DeepSpeed ZeRO (stages 1 and 2) behind zero1/zero2's ``use_ds_zero`` option."""

from __future__ import annotations

import importlib.util
import os
from typing import Any, ClassVar

from atorch.errors import SetupError
from atorch.log import get_logger

logger = get_logger(__name__)


class DeepSpeedZero:
    """Mixin for methods with a DeepSpeed variant: the engine owns backward, step and grad sync."""

    ds_stage: ClassVar[int]

    @staticmethod
    def deepspeed_reason() -> str | None:
        if importlib.util.find_spec("deepspeed") is None:
            return "DeepSpeed is not installed (pip install 'atorch[deepspeed]')"
        return None

    def prepare_deepspeed(self, ctx: Any) -> None:
        reason = self.deepspeed_reason()
        if reason:
            raise SetupError(f"use_ds_zero=True: {reason}; or set use_ds_zero=False")
        if ctx.dp_size != ctx.env.world_size:
            raise SetupError("use_ds_zero=True needs all processes data parallel; remove other parallel_mode dims")
        ctx.data_parallel_wrapped = True  # the engine reduces gradients itself

    def start_deepspeed(self, ctx: Any) -> None:
        if ctx.env.device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": max(ctx.local_batch_size(), 1),
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": self.ds_stage},
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
        logger.info("DeepSpeed ZeRO-%d over %d processes", self.ds_stage, ctx.env.world_size)
