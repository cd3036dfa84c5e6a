"""AutoPlugin: the strategy found by atorch's automatic search."""

from __future__ import annotations

from typing import Any

from atorch.booster.plugin.base import Plugin
from atorch.errors import SetupError
from atorch.options import AutoOptions


class AutoPlugin(Plugin):
    """The strategy that ``auto_accelerate`` finds by itself (no ``load_strategy``): candidates predicted by
    the cost model, the most promising dry-run on all processes, the fastest that fits kept (and cached).

    The search runs real training steps, so it needs the data: boost the dataloader from
    ``plugin.prepare_dataloader(dataset, batch_size)`` (``batch_size`` per process, i.e. a global batch of
    ``batch_size × world size``), and iterate the dataloader that ``boost`` returns: it is split for the
    layout the search picked. The criterion is called as ``criterion(outputs, inputs)`` (or
    ``criterion(outputs)`` if it takes one argument) during the dry-runs.

    Translation (argument -> atorch):
    - ``memory_limit``, ``time_limit``, ``excluded``, ``included``, ``search`` and the other keyword options of
      ``auto_accelerate`` (``strategy_server``, ``verbose``, ...) -> the same ``auto_accelerate`` arguments,
      checked here (``atorch.options``)

    The picked strategy is ``booster.strategy`` after ``boost``. Where the search picks several micro-batches per
    step (``booster.gradient_accumulation_steps`` > 1), the dataloader yields micro-batches: run all but the last
    of each step inside ``booster.no_sync``.
    """

    control_precision_flag = True

    def __init__(self, memory_limit: Any = None, time_limit: float | None = None, excluded: list[str] | None = None,
                 included: list[str] | None = None, search: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__()
        given = {"memory_limit": memory_limit, "time_limit": time_limit, "excluded": excluded, "included": included,
                 "search": search, **options}
        _, problems = AutoOptions.checked(given, "option(s)")
        if problems:  # refused when the plugin is made, as auto_accelerate would refuse them at boost
            raise SetupError(f"AutoPlugin got bad options: {'; '.join(problems)}")
        self.accelerate_kwargs = {"excluded": list(excluded or []), "included": list(included or [])}
        self.accelerate_kwargs.update({k: v for k, v in given.items() if k not in self.accelerate_kwargs
                                       and v is not None})

    def methods(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"AutoPlugin({self.accelerate_kwargs})"
