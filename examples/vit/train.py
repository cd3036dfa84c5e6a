"""Train a ViT image classifier step by step: data parallel, pipeline, tensor, then hybrid parallel.

One script, one command per step; only the atorch strategy changes (printed at the start):

    torchrun --standalone --nproc_per_node 2 examples/vit/train.py --step dp       # data parallel + bf16 autocast
    torchrun --standalone --nproc_per_node 2 examples/vit/train.py --step pp       # pipeline: 2 stages
    torchrun --standalone --nproc_per_node 2 examples/vit/train.py --step tp       # tensor: layers split in 2
    torchrun --standalone --nproc_per_node 8 examples/vit/train.py --step hybrid   # tensor 2 x pipeline 2 x data 2
    torchrun --standalone --nproc_per_node 2 examples/vit/train.py --step auto     # atorch searches a strategy

The tutorial's training recipe is a set of flags that apply to every step: --accumulate N (gradient
accumulation), --clip MAX_NORM (clipping to the global gradient norm), --warmup-ratio R --lr-schedule cosine
(linear warm-up, then cosine decay, stepped every optimizer step), --label-smoothing E, --grad-checkpoint
(activation checkpointing), --schedule interleaved_1f1b (the interleaved pipeline schedule), and
--checkpoint-dir DIR with --save-at STEP / --resume (save and resume training: model, optimizer, LR
schedule).

The model is transformers' ViTForImageClassification with random weights from a ViTConfig, and the data
is CIFAR-10-shaped (32x32x3 images, 10 classes) and generated: each class is a fixed smooth colour
pattern, each image that pattern at a random contrast and shift plus noise, so the classes are learnable
and nothing is downloaded. A held-out split measures accuracy after training. Under pipeline parallel
atorch.train_step runs the pipeline schedule; the other steps use a plain forward / backward / step loop.
Rank 0 logs: the losses it prints are global (averaged over the data-parallel ranks) and the evaluation
counts are summed over all ranks, so what it shows holds for the whole job. The last line (``RESULT
{json}``) holds the losses, the accuracy, throughput (images/s) and the peak memory of every rank.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

import atorch
from atorch.dryrun import PeakMemory
from atorch.opt_lib.pipeline_parallel import PipelinedModel
from atorch.training import eval_logits, train_step

STEPS = ("dp", "pp", "tp", "hybrid", "auto")
CLASSES = 10
IMAGE = 32
# Model sizes: tiny for tests, tutorial for the README's measurements (ViT-S-like width on 32x32 images).
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 128,
             "patch_size": 8},
    "tutorial": {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6, "intermediate_size": 1536,
                 "patch_size": 4},
}
MEMORY_STEPS = 2  # steps run under the peak-memory counter (it slows every operation), not timed


# ----- model and data -----------------------------------------------------------------------
def build_vit(size: str, seed: int = 0) -> nn.Module:
    """ViTForImageClassification for 32x32 RGB images and 10 classes, random weights (same for the same seed)."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    config = ViTConfig(image_size=IMAGE, num_channels=3, num_labels=CLASSES, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, **SIZES[size])
    return ViTForImageClassification(config)


class SyntheticCIFAR(Dataset):
    """CIFAR-10-shaped samples ``{"pixel_values": 3x32x32, "labels": class}`` made on the fly.

    Class c has a fixed smooth pattern (random 4x4x3 values upsampled bilinearly); sample i of class
    i % 10 is that pattern times a contrast in [0.5, 1.5], plus a brightness shift and Gaussian noise
    (std 1, about the pattern's own scale), all drawn from a generator seeded by (seed, i): the same
    sample every time, on every rank, and a held-out split from another seed.
    """

    def __init__(self, samples: int, seed: int) -> None:
        self.samples, self.seed = samples, seed
        g = torch.Generator().manual_seed(1234)  # the class patterns: the same for every split
        coarse = torch.randn(CLASSES, 3, 4, 4, generator=g)
        self.patterns = nn.functional.interpolate(coarse, size=(IMAGE, IMAGE), mode="bilinear", align_corners=False)

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = index % CLASSES
        contrast = 0.5 + torch.rand((), generator=g)
        shift = 0.3 * torch.randn((), generator=g)
        noise = torch.randn(3, IMAGE, IMAGE, generator=g)
        return {"pixel_values": contrast * self.patterns[label] + shift + noise, "labels": torch.tensor(label)}


def loss_func(data: dict[str, torch.Tensor], output: Any) -> torch.Tensor:
    """ATorch's convention: loss_func(batch, model output); the model computes cross-entropy from labels."""
    return output.loss.float()


