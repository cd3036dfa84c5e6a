"""The body of ``ATorchStrategy``, shared by the ``lightning.pytorch`` and ``pytorch_lightning`` classes.

Those two namespaces have separate Strategy base classes and registries, so ``atorch.lightning`` builds
one class per installed namespace (``strategy_class``) from this mixin over that namespace's
DDPStrategy: its launcher (torchrun, or processes it starts itself for ``devices=N``), process-group
set-up, barrier and all-reduce ``reduce`` are kept; model, optimizer, precision, backward, step,
accumulation and checkpoints go through atorch's engine (``engine.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from atorch.errors import SetupError
from atorch.lightning import engine as engine_lib
from atorch.lightning import state
from atorch.lightning.precision import FLAG_TO_METHOD, flag_of
from atorch.log import get_logger
from atorch.opt_lib.precision import Half
from atorch.opt_lib.registry import get_method
from atorch.options import StrategyOptions
from atorch.parallel_layout import ParallelLayout
from atorch.strategy import Strategy

logger = get_logger(__name__)

class StrategyMixin:
    """Put before the namespace's DDPStrategy; ``_ns`` and ``_precision_cls`` are set per namespace."""

    strategy_name = "atorch"
    _ns: Any = None  # lightning.pytorch or pytorch_lightning
    _precision_cls: type = object

    def __init__(self, load_strategy: Any = None, *, accelerator: Any = None, parallel_devices: Any = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None, precision_plugin: Any = None,
                 process_group_backend: str | None = None, start_method: str = "popen", **options: Any) -> None:
        checked, problems = StrategyOptions.checked(options, "option(s)", accepted=("load_strategy",))
        if problems:
            from atorch.lightning.colossalai_args import equivalents_of

            unknown = sorted(set(options) - set(StrategyOptions.model_fields))
            instead = "".join(f"\n  - {line}" for line in equivalents_of(unknown)) if unknown else ""
            raise SetupError(f"ATorchStrategy got bad options: {'; '.join(problems)}{instead}")
        if load_strategy is not None:
            Strategy.load(load_strategy)  # an unreadable or invalid strategy is refused here, before any launch
        if checked.verbose:
            from atorch.log import set_verbose

            set_verbose(True)
        self._load_strategy = load_strategy
        self._options = checked
        self.engine: engine_lib.Engine | None = None
        self._flag = "32-true"
        self._eval_autocast: torch.dtype | None = None
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,  # type: ignore[call-arg]
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         start_method=start_method)

    # ----- precision: Lightning's flag becomes an atorch method, its plugin is replaced ------------------
    @property
    def precision_plugin(self) -> Any:
        plugin = self.__dict__.get("_precision_plugin")
        if plugin is None:
            plugin = self._precision_cls(self._flag, self)
            self._precision_plugin = plugin
        return plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        if plugin is None:
            self._precision_plugin = None
            return
        self._flag = flag_of(plugin)  # an unsupported flag is refused by name, when the Trainer is built
        self._precision_plugin = self._precision_cls(self._flag, self)

    # ----- layout and data --------------------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        return True

    def _layout(self) -> ParallelLayout:
        world = self.num_nodes * self.num_processes
        if self.engine is not None:
            return self.engine.layout
        if self._load_strategy is not None:
            return Strategy.load(self._load_strategy).layout(world)
        return ParallelLayout.data_parallel(world)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        layout = self._layout()  # data-parallel size and rank: tensor-parallel peers read the same samples
        return {"num_replicas": layout.data_size, "rank": layout.data_rank(self.global_rank)}

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return state.broadcast_json(obj, src)

    # ----- model and optimizer ----------------------------------------------------------------------------
    def _env(self) -> Any:
        from atorch.distributed import DistEnv, init_distributed

        if not dist.is_initialized():
            init_distributed()
        return DistEnv(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=self.local_rank,
                       device=self.root_device, backend=dist.get_backend())

    def setup(self, trainer: Any) -> None:
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == self._ns.trainer.states.TrainerFn.FITTING
        module = self.lightning_module
        if self.engine is not None and self.engine.module is module:
            self.model = self.engine.model  # a later run on the same module: it is already transformed
        elif fitting:
            self._build_engine(trainer, module)
        else:  # evaluation before any fit: the plain module, every rank with rank 0's weights
            from atorch.meta_init import is_meta

            if is_meta(module):
                raise SetupError("the LightningModule has meta-device weights; fit it first (ATorchStrategy "
                                 "materialises them when it applies the strategy), or load real weights")
            self.model_to_device()
            if dist.is_initialized() and dist.get_world_size() > 1:
                for tensor in list(module.parameters()) + list(module.buffers()):
                    dist.broadcast(tensor.data, 0)
            method = FLAG_TO_METHOD[self._flag]
            if method is not None and method[0] == Half.name:
                module.to(getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[method[1]["dtype"]]))
            elif method is not None:
                self._eval_autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}[method[1]["dtype"]]
        if fitting:
            assert self.engine is not None
            self.optimizers = [self.engine.optimizer]
        self.setup_precision_plugin()

    def _build_engine(self, trainer: Any, module: Any) -> None:
        from atorch.meta_init import is_meta
        from atorch.prebuilt_optimizer import factory_from_optimizer

        if not is_meta(module):
            self.model_to_device()
        optimizers, schedulers = self._ns.core.optimizer._init_optimizers_and_lr_schedulers(module)
        if len(optimizers) != 1:
            raise SetupError(f"ATorchStrategy trains with one optimizer; configure_optimizers returned "
                             f"{len(optimizers)}: put the parameters in groups of one optimizer instead")
        factory = factory_from_optimizer(optimizers[0], module)
        env = self._env()
        method = FLAG_TO_METHOD[self._flag]
        strategy, record = engine_lib.resolve(self._load_strategy, method, env.world_size), None
        if strategy is None:
            strategy, record = engine_lib.search(module, self._train_loader(trainer), env, self._options, method)
        self.engine = engine_lib.build(module, strategy, factory, env, self._options.find_unused_parameters, record)
        path = self._options.save_strategy_to_file
        if path and env.is_main:
            strategy.save(path)
        for config in schedulers:  # the schedulers drive the rebuilt optimizer (its groups carry their lr)
            config.scheduler.optimizer = self.engine.optimizer
        self.lr_scheduler_configs = schedulers
        self.model = self.engine.model

    @staticmethod
    def _train_loader(trainer: Any) -> Any:
        loader = trainer.fit_loop._data_source.dataloader()
        return loader[0] if isinstance(loader, (list, tuple)) and loader else loader

    def model_to_device(self) -> None:
        self.lightning_module.to(self.root_device)

    @property
    def strategy_in_effect(self) -> Strategy | None:
        """The atorch strategy the module trains with (after fit's setup)."""
        return self.engine.strategy if self.engine is not None else None

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # A sharding strategy materialises a meta-device model one unit at a time (atorch.meta_init).
        given = Strategy.load(self._load_strategy) if self._load_strategy is not None else None
        if empty_init and given is not None and any(get_method(i.name).shards_data(i.config) for i in given.methods):
            with torch.device("meta"):
                yield
            return
        with super().tensor_init_context(empty_init):  # type: ignore[misc]
            yield

    # ----- backward, step and accumulation through the engine ---------------------------------------------
    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-boundary micro-batches of accumulate_grad_batches: the engine skips the gradient reduction."""
        optimizer = self.engine.optimizer if self.engine is not None else None
        if optimizer is None:
            yield
            return
        optimizer.set_gradient_accumulation_boundary(False)
        try:
            yield
        finally:
            optimizer.set_gradient_accumulation_boundary(True)

    def _autocast(self) -> Any:
        dtype = self.engine.autocast_dtype if self.engine is not None else self._eval_autocast
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.root_device.type, dtype=dtype)

    def _redirect(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Run the LightningModule's ``name`` step as the forward of the engine's model, so that DDP's and
        FSDP2's forward hooks run around it, under the strategy's autocast."""
        module, model = self.lightning_module, self.model
        own = module.__dict__.get("forward")  # a per-instance forward (atorch's autocast wrapper) or None

        def restore() -> None:
            if own is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own

        # Manual optimisation runs backward inside DDP's forward: as DDPStrategy does, DDPStrategy.pre_backward
        # prepares the reduction, and DDP's post-forward must then not prepare it again.
        manual_ddp = isinstance(model, DistributedDataParallel) and not module.automatic_optimization

        def step(*a: Any, **k: Any) -> Any:
            restore()  # the step itself may call self(...)
            with self._autocast():
                out = getattr(module, name)(*a, **k)
            if manual_ddp:
                model.require_backward_grad_sync = False
            return out

        module.forward = step
        try:
            return model(*args, **kwargs)
        finally:
            restore()
            if manual_ddp:
                model.require_backward_grad_sync = True

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._redirect("training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._redirect("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._redirect("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._redirect("predict_step", *args, **kwargs)

    # ----- checkpoints: DCP for tensors, JSON for Lightning's metadata ------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine's (sharded) state exists only after setup

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # loaded with the model by atorch.checkpointing.state_io

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the model is saved by DCP in save_checkpoint, sharded where the strategy shards

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # done in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self.engine is None:
            raise SetupError("ATorchStrategy saves checkpoints of a module it trains: call Trainer.save_checkpoint "
                             "during or after fit")
        state.save(checkpoint, filepath, self.engine)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self.engine is not None and self.engine.module is self.lightning_module:
            return state.load(checkpoint_path, self.engine)
        return state.load_weights(checkpoint_path, self.lightning_module)

    def remove_checkpoint(self, filepath: Any) -> None:
        state.remove(filepath)  # rank 0 removes the directory (callers may call on rank 0 only)

    def teardown(self) -> None:
        # The engine stays (module transformed in place, optimizer state): a later validate/test/fit reuses it.
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("atorch", cls, description="atorch's engine: a given or searched strategy")


def strategy_class(ns: Any) -> type:
    """``ATorchStrategy`` for one Lightning namespace (``lightning.pytorch`` or ``pytorch_lightning``)."""
    from atorch.lightning.precision import PrecisionMixin

    precision_cls = type("ATorchPrecision", (PrecisionMixin, ns.plugins.precision.Precision),
                         {"__module__": "atorch.lightning", "__doc__": PrecisionMixin.__doc__})
    return type("ATorchStrategy", (StrategyMixin, ns.strategies.DDPStrategy), {
        "__module__": "atorch.lightning", "__doc__": "atorch's engine as a Lightning strategy: "
        "``ATorchStrategy(load_strategy=None, **auto_accelerate options)``.",
        "_ns": ns, "_precision_cls": precision_cls,
    })
