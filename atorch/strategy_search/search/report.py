"""A search report a person can open: one self-contained HTML page per study.

It holds the pick, a table of every trial (what the cost model predicted, what the dry-run measured,
why a trial was left out) and plots made with Optuna's visualization module and plotly: the
optimisation history, and predicted against measured step time and peak memory (a perfect cost
model puts every point on the diagonal). plotly.js is embedded, so the page opens offline.
``atorch search-report`` writes it; the same storage also opens in optuna-dashboard.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from atorch.errors import SetupError
from atorch.strategy_search.search.describe import describe_record
from atorch.strategy_search.search.progress import MiB

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>atorch search report: {study}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}td.l,th.l{{text-align:left}}
.ok{{color:#060}}.bad{{color:#a00}}</style></head><body>
<h1>Strategy search: {study}</h1>
<p>{summary}</p>
<h2>Pick</h2><p>{pick}</p><p>{decided}</p><pre>{best}</pre>
<h2>Where the time went</h2>{phases}
<h2>Ruled out before the search</h2>{ruled_out}
<h2>Trials</h2>{table}
<h2>Plots</h2>{plots}
</body></html>
"""


def load_trials(storage: str, study_name: str | None = None) -> tuple[Any, list[dict[str, Any]]]:
    """The study and its trials as records (number, value, state, constraints, user attributes)."""
    import optuna

    names = [s.study_name for s in optuna.get_all_study_summaries(storage=storage)]
    if study_name is None:
        searches = [n for n in names if n.startswith("atorch-search-")] or names
        if len(searches) != 1:
            raise SetupError(f"the storage holds {len(searches)} studies: name one with --study "
                             f"({', '.join(searches) or 'none'})")
        study_name = searches[0]
    elif study_name not in names:
        raise SetupError(f"no study '{study_name}' in {storage}; studies there: {', '.join(names) or 'none'}")
    study = optuna.load_study(study_name=study_name, storage=storage)
    records = [{"number": t.number, "value": t.value, "state": t.state.name, "constraints": dict(t.constraints),
                **t.user_attrs} for t in study.get_trials(deepcopy=False)]
    return study, records


def _cell(value: Any, left: bool = False, cls: str = "") -> str:
    attrs = (' class="l' + (f" {cls}" if cls else "") + '"') if left else (f' class="{cls}"' if cls else "")
    return f"<td{attrs}>{html.escape(str(value))}</td>"


def _num(value: Any, scale: float = 1.0) -> str:
    return f"{value / scale:.4g}" if isinstance(value, (int, float)) and value else "-"


def trials_html(records: list[dict[str, Any]]) -> str:
    heads = ["#", "candidate", "predicted s/step", "predicted MiB", "measured s/step", "measured MiB",
             "samples/s", "status", "reason"]
    rows = ["<table><tr>" + "".join(f'<th class="{"l" if i in (1, 7, 8) else ""}">{h}</th>'
                                    for i, h in enumerate(heads)) + "</tr>"]
    for r in records:
        cand, pred, meas = r.get("candidate") or {}, r.get("predicted") or {}, r.get("measured") or {}
        status = r.get("status", r.get("state", ""))
        cls = "ok" if status == "ok" else "bad" if status in ("oom", "failed", "timeout", "predicted_oom") else ""
        rows.append("<tr>" + "".join([
            _cell(r["number"]), _cell(describe_record(cand), left=True),
            _cell(_num(pred.get("step_time_s"))), _cell(_num(pred.get("peak_memory_bytes"), MiB)),
            _cell(_num(meas.get("step_time_s"))), _cell(_num(meas.get("peak_memory_bytes"), MiB)),
            _cell(_num(meas.get("samples_per_s"))), _cell(status, left=True, cls=cls),
            _cell(r.get("reason") or "", left=True),
        ]) + "</tr>")
    return "\n".join(rows) + "</table>"


def _scatter(records: list[dict[str, Any]], key: str, scale: float, title: str, unit: str) -> Any:
    import plotly.graph_objects as go

    points = [(r["predicted"][key] / scale, r["measured"][key] / scale, describe_record(r["candidate"]))
              for r in records if r.get("status") == "ok" and (r.get("predicted") or {}).get(key)
              and (r.get("measured") or {}).get(key)]
    fig = go.Figure()
    if points:
        xs, ys, names = zip(*points, strict=True)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", text=names, name="dry-runs"))
        low, high = min(xs + ys), max(xs + ys)
        fig.add_trace(go.Scatter(x=[low, high], y=[low, high], mode="lines", name="predicted = measured",
                                 line={"dash": "dash"}))
    fig.update_layout(title=title, xaxis_title=f"predicted {unit}", yaxis_title=f"measured {unit}",
                      xaxis_type="log", yaxis_type="log", width=620, height=460)
    return fig


def plots_html(study: Any, records: list[dict[str, Any]]) -> str:
    from optuna.visualization import plot_optimization_history

    figures = [plot_optimization_history(study, target_name="samples/s"),
               _scatter(records, "step_time_s", 1.0, "Step time: cost model vs dry-run", "s/step"),
               _scatter(records, "peak_memory_bytes", MiB, "Peak memory per rank: cost model vs dry-run", "MiB")]
    return "\n".join(fig.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figures))


def ruled_out_html(study: Any) -> str:
    """The method families the build check left out of the space (``unbuildable``), each with its reason."""
    rows = study.user_attrs.get("unbuildable") or []
    if not rows:
        return "<p>none: every method family of the space built on the model (or was left to the dry-runs)</p>"
    head = "<tr><th class=\"l\">method</th><th class=\"l\">layout</th><th class=\"l\">why it does not build</th></tr>"
    body = "".join("<tr>" + _cell(r.get("method"), True) + _cell(r.get("layout"), True)
                   + _cell(r.get("reason"), True, "bad") + "</tr>" for r in rows)
    return f"<table>{head}{body}</table>"


PHASES = {"profile_s": "hardware profile", "analysis_s": "analysis", "build_check_s": "build check",
          "trace_s": "memory trace", "dry_runs_s": "dry-runs", "confirmation_s": "confirmation", "total_s": "total"}


def phases_html(study: Any) -> str:
    """The last search's wall time by phase (``phases``: the planner's and the automatic search's), in seconds."""
    phases = study.user_attrs.get("phases") or {}
    if not phases:
        return "<p>not recorded (a search by an older atorch)</p>"
    return "<p>" + html.escape(", ".join(f"{PHASES.get(k, k)} {v:.1f} s" for k, v in phases.items())) + "</p>"


def write_report(storage: str, out: str | Path, study_name: str | None = None) -> Path:
    """Write the HTML report of a study (the only atorch study in ``storage`` if none is named)."""
    study, records = load_trials(storage, study_name)
    counts: dict[str, int] = {}
    for r in records:
        counts[r.get("status", r["state"])] = counts.get(r.get("status", r["state"]), 0) + 1
    best = study.user_attrs.get("best")
    summary = f"{len(records)} trials: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    pick = next((describe_record(r["candidate"]) for r in records
                 if best and r["number"] == best.get("trial") and r.get("candidate")), "")
    page = PAGE.format(
        study=html.escape(study.study_name), summary=html.escape(summary), pick=html.escape(pick),
        decided=html.escape(str((study.user_attrs.get("confirmation_verdict") or {}).get("rule", ""))),
        ruled_out=ruled_out_html(study), phases=phases_html(study),
        best=html.escape(json.dumps(best, indent=2) if best else "no finished search has stored a pick"),
        table=trials_html(records), plots=plots_html(study, records),
    )
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path
