"""Train a small GPT-2 with atorch.auto_accelerate.

    torchrun --nproc_per_node 2 examples/train_gpt2.py          # 2 processes, strategy found automatically
    python examples/train_gpt2.py                               # 1 process
    torchrun --nproc_per_node 2 examples/train_gpt2.py --memory-limit 40MiB   # a budget DDP cannot meet
    torchrun --nproc_per_node 2 examples/train_gpt2.py --strategy '["parallel_mode", "amp_native"]'
    torchrun --nproc_per_node 2 examples/train_gpt2.py --strategy best.json --save-strategy used.json

Without --strategy, atorch searches: it analyses the model, predicts every candidate strategy with its
cost model, dry-runs the most promising few on all processes and trains with the fastest that fits
(a second run finds the pick in its cache and starts at once).

The model is a transformers GPT2LMHeadModel built from a small config with random weights, and the
data is a generated "language" (words made of fixed token sequences), so nothing is downloaded.
The script is also a check: it exits with status 1 if the loss is not finite or does not clearly fall.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

import atorch
from atorch.log import console
from atorch.training import train_step

WARMUP_STEPS = 3  # left out of the step-time median: first steps allocate and build caches
REQUIRED_DROP = 0.5  # the loss of the last steps must be below this fraction of the first step's


# ----- model and data -----------------------------------------------------------------------
def build_gpt2(vocab: int = 2048, seq_len: int = 128, layers: int = 4, hidden: int = 256, heads: int = 4,
               seed: int = 0) -> nn.Module:
    """A randomly initialised GPT-2 language model (same weights for the same seed)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab, n_positions=seq_len, n_embd=hidden, n_layer=layers, n_head=heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        bos_token_id=vocab - 1, eos_token_id=vocab - 1,
    )
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # name transformers' causal-LM loss (it warns when left unset)
    return model


