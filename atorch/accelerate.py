"""``auto_accelerate``: ATorch's entry point. Semi-automatic mode: apply the given strategy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from atorch import (
    meta_init,
    opt_lib,  # noqa: F401  (registers the methods)
)
from atorch.apply import apply_strategy
from atorch.distributed import DistEnv, agreed_problems, init_distributed
from atorch.errors import NoStrategyFound, StrategyError
from atorch.input_checks import input_problems, launch_problems, wrapped_model_problems
from atorch.lifecycle import import_off_the_stack
from atorch.log import get_logger, set_verbose
from atorch.model_context import MODEL_INPUT_FORMATS, ModelContext, UserSetup
from atorch.no_optimizer import no_optimizer_problems
from atorch.opt_lib.registry import get_method, is_registered, method_names
from atorch.options import AccelerateOptions
from atorch.parallel_layout import ParallelLayout
from atorch.result import AccelerateResult
from atorch.strategy import Strategy

logger = get_logger(__name__)



@dataclass(frozen=True)
class AccelerateArgs:
    """What the training loop needs to know (``result.args``)."""

    use_optim_backward: bool  # call optim.backward(loss) instead of loss.backward()
    requires_set_gradient_accumulation_boundary: bool  # call optim.set_gradient_accumulation_boundary
    device: torch.device
    data_parallel_size: int
    data_parallel_rank: int
    global_batch_size: int | None
    local_batch_size: int | None
    model_input_format: str | None
    memory_limit: int | None
    time_limit: float | None
    skipped: dict[str, str] = field(default_factory=dict)  # method -> reason it was not applied
    # Micro-batches per optimizer step: the dataloader yields micro-batches of global_batch_size /
    # gradient_accumulation_steps; pass that many to train_step (automatic search may choose > 1).
    gradient_accumulation_steps: int = 1
    # how the strategy was found (automatic mode): source, study, dry-runs, stop reason, the pick's description and
    # (rank 0) every trial with its description, status and reason
    search: dict[str, Any] | None = None
    data_parallel_group: Any = field(default=None, repr=False)  # process group of the data-parallel ranks

    # ATorch hands these out as a dict: ``result.args["use_optim_backward"]`` works too.
    def __getitem__(self, key: str) -> Any:
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self.keys() else default

    def keys(self) -> list[str]:
        return [f.name for f in fields(self)]

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def items(self) -> list[tuple[str, Any]]:
        return [(k, getattr(self, k)) for k in self.keys()]


def default_strategy(env: DistEnv) -> Strategy:
    """Used when no load_strategy is given and there is no dataset to search with: data parallel over
    all processes, plus bf16 autocast where the GPU computes bf16 natively."""
    names: list[Any] = ["parallel_mode"]
    if env.device.type == "cuda" and torch.cuda.is_bf16_supported():
        names.append(("amp_native", {"dtype": "bf16"}))
    return Strategy.load(names)


def _setup_problems(setup: UserSetup, excluded: Any, included: Any) -> list[str]:
    problems = []
    if not isinstance(setup.model, nn.Module):
        problems.append(f"model must be a torch.nn.Module, got {type(setup.model).__name__}")
    if setup.optim_func is not None and not callable(setup.optim_func):
        problems.append("optim_func must be an optimizer class or a function (params, **optim_args) -> optimizer")
    if setup.loss_func is not None and not callable(setup.loss_func):
        problems.append("loss_func must be callable as loss_func(data, output)")
    if setup.model_input_format not in MODEL_INPUT_FORMATS:
        problems.append(
            f"model_input_format {setup.model_input_format!r} is not one of None, 'unpack_sequence', 'unpack_dict', "
            "'input_target'"
        )
    for name, value in (("optim_args", setup.optim_args), ("dataloader_args", setup.dataloader_args),
                        ("lr_scheduler_args", setup.lr_scheduler_args)):
        if not isinstance(value, dict):
            problems.append(f"{name} must be a dict, got {type(value).__name__}")
    batch = setup.dataloader_args.get("batch_size", 1) if isinstance(setup.dataloader_args, dict) else 1
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        problems.append(f"dataloader_args['batch_size'] must be a positive int (the global batch), got {batch!r}")
    if setup.dataset is not None and not hasattr(setup.dataset, "__getitem__") and not hasattr(
        setup.dataset, "__iter__"
    ):
        problems.append(f"dataset must be a torch Dataset, got {type(setup.dataset).__name__}")
    for label, names in (("excluded", excluded), ("included", included)):
        if not isinstance(names, (list, tuple, set)):
            problems.append(f"{label} must be a list of method names, got {names!r}")
            continue
        for name in names:
            if not is_registered(name):
                problems.append(f"{label} names unknown method '{name}'; known: {', '.join(method_names())}")
    return problems


def _resolve_strategy(load_strategy: Any, env: DistEnv, excluded: list[str]) -> tuple[Strategy | None, list[str]]:
    try:
        strategy, problems = (default_strategy(env), []) if load_strategy is None else Strategy.parse(load_strategy)
    except StrategyError as exc:  # the source as a whole is unreadable (bad JSON, pickled, ...)
        return None, exc.problems
    problems += strategy.problems(env.world_size)
    if load_strategy is not None:
        problems += [f"'{n}' is in load_strategy and in excluded; remove it from one"
                     for n in excluded if n in strategy]
    return strategy.adjusted(env.world_size), problems


def _copy_if_dict(value: Any) -> Any:
    """A copy of a dict argument (the user's stays as it was); any other value is kept as given so
    that _setup_problems can name its type instead of dict() failing on it."""
    if value is None:
        return {}
    return dict(value) if isinstance(value, dict) else value


def auto_accelerate(
    model: nn.Module,
    optim_func: Callable[..., torch.optim.Optimizer] | None = None,
    dataset: Any = None,
    loss_func: Callable[..., torch.Tensor] | None = None,
    prepare_input: Callable[[Any, torch.device], Any] | None = None,
    model_input_format: str | None = None,
    optim_args: dict[str, Any] | None = None,
    optim_param_func: Callable[[nn.Module], Any] | None = None,
    dataloader_args: dict[str, Any] | None = None,
    distributed_sampler_cls: type | None = None,
    excluded: list[str] | None = None,
    included: list[str] | None = None,
    load_strategy: Any = None,
    lr_scheduler_cls: type | None = None,
    lr_scheduler_args: dict[str, Any] | None = None,
    finetune_strategy: bool = False,
    save_strategy_to_file: str | None = None,
    **kargs: Any,
) -> tuple[bool, AccelerateResult, Strategy | None]:
    """Rewrite model, optimizer and dataloader to train with a strategy on the launched processes.

    Returns ``(status, result, strategy)``; ``result`` is ATorch's namedtuple
    ``(model, optim, dataloader, loss_func, prepare_input, args)`` with ``result.lr_scheduler`` by name.
    Every problem with the arguments or the strategy is raised together, before anything is built.
    ``status`` is False (result empty, ``result.reason`` says why, strategy None) where ATorch's is: the
    automatic search found no strategy that fits and runs.
    """
    options, problems = AccelerateOptions.checked(kargs)  # [input checks] atorch/options.py
    set_verbose(options.verbose)
    memory_limit = None if options.memory_limit is None else int(options.memory_limit)
    time_limit, search_options, strategy_server = options.time_limit, options.search, options.strategy_server
    if finetune_strategy and load_strategy is None:
        problems.append("finetune_strategy=True searches around load_strategy: give load_strategy too, "
                        "or drop finetune_strategy for a full search")
    setup = UserSetup(
        model=model, optim_func=optim_func,  # None: no optimizer, as in ATorch (atorch/no_optimizer.py)
        dataset=dataset, loss_func=loss_func, prepare_input=prepare_input,
        model_input_format=model_input_format, optim_args=_copy_if_dict(optim_args),
        optim_param_func=optim_param_func, dataloader_args=_copy_if_dict(dataloader_args),
        distributed_sampler_cls=distributed_sampler_cls, lr_scheduler_cls=lr_scheduler_cls,
        lr_scheduler_args=_copy_if_dict(lr_scheduler_args),
        find_unused_parameters=options.find_unused_parameters,
    )
    excluded, included = excluded or [], included or []
    setup_problems = _setup_problems(setup, excluded, included)
    setup_problems += wrapped_model_problems(setup.model)  # [input checks] a wrapped model is not probed
    problems += setup_problems
    problems += input_problems(setup, save_strategy_to_file)  # [input checks] atorch/input_checks.py
    if launch := launch_problems():  # [input checks] torchrun's environment, before a group is made from it
        raise StrategyError(problems + launch, what="auto_accelerate cannot start")
    env = init_distributed()
    strategy, skipped = None, {}
    try:  # a rank that fails here must still reach the agreement below, or the others would wait
        strategy, strategy_problems = _resolve_strategy(
            load_strategy, env, excluded if isinstance(excluded, (list, tuple, set)) else []
        )
        problems += strategy_problems
        if optim_func is None:
            problems += no_optimizer_problems(strategy, lr_scheduler_cls, load_strategy is None and dataset is not None
                                              or finetune_strategy)
        if strategy is not None and not strategy_problems and not setup_problems:
            layout = ParallelLayout.of(strategy, env.world_size)
            batch = setup.dataloader_args.get("batch_size", 1)
            if batch % layout.data_size:
                problems.append(
                    f"global batch_size {batch} does not divide over {layout.data_size} data-parallel processes; "
                    f"use a multiple of {layout.data_size}"
                )
            skipped, model_problems = preflight(setup, env, strategy, layout)
            problems += model_problems
    except Exception as exc:  # noqa: BLE001  (reported through the agreement, with its type)
        problems.append(f"checking the strategy failed: {type(exc).__name__}: {exc}")
    # Every rank raises the same error, or none does.
    problems = agreed_problems(problems)
    if problems:
        raise StrategyError(problems, what="auto_accelerate cannot start")
    assert strategy is not None
    micro_batches, search_record = 1, None
    if load_strategy is None and setup.dataset is None:
        logger.warning("no load_strategy and no dataset: automatic search needs batches to measure; using %s",
                       strategy)
    elif load_strategy is None or finetune_strategy:
        # [automatic mode] atorch/strategy_search/automatic.py: every rank returns the same pick.
        try:
            strategy, setup, skipped, micro_batches, search_record = _search(
                setup, env, excluded, included, strategy if finetune_strategy else None, memory_limit, time_limit,
                search_options, strategy_server,
            )
        except NoStrategyFound as exc:  # ATorch's status False (every rank hears it from rank 0)
            logger.error("%s", exc)
            return False, AccelerateResult.failed(exc.problems), None

    ctx = build_context(setup, env, strategy, skipped)
    if save_strategy_to_file and env.is_main:
        strategy.save(save_strategy_to_file)
        logger.info("strategy saved to %s", save_strategy_to_file)
    result = build_result(ctx, setup, memory_limit, time_limit, micro_batches, search_record)
    logger.info("accelerated with %s on %d process(es)", strategy, env.world_size)
    return True, result, strategy


def _search(
    setup: UserSetup, env: DistEnv, excluded: list[str], included: list[str], finetune: Strategy | None,
    memory_limit: int | None, time_limit: float | None, options: Any, strategy_server: str | None,
) -> tuple[Strategy, UserSetup, dict[str, str], int, dict[str, Any]]:
    """Automatic mode: search, then check the pick like a loaded strategy (every rank agrees)."""
    from dataclasses import replace

    from atorch.strategy_search.automatic import search_strategy
    from atorch.strategy_search.describe import search_json

    outcome = search_strategy(setup, env, excluded=list(excluded), included=list(included), finetune=finetune,
                              memory_limit=memory_limit, time_limit=time_limit, options=options,
                              strategy_server=strategy_server)
    strategy = outcome.strategy
    layout = ParallelLayout.of(strategy, env.world_size)
    # The dataloader yields micro-batches; train_step takes outcome.micro_batches of them per step.
    setup = replace(setup, dataloader_args={**setup.dataloader_args,
                                            "batch_size": outcome.micro_batch_size * layout.data_size})
    skipped, problems = preflight(setup, env, strategy, layout)
    problems = agreed_problems(problems)
    if problems:
        raise StrategyError(problems, what=f"the searched strategy {strategy} cannot be applied")
    return strategy, setup, skipped, outcome.micro_batches, search_json(outcome, env.world_size)


def build_result(
    ctx: ModelContext, setup: UserSetup, memory_limit: int | None = None, time_limit: float | None = None,
    micro_batches: int = 1, search: dict[str, Any] | None = None,
) -> AccelerateResult:
    """What auto_accelerate returns, from a built context (holding nothing of the build itself).
    ``micro_batches`` of the setup's batch make one optimizer step."""
    with_data = setup.dataset is not None
    return AccelerateResult(
        model=ctx.model, optim=ctx.optimizer, dataloader=ctx.dataloader, loss_func=setup.loss_func,
        prepare_input=ctx.input_preparer(), lr_scheduler=ctx.lr_scheduler,
        args=AccelerateArgs(
            use_optim_backward=ctx.grad_scaler is not None or ctx.engine is not None,
            requires_set_gradient_accumulation_boundary=ctx.gradient_sync is not None or ctx.engine is not None,
            device=ctx.env.device, data_parallel_size=ctx.dp_size, data_parallel_rank=ctx.dp_rank,
            global_batch_size=setup.dataloader_args.get("batch_size", 1) * micro_batches if with_data else None,
            local_batch_size=ctx.local_batch_size() if with_data else None,
            model_input_format=setup.model_input_format, memory_limit=memory_limit, time_limit=time_limit,
            skipped=dict(ctx.skipped), gradient_accumulation_steps=micro_batches, search=search,
            data_parallel_group=ctx.data_mesh.get_group() if ctx.dp_size > 1 else None,
        ),
    )


def preflight(
    setup: UserSetup, env: DistEnv, strategy: Strategy, layout: ParallelLayout
) -> tuple[dict[str, str], list[str]]:
    """Before anything is built: which methods are skipped here (with why), and every problem of
    the strategy with this machine and this model (the model is only read)."""
    probe = ModelContext(setup, env, layout)
    probe.strategy = strategy  # model checks that depend on other methods (tensor_parallel: module_replace)
    skipped: dict[str, str] = {}
    problems: list[str] = meta_init.meta_problems(setup.model)  # a meta-device model must be initialisable
    for item in strategy.in_apply_order():
        method = get_method(item.name)
        reason = method.applicable(probe)
        if reason is None:
            problems += [f"'{item.name}': {p}" for p in method.model_problems(probe, item.config)]
        elif method.skip_when_inapplicable:
            skipped[item.name] = reason
        else:
            problems.append(f"'{item.name}' cannot run here: {reason}")
    return skipped, problems


def build_context(setup: UserSetup, env: DistEnv, strategy: Strategy, skipped: dict[str, str]) -> ModelContext:
    """Apply a checked strategy to a fresh copy of the user's model; the originals stay as they were.

    Building draws no numbers from the user's random generators (new layers made by module swaps
    are initialised, then overwritten): the user's training sees the same random stream as without atorch.
    """
    for name, reason in skipped.items():
        logger.warning("%s skipped: %s", name, reason)
    import_off_the_stack("torch._dynamo")
    devices = [env.device] if env.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        ctx = ModelContext(setup, env, ParallelLayout.of(strategy, env.world_size)).fresh()
        ctx.skipped = dict(skipped)
        apply_strategy(ctx, strategy)
        ctx.finish()
    return ctx
