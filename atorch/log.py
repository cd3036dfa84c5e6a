"""Logging for atorch: rich output on rank 0, warnings only on the other ranks."""

from __future__ import annotations

import logging
import os

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