class SyntheticLanguage(Dataset):
    """Sentences of words drawn with Zipf frequencies from a fixed lexicon; each word is a fixed run
    of 2-6 tokens. Inside a word the next token is determined, so a model that learns the lexicon
    predicts most tokens: the loss can fall from ln(vocab) (7.6 nats) to about 1.1 nats, the entropy
    of choosing the next word spread over its tokens (with the defaults).

    Items are ``{"input_ids", "labels"}`` (GPT2LMHeadModel shifts the labels itself).
    """

    def __init__(self, samples: int = 2048, seq_len: int = 128, vocab: int = 2048, words: int = 384,
                 seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(2, 7, (words,), generator=g)
        # Words use distinct tokens while the vocabulary lasts (then tokens are reused).
        tokens = torch.randperm(vocab, generator=g).repeat(int(lengths.sum()) // vocab + 1)
        ends = lengths.cumsum(0).tolist()
        lexicon = [tokens[end - int(n):end] for end, n in zip(ends, lengths, strict=True)]
        zipf = 1.0 / torch.arange(1, words + 1, dtype=torch.float64)
        self.data = torch.empty(samples, seq_len, dtype=torch.long)
        for row in range(samples):
            picks = torch.multinomial(zipf, seq_len, replacement=True, generator=g).tolist()
            sentence = torch.cat([lexicon[w] for w in picks])  # at least 2 * seq_len tokens
            self.data[row] = sentence[:seq_len]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[index], "labels": self.data[index]}


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """Learning-rate factor: linear warm-up, then cosine decay to 10% of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def loss_func(data: dict[str, torch.Tensor], output: Any) -> torch.Tensor:
    """ATorch's convention: loss_func(batch, model output)."""
    return output.loss.float()


# ----- command line -------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default=None,
                        help="JSON list of methods or path of a strategy .json file (default: search for one)")
    parser.add_argument("--time-limit", type=float, default=600, help="seconds the search may take")
    parser.add_argument("--memory-limit", help="memory budget per process for the search, e.g. 40MiB")
    parser.add_argument("--max-trials", type=int, default=8, help="most dry-runs the search makes")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch size (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-strategy", metavar="PATH", help="write the strategy used as JSON to PATH")
    parser.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    args = parser.parse_args(argv)
    if args.steps < 2 * WARMUP_STEPS:
        parser.error(f"--steps must be at least {2 * WARMUP_STEPS}, got {args.steps}")
    return args


# ----- training -----------------------------------------------------------------------------
def batches(dataloader: DataLoader) -> Iterator[Any]:
    """Endless batches; atorch's dataloader shuffles anew on every pass (it advances the epoch itself)."""
    while True:
        yield from dataloader


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def train(args: argparse.Namespace) -> dict[str, Any]:
    model = build_gpt2(args.vocab, args.seq_len, args.layers, args.hidden, args.heads, args.seed)
    dataset = SyntheticLanguage(samples=max(64 * args.batch_size, 1024), seq_len=args.seq_len, vocab=args.vocab)

    status, result, strategy = atorch.auto_accelerate(
        model,
        torch.optim.AdamW,
        dataset,
        loss_func,
        optim_args={"lr": args.lr, "weight_decay": 0.01},
        dataloader_args={"batch_size": args.batch_size, "shuffle": True, "drop_last": True},
        model_input_format="unpack_dict",
        load_strategy=args.strategy,
        lr_scheduler_cls=torch.optim.lr_scheduler.LambdaLR,
        lr_scheduler_args={"lr_lambda": functools.partial(warmup_cosine, warmup=args.steps // 10, total=args.steps)},
        save_strategy_to_file=args.save_strategy,
        time_limit=args.time_limit,
        memory_limit=args.memory_limit,
        search={"max_trials": args.max_trials},
    )
    assert status
    scheduler = result.lr_scheduler
    accumulation = result.args.gradient_accumulation_steps  # the search may pick micro-batching

    losses: list[float] = []
    step_times: list[float] = []
    data_iter = batches(result.dataloader)
    with progress(not args.no_progress, args.steps) as advance:
        for step in range(args.steps):
            start = time.perf_counter()
            # One optimizer step over the global batch: forward/backward on each micro-batch, then the
            # step (README.md "Quick start" shows the same loop written out); the global mean loss.
            loss = train_step(result, [next(data_iter) for _ in range(accumulation)])
            step_times.append(time.perf_counter() - start)

            losses.append(float(loss))
            lr = scheduler.get_last_lr()[0]
            advance(step, losses[-1], lr)
    summary = summarize(args, str(strategy), result, losses, step_times)
    summary["strategy_json"] = json.dumps(strategy.to_list())
    summary["search"] = result.args.search
    return summary


@contextmanager
def progress(enabled: bool, total: int) -> Iterator[Callable[[int, float, float], None]]:
    """Yields ``advance(step, loss, lr)``: a rich progress bar on the main process, or a log line
    every 10 steps with --no-progress; nothing on the other processes."""
    if not is_main():
        yield lambda step, loss, lr: None
        return
    if not enabled:
        def log(step: int, loss: float, lr: float) -> None:
            if step % 10 == 0 or step == total - 1:
                print(f"step {step + 1}/{total}  loss {loss:.3f}  lr {lr:.2e}", flush=True)

        yield log
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeRemainingColumn())
    with Progress(*columns) as bar:
        task = bar.add_task("train", total=total, info="")
        yield lambda step, loss, lr: bar.update(task, advance=1, info=f"loss {loss:.3f}  lr {lr:.2e}")


def summarize(args: argparse.Namespace, strategy: str, result: Any, losses: list[float],
              step_times: list[float]) -> dict[str, Any]:
    tail = losses[-max(3, len(losses) // 10):]
    median_step = statistics.median(step_times[WARMUP_STEPS:])
    return {
        "strategy": strategy,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "skipped": dict(result.args.skipped),
        "steps": len(losses),
        "global_batch_size": args.batch_size,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "tail_mean_loss": sum(tail) / len(tail),
        "median_step_s": median_step,
        "samples_per_s": args.batch_size / median_step,
    }


def check(summary: dict[str, Any]) -> list[str]:
    """Why the run counts as failed (empty if it trained)."""
    problems = []
    first, tail = summary["first_loss"], summary["tail_mean_loss"]
    if not (math.isfinite(first) and math.isfinite(tail)):
        problems.append(f"loss is not finite (first {first}, last steps {tail}): training diverged")
    elif tail > REQUIRED_DROP * first:
        problems.append(
            f"loss did not fall enough: last steps {tail:.3f} vs first {first:.3f} "
            f"(must be below {REQUIRED_DROP:.0%} of the first)"
        )
    return problems


def print_summary(summary: dict[str, Any], problems: list[str], wall_s: float) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title="train_gpt2 summary", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("strategy", Text(summary["strategy"])),  # Text: rich would read "[parallel_mode, ...]" as markup
        ("processes", str(summary["world_size"])),
        ("skipped", Text(", ".join(f"{k} ({v})" for k, v in summary["skipped"].items()) or "-")),
        ("steps x global batch", f"{summary['steps']} x {summary['global_batch_size']}"),
        ("first loss", f"{summary['first_loss']:.4f}"),
        ("last loss", f"{summary['last_loss']:.4f} (mean of last steps {summary['tail_mean_loss']:.4f})"),
        ("median step time", f"{summary['median_step_s'] * 1000:.1f} ms"),
        ("throughput", f"{summary['samples_per_s']:.1f} samples/s"),
        ("wall time", f"{wall_s:.1f} s"),
        ("result", "[red]FAILED: " + "; ".join(problems) if problems else "[green]loss decreased"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    args = parse_args(argv)
    console()  # atorch's log lines on the console (a library is silent unless asked)
    try:
        summary = train(args)
        main_process = is_main()
    except atorch.StrategyError as exc:
        if is_main():
            print(f"strategy problem:\n{exc}", file=sys.stderr)
        return 2
    # atorch tears the process group down at exit, all ranks together.
    problems = check(summary)  # the same on every process: the losses are averaged over all of them
    if main_process:
        print_summary(summary, problems, time.perf_counter() - start)
        print("RESULT " + json.dumps(summary), flush=True)  # one machine-readable line for scripts
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
