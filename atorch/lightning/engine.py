"""atorch's engine applied to a LightningModule in place: the strategy (given, or searched), then the
optimizer rebuilt from the one ``configure_optimizers`` returned.

In place, as Lightning's own strategies do: the module the Trainer (and the user) holds is the one
trained. Everything else is atorch's: ``atorch.build`` checks and builds, ``ModelContext``
wraps the optimizer (loss scaling, gradient sync, clipping).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from atorch.build import agreed_preflight, build_context
from atorch.distributed import DistEnv
from atorch.errors import SetupError, StrategyError
from atorch.function_caches import forget_fake_fills
from atorch.log import get_logger
from atorch.model_context import ModelContext, UserSetup
from atorch.opt_lib.registry import methods_in_group
from atorch.options import StrategyOptions
from atorch.parallel_layout import ParallelLayout
from atorch.prebuilt_optimizer import OptimizerFactory
from atorch.strategy import Strategy

logger = get_logger(__name__)



def precision_methods() -> list[str]:
    """The methods that set the compute dtype, which Lightning's precision flag sets instead."""
    return methods_in_group("precision")


@dataclass
class Engine:
    """What the strategy trains with, built once per LightningModule."""

    module: nn.Module  # the LightningModule (transformed in place)
    model: nn.Module  # what forward runs through: the module itself (fsdp, zero2) or DDP around it
    optimizer: Any  # atorch's AcceleratedOptimizer
    strategy: Strategy
    layout: ParallelLayout
    autocast_dtype: torch.dtype | None
    input_dtype: torch.dtype | None
    search: dict[str, Any] | None = None

    @property
    def checkpoint_view(self) -> Any:
        """The (model, optim, lr_scheduler) view atorch.checkpointing.state_io reads and writes."""
        from types import SimpleNamespace

        return SimpleNamespace(model=self.model, optim=self.optimizer, lr_scheduler=None)


def names_module(model: nn.Module) -> nn.Module:
    """A module holding ``model``'s current Parameter objects under their names.

    The optimizer from ``configure_optimizers`` holds these objects; once the strategy has replaced
    them in place (sharding), this is what maps them to names for the rebuilt optimizer.
    """
    root = nn.Module()
    for name, param in model.named_parameters(remove_duplicate=False):
        *path, leaf = name.split(".")
        node = root
        for part in path:
            child = node._modules.get(part)
            if child is None:
                child = nn.Module()
                node.add_module(part, child)
            node = child
        node.register_parameter(leaf, param)
    return root


def resolve(load_strategy: Any, precision_method: tuple[str, Any] | None, world_size: int) -> Strategy | None:
    """The given strategy with the precision method of Lightning's flag; None: search for one."""
    if load_strategy is None:
        return None
    strategy = Strategy.load(load_strategy)
    if precision_method is not None:
        clash = [n for n in precision_methods() if n in strategy]
        if clash:
            raise StrategyError([f"the strategy has {clash[0]!r} and the Trainer's precision flag sets "
                                 f"{precision_method[0]!r}; set the precision in one place (drop it from the "
                                 f"strategy, or use Trainer(precision='32-true'))"], what="ATorchStrategy")
        strategy = strategy.with_method(*precision_method)
    problems = strategy.problems(world_size)
    if problems:
        raise StrategyError(problems, what="ATorchStrategy: invalid strategy")
    return strategy.adjusted(world_size)


class _TrainingStepModule(nn.Module):
    """For the search: a forward that is the LightningModule's training_step, returning its loss."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any) -> torch.Tensor:
        out = self.module.training_step(batch, 0)
        return out["loss"] if isinstance(out, dict) else out


def _loss_is_output(data: Any, output: torch.Tensor) -> torch.Tensor:
    return output


def search(module: nn.Module, loader: Any, env: DistEnv, options: StrategyOptions,
           precision_method: tuple[str, Any] | None) -> tuple[Strategy, dict[str, Any]]:
    """atorch's automatic search on the LightningModule: its train dataset, and training_step as the loss.

    The global batch is the dataloader's batch on every process; precision stays the Trainer's flag
    (precision methods are excluded from the search and the flag's method added to the pick).
    """
    if loader is None or getattr(loader, "dataset", None) is None or getattr(loader, "batch_size", None) is None:
        raise SetupError("ATorchStrategy without load_strategy searches a strategy with the train dataloader's "
                         "dataset and batch size; give a train_dataloader with a batch_size (a DataLoader), "
                         "or pass ATorchStrategy(load_strategy=[...])")
    from atorch.strategy_search.search.entry import search_and_check

    memory_limit = None if options.memory_limit is None else int(options.memory_limit)
    excluded = sorted(set(options.excluded) | set(precision_methods()))
    setup = UserSetup(
        model=_TrainingStepModule(module), optim_func=torch.optim.SGD, dataset=loader.dataset,
        loss_func=_loss_is_output, model_input_format=None, optim_args={"lr": 0.0},
        dataloader_args={"batch_size": loader.batch_size * env.world_size, "collate_fn": loader.collate_fn},
    )
    with warnings.catch_warnings():  # self.log() in training_step has no Trainer in the search's copies
        warnings.filterwarnings("ignore", message=".*self.log.*")
        strategy, _, _, micro_batches, record = search_and_check(
            setup, env, excluded, list(options.included), None, memory_limit, options.time_limit, options.search,
            options.strategy_server)
    if micro_batches > 1:
        logger.warning("the search chose %d micro-batches per step; Lightning feeds whole batches, so use "
                       "Trainer(accumulate_grad_batches=...) and a smaller batch to follow it", micro_batches)
    if precision_method is not None:
        strategy = strategy.with_method(*precision_method)
    return strategy, record


def build(module: nn.Module, strategy: Strategy, factory: OptimizerFactory, env: DistEnv,
          find_unused_parameters: bool = False, search_record: dict[str, Any] | None = None) -> Engine:
    """Check, then apply ``strategy`` to ``module`` in place and build the optimizer ``factory`` describes."""
    layout = strategy.layout(env.world_size)
    setup = UserSetup(model=module, optim_func=factory.optim_func, optim_args=dict(factory.optim_args),
                      optim_param_func=factory.optim_param_func, find_unused_parameters=find_unused_parameters)
    skipped = agreed_preflight(setup, env, strategy, what=f"ATorchStrategy cannot apply {strategy}")
    forget_fake_fills(module, rescan=True)  # what the checks' and the search's fake runs left in the model's caches
    # The optimizer's parameters are named through a snapshot taken before sharding replaces them.
    ctx = ModelContext(replace(setup, model=names_module(module)), env, layout, model=module)
    ctx = build_context(setup, env, strategy, skipped, ctx)  # in place
    logger.info("ATorchStrategy: %s on %d process(es)", strategy, env.world_size)
    return Engine(module=module, model=ctx.model, optimizer=ctx.optimizer, strategy=strategy, layout=layout,
                  autocast_dtype=ctx.autocast_dtype, input_dtype=ctx.input_dtype, search=search_record)
