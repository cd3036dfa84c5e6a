"""The dashboard a person opens: /ui (studies, best strategy, predicted vs measured per trial) and
optuna-dashboard on the same storage at /dashboard (its plots and trial views; its own paths /api,
/static and /csv are served beside it, since its front end asks for them at the root)."""

from __future__ import annotations

import html
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from atorch.server.store import Studies

MiB = 2**20
STYLE = """body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin-bottom:2em}
td,th{border:1px solid #ccc;padding:.25em .5em;font-size:90%}th{background:#eee}.ok{color:#060}.bad{color:#a00}"""


def _strategy(attrs: dict[str, Any]) -> str:
    strategy = (attrs.get("candidate") or {}).get("strategy")
    if isinstance(strategy, dict) and isinstance(strategy.get("methods"), list):
        names = [str(m.get("name", m)) if isinstance(m, dict) else str(m) for m in strategy["methods"]]
        mbs = (attrs.get("candidate") or {}).get("micro_batch_size")
        return " + ".join(names) + (f" (mbs {mbs})" if mbs is not None else "")
    point = (attrs.get("candidate") or {}).get("point") or attrs.get("key", "")
    return str(point)


def _num(value: Any, scale: float = 1.0, fmt: str = "{:.3g}") -> str:
    return fmt.format(value / scale) if isinstance(value, (int, float)) else ""


def _step(sps: Any, global_batch: Any) -> Any:
    return global_batch / sps if isinstance(sps, (int, float)) and sps > 0 and global_batch else None


def study_html(study: Any) -> str:
    table = study.user_attrs.get("atorch_table") or {}
    gb = table.get("global_batch")
    best = study.user_attrs.get("best")
    rows = []
    for t in study.get_trials(deepcopy=False):
        a, pred, meas = t.user_attrs, t.user_attrs.get("predicted") or {}, t.user_attrs.get("measured") or {}
        status = a.get("status", t.state.name.lower())
        cls = "ok" if status == "ok" else ("bad" if status not in ("running", "duplicate", "waiting") else "")
        cells = [str(t.number), t.state.name, f'<span class="{cls}">{html.escape(str(status))}</span>',
                 html.escape(_strategy(a)),
                 _num(pred.get("step_time_s")), _num(_step(meas.get("samples_per_s"), gb)),
                 _num(pred.get("samples_per_s")), _num(meas.get("samples_per_s")),
                 _num(pred.get("peak_memory_bytes"), MiB, "{:.1f}"), _num(meas.get("peak_memory_bytes"), MiB, "{:.1f}"),
                 html.escape(str(a.get("reason", "")))]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    head = ("trial", "state", "status", "strategy", "predicted step s", "measured step s", "predicted samples/s",
            "measured samples/s", "predicted peak MiB", "measured peak MiB", "reason")
    best_of = _strategy({"candidate": {"strategy": best.get("strategy"), "point": best.get("point"),
                                       "micro_batch_size": (best.get("point") or {}).get("micro_batch_size")}}
                        ) if best else ""
    best_text = (f"{html.escape(best_of)}"
                 f" &mdash; {_num(best.get('samples_per_s'))} samples/s, peak "
                 f"{_num(best.get('peak_memory_bytes'), MiB, '{:.1f}')} MiB (trial {best.get('trial')})"
                 if best else "none yet")
    name = html.escape(study.study_name)
    return (f'<h2 id="{name}">{name}</h2><p>best strategy: <b class="best">{best_text}</b> &middot; '
            f'<a href="/dashboard/studies/{study.study_id}">plots in optuna-dashboard</a></p>'
            f"<table><tr>{''.join(f'<th>{h}</th>' for h in head)}</tr>{''.join(rows)}</table>")


def page(studies: Studies) -> str:
    names = studies.names()
    body = "".join(study_html(studies.view(n)) for n in names)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>atorch strategy server</title>"
            f"<style>{STYLE}</style></head><body><h1>atorch strategy search</h1>"
            f"<p>{len(names)} stud{'y' if len(names) == 1 else 'ies'} &middot; "
            f"<a href='/dashboard'>optuna-dashboard</a> &middot; <a href='/docs'>API</a></p>"
            f"{body or '<p>No study yet.</p>'}</body></html>")


def mount(app: FastAPI, studies: Studies, token: str | None, failures: Any = None) -> None:
    from a2wsgi import WSGIMiddleware
    from optuna_dashboard import wsgi

    from atorch.server.auth import TokenGate

    ui = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @ui.get("/", response_class=HTMLResponse)
    def index() -> str:
        return page(studies)

    app.mount("/ui", TokenGate(ui, token, failures))
    # Last: optuna-dashboard takes every path the API does not (/dashboard, /api, /static, /csv).
    app.mount("/", TokenGate(WSGIMiddleware(wsgi(studies.rdb)), token, failures))
