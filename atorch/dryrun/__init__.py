"""Dry-runs of candidate strategies: measured steps, peak memory, failures that never hang the search."""

from atorch.dryrun.memory import PeakMemory, live_tensor_bytes
from atorch.dryrun.runner import RankOutcome, TrialResult, dry_run, dry_run_many

__all__ = ["PeakMemory", "RankOutcome", "TrialResult", "dry_run", "dry_run_many", "live_tensor_bytes"]
