"""Logging for atorch, as a library logs: records go to the ``atorch`` logger and propagate, so an
application's own logging configuration receives them; atorch adds no handler of its own unless asked.

The ``atorch`` logger holds a ``NullHandler`` and a level: INFO on rank 0, WARNING on the other ranks
(DEBUG on rank 0 with ``verbose``). ``console()`` (``auto_accelerate(verbose=True)``, the CLI) adds the
rich console handler, on which lines carry their rank; while it is attached the records stop there
instead of also reaching the root logger's handlers (no line is printed twice).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

_ROOT = "atorch"
_CONFIGURED = False
_CONSOLE: logging.Handler | None = None  # the handler console() attached, if any


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def get_logger(name: str = _ROOT) -> logging.Logger:
    global _CONFIGURED
    logger = logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")
    if not _CONFIGURED:
        _CONFIGURED = True
        root = logging.getLogger(_ROOT)
        root.setLevel(logging.INFO if _rank() == 0 else logging.WARNING)  # rank 0 speaks for the job
        root.addHandler(logging.NullHandler())
    return logger


def console(verbose: bool = False) -> logging.Handler:
    """Print atorch's lines on the console (rich, ``[rankN]`` first), at DEBUG on rank 0 if ``verbose``.
    Attached once; the CLI and ``auto_accelerate(verbose=True)`` call it."""
    global _CONSOLE
    root = get_logger()
    if _CONSOLE is None or _CONSOLE not in root.handlers:
        handler: logging.Handler
        if sys.stdout.isatty():
            from rich.logging import RichHandler

            handler = RichHandler(show_path=False, rich_tracebacks=False)
            handler.setFormatter(logging.Formatter(f"[rank{_rank()}] %(message)s"))
        else:  # a file or a pipe: whole lines with their time (rich would wrap them at 80 columns)
            handler = logging.StreamHandler(sys.stdout)
            handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [rank{_rank()}] %(message)s",
                                                   datefmt="%H:%M:%S"))
        root.addHandler(handler)
        root.propagate = False
        _CONSOLE = handler
    set_verbose(verbose)
    return _CONSOLE


@contextlib.contextmanager
def console_while(verbose: bool = False) -> Iterator[logging.Handler]:
    """atorch's console for the block (a CLI command); a console attached before stays after it."""
    attached_here = _CONSOLE is None or _CONSOLE not in get_logger().handlers
    handler = console(verbose)
    try:
        yield handler
    finally:
        if attached_here:
            _detach_console()


@contextlib.contextmanager
def progress_console(enabled: bool = True) -> Iterator[None]:
    """atorch's console for the block where the application has set up no logging of its own (no handler on the
    root logger, atorch's console not attached): long work (the automatic search) is never silent by default.
    ``enabled=False`` (the search option ``progress``) keeps it quiet."""
    if not enabled or logging.getLogger().handlers or (_CONSOLE is not None and _CONSOLE in get_logger().handlers):
        yield
        return
    with console_while():
        yield


def _detach_console() -> None:
    global _CONSOLE
    root = get_logger()
    if _CONSOLE is not None:
        root.removeHandler(_CONSOLE)
    root.propagate = True
    _CONSOLE = None
    set_verbose(False)


def set_verbose(verbose: bool) -> None:
    """``verbose=True``: DEBUG on rank 0, on atorch's console. False: back to INFO on rank 0 (a console
    attached earlier stays)."""
    if verbose and (_CONSOLE is None or _CONSOLE not in get_logger().handlers):
        console(verbose=True)
        return
    level = logging.DEBUG if verbose else logging.INFO
    get_logger().setLevel(level if _rank() == 0 else logging.WARNING)


def say_where_seen(log: logging.Logger, level: int, message: str, prefix: str) -> None:
    """Log ``message``, and print it on stderr (after ``prefix``) as well where no handler would show it: a line
    that must be seen (a process about to end itself, a launch waiting for its processes) even where the
    application configured no logging (atorch adds only a NullHandler)."""
    log.log(level, "%s", message)
    current: logging.Logger | None = log
    while current is not None:
        if any(not isinstance(h, logging.NullHandler) and h.level <= level for h in current.handlers):
            if log.isEnabledFor(level):
                return
            break
        current = current.parent if current.propagate else None
    print(f"{prefix} {message}", file=sys.stderr, flush=True)


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
