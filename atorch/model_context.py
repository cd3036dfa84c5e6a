"""The user's training objects, and the build of model → optimizer → scheduler → dataloader.

A ModelContext never changes the user's objects: ``fresh()`` gives a context over a deep copy of
the model, on which ``atorch.apply.apply_strategy`` applies a Strategy; ``finish()`` then builds the
LR scheduler and the dataloader.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from atorch import meta_init
from atorch.data import build_dataloader
from atorch.distributed import DistEnv
from atorch.log import get_logger
from atorch.optimizer import AcceleratedOptimizer
from atorch.parallel_layout import ParallelLayout
from atorch.state_names import trained_param_names

logger = get_logger(__name__)

# "input_target": batches are (input, target) pairs, the model takes the input alone (an nn.Sequential).
MODEL_INPUT_FORMATS = (None, "unpack_sequence", "unpack_dict", "input_target")


@dataclass(frozen=True)
class UserSetup:
    """What the user passed to auto_accelerate; read, never modified."""

    model: nn.Module
    optim_func: Callable[..., torch.optim.Optimizer] | None  # None: build no optimizer (ATorch's)
    dataset: Dataset | None = None
    loss_func: Callable[..., torch.Tensor] | None = None
    prepare_input: Callable[[Any, torch.device], Any] | None = None
    model_input_format: str | None = None
    optim_args: dict[str, Any] = field(default_factory=dict)
    optim_param_func: Callable[[nn.Module], Any] | None = None
    dataloader_args: dict[str, Any] = field(default_factory=dict)
    distributed_sampler_cls: type | None = None
    lr_scheduler_cls: type | None = None
    lr_scheduler_args: dict[str, Any] = field(default_factory=dict)
    find_unused_parameters: bool = False


def move_to(data: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """Move tensors in nested lists/tuples/dicts to device; cast floating tensors to dtype if given."""
    if isinstance(data, torch.Tensor):
        data = data.to(device, non_blocking=True)
        return data.to(dtype) if dtype is not None and data.is_floating_point() else data
    if isinstance(data, dict):
        return type(data)((k, move_to(v, device, dtype)) for k, v in data.items())
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(move_to(v, device, dtype) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(move_to(v, device, dtype) for v in data)
    return data


def call_model(model: nn.Module, data: Any, model_input_format: str | None) -> Any:
    """Call the model on one batch the way ``model_input_format`` says (ATorch's semantics)."""
    if model_input_format == "unpack_sequence":
        return model(*data)
    if model_input_format == "unpack_dict":
        return model(**data)
    if model_input_format == "input_target":
        return model(data[0])
    return model(data)


class ModelContext:
    """Working state while a Strategy is applied to one copy of the user's model (see apply.py)."""

    def __init__(self, setup: UserSetup, env: DistEnv, layout: ParallelLayout, model: nn.Module | None = None) -> None:
        self.setup = setup
        self.env = env
        self.layout = layout  # the one source of the data-parallel size and rank
        self.model: nn.Module = setup.model if model is None else model
        # Set while the strategy is applied (apply.py):
        self.sharded_gradients = False  # gradients are shards (FSDP/ZeRO-2): checks need all ranks
        self.input_dtype: torch.dtype | None = None  # 'half' casts floating inputs
        self.autocast_dtype: torch.dtype | None = None
        self.grad_scaler: Any = None
        self.skip_if_nonfinite = False
        self.gradient_sync: Callable[[bool], None] | None = None
        self.engine: Any = None  # DeepSpeed engine, if one owns the step
        self.skipped: dict[str, str] = {}  # method name -> why it was not applied
        self.strategy: Any = None  # the Strategy being applied
        # Built at the end:
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None
        self.dataloader: DataLoader | None = None

    def fresh(self) -> ModelContext:
        """A new context over a deep copy of the user's model: the originals stay untouched."""
        model = meta_init.to_device(copy.deepcopy(self.setup.model), self.env.device)  # meta: materialised later
        return ModelContext(self.setup, self.env, self.layout, model)

    # ----- parallel layout (all from self.layout) -------------------------------------------
    @property
    def dp_size(self) -> int:
        return self.layout.data_size

    @property
    def replica_size(self) -> int:
        """The ranks of ``data_mesh``, which gradients are averaged over: data × expert × context."""
        return self.layout.replica_size

    @property
    def dp_rank(self) -> int:
        return self.layout.data_rank(self.env.rank)

    @property
    def data_mesh(self) -> Any:
        """The 1-D data-parallel DeviceMesh of this process (created once per layout)."""
        return self.layout.data_mesh(self.env.device.type)

    # ----- what is built after the strategy's transformations -------------------------------
    def finish(self) -> None:
        """Wrap the optimizer (none with optim_func=None), then build the LR scheduler and the dataloader."""
        if self.optimizer is not None:
            self.optimizer = AcceleratedOptimizer(
                self.optimizer,
                grad_scaler=self.grad_scaler,
                skip_if_nonfinite=self.skip_if_nonfinite,
                gradient_sync=self.gradient_sync,
                engine=self.engine,
            )
            self.optimizer.param_names = trained_param_names(self.model)  # Booster checkpoint IO: state by name
        self.lr_scheduler = self._build_scheduler()
        self.dataloader = self._build_dataloader()

    def _build_scheduler(self) -> Any:
        if self.setup.lr_scheduler_cls is None:
            return None
        return self.setup.lr_scheduler_cls(self.optimizer, **self.setup.lr_scheduler_args)

    def local_batch_size(self) -> int:
        return int(self.setup.dataloader_args.get("batch_size", 1)) // self.dp_size

    def _build_dataloader(self) -> DataLoader | None:
        if self.setup.dataset is None:
            return None
        # [data] the per-rank dataloader is built in atorch/data.py
        return build_dataloader(self.setup.dataset, self.setup.dataloader_args, self.dp_size, self.dp_rank,
                                self.setup.distributed_sampler_cls)

    def input_preparer(self) -> InputPreparer:
        """``result.prepare_input``: holds only what it needs, not this context."""
        return InputPreparer(self.setup.prepare_input, self.env.device, self.input_dtype)


@dataclass(frozen=True)
class InputPreparer:
    """Move a batch to the device (through the user's prepare_input if given); cast for 'half'."""

    user_prepare_input: Callable[[Any, torch.device], Any] | None
    device: torch.device
    input_dtype: torch.dtype | None

    def __call__(self, data: Any, device: torch.device | None = None) -> Any:
        device = self.device if device is None else device
        if self.user_prepare_input is not None:
            data = self.user_prepare_input(data, device)
        return move_to(data, device, self.input_dtype)
