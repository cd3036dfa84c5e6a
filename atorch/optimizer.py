"""The optimizer returned to the user: the real optimizer plus loss scaling, step skipping and
gradient-sync control, behind the ordinary torch.optim.Optimizer interface."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly DTensor) tensor that lives on this rank."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def grads_are_finite(optimizer: torch.optim.Optimizer) -> bool:
    """True if every gradient on every rank is finite (sharded gradients are checked per shard)."""
    bad = torch.zeros((), dtype=torch.float32)
    grads = [local_tensor(p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if grads:
        bad = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any().float().cpu()
    if dist.is_initialized() and dist.get_world_size() > 1:
        # NCCL reduces CUDA tensors only (and a rank may hold no gradient shard at all).
        nccl = dist.get_backend() == "nccl"
        bad = bad.to(torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu"))
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bool(bad.item())


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Forwards to ``optimizer``; adds ``backward``, loss scaling, skipping and gradient sync.

    It subclasses Optimizer (without its __init__) so that LR schedulers and isinstance checks
    accept it; param_groups and state are the wrapped optimizer's own.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        grad_scaler: Any = None,
        skip_if_nonfinite: bool = False,
        gradient_sync: Callable[[bool], None] | None = None,
        engine: Any = None,
    ) -> None:
        self.optimizer = optimizer
        self.grad_scaler = grad_scaler
        self.skip_if_nonfinite = skip_if_nonfinite
        self.gradient_sync = gradient_sync
        self.engine = engine  # a DeepSpeed engine owns backward and step
        self._skipped = 0  # steps skipped by the non-finite check
        # Steps the loss scaler skipped, summed on the device: reading it each step would stall a GPU.
        self._scaler_skipped: torch.Tensor | None = None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because gradients held inf/nan (on any rank)."""
        pending = int(self._scaler_skipped.item()) if self._scaler_skipped is not None else 0
        return self._skipped + pending

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped, self._scaler_skipped = int(value), None

    # The wrapped optimizer's own data, so schedulers change the real learning rate.
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def backward(self, loss: torch.Tensor) -> None:
        if self.engine is not None:
            self.engine.backward(loss)
        elif self.grad_scaler is not None:
            self.grad_scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if self.engine is not None:
            self.engine.step()
            self._clip_in_engine(0.0)  # a clip applies to the step it was asked for
            return None
        self._complete_gradient_sync()
        if self.grad_scaler is not None:
            result = self.grad_scaler.step(self.optimizer)
            self._count_scaler_skip()
            self.grad_scaler.update()
            return result
        if self.skip_if_nonfinite and not grads_are_finite(self.optimizer):
            self._skipped += 1
            return None
        return self.optimizer.step(closure)

    def _count_scaler_skip(self) -> None:
        # GradScaler keeps this step's inf/nan flags until update(); add them up without a sync.
        state = self.grad_scaler._per_optimizer_states.get(id(self.optimizer), {})
        flags = list(state.get("found_inf_per_device", {}).values())
        if not flags:
            return
        skipped = (torch.stack([f.to(flags[0].device) for f in flags]).sum() > 0).to(torch.int64)
        self._scaler_skipped = skipped if self._scaler_skipped is None else self._scaler_skipped + skipped

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.engine is not None:
            self.engine.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Call in each training pass when accumulating, before its forward (cheapest) or before its
        backward: False leaves the gradient reduction out, True (the boundary pass) reduces."""
        if self.engine is not None:
            self.engine.set_gradient_accumulation_boundary(is_boundary)
        elif self.gradient_sync is not None:
            self.gradient_sync(is_boundary)

    def _complete_gradient_sync(self) -> None:
        # DDP: a boundary declared after the forward of its pass is reduced here (atorch/grad_sync.py).
        complete = getattr(self.gradient_sync, "complete", None)
        if complete is not None:
            complete()

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    def _unscaled_grads(self) -> list[torch.Tensor]:
        """This step's reduced, unscaled gradients (GradScaler then does not unscale again in step)."""
        self._complete_gradient_sync()
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            self.grad_scaler.unscale_(self.optimizer)
        return self._grads()

    def _clip_in_engine(self, max_norm: float) -> None:
        # DeepSpeed ZeRO clips its fp32 partitions in step by the norm it computes, with torch's formula.
        zero_optimizer = getattr(self.engine, "optimizer", None)
        if zero_optimizer is not None and hasattr(zero_optimizer, "clip_grad"):
            zero_optimizer.clip_grad = float(max_norm)
        elif max_norm:
            raise NotImplementedError("this DeepSpeed engine's optimizer has no clip_grad setting")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the whole global batch to max_norm; returns their total norm.

        Right under every strategy: loss scaling is undone first, sharded gradients count once over
        all ranks, and the norm is that of the unscaled, reduced gradients. Call after the last
        backward of a step, before ``step()``.
        """
        norm_type = float(norm_type)
        if self.engine is not None:
            from atorch.clipping import deepspeed_total_norm

            self._clip_in_engine(max_norm)
            return deepspeed_total_norm(self.engine, norm_type)
        from atorch.clipping import clip_by_norm, total_norm

        grads = self._unscaled_grads()
        norm = total_norm(grads, norm_type)
        clip_by_norm(grads, max_norm, norm)
        return norm

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every (unscaled) gradient element to [-clip_value, clip_value]."""
        if self.engine is not None:
            raise NotImplementedError(
                "clip_grad_value_ is not available under DeepSpeed (implementation 'deepspeed'): DeepSpeed clips by "
                "norm only; use clip_grad_norm_, or the default implementation"
            )
        from atorch.clipping import clip_by_value

        clip_by_value(self._unscaled_grads(), float(clip_value))

    # Colossal-AI's names for the same operations.
    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return self.clip_grad_norm_(max_norm, norm_type)

    def clip_grad_by_value(self, clip_value: float) -> None:
        self.clip_grad_value_(clip_value)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not found normally: forward to the wrapped optimizer.
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"