def smoothed_loss(smoothing: float) -> Any:
    """Cross-entropy with label smoothing (the tutorial's ``CrossEntropyLoss(label_smoothing=...)``), from the
    logits; without smoothing the model's own loss."""
    if not smoothing:
        return loss_func

    def loss(data: dict[str, torch.Tensor], output: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(output.logits.float(), data["labels"], label_smoothing=smoothing)

    return loss


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """The LR factor at optimizer step ``step``: linear warm-up over ``warmup`` steps, then cosine decay to 0 at
    ``total`` (Colossal-AI's CosineAnnealingWarmupLR)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def lr_schedule(args: argparse.Namespace) -> dict[str, Any]:
    """auto_accelerate's lr_scheduler_cls / lr_scheduler_args for --lr-schedule (none for 'constant')."""
    if args.lr_schedule == "constant":
        return {}
    warmup = math.ceil(args.warmup_ratio * args.steps)
    return {"lr_scheduler_cls": torch.optim.lr_scheduler.LambdaLR,
            "lr_scheduler_args": {"lr_lambda": functools.partial(warmup_cosine, warmup=warmup, total=args.steps)}}


# ----- the four steps -----------------------------------------------------------------------
def strategy_for(step: str, args: argparse.Namespace, world: int) -> list[Any] | None:
    """The atorch strategy of each step (None: the automatic search picks one). bf16 autocast: by default
    on the data-parallel step only (the tutorial's first step), --amp / --no-amp for every step."""
    amp = [("amp_native", {"dtype": "bf16"})] if (step == "dp" if args.amp is None else args.amp) else []
    recompute = ["checkpoint"] if args.grad_checkpoint else []  # activation checkpointing of every block
    pipe = {"schedule": args.schedule, "micro_batches": args.micro_batches}
    if step == "dp":
        return ["parallel_mode", *amp, *recompute]
    if step == "pp":
        return [("parallel_mode", {"dims": [["pipeline", args.pp], ["data", -1]]}), *amp,
                ("pipeline_parallel", pipe), *recompute]
    if step == "tp":  # tensor × data: the shards replicated over the data ranks (gradients averaged)
        return [("parallel_mode", {"dims": [["tensor", args.tp], ["data", -1]]}), *amp, "tensor_parallel",
                *recompute]
    if step == "hybrid":
        data = world // (args.tp * args.pp)
        return [("parallel_mode", {"dims": [["tensor", args.tp], ["pipeline", args.pp], ["data", -1]]}), *amp,
                ("mixed_parallel", {"tensor": {}, "pipeline": pipe}), *recompute,
                *(["fsdp"] if data > 1 else [])]  # replicated tensor-parallel stages need FSDP over data
    return None


# ----- helpers ------------------------------------------------------------------------------
def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def log(*parts: Any) -> None:
    if rank() == 0:
        print(*parts, flush=True)


def summed(values: list[float]) -> list[float]:
    """Element-wise sum over all ranks (float64, so counts stay exact)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor.tolist()


def gathered(value: int) -> list[int]:
    """One integer per rank, in rank order, on every rank (an all-reduce of a one-hot vector: nothing pickled)."""
    tensor = torch.zeros(world_size(), dtype=torch.int64)
    tensor[rank()] = value
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor.tolist()


def batches(dataloader: Any) -> Any:
    while True:  # atorch's dataloader reshuffles on every pass by itself
        yield from dataloader


def one_step(result: Any, micro_batches: list[Any], clip: float) -> torch.Tensor:
    """One optimizer step over the micro-batches (gradient accumulation). Pipeline parallel: atorch.train_step
    runs the schedule over them, clips over every stage and steps. Otherwise the README's loop written out:
    forward, backward (through the optimizer when it owns it) per micro-batch, the gradients synchronised on
    the last one only, then clipping to the global norm, the step and the LR schedule."""
    max_norm = clip if clip > 0 else None
    if isinstance(result.model, PipelinedModel):
        return train_step(result, micro_batches, max_norm=max_norm)
    model, optim, args = result.model, result.optim, result.args
    total = torch.zeros(())
    for index, batch in enumerate(micro_batches):
        if args.requires_set_gradient_accumulation_boundary:
            optim.set_gradient_accumulation_boundary(index == len(micro_batches) - 1)
        data = result.prepare_input(batch, args.device)
        loss = result.loss_func(data, model(**data)) / len(micro_batches)
        optim.backward(loss) if args.use_optim_backward else loss.backward()
        total += loss.detach().float().cpu()
    if max_norm is not None:
        optim.clip_grad_norm_(max_norm)  # unscaled, over all ranks' shards: the norm one process would see
    optim.step()
    optim.zero_grad()
    if result.lr_scheduler is not None:
        result.lr_scheduler.step()
    if args.data_parallel_size > 1:  # the global batch's loss, for the log
        dist.all_reduce(total, group=args.data_parallel_group)
        total /= args.data_parallel_size
    return total


def save_if_asked(result: Any, directory: str | None, step: int, args: argparse.Namespace) -> None:
    """--save-at: every rank writes its part of the checkpoint (model, optimizer, LR schedule) after that step."""
    if args.save_at == step and directory is not None:
        atorch.save_checkpoint(directory, result, step=step)
        log(f"saved {directory} after step {step}")


def evaluate(result: Any, dataset: Dataset, batch_size: int) -> dict[str, float]:
    """Accuracy and loss on the held-out split: each data-parallel rank takes its share; the ranks that hold
    the logits (every rank of a tensor group, the last stage of a pipeline) count, and the counts are
    summed over all ranks."""
    dp, dp_rank = result.args.data_parallel_size, result.args.data_parallel_rank
    indices = list(range(dp_rank, len(dataset), dp))
    correct = seen = loss_sum = 0.0
    was_training = result.model.training
    result.model.eval()
    for start in range(0, len(indices) - batch_size + 1, batch_size):
        items = [dataset[i] for i in indices[start:start + batch_size]]
        batch = {key: torch.stack([item[key] for item in items]) for key in items[0]}
        logits = eval_logits(result, batch)
        if logits is None:
            continue
        logits = logits.float().cpu()
        correct += float((logits.argmax(-1) == batch["labels"]).sum())
        loss_sum += float(nn.functional.cross_entropy(logits, batch["labels"], reduction="sum"))
        seen += len(items)
    result.model.train(was_training)
    # Every data-parallel shard is counted by the same number of ranks (its tensor group's last stage).
    correct, seen, loss_sum, holders = summed([correct, seen, loss_sum, float(seen > 0)])
    per_shard = holders / dp
    return {"accuracy": correct / max(seen, 1), "loss": loss_sum / max(seen, 1), "samples": int(seen / per_shard)}


# ----- main ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step", required=True, help="dp, pp, tp, hybrid or auto; several separated by commas "
                        "run one after the other in one launch (as the tests do)")
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--tp", type=int, default=2, help="tensor size (tp, hybrid)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline size (pp, hybrid)")
    parser.add_argument("--micro-batches", type=int, default=None, help="pipeline micro-batches (default: 2 x pp)")
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe", "interleaved_1f1b", "interleaved_zb",
                                                                "zbv"),
                        help="pipeline schedule (pp, hybrid); the interleaved ones hold 2 stages per rank")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="micro-batches per optimizer step (gradient accumulation; each of --batch-size)")
    parser.add_argument("--clip", type=float, default=0.0, help="clip the global gradient norm (0: off)")
    parser.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                        help="cosine: linear warm-up (--warmup-ratio of the steps), then cosine decay to 0")
    parser.add_argument("--warmup-ratio", type=float, default=0.0)
    parser.add_argument("--label-smoothing", type=float, default=0.0)
    parser.add_argument("--grad-checkpoint", action="store_true", help="activation checkpointing of every block")
    parser.add_argument("--checkpoint-dir", default=None, help="where --save-at writes and --resume reads "
                        "(a subdirectory per step)")
    parser.add_argument("--save-at", type=int, default=None, help="save a checkpoint after this optimizer step")
    parser.add_argument("--resume", action="store_true", help="resume from --checkpoint-dir (weights, optimizer, "
                        "LR schedule, step count; the data continues where it stopped)")
    amp = parser.add_mutually_exclusive_group()
    amp.add_argument("--amp", dest="amp", action="store_true", default=None, help="bf16 autocast (default: dp only)")
    amp.add_argument("--no-amp", dest="amp", action="store_false")
    parser.add_argument("--train-samples", type=int, default=4096)
    parser.add_argument("--eval-samples", type=int, default=512)
    parser.add_argument("--max-trials", type=int, default=4, help="auto: most dry-runs of the search")
    parser.add_argument("--time-limit", type=float, default=300, help="auto: seconds the search may take")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-shuffle", action="store_true",
                        help="batches in sample order: every layout then trains on the batches a single process sees")
    args = parser.parse_args(argv)
    args.steps_to_run = args.step.split(",")
    unknown = [s for s in args.steps_to_run if s not in STEPS]
    if unknown:
        parser.error(f"unknown --step {', '.join(unknown)}; choose from {', '.join(STEPS)}")
    if args.steps <= MEMORY_STEPS:
        parser.error(f"--steps must be more than {MEMORY_STEPS}")
    if (args.save_at is not None or args.resume) and args.checkpoint_dir is None:
        parser.error("--save-at and --resume need --checkpoint-dir")
    if args.accumulate < 1:
        parser.error("--accumulate must be 1 or more")
    return args


def train(step: str, args: argparse.Namespace) -> dict[str, Any]:
    model = build_vit(args.size, args.seed)
    params = sum(p.numel() for p in model.parameters())
    optim_cls, optim_args = ((torch.optim.AdamW, {"lr": args.lr, "weight_decay": 0.05}) if args.optimizer == "adamw"
                             else (torch.optim.SGD, {"lr": args.lr}))
    load_strategy = strategy_for(step, args, int(os.environ.get("WORLD_SIZE", "1")))
    status, result, strategy = atorch.auto_accelerate(
        model, optim_cls, SyntheticCIFAR(args.train_samples, seed=1), smoothed_loss(args.label_smoothing),
        model_input_format="unpack_dict", optim_args=optim_args,
        dataloader_args={"batch_size": args.batch_size, "shuffle": not args.no_shuffle, "drop_last": True},
        load_strategy=load_strategy, **lr_schedule(args),
        **({} if load_strategy else {"time_limit": args.time_limit, "search": {"max_trials": args.max_trials}}),
    )
    assert status
    del model  # atorch trains a copy; the original would count in the peak memory below
    log(f"step {step}: ViT '{args.size}' ({params / 1e6:.2f}M parameters) on {world_size()} processes")
    log(f"strategy: {json.dumps(strategy.to_list())}")
    # --accumulate micro-batches per step (times what the search picked, under --step auto)
    accumulation = args.accumulate * result.args.gradient_accumulation_steps
    data = batches(result.dataloader)
    first = 0  # optimizer steps already taken (a resumed run continues from its checkpoint)
    directory = os.path.join(args.checkpoint_dir, step) if args.checkpoint_dir else None
    if args.resume:
        first = atorch.load_checkpoint(directory, result)["step"]
        for _ in range(first * accumulation):  # the batches those steps consumed
            next(data)
        log(f"resumed from {directory} after step {first}")
    losses: list[float] = []
    times: list[float] = []
    with PeakMemory(result.args.device) as peak:  # the first steps: optimizer state and activations appear
        for index in range(first, min(first + MEMORY_STEPS, args.steps)):
            losses.append(float(one_step(result, [next(data) for _ in range(accumulation)], args.clip)))
            save_if_asked(result, directory, index + 1, args)
    log(f"step {first + 1}/{args.steps}  loss {losses[0]:.4f}")
    for index in range(first + MEMORY_STEPS, args.steps):
        start = time.perf_counter()
        losses.append(float(one_step(result, [next(data) for _ in range(accumulation)], args.clip)))
        times.append(time.perf_counter() - start)
        save_if_asked(result, directory, index + 1, args)
        if (index + 1) % args.log_every == 0 or index == args.steps - 1:
            log(f"step {index + 1}/{args.steps}  loss {losses[-1]:.4f}  lr {result.optim.param_groups[0]['lr']:.2e}")
    evaluation = evaluate(result, SyntheticCIFAR(args.eval_samples, seed=2), result.args.local_batch_size)
    log(f"held-out: accuracy {evaluation['accuracy']:.3f}  loss {evaluation['loss']:.4f} "
        f"({int(evaluation['samples'])} counted)")
    median = statistics.median(times) if times else float("nan")  # a resumed run may time no step
    peaks = gathered(peak.bytes)
    summary = {
        "step": step, "size": args.size, "world_size": world_size(), "parameters": params,
        "strategy": strategy.to_list(), "steps": args.steps, "first_step": first + 1,
        "global_batch_size": args.batch_size * accumulation, "lr": result.optim.param_groups[0]["lr"],
        "losses": losses, "eval": evaluation, "median_step_s": median,
        "images_per_s": args.batch_size * accumulation / median, "peak_bytes_per_rank": peaks,
        "search": result.args.search,  # auto: how the strategy was found (source, dry-runs)
    }
    log(f"throughput {summary['images_per_s']:.1f} images/s (median step {median * 1000:.0f} ms); peak memory per "
        f"rank (MiB): {' '.join(f'{b / 2**20:.1f}' for b in peaks)}")
    result.close()  # frees the model, optimizer state and buffers before the next step's run
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    finite = True
    for step in args.steps_to_run:
        try:
            summary = train(step, args)
        except atorch.StrategyError as exc:
            log(f"strategy problem:\n{exc}")
            return 2
        log("RESULT " + json.dumps(summary))  # one machine-readable line per run
        finite = finite and all(math.isfinite(v) for v in summary["losses"])
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
