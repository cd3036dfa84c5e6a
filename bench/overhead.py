"""Overhead of auto_accelerate against a hand-written DDP loop, measured side by side in one run.

    torchrun --nproc_per_node 2 bench/overhead.py [--repeats 240] [--steps 1] [--control] [--json results.json]

Both loops train the same GPT-2 (same initial weights, same data in the same order, same AdamW,
same global batch): "atorch" is ``auto_accelerate(load_strategy=["parallel_mode"])`` driven by
``atorch.training.train_step``; "hand" is torch DistributedDataParallel with a DistributedSampler.
After a warm-up, timed rounds of ``--steps`` steps alternate A B | B A | A B ... so drift in machine
load falls on both alike (with --control, a second identical hand-written loop joins the rotation:
its ratio to the first is the noise floor of the machine). Reports, as seen by rank 0, the median
step time and throughput of each, their throughput ratio (atorch/hand, target >= 0.99), the CPU
time per step (less sensitive to other programs on the machine), and whether the loops produced
the same losses (they should be bit-identical; the exit status is 1 if not).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from datetime import date
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SyntheticLanguage, build_gpt2, is_main, loss_func, machine, stats  # noqa: E402

import atorch  # noqa: E402
from atorch.distributed import init_distributed  # noqa: E402
from atorch.training import train_step  # noqa: E402

TARGET_RATIO = 0.99
LR = 1e-3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1, help="steps per timed round (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=240, help="timed rounds of each loop (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each loop first (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8, help="global batch size (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--control", action="store_true",
                        help="also time a second hand-written loop, to show the noise floor of the machine")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    for name in ("steps", "repeats", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def endless(loader: DataLoader) -> Iterator[Any]:
    epoch = 0
    while True:
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


class Runner:
    """One training loop under test: ``step()`` takes the next batch and trains on it."""

    def __init__(self, name: str, step: Callable[[Any], torch.Tensor], loader: DataLoader) -> None:
        self.name, self._step, self._batches = name, step, endless(loader)
        self.losses: list[float] = []
        self.step_times: list[float] = []  # wall-clock seconds of every timed step
        self.cpu_times: list[float] = []  # CPU seconds of this process (all threads) in every timed step
        self.round_times: list[float] = []  # mean step time of each timed round

    def run(self, steps: int, timed: bool) -> None:
        dist.barrier()  # both processes start the round together; the barrier is not timed
        times, cpu = [], []
        for _ in range(steps):
            start, cpu_start = time.perf_counter(), time.process_time()
            loss = self._step(next(self._batches))
            self.losses.append(loss.item())
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
        if timed:
            self.step_times += times
            self.cpu_times += cpu
            self.round_times.append(sum(times) / steps)


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def atorch_runner(model: torch.nn.Module, dataset: SyntheticLanguage, batch_size: int) -> Runner:
    _, result, _ = atorch.auto_accelerate(
        model, torch.optim.AdamW, dataset, loss_func,
        optim_args={"lr": LR}, dataloader_args={"batch_size": batch_size, "shuffle": False},
        model_input_format="unpack_dict", load_strategy=["parallel_mode"],
    )
    return Runner("atorch", lambda batch: train_step(result, [batch]), result.dataloader)


def hand_runner(model: torch.nn.Module, dataset: SyntheticLanguage, batch_size: int, name: str = "hand") -> Runner:
    """The DDP loop a user writes without atorch (no DDP on one process, as auto_accelerate does)."""
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    local = copy.deepcopy(model).to(dev)
    if world > 1:
        local = DistributedDataParallel(local, device_ids=[dev.index] if dev.type == "cuda" else None)
    optim = torch.optim.AdamW(local.parameters(), lr=LR)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size // world, sampler=sampler)

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        batch = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
        loss = local(**batch).loss.float()
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        loss = loss.detach()
        if world > 1:  # the global batch's loss, as train_step returns it (what a training log shows)
            dist.all_reduce(loss)
            loss /= world
        return loss

    return Runner(name, step, loader)


def compare(runner: Runner, base: Runner) -> dict[str, Any]:
    """How ``runner`` does against ``base``: > 1 means faster."""
    step, base_step = stats(runner.step_times), stats(base.step_times)
    paired = stats([b / r for r, b in zip(runner.round_times, base.round_times, strict=True)])
    diffs = [abs(x - y) for x, y in zip(runner.losses, base.losses, strict=True)]
    return {
        "throughput_ratio": base_step.median / step.median,
        "paired_round_ratio": paired.as_dict(),
        "cpu_ratio": stats(base.cpu_times).median / stats(runner.cpu_times).median,
        "fastest_step_ratio": base_step.minimum / step.minimum,
        "losses_identical": max(diffs) == 0.0,
        "losses_max_abs_diff": max(diffs),
        "steps_compared": len(diffs),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    world = init_distributed().world_size  # the process group both loops use (torchrun's, or 1 process)
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the {world} processes")
    model = build_gpt2(args.vocab, args.seq_len, args.layers, args.hidden, args.heads, seed=0)
    dataset = SyntheticLanguage(samples=512, seq_len=args.seq_len, vocab=args.vocab)
    runners = [atorch_runner(model, dataset, args.batch_size), hand_runner(model, dataset, args.batch_size)]
    if args.control:  # a second, identical hand-written loop: its ratio to the first is the noise floor
        runners.append(hand_runner(model, dataset, args.batch_size, name="hand (control)"))
    orders = list(itertools.permutations(runners))  # every loop runs in every position equally often
    for runner in runners:
        runner.run(args.warmup, timed=False)
    for index in range(args.repeats):
        for runner in orders[index % len(orders)]:  # two loops: A B | B A | A B ...
            runner.run(args.steps, timed=True)

    atorch_run, hand = runners[0], runners[1]
    report: dict[str, Any] = {
        "date": date.today().isoformat(), "machine": machine(),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "params": sum(p.numel() for p in model.parameters()),
        "loops": {},
    }
    for runner in runners:
        step = stats(runner.step_times)
        report["loops"][runner.name] = {
            "median_step_s": step.median, "samples_per_s": args.batch_size / step.median,
            "step_s": step.as_dict(), "round_mean_step_s": stats(runner.round_times).as_dict(),
            "cpu_step_s": stats(runner.cpu_times).as_dict(),
        }
    report["atorch_vs_hand"] = compare(atorch_run, hand)
    report["ratio"] = report["atorch_vs_hand"]["throughput_ratio"]
    report["losses"] = {
        "identical": report["atorch_vs_hand"]["losses_identical"],
        "first": atorch_run.losses[0], "last": [atorch_run.losses[-1], hand.losses[-1]],
    }
    if args.control:
        report["control_vs_hand"] = compare(runners[2], hand)
    return report


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg = report["config"]
    table = Table(title=(
        f"auto_accelerate(['parallel_mode']) vs hand-written DDP: {report['machine']['world_size']} processes, "
        f"{report['params'] / 1e6:.2f}M params, global batch {cfg['batch_size']}, "
        f"{cfg['repeats']} interleaved rounds x {cfg['steps']} steps"
    ))
    for column in ("loop", "median step", "quartiles", "min-max", "samples/s", "CPU per step (median)"):
        table.add_column(column, justify="right")
    for name, row in report["loops"].items():
        s = row["step_s"]
        table.add_row(
            name, f"{s['median'] * 1e3:.2f} ms", f"{s['q1'] * 1e3:.2f}-{s['q3'] * 1e3:.2f} ms",
            f"{s['minimum'] * 1e3:.2f}-{s['maximum'] * 1e3:.2f} ms", f"{row['samples_per_s']:.1f}",
            f"{row['cpu_step_s']['median'] * 1e3:.2f} ms",
        )
    console = Console(width=120)
    console.print(table)
    for key, label in (("atorch_vs_hand", "atorch/hand"), ("control_vs_hand", "control/hand (noise floor)")):
        if key not in report:
            continue
        c = report[key]
        paired = c["paired_round_ratio"]
        verdict = ""
        if key == "atorch_vs_hand":
            verdict = " ([green]meets" if c["throughput_ratio"] >= TARGET_RATIO else " ([red]below"
            verdict += f" the {TARGET_RATIO} target[/])"
        same = "[green]identical[/]"
        if not c["losses_identical"]:
            same = f"[red]differ[/] (max {c['losses_max_abs_diff']:.3g})"
        console.print(
            f"{label}: throughput ratio [bold]{c['throughput_ratio']:.3f}[/]{verdict}; per-round ratios median "
            f"{paired['median']:.3f} (quartiles {paired['q1']:.3f}-{paired['q3']:.3f}); CPU-time ratio "
            f"{c['cpu_ratio']:.3f}; fastest-step ratio {c['fastest_step_ratio']:.3f}; "
            f"losses over {c['steps_compared']} steps {same}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = measure(args)
    if is_main():
        print_report(report)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print("RESULT " + json.dumps(report), flush=True)
    return 0 if report["losses"]["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
