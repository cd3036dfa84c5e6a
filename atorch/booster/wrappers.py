"""What ``Booster.boost`` returns: the accelerated model and optimizer behind Colossal-AI's wrapper interface.

``BoostedModel.module`` / ``BoostedOptimizer.optim`` are exactly what ``auto_accelerate`` returns
(``result.model`` / ``result.optim``); ``.result`` is the whole AccelerateResult.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from atorch.errors import SetupError
from atorch.names import unwrapped
from atorch.opt_lib.pipeline_parallel import PipelinedModel


def is_pipelined(result: Any) -> bool:
    return isinstance(result.model, PipelinedModel)


class BoostedModel(nn.Module):
    """Colossal-AI's ModelWrapper: ``model(...)`` moves the inputs to the device (and casts them when the
    whole model is in half precision), then calls the accelerated module."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self.module = result.model
        self.__dict__["result"] = result  # not a submodule: the result holds the same model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if is_pipelined(self.result):
            raise SetupError("under HybridParallelPlugin(pp_size > 1) each process holds only some layers and a "
                             "schedule runs them: call booster.execute_pipeline(iter(dataloader), model, criterion, "
                             "optimizer) instead of model(...) and booster.backward")
        prepare = self.result.prepare_input
        return self.module(*prepare(args), **prepare(kwargs))

    def unwrap(self, unwrap_peft: bool = True) -> nn.Module:
        """The user's module as trained (inside DDP / DeepSpeed's engine)."""
        return unwrapped(self.module)


class BoostedOptimizer:
    """Colossal-AI's OptimizerWrapper over atorch's optimizer (``.optim``, an AcceleratedOptimizer).

    ``clip_grad_by_norm`` / ``clip_grad_by_value`` use atorch's clipping (right for sharded gradients and
    under loss scaling; over pipeline stages too). ``max_norm`` > 0 (a plugin argument) clips in ``step()``.
    """

    def __init__(self, result: Any, max_norm: float = 0.0, norm_type: float = 2.0) -> None:
        self.result = result
        self.optim = result.optim
        self.max_norm, self.norm_type = float(max_norm), float(norm_type)
        self.accumulating = False  # inside booster.no_sync: gradients are not synchronised yet

    # ----- torch.optim.Optimizer's data --------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optim.defaults

    @property
    def state(self) -> Any:
        return self.optim.state

    def parameters(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    # ----- the step ----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, inputs: Any = None, retain_graph: bool = False) -> None:
        if is_pipelined(self.result):
            raise SetupError("under pipeline parallel, booster.execute_pipeline runs the forward and the backward; "
                             "do not call booster.backward")
        if inputs is None and not retain_graph:
            self.optim.backward(loss)
            return
        if self.optim.engine is not None:
            raise SetupError("DeepSpeed's engine runs backward itself: inputs / retain_graph cannot be passed")
        scaler = self.optim.grad_scaler
        (scaler.scale(loss) if scaler is not None else loss).backward(inputs=inputs, retain_graph=retain_graph)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor, inputs: Any = None,
                         retain_graph: bool = False) -> None:
        if self.optim.grad_scaler is not None or self.optim.engine is not None:
            raise SetupError("backward_by_grad cannot scale a given gradient: use booster.backward(loss, optimizer)")
        torch.autograd.backward(tensor, grad, inputs=inputs, retain_graph=retain_graph)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        if self.accumulating:
            raise SetupError("optimizer.step() inside booster.no_sync(): the gradients are not synchronised yet; "
                             "run the last micro-batch's forward and backward outside no_sync, then step")
        if self.max_norm > 0:
            self.clip_grad_by_norm(self.max_norm, self.norm_type)
        return self.optim.step(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    # ----- clipping ----------------------------------------------------------------------------------
    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                          *args: Any, **kwargs: Any) -> torch.Tensor:
        """Clip the whole (global) gradient to ``max_norm``; returns its norm before clipping."""
        if is_pipelined(self.result):
            from atorch.booster.pipeline import clip_pipeline_grad_norm

            norm = clip_pipeline_grad_norm(self.optim, self.result.model, float(max_norm), float(norm_type))
        else:
            norm = self.optim.clip_grad_norm_(max_norm, norm_type)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise SetupError(f"the gradient norm is {norm.item()}: the gradients hold inf/nan")
        return norm

    def clip_grad_by_value(self, clip_value: float, *args: Any, **kwargs: Any) -> None:
        self.optim.clip_grad_value_(clip_value)

    def get_grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global gradient norm (no clipping)."""
        return self.clip_grad_by_norm(float("inf"), norm_type)

    # ----- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def unwrap(self) -> torch.optim.Optimizer:
        """The torch optimizer inside atorch's wrapper."""
        return self.optim.optimizer

    def __getattr__(self, name: str) -> Any:
        if name in ("optim", "result"):
            raise AttributeError(name)
        return getattr(self.optim, name)

    def __repr__(self) -> str:
        return f"BoostedOptimizer({self.optim!r})"


def criterion_as_loss_func(holder: Callable[[], Any]) -> Callable[[Any, Any], torch.Tensor]:
    """atorch's ``loss_func(data, output)`` from Colossal-AI's ``criterion(outputs, inputs)`` (or
    ``criterion(outputs)`` for a one-argument criterion); ``holder()`` gives the criterion of the call."""
    import inspect

    def loss_func(data: Any, output: Any) -> torch.Tensor:
        criterion = holder()
        if criterion is None:
            raise SetupError("no criterion: pass it to booster.boost(...) or booster.execute_pipeline(...)")
        try:
            params = [p for p in inspect.signature(criterion).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
            single = len(params) == 1 and params[0].kind is not inspect.Parameter.VAR_POSITIONAL
        except (TypeError, ValueError):
            single = False
        return criterion(output) if single else criterion(output, data)

    return loss_func
