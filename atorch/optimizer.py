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
            return None
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
        """Call before each backward when accumulating: False skips the gradient all-reduce."""
        if self.engine is not None:
            self.engine.set_gradient_accumulation_boundary(is_boundary)
        elif self.gradient_sync is not None:
            self.gradient_sync(is_boundary)

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
