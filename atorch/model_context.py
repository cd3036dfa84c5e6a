"""The user's training objects, and the build of model → optimizer → scheduler → dataloader.

A ModelContext never changes the user's objects: ``fresh()`` gives a context over a deep copy of
the model, on which a Strategy is applied. Methods change the context's fields in APPLY_ORDER;
``build`` then finishes in one fixed order (data-parallel wrapper, optimizer, after-build hooks,
scheduler, dataloader).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from atorch import meta_init
from atorch.distributed import DistEnv
from atorch.log import get_logger
from atorch.optimizer import AcceleratedOptimizer

logger = get_logger(__name__)

MODEL_INPUT_FORMATS = (None, "unpack_sequence", "unpack_dict")


@dataclass(frozen=True)
class UserSetup:
    """What the user passed to auto_accelerate; read, never modified."""

    model: nn.Module
    optim_func: Callable[..., torch.optim.Optimizer]
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
    return model(data)


class ModelContext:
    """Working state while a Strategy is applied to one copy of the user's model."""

    def __init__(self, setup: UserSetup, env: DistEnv, model: nn.Module | None = None) -> None:
        self.setup = setup
        self.env = env
        self.model: nn.Module = setup.model if model is None else model
        # Set by methods in APPLY_ORDER:
        self.mesh: Any = None  # torch DeviceMesh over all ranks, named dimensions
        self.data_parallel_wrapped = False  # a sharding method replaced DDP
        self.sharded_gradients = False  # gradients are shards (FSDP/ZeRO-2): checks need all ranks
        self.optimizer_factory: Callable[[Any], torch.optim.Optimizer] = self._plain_optimizer
        self.input_dtype: torch.dtype | None = None  # 'half' casts floating inputs
        self.autocast_dtype: torch.dtype | None = None
        self.grad_scaler: Any = None
        self.skip_if_nonfinite = False
        self.gradient_sync: Callable[[bool], None] | None = None
        self.engine: Any = None  # DeepSpeed engine, if one owns the step
        self.skipped: dict[str, str] = {}  # method name -> why it was not applied
        self.strategy: Any = None  # the Strategy being applied
        # Built by build():
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None
        self.dataloader: DataLoader | None = None

    def fresh(self) -> ModelContext:
        """A new context over a deep copy of the user's model: the originals stay untouched."""
        model = meta_init.to_device(copy.deepcopy(self.setup.model), self.env.device)  # meta: materialised later
        return ModelContext(self.setup, self.env, model)

    # ----- parallel layout ------------------------------------------------------------------
    def dim_size(self, name: str) -> int:
        """Size of a parallel dimension; with no mesh yet, every process is data parallel."""
        if self.mesh is None:
            return self.env.world_size if name == "data" else 1
        return self.mesh[name].size() if name in (self.mesh.mesh_dim_names or ()) else 1

    @property
    def dp_size(self) -> int:
        return self.dim_size("data")

    @property
    def dp_rank(self) -> int:
        if self.mesh is None:
            return self.env.rank
        names = self.mesh.mesh_dim_names or ()
        if "data" not in names:
            return 0
        # The mesh coordinate, not get_local_rank(): torch numbers a group's ranks in sorted order,
        # which would ignore parallel_mode's rank_order when the data is sharded.
        return self.mesh.get_coordinate()[names.index("data")]

    def dp_mesh(self) -> Any:
        """The 1-D data-parallel mesh (created over the whole world if parallel_mode made none)."""
        if self.mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(self.env.device.type, (self.env.world_size,), mesh_dim_names=("data",))
        return self.mesh["data"]

    # ----- fixed build order ----------------------------------------------------------------
    def build_after_methods(self, after_build_hooks: list[Callable[[], None]]) -> None:
        self._wrap_data_parallel()
        self.optimizer = self.optimizer_factory(self._optimizer_params())
        for hook in after_build_hooks:
            hook()
        self.optimizer = AcceleratedOptimizer(
            self.optimizer,
            grad_scaler=self.grad_scaler,
            skip_if_nonfinite=self.skip_if_nonfinite,
            gradient_sync=self.gradient_sync,
            engine=self.engine,
        )
        self.lr_scheduler = self._build_scheduler()
        self.dataloader = self._build_dataloader()

    def _wrap_data_parallel(self) -> None:
        if self.data_parallel_wrapped or self.dp_size == 1:
            return
        from torch.nn.parallel import DistributedDataParallel as DDP

        cuda = self.env.device.type == "cuda"
        model = DDP(
            self.model,
            device_ids=[self.env.device.index] if cuda else None,
            process_group=self.dp_mesh().get_group(),
            find_unused_parameters=self.setup.find_unused_parameters,
        )
        self.model = model
        self.data_parallel_wrapped = True

        def set_sync(enabled: bool) -> None:
            model.require_backward_grad_sync = enabled

        self.gradient_sync = set_sync
        logger.info("data parallel: DDP over %d processes", self.dp_size)

    def _optimizer_params(self) -> Any:
        if self.setup.optim_param_func is not None:
            return self.setup.optim_param_func(self.model)
        return self.model.parameters()

    def _plain_optimizer(self, params: Any) -> torch.optim.Optimizer:
        return self.setup.optim_func(params, **self.setup.optim_args)

    def _build_scheduler(self) -> Any:
        if self.setup.lr_scheduler_cls is None:
            return None
        return self.setup.lr_scheduler_cls(self.optimizer, **self.setup.lr_scheduler_args)

    def local_batch_size(self) -> int:
        return int(self.setup.dataloader_args.get("batch_size", 1)) // self.dp_size

    def _build_dataloader(self) -> DataLoader | None:
        if self.setup.dataset is None:
            return None
        args = dict(self.setup.dataloader_args)
        args["batch_size"] = self.local_batch_size()
        shuffle = bool(args.pop("shuffle", False))
        sampler_cls = self.setup.distributed_sampler_cls
        if sampler_cls is None and self.dp_size > 1:
            sampler_cls = DistributedSampler
        if sampler_cls is not None:
            args["sampler"] = sampler_cls(
                self.setup.dataset, num_replicas=self.dp_size, rank=self.dp_rank, shuffle=shuffle
            )
        else:
            args["shuffle"] = shuffle
        return DataLoader(self.setup.dataset, **args)

    def prepare_input(self, data: Any, device: torch.device | None = None) -> Any:
        """Move a batch to the device (through the user's prepare_input if given); cast for 'half'."""
        device = self.env.device if device is None else device
        if self.setup.prepare_input is not None:
            data = self.setup.prepare_input(data, device)
        return move_to(data, device, self.input_dtype)
