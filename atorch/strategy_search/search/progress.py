"""What a person sees while the search runs (rank 0): a live trial table, then a summary.

On a terminal the table is redrawn in place (rich ``Live``); elsewhere (a log file, CI) each finished
dry-run is one log line. Either way the search ends with a summary table of every trial of the study:
what the cost model predicted, what the dry-run measured, and why a trial was left out (the whole reason,
wrapped). Each candidate is named by its one description (``atorch.strategy_search.search.describe``), and a measured
outcome is judged again under this search's memory limit: the study may hold trials told under another.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from atorch.log import get_logger
from atorch.strategy_search.search.ask_tell import judge
from atorch.strategy_search.search.describe import describe_candidate, describe_record
from atorch.strategy_search.search.outcome import Measured, Predicted

logger = get_logger(__name__)

MiB = 2**20


def _mib(value: Any) -> str:
    return f"{value / MiB:.3g}" if isinstance(value, (int, float)) and value else "-"


def _secs(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, (int, float)) and value else "-"


def rejudged(record: dict[str, Any], budget: float | None) -> dict[str, Any]:
    """A trial record with its status and reason judged again under ``budget`` (the current memory limit):
    a study's trials may have been told under another limit. Only measured outcomes are judged again; a
    prediction told over the budget keeps its reason, which names the budget it was compared with."""
    measured = record.get("measured")
    if budget is None or not measured or record.get("status") in ("duplicate", "running"):
        return record
    _, _, attrs = judge(measured, record.get("predicted") or {}, budget)
    return {**record, "status": attrs["status"], "reason": attrs.get("reason", "")}


def status_text(record: dict[str, Any]) -> str:
    """A trial's status with its whole reason (never cut: the table wraps it)."""
    status = str(record.get("status", "running"))
    reason = record.get("reason")
    return f"{status}: {reason}" if reason and reason != status and status != "ok" else status


def trial_table(rows: list[dict[str, Any]], title: str, world_size: int | None = None,
                budget: float | None = None) -> Table:
    """A table of trial records (``PlanResult.trials`` or the live rows), one per trial; with ``budget``
    (bytes) each measured status is judged again under it. Cells are ``Text``: a ``[...]`` in a strategy or
    a reason is shown as written, never read as rich markup."""
    table = Table(title=Text(title), title_justify="left")
    for name, justify in (("#", "right"), ("candidate", "left"), ("pred. s", "right"), ("pred. MiB", "right"),
                          ("meas. s", "right"), ("meas. MiB", "right"), ("samples/s", "right"), ("status", "left")):
        table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for row in rows:
        row = rejudged(row, budget)
        pred = row.get("predicted") or {}
        meas = row.get("measured") or {}
        sps = meas.get("samples_per_s")
        table.add_row(
            Text(str(row.get("number", ""))), Text(describe_record(row.get("candidate") or {}, world_size)),
            Text(_secs(pred.get("step_time_s"))), Text(_mib(pred.get("peak_memory_bytes"))),
            Text(_secs(meas.get("step_time_s"))), Text(_mib(meas.get("peak_memory_bytes"))),
            Text(f"{sps:.1f}" if sps else "-"), Text(status_text(row)),
        )
    return table


class SearchProgress:
    """Live rows for the dry-runs of one search (rank 0)."""

    def __init__(self, memory_budget: int, console: Console | None = None, world_size: int | None = None,
                 max_dry_runs: int | None = None) -> None:
        self.max_dry_runs = max_dry_runs  # the search's max_trials: "dry-run k of at most n"
        self.console = console or Console(stderr=True)
        if not self.console.is_terminal:  # a log file: wide enough for one line per trial
            self.console.width = max(self.console.width, 150)
        self.budget = memory_budget
        self.world_size = world_size  # for the layout in each description (the data size)
        self.rows: list[dict[str, Any]] = []
        self._live: Live | None = None

    def __enter__(self) -> SearchProgress:
        if self.console.is_terminal:
            self._live = Live(self._table(), console=self.console, auto_refresh=False, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None

    def _table(self) -> Table:
        return trial_table(self.rows, f"strategy search: dry-runs (budget {self.budget / MiB:.0f} MiB per rank)",
                           self.world_size, self.budget)

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._table(), refresh=True)

    def describe(self, cand: Any) -> str:
        """The one description of a Candidate at this search's world size."""
        return describe_candidate(cand.strategy, cand.micro_batch_size, cand.micro_batches, self.world_size)

    def note(self, text: str) -> None:
        """A line on what the search does between dry-runs (one-time preparations): above the live table on a
        terminal, else in the log."""
        if self._live is not None:
            self._live.console.print(text)
        else:
            logger.info("%s", text)

    def started(self, cand: Any, prediction: Predicted | None) -> None:
        pred = {} if prediction is None or not prediction.ok else {
            "step_time_s": prediction.step_time_s, "peak_memory_bytes": prediction.peak_memory_bytes}
        self.rows.append({"number": f"d{len(self.rows) + 1}", "predicted": pred, "status": "running",
                          "candidate": {**cand.to_json(), "description": self.describe(cand)}})
        self._refresh()
        if self._live is None:  # a log, not a live table: what runs now (each line may stand for minutes)
            most = f" of at most {self.max_dry_runs}" if self.max_dry_runs else ""
            logger.info("dry-run %d%s: %s (predicted %s s/step, %s MiB)", len(self.rows), most,
                        self.rows[-1]["candidate"]["description"], _secs(pred.get("step_time_s")),
                        _mib(pred.get("peak_memory_bytes")))

    def finished(self, cand: Any, prediction: Predicted | None, measured: Measured) -> None:
        row = self.rows[-1]
        row["measured"] = {"status": str(measured.status).lower(), "step_time_s": measured.step_time_s,
                           "peak_memory_bytes": measured.peak_memory_bytes,
                           "samples_per_s": measured.samples_per_s, "reason": measured.reason or ""}
        row["status"] = measured.status
        row["reason"] = measured.reason
        self._refresh()
        pred = row["predicted"]
        logger.info(
            "dry-run %d: %s -> %s, %s s/step (predicted %s), peak %s MiB (predicted %s)%s",
            len(self.rows), row["candidate"]["description"],
            measured.status, _secs(measured.step_time_s), _secs(pred.get("step_time_s")),
            _mib(measured.peak_memory_bytes), _mib(pred.get("peak_memory_bytes")),
            f": {measured.reason}" if measured.reason else
            f" (stopped after {len(measured.step_times_s)} timed steps: slower than the best by the early-stop margin)"
            if measured.stopped_early else "",
        )

    def summary(self, result: Any) -> None:
        """Every trial of the study, judged again under this search's memory budget (the pick is logged once, by
        the search that called this)."""
        # Left out: duplicates (their outcome is another trial's) and enqueued trials never asked (no candidate).
        rows = [t for t in result.trials if t.get("status") != "duplicate" and t.get("candidate")]
        if rows and result.source != "cache":
            self.console.print(trial_table(rows, f"strategy search: {len(rows)} trials in study {result.study_name}",
                                           self.world_size, self.budget))
