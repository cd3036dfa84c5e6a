"""``atorch plan``: the command's arguments, its table, ``--json``, ``--html`` and ``--emit-strategy``.

The planning itself is ``cluster_plan.plan_job``; this module only reads the command line and writes what
it found.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from pathlib import Path
from typing import Any

from atorch.errors import SetupError
from atorch.strategy_search.cluster.cluster_plan import (
    MEMORY_BAND,
    Plan,
    PlanResult,
    humanize_count,
    parse_layout,
    plan_job,
    smallest_fitting_cluster,
)
from atorch.strategy_search.cluster.precision import REGIME_NAMES
from atorch.units import parse_bytes

GIB = 2**30


def add_parser(sub: Any) -> None:
    plan = sub.add_parser("plan", help="plan a training job for a cluster: every layout's memory, step time, MFU",
                          description="Predict every layout of a transformer on a cluster with the search's cost "
                          "model, ranked by step time among those that fit.")
    plan.add_argument("model", help="a built-in name (e.g. llama2-70b), a transformers config.json, or "
                      "module:function returning an nn.Module on the meta device")
    plan.add_argument("--gpus", type=int, required=True, help="GPUs in the cluster (the world size)")
    plan.add_argument("--gpus-per-node", type=int, default=None, help="default: the hardware profile's (8)")
    plan.add_argument("--hardware", default="a100-80gb", help="a profile name (a100-80gb, h100-80gb) or a JSON file "
                      "(a measured profile saved by atorch, or a table in the same format)")
    plan.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    plan.add_argument("--seq", type=int, required=True, help="sequence length in tokens")
    plan.add_argument("--memory-limit", default=None, help="bytes a GPU may use, e.g. 70GB (default: the profile's)")
    plan.add_argument("--top", type=int, default=10, help="rows of the table (the JSON has every plan)")
    plan.add_argument("--layout", default=None, help="evaluate a layout, e.g. tensor=8,pipeline=4,sharding=fsdp "
                      "(keys: tensor, pipeline, data, sharding, recompute, schedule, virtual_stages, "
                      "sequence_parallel, micro_batch_size, expert, fp8, context; schedule also dualpipe; the rest "
                      "chosen by the planner)")
    plan.add_argument("--precision-regime", default="auto", choices=("auto", *REGIME_NAMES),
                      help="bytes per parameter as which mixed precision keeps them: amp_native (fp32 weights, "
                      "autocast), fsdp_mixed (FSDP2 MixedPrecisionPolicy: fp32 sharded master, bf16 gathered), "
                      "megatron "
                      "(bf16 weights, fp32 gradient buffer, fp32 master + Adam in the distributed optimizer); auto: "
                      "what runs each layout (fsdp_mixed under zero2/fsdp, megatron where only Megatron-style stacks "
                      "run it: DDP/ZeRO-1 over a tensor dimension, else amp_native)")
    plan.add_argument("--json", default=None, help="write every plan here as {\"plans\": [...]}, best first")
    plan.add_argument("--html", default=None, help="write a page with a Pareto plot (step time vs memory)")
    plan.add_argument("--emit-strategy", default=None, help="write the first plan's strategy (the given layout's, "
                      "else the best) as JSON for auto_accelerate(load_strategy=FILE)")
    plan.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (SetupError, FileNotFoundError) as exc:
        problems = exc.args[0] if exc.args and isinstance(exc.args[0], list) else [str(exc)]
        print("atorch plan: " + "\n  ".join(problems), file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from atorch.strategy_search.cluster.model_shapes import analysed_stats, resolve_model
    from atorch.strategy_search.costing.hardware import load_profile

    profile = load_profile(args.hardware)
    name, shape = resolve_model(args.model, args.seq)
    limit = parse_bytes(args.memory_limit) if args.memory_limit else None
    given = parse_layout(args.layout) if args.layout else None
    # A profile atorch measured on these processes: predict as the automatic search does, from the analyser's
    # statistics of the model itself (per-operation and DTensor costs dominate the steps of the small models such
    # machines plan); a table (a cluster that is not here): the transformer terms of large runs.
    stats = analysed_stats(args.model, args.seq) if profile.source == "measured" else None
    terms = "the search's terms (the model analysed on fake tensors)" if stats is not None else "transformer terms"
    precision = None if args.precision_regime == "auto" else args.precision_regime
    result = plan_job(shape, args.gpus, args.global_batch, profile, args.gpus_per_node, limit, given, stats,
                      precision)
    per_node = args.gpus_per_node or profile.gpus_per_node or profile.local_world_size
    print(f"{name}: {humanize_count(shape.params())} parameters, {shape.layers} layers, hidden {shape.hidden}, "
          f"heads {shape.heads} (kv {shape.kv_heads}), vocabulary {shape.vocab}; {args.gpus} × {profile.device_name} "
          f"({per_node} per node), global batch {args.global_batch} × {args.seq} tokens; "
          f"{result.considered} layouts in {result.seconds:.2f} s; cost model: {terms}")
    if shape.moe:
        print(f"mixture of experts: {humanize_count(shape.active_params())} of the parameters active per token "
              f"(top-{shape.top_k} of {shape.experts} experts of width {shape.expert_ffn}"
              f"{f', {shape.shared_experts} shared' if shape.shared_experts else ''}; FLOPs counted at the active "
              f"ones); a MoE layer's all-to-all sends {shape.all_to_all_bytes_per_token():,.0f} bytes per token each "
              f"way (dispatch, combine); expert layouts show '·eN' (experts split over N data ranks)")
    print_table(result, args.top)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": name, "gpus": args.gpus, "hardware": args.hardware,
                                               "global_batch": args.global_batch, "seq": args.seq,
                                               "memory_limit_bytes": result.memory_limit,
                                               "precision_regime": args.precision_regime,
                                               "parameters": shape.params(),
                                               "active_parameters": shape.active_params(),
                                               "atorch_version": _version(),
                                               "cost_model": "search" if stats is not None else "transformer",
                                               "plans": [p.to_json() for p in result.plans]}, indent=1) + "\n")
        print(f"plans written to {args.json}")
    if args.html:
        Path(args.html).write_text(html_page(name, result, args.top))
        print(f"page written to {args.html}")
    first = result.plans[0] if result.plans else None
    if not any(p.fits for p in result.plans):
        fewest = smallest_fitting_cluster(shape, args.global_batch, profile, per_node, result.memory_limit)
        closest = min(result.plans, key=lambda p: p.over_by) if result.plans else None
        where = (f"the smallest cluster (doubling whole nodes) on which a layout fits is {fewest} GPUs"
                 if fewest else "no cluster up to 16,384 nodes fits it at this batch")
        over = f" (the closest is over by {closest.over_by / GIB:.1f} GiB)" if closest else ""
        print(f"atorch plan: no layout fits {result.memory_limit / GIB:.1f} GiB per GPU{over}; {where}",
              file=sys.stderr)
        return 3
    if args.emit_strategy and first is not None:
        assert first.strategy is not None
        Path(args.emit_strategy).write_text(first.strategy.to_json() + "\n")
        if first.problems:  # a published layout atorch cannot run yet: written for reference, and said so
            print(f"atorch plan: the strategy written to {args.emit_strategy} does NOT run in atorch {_version()} "
                  f"(`atorch check` refuses it): {'; '.join(first.problems)}", file=sys.stderr)
            return 0
        for note in first.notes:
            print(f"note: {note}")
        lay = first.layout
        # dataloader_args' batch_size is the global batch of one call (split over the data ranks)
        batch = (f"dataloader_args batch_size {args.global_batch} (the schedule splits each rank's share into "
                 f"{lay.micro_batches} micro-batches of {lay.micro_batch_size})" if lay.pipeline > 1 else
                 f"dataloader_args batch_size {lay.micro_batch_size * lay.data} ({lay.micro_batch_size} per data "
                 f"rank), {lay.micro_batches} of them per optimizer step")
        print(f"strategy of plan 1 written to {args.emit_strategy}: {batch}; check it with "
              f"`atorch check {args.emit_strategy} --world-size {args.gpus}`")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("atorch")
    except PackageNotFoundError:
        return "(source tree)"


def _row(i: int, p: Plan) -> list[str]:
    lay, mem, t = p.layout, p.prediction.memory, p.prediction.time
    mark = "given" if p.given else str(i)
    fits = "yes" if p.fits else f"+{p.over_by / GIB:.1f}"
    sp = " sp" if lay.sequence_parallel else ""
    return [mark, lay.describe() + sp, lay.sharding, lay.recompute, f"{lay.micro_batch_size}×{lay.micro_batches}",
            f"{mem.peak / GIB:.1f}±{mem.peak * MEMORY_BAND / GIB:.1f}",
            f"{mem.parameters / GIB:.1f}/{mem.gradients / GIB:.1f}/{mem.optimizer_state / GIB:.1f}/"
            f"{mem.activations / GIB:.1f}", fits, f"{t.step:.3g}",
            f"{t.compute:.3g}/{t.communication:.2g}/{t.bubble:.2g}", f"{p.tokens_per_s:,.0f}",
            f"{p.tflops_per_gpu:.0f}" + ("!" if p.above_ceiling else ""), f"{p.mfu:.1%}", p.precision]


HEADER = ("#", "layout", "sharding", "recompute", "mbs×n", "GiB/GPU", "params/grads/optim/acts", "fits",
          "step s", "compute/comm/bubble", "tokens/s", "TFLOP/s", "MFU", "precision")


def print_table(result: PlanResult, top: int) -> None:
    from rich.console import Console
    from rich.table import Table

    shown = result.plans[:top]
    misfits = [p for p in result.plans if not p.fits and p not in shown][:3]  # what a bigger GPU would allow
    also = f", then the {len(misfits)} fastest that do not fit" if misfits else ""
    table = Table(title=f"best {len(shown)} of {len(result.plans)} runnable plans{also} "
                  f"(memory limit {result.memory_limit / GIB:.1f} GiB per GPU)")
    for column in HEADER:
        table.add_column(column, overflow="fold")
    for i, p in enumerate(shown + misfits, start=0 if result.plans and result.plans[0].given else 1):
        table.add_row(*_row(i, p))
    Console(width=max(180, Console().width)).print(table)
    print(f"GiB/GPU: the prediction ± its band ({MEMORY_BAND:.0%}, the analytical cost model's measured error); "
          "TFLOP/s marked ! where above the profile's measured matmul rate (not believable)")
    for p in shown[:1]:
        if p.given and p.problems:
            print(f"given layout cannot run under atorch: {'; '.join(p.problems)}")
    flagged = [p for p in shown + misfits if p.above_ceiling]
    if flagged:
        print(f"{len(flagged)} plan(s) predicted above the profile's matmul ceiling "
              f"({flagged[0].mfu_ceiling:.0%} of peak): the terms are missing a cost there")


def html_page(name: str, result: PlanResult, top: int) -> str:
    """A self-contained page: a Pareto plot of step time against memory per GPU (SVG) and the top plans."""
    plans = result.plans
    width, height, pad = 720, 420, 50
    xs = [p.prediction.memory.peak / GIB for p in plans] or [1.0]
    ys = [p.prediction.time.step for p in plans] or [1.0]
    x_max, y_min, y_max = max(xs) * 1.05, min(ys) * 0.95, max(ys) * 1.05

    def point(x: float, y: float) -> tuple[float, float]:
        return (pad + x / x_max * (width - 2 * pad),
                height - pad - (y - y_min) / ((y_max - y_min) or 1) * (height - 2 * pad))

    frontier, best = [], float("inf")
    for p in sorted(plans, key=lambda p: p.prediction.memory.peak):
        if p.prediction.time.step < best:
            best = p.prediction.time.step
            frontier.append(p)
    dots = "".join(
        f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="2.5" fill="{"#1f77b4" if p.fits else "#bbb"}">'
        f"<title>{html.escape(p.layout.describe())} {p.layout.sharding} {p.prediction.time.step:.3g} s</title></circle>"
        for p in plans for cx, cy in [point(p.prediction.memory.peak / GIB, p.prediction.time.step)])
    line = " ".join(f"{cx:.1f},{cy:.1f}" for p in frontier
                    for cx, cy in [point(p.prediction.memory.peak / GIB, p.prediction.time.step)])
    lx, _ = point(result.memory_limit / GIB, y_min)
    svg = (f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">{dots}'
           f'<polyline points="{line}" fill="none" stroke="#d62728"/>'
           f'<line x1="{lx:.1f}" x2="{lx:.1f}" y1="{pad}" y2="{height - pad}" stroke="#888" stroke-dasharray="4"/>'
           f'<text x="{width / 2}" y="{height - 10}" text-anchor="middle">memory per GPU (GiB)</text>'
           f'<text x="12" y="{height / 2}" transform="rotate(-90 12 {height / 2})" text-anchor="middle">'
           f"step time (s)</text></svg>")
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in _row(i + 1, p)) + "</tr>"
                   for i, p in enumerate(plans[:top]))
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADER)
    return (f"<!doctype html><meta charset='utf-8'><title>atorch plan: {html.escape(name)}</title>"
            f"<h1>atorch plan: {html.escape(name)}</h1><p>{len(plans)} plans; blue: fits, grey: does not; red: "
            f"the Pareto front (no plan is both faster and smaller); dashed: the memory limit.</p>{svg}"
            f"<h2>Top plans</h2><table border=1 cellspacing=0 cellpadding=3><tr>{head}</tr>{rows}</table>\n")
