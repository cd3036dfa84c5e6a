"""Errors that atorch raises for a user's mistake: each names the problem and the fix."""

from __future__ import annotations


class AtorchError(Exception):
    """Base class of every error atorch raises on purpose."""


class StrategyError(AtorchError, ValueError):
    """A strategy that cannot be applied; lists every problem found, not only the first."""

    def __init__(self, problems: list[str], what: str = "invalid strategy"):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{what} ({len(self.problems)} problem(s)):\n{lines}")


class SetupError(AtorchError, ValueError):
    """The user's training objects (model, dataset, arguments) cannot be used as given."""
