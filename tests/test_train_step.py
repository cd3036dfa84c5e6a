"""``train_step(result, batches, max_norm=...)`` clips like ``optim.clip_grad_norm_`` before the step (one process;
under pipeline parallel the norm over every stage is checked by tests/test_vit_example.py and test_booster.py)."""

from __future__ import annotations

import torch
from toy_models import mlp, mlp_dataset, mlp_loss

import atorch
from atorch.training import train_step

ARGS = dict(dataset=mlp_dataset(), loss_func=mlp_loss, model_input_format="unpack_sequence",
            optim_args={"lr": 0.1}, dataloader_args={"batch_size": 8}, load_strategy=["parallel_mode"])


def test_max_norm_clips_the_step_as_clip_grad_norm_does() -> None:
    batch = next(iter(torch.utils.data.DataLoader(mlp_dataset(), batch_size=8)))
    weights = []
    for clip in ("train_step", "by hand", None):
        _, result, _ = atorch.auto_accelerate(mlp(), torch.optim.SGD, **ARGS)
        with result:
            if clip == "by hand":
                data = result.prepare_input(batch, result.args.device)
                result.loss_func(data, result.model(*data)).backward()
                result.optim.clip_grad_norm_(0.05)
                result.optim.step()
            else:
                train_step(result, [batch], max_norm=0.05 if clip else None)
            weights.append(torch.cat([p.detach().flatten() for p in result.model.parameters()]))
    assert torch.equal(weights[0], weights[1])  # the same clip, then the same step
    assert not torch.allclose(weights[0], weights[2])  # and the clip engaged (the norm is above 0.05)
