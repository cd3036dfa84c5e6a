"""``auto_accelerate``: ATorch's entry point. Semi-automatic mode: apply the given strategy."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from atorch.build import agreed_build, build_result, preflight, setup_same, strategy_same
from atorch.data import empty_loader_problems, short_dataset_warning
from atorch.distributed import DistEnv, agreed_problems, init_distributed
from atorch.errors import NoStrategyFound, SearchOptionIgnored, StrategyError
from atorch.function_caches import forget_fake_fills
from atorch.input_checks import input_problems, launch_problems, unused_parameter_problems, wrapped_model_problems
from atorch.log import get_logger, set_verbose
from atorch.model_context import MODEL_INPUT_FORMATS, UserSetup
from atorch.no_optimizer import no_optimizer_problems
from atorch.opt_lib.parallel_mode import ParallelMode
from atorch.opt_lib.precision import AmpNative
from atorch.opt_lib.registry import get_method, is_registered, method_names
from atorch.options import AccelerateOptions
from atorch.result import AccelerateResult
from atorch.strategy import Strategy

logger = get_logger(__name__)


def default_strategy(env: DistEnv) -> Strategy:
    """Used when no load_strategy is given and there is no dataset to search with: data parallel over
    all processes, plus bf16 autocast where the GPU computes bf16 natively."""
    names: list[Any] = [ParallelMode.name]
    if env.device.type == "cuda" and torch.cuda.is_bf16_supported():
        names.append((AmpNative.name, {"dtype": "bf16"}))
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


# Options of the automatic search alone: with a load_strategy (and no finetune_strategy) nothing reads them.
_SEARCH_ONLY = ("memory_limit", "time_limit", "search", "strategy_server")


def _warn_search_options(kargs: dict[str, Any], options: AccelerateOptions, why: str) -> None:
    """Each option of the automatic search the caller gave where no search runs, named in one warning
    (a warning, not an error: ATorch accepts them with load_strategy, and result.args still reports them)."""
    given = [name for name in _SEARCH_ONLY if kargs.get(name) not in (None, {}, "")]
    if not given:
        return
    warnings.warn(
        f"auto_accelerate: {', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to the automatic "
        f"search, and none runs here ({why}): {'it is' if len(given) == 1 else 'they are'} ignored. Drop "
        f"{'it' if len(given) == 1 else 'them'}, or leave out load_strategy to search (finetune_strategy=True "
        "searches around load_strategy)", SearchOptionIgnored, stacklevel=3)


def _casts(load_strategy: Any, included: Any, searching: bool) -> bool:
    """Whether the strategy given (or included in the search) casts inputs or parameters (autocast, half, fp8):
    the user's step is then not held to the model's own dtypes."""
    methods: list[tuple[str, Any]] = []
    if load_strategy is not None:
        try:
            methods = [(item.name, item.config) for item in Strategy.parse(load_strategy)[0].methods]
        except Exception:  # noqa: BLE001  (an unreadable strategy is reported by _resolve_strategy)
            return True
    if searching and isinstance(included, (list, tuple, set)):
        methods += [(str(n), None) for n in included]
    return any(name in method_names() and get_method(name).casts(config) for name, config in methods)


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
    searching = load_strategy is None and setup.dataset is not None or finetune_strategy
    problems += input_problems(setup, save_strategy_to_file,  # [input checks] atorch/input_checks.py
                               casts=_casts(load_strategy, included, searching))
    if not searching:
        _warn_search_options(kargs, options, "load_strategy is given" if load_strategy is not None else
                             "there is no dataset to search with")
    elif isinstance(setup.dataloader_args, dict) and not setup_problems:
        problems += empty_loader_problems(setup.dataset, setup.dataloader_args, None)
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
            layout = strategy.layout(env.world_size)
            batch = setup.dataloader_args.get("batch_size", 1)
            if batch % layout.data_size:
                problems.append(
                    f"global batch_size {batch} does not divide over {layout.data_size} data-parallel processes; "
                    f"use a multiple of {layout.data_size}"
                )
            if not searching and setup.dataset is not None:
                problems += empty_loader_problems(setup.dataset, setup.dataloader_args, layout.data_size)
            if not problems:
                # searching: the space's DDP candidates would each fail at their second step, and the search would
                # blame the setup with DDP's own message; named here, before any dry-run
                problems += unused_parameter_problems(setup, strategy, layout.data_size)
            skipped, model_problems = preflight(setup, env, strategy, layout)
            problems += model_problems
    except Exception as exc:  # noqa: BLE001  (reported through the agreement, with its type)
        problems.append(f"checking the strategy failed: {type(exc).__name__}: {exc}")
    # Every rank raises the same error, or none does; ranks given different strategies, arguments or models
    # (which would wait for each other in different collectives) are named here, before anything is built.
    problems = agreed_problems(problems, same=[strategy_same(strategy), *setup_same(
        setup, automatic_search=bool(searching), finetune_strategy=finetune_strategy, excluded=excluded,
        included=included, memory_limit=memory_limit, time_limit=time_limit,
        search=search_options.model_dump(mode="json"), strategy_server=strategy_server)])
    if problems:
        raise StrategyError(problems, what="auto_accelerate cannot start")
    assert strategy is not None
    if setup.dataset is not None and (short := short_dataset_warning(setup.dataset, setup.dataloader_args)):
        warnings.warn(short, UserWarning, stacklevel=2)
    micro_batches, search_record = 1, None
    if load_strategy is None and setup.dataset is None:
        logger.warning("no load_strategy and no dataset: automatic search needs batches to measure; using %s",
                       strategy)
    elif searching:
        # [automatic mode] atorch/strategy_search/search/automatic.py: every rank returns the same pick.
        from atorch.strategy_search.search.entry import search_and_check  # `import atorch` loads no search (no Optuna)

        try:
            strategy, setup, skipped, micro_batches, search_record = search_and_check(
                setup, env, excluded, included, strategy if finetune_strategy else None, memory_limit, time_limit,
                search_options, strategy_server,
            )
        except NoStrategyFound as exc:  # ATorch's status False (every rank hears it from rank 0)
            logger.error("%s", exc)
            return False, AccelerateResult.failed(exc.problems), None

    forget_fake_fills(setup.model, rescan=True)  # what the checks' and the search's fake runs cached
    ctx = agreed_build(setup, env, strategy, skipped)  # a build that fails on one rank fails on all
    if save_strategy_to_file and env.is_main:
        strategy.save(save_strategy_to_file)
        logger.info("strategy saved to %s", save_strategy_to_file)
    result = build_result(ctx, setup, memory_limit, time_limit, micro_batches, search_record)
    steps = f"; {micro_batches} micro-batches of {setup.dataloader_args.get('batch_size', 1)} samples make one " \
        "optimizer step (result.args.gradient_accumulation_steps)" if micro_batches > 1 else ""
    logger.info("accelerated with %s on %d process(es)%s", strategy, env.world_size, steps)
    return True, result, strategy

