"""``atorch`` command line: list the methods, check a strategy, plan a job for a cluster, report on a search,
list or clear the search cache, run the strategy server."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from atorch import __version__, opt_lib
from atorch.errors import StrategyError
from atorch.opt_lib.compatibility import all_rules
from atorch.strategy import Strategy


def _default(field: Any) -> str:
    default = field.get_default(call_default_factory=True)
    if hasattr(default, "model_dump"):  # a nested method config (mixed_parallel's)
        return json.dumps(default.model_dump(mode="json", exclude_defaults=True))
    return json.dumps(default) if not callable(default) else "…"


def methods_markdown() -> str:
    """The methods reference in docs/methods.md: generated from the registry, so it cannot drift."""
    lines = ["| method | group | what it does |", "|---|---|---|"]
    for name in opt_lib.method_names():
        method = opt_lib.get_method(name)
        lines.append(f"| `{name}` | {method.group} | {method.summary} |")
    for name in opt_lib.method_names():
        method = opt_lib.get_method(name)
        lines += ["", f"**`{name}`** config:", "", "| key | default | meaning |", "|---|---|---|"]
        for key, field in method.Config.model_fields.items():
            lines.append(f"| `{key}` | `{_default(field)}` | {field.description or ''} |")
    lines += ["", "Combinations that are refused:", "", "| methods | when | because | fix |", "|---|---|---|---|"]
    for rule in all_rules():
        names = " + ".join(f"`{m}`" for m in rule.methods)
        lines.append(f"| {names} | {rule.condition or 'always'} | {rule.reason} | {rule.fix} |")
    return "\n".join(lines)


def _cmd_methods(args: argparse.Namespace) -> int:
    if args.markdown:
        print(methods_markdown())
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="atorch optimization methods (apply order)")
    for column in ("method", "group", "config (default)", "what it does"):
        table.add_column(column)
    for name in opt_lib.method_names():
        method = opt_lib.get_method(name)
        keys = "\n".join(f"{k}={_default(f)}" for k, f in method.Config.model_fields.items())
        table.add_row(name, method.group, keys, method.summary)
    Console().print(table)
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    try:
        strategy = Strategy.load(args.strategy, world_size=args.world_size)
    except StrategyError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"ok: {strategy} runs on {args.world_size} process(es)")
    print(strategy.adjusted(args.world_size).to_json())
    return 0


def _cmd_search_report(args: argparse.Namespace) -> int:
    from atorch.errors import SetupError
    from atorch.strategy_search.search.planner import default_storage
    from atorch.strategy_search.search.report import write_report

    try:
        path = write_report(args.storage or default_storage(), args.out, args.study)
    except SetupError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"report written to {path}")
    return 0


def _cmd_cache_list(args: argparse.Namespace) -> int:
    from atorch.strategy_search.search.planner import list_studies

    rows = list_studies(args.storage)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no studies in the search cache")
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="atorch search cache")
    table.add_column("study", no_wrap=True)  # whole: it is what `atorch cache clear` takes
    for column in ("created", "model", "world", "batch", "measured", "finished under", "last stop", "best"):
        table.add_column(column, overflow="fold")
    for r in rows:
        finished = ", ".join(f"{b / 2**20:.0f} MiB" for b in r["finished"]) or "no"
        best = f"{r['best']} ({r['best_samples_per_s']:.3g} samples/s)" if r["best"] else "-"
        model = f"{r['model'].rsplit('.', 1)[-1]} {r['fingerprint']}".strip() or "-"
        table.add_row(*(escape(str(v)) for v in (
            r["study"], r["created"], model, r["world_size"] or "-", r["global_batch"] or "-", r["measured"],
            finished, r["last_stop"] or "-", best)))
    Console(width=max(160, Console().width)).print(table)
    return 0


def _cmd_cache_clear(args: argparse.Namespace) -> int:
    from atorch.strategy_search.search.planner import clear_studies

    try:
        names = clear_studies(args.storage, args.study)
    except KeyError as exc:
        print(exc.args[0], file=sys.stderr)
        return 1
    print(f"deleted {len(names)} stud{'y' if len(names) == 1 else 'ies'}" + "".join(f"\n  {n}" for n in names))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        from atorch.server.serve import serve
    except ModuleNotFoundError as exc:  # the server's packages are an extra
        print(f"atorch serve needs the strategy server's packages ({exc.name} is not installed): "
              "pip install 'atorch[server]' (in a checkout: pip install -e '.[server]')", file=sys.stderr)
        return 2

    return serve(args.host, args.port, args.storage, args.token, args.max_body, args.token_file)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="atorch", description=__doc__)
    parser.add_argument("--version", action="version", version=f"atorch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    methods = sub.add_parser("methods", help="list the optimization methods with their configs")
    methods.add_argument("--markdown", action="store_true", help="print the reference tables of docs/methods.md")
    methods.set_defaults(run=_cmd_methods)
    check = sub.add_parser("check", help="validate a strategy (JSON text or .json path) for a world size")
    check.add_argument("strategy", help="the strategy: JSON text (a list of methods) or the path of a .json file "
                       "that save_strategy_to_file wrote")
    check.add_argument("--world-size", type=int, default=1,
                       help="the number of processes it will run on (layout sizes must divide it; default 1)")
    check.set_defaults(run=_cmd_check)
    from atorch.strategy_search.cluster.plan_cli import add_parser as add_plan_parser

    add_plan_parser(sub)
    report = sub.add_parser("search-report", help="write an HTML report of a strategy search (trials and plots)")
    report.add_argument("--storage", help="Optuna storage URL (default: the search cache's SQLite file)")
    report.add_argument("--study", help="study name (default: the only atorch study in the storage)")
    report.add_argument("--out", default="search-report.html", help="HTML file to write")
    report.set_defaults(run=_cmd_search_report)
    cache = sub.add_parser("cache", help="list or clear the strategy search's stored studies")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)
    listing = cache_sub.add_parser("list", help="each study: what it is for, its last search, its best")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    clear = cache_sub.add_parser("clear", help="delete one study, or every study when none is named")
    clear.add_argument("study", nargs="?", help="the study's name (atorch cache list shows them)")
    for p, run in ((listing, _cmd_cache_list), (clear, _cmd_cache_clear)):
        p.add_argument("--storage", help="Optuna storage URL (default: the search cache's SQLite file)")
        p.set_defaults(run=run)
    serve = sub.add_parser("serve", help="run the strategy server (HTTP + JSON, Optuna storage)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (non-loopback needs a token)")
    serve.add_argument("--port", type=int, default=8765, help="TCP port to listen on (default 8765)")
    serve.add_argument("--storage", default=None, help="Optuna/SQLAlchemy URL (default: SQLite in the cache dir)")
    serve.add_argument("--token-file", default=None, help="file holding the bearer token (safe: not in ps)")
    serve.add_argument("--token", default=None, help=(
        "bearer token, visible in ps: prefer --token-file or $ATORCH_SERVER_TOKEN (the default)"))
    serve.add_argument("--max-body", type=int, default=8 * 2**20, help="largest request body in bytes")
    serve.set_defaults(run=_cmd_serve)
    for group in (sub, cache_sub):  # each command's --help opens with what it does (its line in the list)
        for action in group._choices_actions:
            command = group.choices[action.dest]
            command.description = command.description or action.help
    args = parser.parse_args(argv)
    from atorch.log import console_while

    with console_while():  # a command's log lines are its output: atorch's console, for the command
        return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
