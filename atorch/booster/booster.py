"""``Booster``: Colossal-AI's training facade, on atorch's engine.

``boost`` translates the plugin (and ``mixed_precision``) into an atorch strategy, rebuilds the user's
optimizer on the accelerated model (same class, defaults and parameter groups), applies the strategy with
``auto_accelerate`` and returns Colossal-AI's 5-tuple. Every method is atorch's; the Booster only translates.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from atorch.booster.mixed_precision import mixed_precision_methods
from atorch.booster.pipeline import input_format_of, run_pipeline
from atorch.booster.plugin.base import Plugin
from atorch.booster.scheduler import carry_group_keys, retarget
from atorch.booster.wrappers import BoostedModel, BoostedOptimizer, criterion_as_loss_func, is_pipelined
from atorch.errors import SetupError, StrategyError
from atorch.log import get_logger

logger = get_logger(__name__)


class Booster:
    """``Booster(device=None, mixed_precision=None, plugin=None)``.

    - ``plugin``: one of ``atorch.booster.plugin`` (each is a translation into an atorch strategy); None with
      no ``mixed_precision`` leaves the objects as given (``booster.backward`` then calls ``loss.backward()``);
      None with ``mixed_precision`` means ``TorchDDPPlugin()``.
    - ``mixed_precision``: 'fp16' / 'bf16' (``amp_native``) or 'fp8' (``fp8``; skipped with the reason in
      ``booster.skipped`` where the hardware lacks it), for plugins that leave precision to the Booster
      (TorchDDPPlugin); the others take their own ``precision`` argument, and giving both is refused.
    - ``device``: the plugins place the model themselves (the process's GPU, else the CPU); 'cuda' without a
      GPU is refused.
    """

    def __init__(self, device: str | None = None, mixed_precision: Any = None, plugin: Plugin | None = None) -> None:
        if plugin is not None and not isinstance(plugin, Plugin):
            raise SetupError(f"plugin must be one of atorch.booster.plugin (TorchDDPPlugin, TorchFSDPPlugin, "
                             f"LowLevelZeroPlugin, GeminiPlugin, HybridParallelPlugin, AutoPlugin), got "
                             f"{type(plugin).__name__}")
        if device not in (None, "cpu", "cuda"):
            raise SetupError(f"device={device!r}: use 'cpu', 'cuda' or None")
        # What Colossal-AI ignores with a warning when the plugin decides (control_device / control_precision),
        # atorch ignores with a warning too (once per call site: Python's default warning filter).
        if device is not None and (plugin is not None and plugin.control_device()) and \
                (device == "cuda") != torch.cuda.is_available():
            warnings.warn(f"Booster(device={device!r}) is ignored: {type(plugin).__name__} places the model itself "
                          f"(this process's GPU, else the CPU; hide the GPUs with CUDA_VISIBLE_DEVICES='' to train "
                          f"on the CPU)", UserWarning, stacklevel=2)
        elif device == "cuda" and not torch.cuda.is_available():
            raise SetupError("device='cuda' but no CUDA GPU is visible; leave device out (the CPU is used)")
        if plugin is not None and plugin.control_precision() and mixed_precision is not None:
            warnings.warn(f"Booster(mixed_precision={mixed_precision!r}) is ignored: {type(plugin).__name__} sets the "
                          f"precision itself (its precision= argument; TorchFSDPPlugin: mixed_precision="
                          f"MixedPrecision(param_dtype=...))", UserWarning, stacklevel=2)
            self.precision_methods: list[Any] = []
        else:
            self.precision_methods = mixed_precision_methods(mixed_precision)
        self.device, self.mixed_precision, self.plugin = device, mixed_precision, plugin
        self.strategy: Any = None  # the atorch strategy of the last boost
        self.result: Any = None  # the AccelerateResult of the last boost
        self._optimizers: dict[int, BoostedOptimizer] = {}  # id(result) -> its BoostedOptimizer

    # ----- boost -------------------------------------------------------------------------------------
    def boost(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, criterion: Any = None,
              dataloader: DataLoader | None = None, lr_scheduler: Any = None) -> tuple[Any, Any, Any, Any, Any]:
        """Returns ``(model, optimizer, criterion, dataloader, lr_scheduler)``, boosted."""
        if isinstance(model, BoostedModel):
            raise SetupError("this model is already boosted; boost the original model once")
        if self.plugin is None and not self.precision_methods:
            return model, optimizer, criterion, dataloader, lr_scheduler  # nothing to apply (Colossal-AI's way)
        from atorch.accelerate import auto_accelerate
        from atorch.booster.plugin.torch_ddp import TorchDDPPlugin
        from atorch.distributed import init_distributed
        from atorch.prebuilt_optimizer import factory_from_optimizer

        plugin = self.plugin if self.plugin is not None else TorchDDPPlugin()
        env = init_distributed()
        per_rank = getattr(dataloader, "batch_size", None) if dataloader is not None else None
        resolve = getattr(plugin, "resolve_micro_batches", None)
        if resolve is not None:
            resolve(per_rank)
        model = plugin.prepare_model(model)
        criterion_box = {"criterion": criterion}
        kwargs: dict[str, Any] = dict(plugin.accelerate_kwargs)
        kwargs["loss_func"] = criterion_as_loss_func(lambda: criterion_box["criterion"])
        if optimizer is not None:
            kwargs.update(self._optimizer_kwargs(factory_from_optimizer(optimizer, model), optimizer, plugin))
        else:  # boost(model) alone: an optimizer nobody steps (AdamW's state is made on its first step), so that
            kwargs["optim_func"] = torch.optim.AdamW  # plugins whose methods own one (zero1, DeepSpeed) still build

        strategy = plugin.strategy(self.precision_methods)
        if strategy is None:  # AutoPlugin: the search needs batches
            kwargs.update(self._search_data(dataloader, env.world_size))
        else:
            kwargs["load_strategy"] = strategy
            data_size = plugin.layout(env.world_size).data_size
            kwargs["dataloader_args"] = {"batch_size": (per_rank or 1) * data_size}
        try:
            status, result, self.strategy = auto_accelerate(model, **kwargs)
        except StrategyError as exc:
            raise StrategyError(exc.problems, what=f"{plugin!r} (as atorch strategy {strategy}) cannot be "
                                "applied") from None
        if not status:  # boost has no status to return: the search's "no strategy" is an error here
            raise StrategyError(list(result.problems), what=f"{plugin!r}: the automatic search found no strategy")
        self.result = result
        plugin.announce_no_effect()  # each argument that changes nothing here, named once
        self._set_scaler(result, plugin)
        boosted_model = BoostedModel(result)
        boosted_model.__dict__["criterion_box"] = criterion_box
        boosted_optimizer = None
        if optimizer is not None:
            carry_group_keys(optimizer, result.optim)  # initial_lr and the scheduler's current lr
            boosted_optimizer = BoostedOptimizer(result, plugin.max_norm, plugin.norm_type)
            self._optimizers[id(result)] = boosted_optimizer
        lr_scheduler = retarget(lr_scheduler, optimizer, result.optim)
        if strategy is None:
            dataloader = result.dataloader  # split for the layout the search picked
            if self.gradient_accumulation_steps > 1:
                logger.warning("the search picked %d micro-batches per optimizer step: the dataloader yields "
                               "micro-batches; accumulate them with booster.no_sync before each step",
                               self.gradient_accumulation_steps)
        return boosted_model, boosted_optimizer, criterion, dataloader, lr_scheduler

    @staticmethod
    def _optimizer_kwargs(factory: Any, optimizer: torch.optim.Optimizer, plugin: Plugin) -> dict[str, Any]:
        if not plugin.is_pipeline():
            return factory.as_kwargs()
        # pipeline_parallel builds the optimizer over each stage's parameters as one group
        if len(optimizer.param_groups) > 1:
            raise SetupError(f"{type(plugin).__name__}(pp_size > 1) cannot keep {len(optimizer.param_groups)} "
                             "parameter groups yet (each stage's optimizer is built over its parameters as one "
                             "group): build the optimizer with one group, or use pp_size=1")
        group = optimizer.param_groups[0]
        args = {key: group.get(key, value) for key, value in factory.optim_args.items()}
        return {"optim_func": factory.optim_func, "optim_args": args}

    @staticmethod
    def _search_data(dataloader: DataLoader | None, world_size: int) -> dict[str, Any]:
        if dataloader is None:
            raise SetupError("AutoPlugin searches by running candidate strategies on real batches: pass the "
                             "dataloader (from plugin.prepare_dataloader(dataset, batch_size)) to booster.boost, "
                             "or use a plugin with a fixed strategy")
        if dataloader.batch_size is None:
            raise SetupError("AutoPlugin needs a dataloader with a batch_size (not a batch_sampler)")
        sampler = dataloader.sampler
        args: dict[str, Any] = {"batch_size": dataloader.batch_size * world_size,
                                "shuffle": bool(getattr(sampler, "shuffle", False)),
                                "drop_last": dataloader.drop_last, "num_workers": dataloader.num_workers,
                                "pin_memory": dataloader.pin_memory, "collate_fn": dataloader.collate_fn}
        # how the dry-runs call the model: from one collated batch (also for an IterableDataset)
        batch_format = input_format_of(next(iter(dataloader)))
        return {"dataset": dataloader.dataset, "dataloader_args": args, "model_input_format": batch_format}

    @staticmethod
    def _set_scaler(result: Any, plugin: Plugin) -> None:
        """Colossal-AI's loss-scale arguments onto the GradScaler (before its first use creates the scale)."""
        scaler = getattr(result.optim, "grad_scaler", None)
        if scaler is None or not plugin.scaler_settings:
            return
        for key, value in plugin.scaler_settings.items():
            setattr(scaler, f"_{key}", value)

    # ----- the training step -------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, optimizer: Any) -> None:
        """``optimizer.backward(loss)`` (loss scaling, DeepSpeed); a plain torch optimizer: ``loss.backward()``."""
        backward = getattr(optimizer, "backward", None)
        if backward is None:
            loss.backward()
        else:
            backward(loss)

    def execute_pipeline(self, data_iter: Iterator[Any], model: nn.Module, criterion: Any, optimizer: Any = None,
                         return_loss: bool = True, return_outputs: bool = False) -> dict[str, Any]:
        """Forward and backward of the next batch of ``data_iter`` through the pipeline schedule (its
        ``num_microbatches`` micro-batches); call ``optimizer.step()`` after it. ``criterion(outputs, inputs)``
        runs per micro-batch on the last stage. Returns ``{'loss': ..., 'outputs': None}``: the batch's mean
        loss on EVERY rank of the pipeline (sent from the last stage; this data-parallel rank's batch)."""
        if not isinstance(model, BoostedModel) or not is_pipelined(model.result):
            raise SetupError("execute_pipeline runs a pipeline-parallel model: boost it with "
                             "HybridParallelPlugin(pp_size > 1, ...); other models are called as model(batch)")
        if return_outputs:
            raise SetupError("return_outputs=True is not supported: the last stage's outputs are not gathered; "
                             "compute what you need in the criterion")
        if criterion is not None:
            model.criterion_box["criterion"] = criterion
        loss = run_pipeline(model.result, data_iter)
        return {"loss": loss if return_loss else None, "outputs": None}

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module | None = None, optimizer: Any = None) -> Iterator[None]:
        """Gradient accumulation: backward passes inside leave the gradients unsynchronised (each rank
        accumulates its own); the next backward outside synchronises them all, then step. The same contract
        for every plugin (DDP, ZeRO-1/2, FSDP, Gemini, tensor parallel); refused with the alternative under
        pipeline parallel. ``optimizer.step()`` inside is an error. Without a plugin it does nothing."""
        result = self._result_of(model, optimizer)
        if result is None:
            yield
            return
        refusal = self.plugin.no_sync_refusal() if self.plugin is not None else None
        if refusal is None and is_pipelined(result):
            refusal = "the pipeline schedule accumulates over micro-batches itself"
        if refusal is not None:
            raise SetupError(f"no_sync cannot be used: {refusal}")
        boosted = self._optimizers.get(id(result))
        result.optim.set_gradient_accumulation_boundary(False)
        if boosted is not None:
            boosted.accumulating = True
        try:
            yield
        finally:
            result.optim.set_gradient_accumulation_boundary(True)
            if boosted is not None:
                boosted.accumulating = False

    def _result_of(self, model: Any, optimizer: Any) -> Any:
        for obj in (model, optimizer):
            if isinstance(obj, (BoostedModel, BoostedOptimizer)):
                return obj.result
        if model is None and optimizer is None and self.result is not None:
            return self.result
        if self.plugin is None and not self.precision_methods:
            return None
        raise SetupError("no_sync needs the boosted model or optimizer (what booster.boost returned)")

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step that the last boost's strategy expects (AutoPlugin's search may pick
        more than 1: the returned dataloader then yields micro-batches; run all but the last of each step
        inside ``booster.no_sync``)."""
        return self.result.args.gradient_accumulation_steps if self.result is not None else 1

    @property
    def skipped(self) -> dict[str, str]:
        """Methods of the last boost's strategy that do not run here, with the reason (fp8 on CPU, ...)."""
        return dict(self.result.args.skipped) if self.result is not None else {}

    # ----- checkpoints and LoRA (atorch/booster/checkpoint_io.py, lora.py) ----------------------------
    def save_model(self, model: nn.Module, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                   prefix: str | None = None, size_per_shard: int = 1024, use_safetensors: bool = False,
                   use_async: bool = False) -> None:
        from atorch.booster import checkpoint_io

        if use_async:  # Colossal-AI's asynchronous writer implies safetensors
            _written_synchronously("save_model")
            use_safetensors = True

        checkpoint_io.save_model(_module(model), checkpoint, shard=shard, gather_dtensor=gather_dtensor, prefix=prefix,
                                 size_per_shard=size_per_shard, use_safetensors=use_safetensors)

    def load_model(self, model: nn.Module, checkpoint: str, strict: bool = True, low_cpu_mem_mode: bool = True,
                   num_threads: int = 1) -> None:
        from atorch.booster import checkpoint_io

        _loader_options("load_model", low_cpu_mem_mode, num_threads)

        checkpoint_io.load_model(_module(model), checkpoint, strict=strict)

    def save_optimizer(self, optimizer: Any, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                       prefix: str | None = None, size_per_shard: int = 1024, use_async: bool = False) -> None:
        from atorch.booster import checkpoint_io

        if use_async:
            _written_synchronously("save_optimizer")

        checkpoint_io.save_optimizer(_optim(optimizer), checkpoint, shard=shard, gather_dtensor=gather_dtensor,
                                     prefix=prefix, size_per_shard=size_per_shard)

    def load_optimizer(self, optimizer: Any, checkpoint: str, low_cpu_mem_mode: bool = True,
                       num_threads: int = 1) -> None:
        from atorch.booster import checkpoint_io

        _loader_options("load_optimizer", low_cpu_mem_mode, num_threads)

        checkpoint_io.load_optimizer(_optim(optimizer), checkpoint)

    def save_lr_scheduler(self, lr_scheduler: Any, checkpoint: str) -> None:
        from atorch.booster import checkpoint_io

        checkpoint_io.save_lr_scheduler(lr_scheduler, checkpoint)

    def load_lr_scheduler(self, lr_scheduler: Any, checkpoint: str) -> None:
        from atorch.booster import checkpoint_io

        checkpoint_io.load_lr_scheduler(lr_scheduler, checkpoint)

    def enable_lora(self, model: nn.Module, pretrained_dir: str | None = None, lora_config: Any = None,
                    bnb_quantization_config: Any = None, quantize: bool = False) -> nn.Module:
        """LoRA adapters on the model, before ``boost``."""
        if isinstance(model, BoostedModel):
            raise SetupError("enable_lora must be called before booster.boost (on the original model)")
        if bnb_quantization_config is not None or quantize:
            raise SetupError("quantized LoRA (bitsandbytes) is not supported; leave bnb_quantization_config / "
                             "quantize out")
        from atorch.booster import lora

        return lora.enable_lora(model, pretrained_dir=pretrained_dir, lora_config=lora_config)

    def save_lora_as_pretrained(self, model: nn.Module, checkpoint: str, use_safetensors: bool = False) -> None:
        from atorch.booster import checkpoint_io

        checkpoint_io.save_lora_as_pretrained(_module(model), checkpoint, use_safetensors=use_safetensors)


def _module(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, BoostedModel) else model


def _optim(optimizer: Any) -> Any:
    return optimizer.optim if isinstance(optimizer, BoostedOptimizer) else optimizer


def _written_synchronously(method: str) -> None:
    warnings.warn(f"{method}(use_async=True): atorch writes the checkpoint before returning (no asynchronous "
                  "writer); the files are the same", UserWarning, stacklevel=3)


def _loader_options(method: str, low_cpu_mem_mode: bool, num_threads: int) -> None:
    if not low_cpu_mem_mode or num_threads != 1:
        warnings.warn(f"{method}(low_cpu_mem_mode={low_cpu_mem_mode}, num_threads={num_threads}) has no effect in "
                      "atorch (its checkpoint reader has neither setting)", UserWarning,
                      stacklevel=3)
