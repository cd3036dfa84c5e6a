"""Operations whose fake-tensor (meta) kernels refuse what their real kernels run, made to run on fake tensors.

The analyser and the memory tracing run the user's model on fake tensors (shapes and dtypes, no values). Where
torch's meta kernel is stricter than the real one, the whole analysis would fail, and the search would plan
blind. ``FakeKernelGaps`` is a dispatch mode entered right above the fake mode that runs such an operation in a
form the meta kernel takes and returns what the real kernel would (shape, dtype); the modes above it (FLOP and
operation counters, the memory tracker) see the operation as the model called it.

* ``aten._grouped_mm``: transformers 5.x runs mixture-of-experts layers through it; its meta kernel accepts
  only bf16 inputs ("Expected inputs of BF16 type"), while the CPU kernel runs fp32 too. Its FLOPs are not in
  torch's FLOP registry either: ``EXTRA_FLOPS`` counts them (every routed token's rows through its expert, so
  top-k routing is counted as routed, not as if every token visited every expert).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_GROUPED_MM = torch.ops.aten._grouped_mm


def _grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """2·M·K·N summed over the groups: (tokens, K) x (groups, K, N), (groups, M, K) x (groups, K, N), and
    (M, K total) x (K total, N) with K split into groups (the weight gradient)."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(out_shape) * a_shape[-1]


EXTRA_FLOPS = {_GROUPED_MM: _grouped_mm_flops}


class FakeKernelGaps(TorchDispatchMode):
    """Runs the operations listed in this module's docstring in a form their meta kernels accept."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket is _GROUPED_MM:
            dtype = kwargs.get("out_dtype") or args[0].dtype
            if dtype != torch.bfloat16 or args[1].dtype != torch.bfloat16:
                cast = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() and i < 2
                        else a for i, a in enumerate(args)]
                bias = kwargs.get("bias")
                rest = {**kwargs, "out_dtype": None, "bias": bias.to(torch.bfloat16) if bias is not None else None}
                return func(*cast, **rest).to(dtype)
        return func(*args, **kwargs)
