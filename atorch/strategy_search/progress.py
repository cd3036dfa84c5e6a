"""What a person sees while the search runs (rank 0): a live trial table, then a summary.

On a terminal the table is redrawn in place (rich ``Live``); elsewhere (a log file, CI) each finished
dry-run is one log line. Either way the search ends with a summary table of every trial of the study:
what the cost model predicted, what the dry-run measured, and why a trial was left out.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from atorch.log import get_logger

logger = get_logger(__name__)

MiB = 2**20


def describe(point: dict[str, Any]) -> str:
    """A short name of a search point, e.g. ``zero2/fsdp2 amp_bf16 ckpt``."""
    if "sharding" not in point:  # a finetune point: its tunable fields
        return " ".join(f"{k}={v}" for k, v in point.items() if k != "micro_batch_size") or "as loaded"
    options = [f"{k.split('.', 1)[1]}={v}" for k, v in sorted(point.items()) if k.startswith(f"{point['sharding']}.")]
    text = point["sharding"] + (f"({', '.join(options)})" if options else "")
    if point.get("precision", "fp32") != "fp32":
        text += f" {point['precision']}"
    if point.get("checkpoint"):
        text += " ckpt"
    if point.get("module_replace"):
        text += " replace"
    return text


def _mib(value: Any) -> str:
    return f"{value / MiB:.3g}" if isinstance(value, (int, float)) and value else "-"


def _secs(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, (int, float)) and value else "-"


def trial_table(rows: list[dict[str, Any]], title: str) -> Table:
    """A table of trial records (``PlanResult.trials`` or the live rows), one line each."""
    table = Table(title=title, title_justify="left")
    for name, justify in (("#", "right"), ("candidate", "left"), ("micro-batch", "right"), ("pred. s", "right"),
                          ("pred. MiB", "right"), ("meas. s", "right"), ("meas. MiB", "right"),
                          ("samples/s", "right"), ("status", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        cand = row.get("candidate") or {}
        pred = row.get("predicted") or {}
        meas = row.get("measured") or {}
        status = row.get("status", "running")
        if row.get("reason") and status != "ok":
            status += f": {row['reason'][:70]}"
        sps = meas.get("samples_per_s")
        table.add_row(
            str(row.get("number", "")), describe(cand.get("point", {})),
            f"{cand.get('micro_batch_size', '?')}x{cand.get('micro_batches', '?')}",
            _secs(pred.get("step_time_s")), _mib(pred.get("peak_memory_bytes")), _secs(meas.get("step_time_s")),
            _mib(meas.get("peak_memory_bytes")), f"{sps:.1f}" if sps else "-", status,
        )
    return table


class SearchProgress:
    """Live rows for the dry-runs of one search (rank 0)."""

    def __init__(self, memory_budget: int, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        if not self.console.is_terminal:  # a log file: wide enough for one line per trial
            self.console.width = max(self.console.width, 150)
        self.budget = memory_budget
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
        return trial_table(self.rows, f"strategy search: dry-runs (budget {self.budget / MiB:.0f} MiB per rank)")

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._table(), refresh=True)

    def started(self, cand: Any, prediction: Any) -> None:
        pred = {} if prediction is None or isinstance(prediction, str) else {
            "step_time_s": prediction.step_time_s, "peak_memory_bytes": prediction.peak_memory_bytes}
        self.rows.append({"number": f"d{len(self.rows) + 1}", "candidate": cand.to_json(), "predicted": pred,
                          "status": "running"})
        self._refresh()

    def finished(self, cand: Any, prediction: Any, measured: Any) -> None:
        row = self.rows[-1]
        row["measured"] = {"step_time_s": measured.step_time_s, "peak_memory_bytes": measured.peak_memory_bytes,
                           "samples_per_s": measured.samples_per_s}
        row["status"] = measured.status
        row["reason"] = measured.reason
        self._refresh()
        pred = row["predicted"]
        logger.info(
            "dry-run %d: %s mbs %sx%s -> %s, %s s/step (predicted %s), peak %s MiB (predicted %s)%s",
            len(self.rows), describe(cand.to_json()["point"]), cand.micro_batch_size, cand.micro_batches,
            measured.status, _secs(measured.step_time_s), _secs(pred.get("step_time_s")),
            _mib(measured.peak_memory_bytes), _mib(pred.get("peak_memory_bytes")),
            f": {measured.reason}" if measured.reason else "",
        )

    def summary(self, result: Any) -> None:
        """Every trial of the study, then the pick."""
        rows = [t for t in result.trials if t.get("status") != "duplicate"]
        if rows and result.source != "cache":
            self.console.print(trial_table(rows, f"strategy search: {len(rows)} trials in study {result.study_name}"))
        if result.candidate is not None:
            logger.info("strategy search (%s, %d dry-runs, %s): %s", result.source, result.dry_runs,
                        result.stop_reason, result.candidate)
