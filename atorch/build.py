"""The build kernel: check a strategy against this machine and model, agree across ranks, build, hand back.

One path for every caller: ``auto_accelerate`` (semi-automatic and searched strategies), the dry-run of each
candidate (``atorch.dryrun``), the cost model's memory tracer (on fake tensors), the Lightning strategy (in
place) and, through ``auto_accelerate``, the Booster.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from atorch import meta_init
from atorch.agreement import Same, model_signature, plain
from atorch.apply import apply_strategy
from atorch.distributed import DistEnv, agreed_problems
from atorch.errors import StrategyError
from atorch.lifecycle import import_off_the_stack
from atorch.log import get_logger
from atorch.model_context import ModelContext, UserSetup
from atorch.opt_lib.registry import get_method
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
    # process group of the data-parallel ranks (with context_parallel: data × context, which train the same loss)
    data_parallel_group: Any = field(default=None, repr=False)

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


# dataloader_args that decide how many batches a rank loads and which (a rank with one batch more waits for
# the others in its last step); the rest (num_workers, pin_memory, ...) may differ between ranks.
_LOADER_KEYS = ("batch_size", "shuffle", "drop_last")


def strategy_same(strategy: Strategy | None) -> Same:
    """The strategy every rank must build (compared as its canonical JSON, shown in its short form)."""
    return Same("strategy", None if strategy is None else strategy.to_json(indent=None),
                "every process must pass the same load_strategy (a rank-dependent strategy makes the processes "
                "wait for each other in different collectives)", shown=None if strategy is None else str(strategy))


def setup_same(setup: UserSetup, **options: Any) -> list[Same]:
    """The user's arguments that shape the build or the collectives it runs, with the caller's ``options``
    (memory_limit, the search's options, ...), and the model's parameters and buffers: equal on every rank."""
    args = setup.dataloader_args if isinstance(setup.dataloader_args, dict) else {}
    shaping: dict[str, Any] = {f"dataloader_args['{k}']": args[k] for k in _LOADER_KEYS if k in args}
    try:  # a rank with more samples loads more batches
        shaping["len(dataset)"] = len(setup.dataset) if setup.dataset is not None else None  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001  (an IterableDataset has no length; this check must not raise on one rank)
        pass
    shaping.update({
        "model_input_format": setup.model_input_format, "optim_func": setup.optim_func,
        "optim_args": setup.optim_args, "lr_scheduler_cls": setup.lr_scheduler_cls,
        "lr_scheduler_args": setup.lr_scheduler_args, "distributed_sampler_cls": setup.distributed_sampler_cls,
        "find_unused_parameters": setup.find_unused_parameters, **options,
    })
    return [
        Same("options", {k: plain(v) for k, v in shaping.items()},
             "give every process the same arguments: a rank that builds or loads differently waits for the "
             "others in collectives they never run"),
        Same("model", model_signature(setup.model),
             "every process must build the same model (parameter names, shapes, dtypes and requires_grad, "
             "buffers): build it the same way on every rank"),
    ]


def agreed_preflight(setup: UserSetup, env: DistEnv, strategy: Strategy, what: str) -> dict[str, str]:
    """``preflight`` on every rank, the problems agreed: every rank raises the same StrategyError (``what``
    cannot ...) or none does; so does a strategy, model or argument that differs between ranks.
    Returns the methods skipped here."""
    skipped, problems = preflight(setup, env, strategy, strategy.layout(env.world_size))
    problems = agreed_problems(problems, same=[strategy_same(strategy), *setup_same(setup)])
    if problems:
        raise StrategyError(problems, what=what)
    return skipped


def build_context(
    setup: UserSetup, env: DistEnv, strategy: Strategy, skipped: dict[str, str], ctx: ModelContext | None = None
) -> ModelContext:
    """Apply a checked strategy; by default to a fresh copy of the user's model (the originals stay as they
    were), or in ``ctx`` as given (the Lightning strategy's module, in place).

    Building draws no numbers from the user's random generators (new layers made by module swaps
    are initialised, then overwritten): the user's training sees the same random stream as without atorch.
    """
    for name, reason in skipped.items():
        logger.warning("%s skipped: %s", name, reason)
    import_off_the_stack("torch._dynamo")
    devices = [env.device] if env.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        if ctx is None:
            ctx = ModelContext(setup, env, strategy.layout(env.world_size)).fresh()
        ctx.skipped = dict(skipped)
        apply_strategy(ctx, strategy)
        ctx.finish()
    return ctx



def agreed_build(setup: UserSetup, env: DistEnv, strategy: Strategy, skipped: dict[str, str]) -> ModelContext:
    """``build_context``, then every rank agrees that it worked: a build that raised on some ranks only (a user's
    optim_func failing on one, a layer only some pipeline stages hold) makes every rank raise that error, where
    the others would otherwise go on and wait in their first training collective. A rank that raises while the
    others are inside one of the build's own collectives (DDP's constructor) is not caught by this."""
    try:
        ctx, failure = build_context(setup, env, strategy, skipped), []
    except Exception as exc:  # noqa: BLE001  (reported through the agreement, with its type)
        logger.error("building %s failed: %s: %s", strategy, type(exc).__name__, exc)
        ctx, failure = None, [f"building the strategy failed: {type(exc).__name__}: {exc}"]
    problems = agreed_problems(failure)
    if problems:
        raise StrategyError(problems, what=f"auto_accelerate could not build {strategy}")
    assert ctx is not None
    return ctx

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
            data_parallel_group=ctx.data_mesh.get_group() if ctx.replica_size > 1 else None,
        ),
    )
