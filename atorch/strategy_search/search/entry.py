"""The automatic search as ``auto_accelerate`` and the Lightning strategy start it: the search run on every
rank, and the pick checked like a loaded strategy (the options are read by atorch/options.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from atorch.build import agreed_preflight, setup_same, strategy_same
from atorch.distributed import DistEnv, agreed_problems
from atorch.errors import StrategyError
from atorch.log import progress_console
from atorch.model_context import UserSetup
from atorch.strategy import Strategy
from atorch.strategy_search.search.automatic import SearchOptions, search_strategy
from atorch.strategy_search.search.describe import search_json


def search_and_check(
    setup: UserSetup, env: DistEnv, excluded: list[str], included: list[str], finetune: Strategy | None,
    memory_limit: int | None, time_limit: float | None, options: SearchOptions, strategy_server: str | None,
) -> tuple[Strategy, UserSetup, dict[str, str], int, dict[str, Any]]:
    """Automatic mode: search, then check the pick like a loaded strategy (every rank agrees).

    Returns the pick, the setup with the dataloader's batch set to one micro-batch over the data-parallel
    ranks, the methods skipped here, the micro-batches per optimizer step and the search's record."""
    # Before the search: ranks given different models or options would search (and dry-run) differently and
    # wait for each other in different collectives; every rank raises the same error instead.
    if problems := agreed_problems([], same=[strategy_same(finetune), *setup_same(
            setup, excluded=excluded, included=included, memory_limit=memory_limit, time_limit=time_limit,
            search=options.model_dump(mode="json"), strategy_server=strategy_server)]):
        raise StrategyError(problems, what="the automatic search cannot start")
    with progress_console(options.progress):  # what the search does is shown, with no logging set up by the user
        outcome = search_strategy(setup, env, excluded=list(excluded), included=list(included), finetune=finetune,
                                  memory_limit=memory_limit, time_limit=time_limit, options=options,
                                  strategy_server=strategy_server)
    strategy = outcome.strategy
    layout = strategy.layout(env.world_size)
    # The dataloader yields micro-batches; train_step takes outcome.micro_batches of them per step.
    setup = replace(setup, dataloader_args={**setup.dataloader_args,
                                            "batch_size": outcome.micro_batch_size * layout.data_size})
    skipped = agreed_preflight(setup, env, strategy, what=f"the searched strategy {strategy} cannot be applied")
    return strategy, setup, skipped, outcome.micro_batches, search_json(outcome, env.world_size)
