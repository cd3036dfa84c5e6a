"""Tensor, pipeline and 3-D parallel against DDP and fsdp: step time, throughput and peak memory per rank, side
by side in one run, and the measured pipeline bubble against (p − 1) / (m + p − 1).

    torchrun --standalone --nproc_per_node 2 bench/parallel.py [--repeats 3] [--json out.json]
    torchrun --standalone --nproc_per_node 4 bench/parallel.py    # adds tensor 2 x pipeline 2 and tensor 2 x fsdp 2

Model: a transformers Llama (random weights; hidden 256, 4 layers, 4 heads, vocabulary 2048, sequence 64),
AdamW, fp32. Every layout is measured with the dry-run the search uses (``DryRunSession``: median of
barrier-synchronised steps after warm-up, the slowest rank's; peak increase of live tensor bytes per rank),
interleaved over ``--repeats`` rounds; figures are medians over the rounds.

Bubble: with a fixed micro-batch size a pipeline step of ``m`` micro-batches takes about ``(m + p − 1) t + c``
(``t`` one micro-batch's forward and backward on one stage). The 1F1B step time is measured at m = p, 2p, 4p;
the slope over ``m`` is ``t``, and the measured bubble at each ``m`` is ``(p − 1) t / T(m)``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from atorch.distributed import init_distributed  # noqa: E402
from atorch.dryrun.runner import DryRunSession  # noqa: E402
from atorch.model_context import UserSetup  # noqa: E402
from atorch.strategy import Strategy  # noqa: E402

SEQ, VOCAB, MICRO = 64, 2048, 2  # sequence length, vocabulary, samples per micro-batch and data-parallel rank


class Tokens(Dataset):
    def __init__(self, samples: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, VOCAB, (samples, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ)
    return LlamaForCausalLM(config)


def loss(data: Any, output: Any) -> torch.Tensor:
    return output.loss.float()


def layouts(world: int) -> dict[str, tuple[list[Any], int]]:
    """name -> (strategy, pipeline micro-batches per step; 1 without a pipeline)."""
    def pipe(schedule: str, m: int) -> tuple[list[Any], int]:
        return [("parallel_mode", {"dims": [["pipeline", world], ["data", -1]]}),
                ("pipeline_parallel", {"schedule": schedule, "micro_batches": m})], m

    out: dict[str, tuple[list[Any], int]] = {
        "ddp": (["parallel_mode"], 1),
        "fsdp": (["parallel_mode", "fsdp"], 1),
        f"tp{world}": ([("parallel_mode", {"dims": [["tensor", world], ["data", -1]]}), "tensor_parallel"], 1),
    }
    m = 2 * world
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        out[f"pp{world} {schedule} m={m}"] = pipe(schedule, m)
    for k in (1, 4):  # the bubble's slope: 1F1B at m = p and 4p besides 2p
        out[f"pp{world} 1f1b m={k * world}"] = pipe("1f1b", k * world)
    if world == 4:
        out["tp2 x pp2 (1f1b m=4)"] = ([("parallel_mode", {"dims": [["tensor", 2], ["pipeline", 2], ["data", -1]]}),
                                        ("mixed_parallel", {"pipeline": {"micro_batches": 4}})], 4)
        out["tp2 x fsdp dp2"] = ([("parallel_mode", {"dims": [["tensor", 2], ["data", -1]]}), "tensor_parallel",
                                  "fsdp"], 1)
    return out


def samples_per_step(strategy: list[Any], world: int, micro_batches: int) -> int:
    """Global samples of one step. Pipelines: MICRO per data-parallel rank and micro-batch (the bubble rows
    vary m at a fixed micro-batch); the rest: the global batch of the pipelines at m = 2p, MICRO x 2 x world."""
    dp = Strategy.load(strategy).layout(world).data_size
    return MICRO * dp * micro_batches if micro_batches > 1 else MICRO * 2 * world


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    env = init_distributed()
    world = env.world_size
    cases = layouts(world)
    setup = UserSetup(model=llama(), optim_func=torch.optim.AdamW, dataset=Tokens(256), loss_func=loss,
                      model_input_format="unpack_dict", optim_args={"lr": 1e-4},
                      dataloader_args={"batch_size": MICRO * world, "shuffle": False})
    session = DryRunSession(setup, env, warmup=2, steps=args.steps, rejoin_timeout_s=1200)
    rows: dict[str, dict[str, Any]] = {name: {"step_s": [], "peak": None, "status": None} for name in cases}
    for _ in range(args.repeats):  # interleaved: each round measures every layout once
        for name, (strategy, m) in cases.items():
            batch = samples_per_step(strategy, world, m)  # one batch a step (a pipeline splits it into m)
            trial = session.run(Strategy.load(strategy), timeout_s=600, micro_batches=1, batch_size=batch)
            row = rows[name]
            row["status"], row["reason"] = trial.status, trial.reason
            if trial.status == "ok":
                row["step_s"].append(trial.step_time_s)
                row["peak"] = trial.peak_bytes_per_rank
                row["samples"] = batch
    session.close()
    if env.rank != 0:
        return
    report = {"world_size": world, "rows": {}}
    print(f"\n{world} ranks, Llama 4 x 256, sequence {SEQ}; global batch {MICRO * 2 * world} "
          f"(bubble rows: {MICRO} x m)")
    print(f"{'layout':<26}{'step s':>9}{'samples/s':>11}  peak MiB per rank")
    for name, row in rows.items():
        if not row["step_s"]:
            print(f"{name:<26}  {row['status']}: {(row.get('reason') or '')[:80]}")
            report["rows"][name] = row
            continue
        step = statistics.median(row["step_s"])
        peaks = [round(p / 2**20, 1) for p in row["peak"] if p is not None]
        print(f"{name:<26}{step:>9.3f}{row['samples'] / step:>11.1f}  {peaks}")
        report["rows"][name] = {**row, "step_median_s": step, "samples_per_s": row["samples"] / step}
    one_f = {k * world: report["rows"].get(f"pp{world} 1f1b m={k * world}", {}).get("step_median_s")
             for k in (1, 2, 4)}
    if all(one_f.values()):
        ms = sorted(one_f)
        slope = (one_f[ms[-1]] - one_f[ms[0]]) / (ms[-1] - ms[0])  # t: one micro-batch on one stage
        p = world
        print("\npipeline bubble (1F1B): m, step s, measured (p-1)t/T, theory (p-1)/(m+p-1)")
        report["bubble"] = []
        for m in ms:
            measured, theory = (p - 1) * slope / one_f[m], (p - 1) / (m + p - 1)
            report["bubble"].append({"m": m, "step_s": one_f[m], "measured": measured, "theory": theory})
            print(f"  m={m:<3} {one_f[m]:.3f}  {measured:.2f}  {theory:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
