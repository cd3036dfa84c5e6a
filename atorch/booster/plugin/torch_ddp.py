"""TorchDDPPlugin: torch DDP over every process, as atorch's data-parallel strategy."""

from __future__ import annotations

from typing import Any

import torch

from atorch.booster.plugin.base import Plugin
from atorch.opt_lib.parallel_mode import ParallelMode


class TorchDDPPlugin(Plugin):
    """Colossal-AI's ``TorchDDPPlugin``, translated into atorch's strategy ``["parallel_mode"]`` (DDP over all
    processes). Precision comes from ``Booster(mixed_precision=...)``.

    Translation (argument -> atorch):
    - ``find_unused_parameters`` -> ``auto_accelerate(find_unused_parameters=...)``
    - ``bucket_cap_mb``, ``gradient_as_bucket_view``, ``static_graph``, ``check_reduction`` -> accepted: speed
      knobs; atorch's DDP keeps torch's defaults (results are the same)
    - ``broadcast_buffers`` -> True (torch's default) only: atorch's DDP broadcasts buffers
    - ``fp8_communication`` -> refused: no fp8 gradient compression in atorch
    - ``sync_bn`` (atorch) -> None: BatchNorm becomes SyncBatchNorm on CUDA (Colossal-AI's behaviour) and stays
      BatchNorm on CPU, where torch's SyncBatchNorm cannot run; True on CPU is refused
    """

    control_precision_flag = False

    def __init__(self, broadcast_buffers: bool = True, bucket_cap_mb: int = 25, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 fp8_communication: bool = False, sync_bn: bool | None = None) -> None:
        super().__init__()
        self._refuse_unless(broadcast_buffers, "broadcast_buffers", broadcast_buffers,
                            "atorch's DDP always broadcasts buffers from rank 0 (torch's default); leave it out")
        self._refuse_unless(not fp8_communication, "fp8_communication", fp8_communication,
                            "atorch has no fp8 gradient compression; leave it out")
        cuda = torch.cuda.is_available()
        self._refuse_unless(not (sync_bn and not cuda), "sync_bn", sync_bn,
                            "torch's SyncBatchNorm needs CUDA tensors; leave it out on CPU (BatchNorm stays BatchNorm)")
        self.sync_bn = cuda if sync_bn is None else bool(sync_bn)
        self.accelerate_kwargs = {"find_unused_parameters": bool(find_unused_parameters)}
        self._accepted_without_effect(
            locals(),
            ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "check_reduction"),
            "a speed knob; atorch's DDP keeps torch's defaults (the results are the same)",
        )
        self._check()

    def supported_precisions(self) -> list[str]:
        return ["fp16", "bf16", "fp8"]

    def methods(self) -> list[Any]:
        return [ParallelMode.name]

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """With sync_bn, the model's BatchNorms become SyncBatchNorms, in place as in Colossal-AI (the parameters stay
        the same objects, so the optimizer built on them still matches)."""
        if not self.sync_bn or not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            return model
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
