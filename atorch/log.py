"""Logging for atorch: rich output on rank 0, warnings only on the other ranks."""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

_CONFIGURED = False


def get_logger(name: str = "atorch") -> logging.Logger:
    global _CONFIGURED
    logger = logging.getLogger(name if name.startswith("atorch") else f"atorch.{name}")
    if not _CONFIGURED:
        _CONFIGURED = True
        root = logging.getLogger("atorch")
        rank = int(os.environ.get("RANK", "0"))
        root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
        if not root.handlers:
            try:
                from rich.logging import RichHandler

                handler: logging.Handler = RichHandler(show_path=False, rich_tracebacks=False)
            except ImportError:  # rich is a dependency; stay usable without it all the same
                handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter(f"[rank{rank}] %(message)s"))
            root.addHandler(handler)
            root.propagate = False
    return logger


def set_verbose(verbose: bool) -> None:
    get_logger()
    rank = int(os.environ.get("RANK", "0"))
    level = logging.DEBUG if verbose else logging.INFO
    logging.getLogger("atorch").setLevel(level if rank == 0 else logging.WARNING)


class RepeatedWarnings:
    """Warnings that recur for many items (the cost model failing the same way for every candidate), logged
    once each with their count when the block ends, instead of once per item.

    ``with RepeatedWarnings(logger, "candidates") as warn: warn(key, message)``: messages with one ``key``
    count as one warning (the first message is shown); Python warnings raised in the block (a model's
    ``warnings.warn`` per call) are gathered the same way, by category and text.
    """

    def __init__(self, logger: logging.Logger, items: str = "candidates") -> None:
        self.logger, self.items = logger, items
        self.first: dict[str, str] = {}  # key -> the first message, in order of first appearance
        self.counts: dict[str, int] = {}
        self._catcher: Any = None
        self._caught: list[warnings.WarningMessage] = []

    def __call__(self, key: str, message: str) -> None:
        self.first.setdefault(key, message)
        self.counts[key] = self.counts.get(key, 0) + 1

    def __enter__(self) -> RepeatedWarnings:
        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        warnings.simplefilter("always")  # every occurrence is counted (the default shows one per place)
        return self

    def __exit__(self, *exc: object) -> None:
        self._catcher.__exit__(*exc)
        for w in self._caught:
            text = f"{w.category.__name__}: {w.message}"
            self(text, text)
        for key, message in self.first.items():
            count = self.counts[key]
            self.logger.warning("%s%s", message, f" (repeated for {count} {self.items})" if count > 1 else "")
