"""The numerics check of a dry-run: does the candidate compute what the user's model computes?

Every dry-run records the global loss of each step (``TrialResult.losses``). Its first warm-up step runs in
eval mode (dropout off: ``deterministic_step``), before any optimizer update, on the first global batch of
the candidate's dataloader. The reference is the same loss computed by a copy of the user's own model,
unchanged and in its own dtypes, on the same samples split the same way (``reference_loss``: no gradients, rank 0 only).

``loss_problem`` rejects a candidate whose loss is not finite at any step, or whose first loss departs from
the reference by more than the tolerance of the dtype it computes in (``LOSS_RTOL``). What each tolerance
covers, from the arithmetic:

* fp32 (``2**-14`` = 6.1e-5 relative): strategies that keep the user's numbers change only the order of
  sums (data-parallel reductions, a split matmul under tensor parallel); on this project's models that
  moves the loss by 1e-7 to 1e-6 relative. A plan that computes something else (a fused projection split
  twice: 1e-4 relative on the first step) is past it.
* bf16 (``8 * 2**-8`` = 3.1e-2) and fp16 (``8 * 2**-11`` = 3.9e-3): every matmul input and output rounds to
  the 16-bit format (unit roundoff ``2**-8`` and ``2**-11``), and the rounding of the logits reaches the
  loss through the log-softmax; eight units covers a few layers of it. Broken mixed precision (an overflow,
  a lost scale) is off by far more, or not finite.

A model that cannot train a step in eval mode (an eval-mode cache, as LeViT's attention biases) has no such step:
its session runs the first step in train mode and checks the losses for being finite only
(``DryRunSession.eval_step``, ``TrialResult.first_step_in_eval``).

Only the first step is compared: later steps follow each candidate's own optimizer arithmetic, which is
allowed to differ as much as the dtype does, step after step. A dry-run with fewer than two warm-up steps
has no deterministic step and is checked for finite losses only.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

LOSS_RTOL: dict[str, float] = {"fp32": 2.0**-14, "bf16": 8 * 2.0**-8, "fp16": 8 * 2.0**-11}
MIN_WARMUP_FOR_CHECK = 2  # the first warm-up step runs in eval mode; the second brings the peak in train mode


def compute_dtype(strategy: Any) -> str:
    """The dtype a strategy's matmuls compute in: "fp32", "bf16" or "fp16" (its methods say: Method.compute_dtype)."""
    return str(strategy.compute_dtype())


@contextlib.contextmanager
def deterministic_step(model: nn.Module) -> Iterator[None]:
    """Run one training step in eval mode (no dropout), then restore each module's own mode."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.train(training)


def reference_loss(setup: Any, device: torch.device, batch_size: int, micro_batches: int, data_size: int) -> float:
    """The first step's global loss with a copy of the user's own model (eval mode, no gradients): the mean
    over ``data_size`` ranks of the mean over ``micro_batches`` batches of each rank's dataloader, as
    ``atorch.train_step`` reports it. ``batch_size`` is the global batch of one micro-batch.

    A copy, as every trial gets: a forward may have side effects on its module (a LightningModule's
    training_step records its losses, logs through its Trainer), and the user's object must come out of
    the search exactly as it went in."""
    from atorch import meta_init
    from atorch.data import build_dataloader
    from atorch.model_context import InputPreparer, call_model

    prepare = InputPreparer(setup.prepare_input, device, None)
    args = {**setup.dataloader_args, "batch_size": batch_size, "num_workers": 0}
    total = 0.0
    model = meta_init.to_device(copy.deepcopy(setup.model), device)
    with deterministic_step(model), torch.no_grad():
        for rank in range(data_size):
            loader = build_dataloader(setup.dataset, args, data_size, rank, setup.distributed_sampler_cls)
            batches = iter(loader)
            for _ in range(micro_batches):
                data = prepare(next(batches))
                loss = setup.loss_func(data, call_model(model, data, setup.model_input_format))
                total += float(loss.detach().float()) / micro_batches
    return total / data_size


def loss_problem(losses: list[float], reference: float | None, dtype: str, checked_first: bool) -> str | None:
    """Why a dry-run's losses are wrong, or None. ``checked_first``: the first loss ran deterministically on
    the reference's samples and is compared with ``reference``."""
    for step, loss in enumerate(losses):
        if not math.isfinite(loss):
            return f"the loss is {loss} at step {step} (fp32 reference {reference:.6g})" if reference is not None \
                else f"the loss is {loss} at step {step}"
    if not checked_first or reference is None or not losses or not math.isfinite(reference):
        return None
    rtol = LOSS_RTOL.get(dtype, LOSS_RTOL["fp32"])
    off = abs(losses[0] - reference) / max(abs(reference), 1.0)
    if off <= rtol:
        return None
    return (f"first-step loss {losses[0]:.7g} departs from the user's model ({reference:.7g}) by {off:.2g} "
            f"relative, over the {dtype} tolerance {rtol:.2g}: the strategy changes what the model computes")
