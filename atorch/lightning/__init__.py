"""atorch as a Lightning strategy: ``Trainer(strategy="atorch")`` or ``strategy=ATorchStrategy(load_strategy=[...])``.

Importing this module registers "atorch" in the StrategyRegistry of each installed Lightning namespace
(``lightning.pytorch`` and ``pytorch_lightning`` are separate: each gets its own class).
``ATorchStrategy`` is the ``lightning.pytorch`` class when that is installed, else ``pytorch_lightning``'s;
``STRATEGIES`` maps each namespace name to its class.
"""

from __future__ import annotations

import importlib
from typing import Any

from atorch.errors import SetupError

NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


def _register() -> dict[str, type]:
    from atorch.lightning.strategy import strategy_class

    found = {}
    for name in NAMESPACES:
        try:
            ns = importlib.import_module(name)
        except ImportError:
            continue
        cls = strategy_class(ns)
        registry = ns.strategies.StrategyRegistry
        if "atorch" not in registry:
            cls.register_strategies(registry)
        found[name] = cls
    return found


STRATEGIES: dict[str, type] = _register()
if not STRATEGIES:
    raise SetupError("atorch.lightning needs Lightning: pip install 'atorch[lightning]' "
                     "(lightning or pytorch_lightning)")
ATorchStrategy: Any = next(iter(STRATEGIES.values()))

__all__ = ["ATorchStrategy", "STRATEGIES"]
