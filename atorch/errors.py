"""Errors that atorch raises for a user's mistake: each names the problem and the fix."""

from __future__ import annotations


class AtorchError(Exception):
    """Base class of every error atorch raises on purpose."""


class ProblemsError(AtorchError, ValueError):
    """Lists every problem found, not only the first, under one heading."""

    def __init__(self, problems: list[str], what: str):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{what} ({len(self.problems)} problem(s)):\n{lines}")


class StrategyError(ProblemsError):
    """A strategy (or the arguments around it) that cannot be applied."""

    def __init__(self, problems: list[str], what: str = "invalid strategy"):
        super().__init__(problems, what)


class NoStrategyFound(StrategyError):
    """The automatic search ended without a strategy that fits and runs: ``auto_accelerate`` returns
    status False (ATorch's behaviour) instead of raising; the problems say why and what to change."""


class SetupError(AtorchError, ValueError):
    """The user's training objects (model, dataset, arguments) cannot be used as given."""


class CheckpointError(ProblemsError):
    """A checkpoint that cannot be written or read as asked."""

    def __init__(self, what: str, problems: list[str]):
        super().__init__(problems, what)


class RankLost(AtorchError, RuntimeError):
    """A process stopped answering (stuck in a dry-run past its timeout and the grace after it): the job cannot
    go on without it, so every process that still runs raises this instead of waiting for ever. ``results``: the
    dry-runs that finished before (``dry_run_many``)."""

    def __init__(self, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = list(ranks or [])
        self.results: list = []


class SearchOptionIgnored(UserWarning):
    """An option of the automatic search (memory_limit, time_limit, search, strategy_server) given where no search
    runs (a load_strategy without finetune_strategy): it is ignored, and named in this warning."""
