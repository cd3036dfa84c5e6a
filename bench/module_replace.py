"""What module_replace gains: a training step of transformers models as built with eager attention, against the
same models after module_replace (torch's scaled_dot_product_attention, nn.RMSNorm), side by side in one run.

    PYTHONPATH=. python bench/module_replace.py [--models bert,gpt2,clip,vit,llama] [--seq-len 512]
        [--repeats 10] [--device cpu|cuda] [--dtype fp32|bf16] [--pairs hf_attention_sdpa,...] [--json PATH]

Each model is built once (random weights, no download) with ``attn_implementation="eager"``; the replaced copy
goes through ``atorch.opt_lib.module_replace.replace_modules`` with every built-in pair (or ``--pairs``), as
``load_strategy=["module_replace"]`` does. Both train on the same batch with AdamW. After a warm-up, timed
steps alternate original / replaced, then replaced / original, so drift in machine load falls on both alike.
Reports per model the median step time of each (and the interquartile spread), the speed-up
(original / replaced), the same for the process's CPU time per step (steadier on a loaded machine), what
was replaced, and the difference of the first step's losses (the same model: it
should be at roundoff).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, stats  # noqa: E402

from atorch.opt_lib.module_replace import replace_modules, replace_pairs  # noqa: E402

EAGER = {"attn_implementation": "eager"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bert,gpt2,clip,vit,llama", help="comma-separated (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per text sample (default: %(default)s)")
    parser.add_argument("--image-size", type=int, default=256,
                        help="pixels per side; 16-pixel patches: 256 gives 256 patches (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10, help="timed steps of each variant (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each first (default: %(default)s)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="parameter and compute dtype")
    parser.add_argument("--pairs", help="comma-separated replace pairs to apply (default: every built-in pair)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    return parser.parse_args(argv)


def builders(a: argparse.Namespace) -> dict[str, tuple[Callable[[], nn.Module], Callable[[], dict[str, Any]]]]:
    """name: (model built with eager attention, one batch with its labels)."""
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        CLIPConfig,
        CLIPModel,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        ViTConfig,
        ViTForImageClassification,
    )

    h, heads, layers, seq, image = a.hidden, a.heads, a.layers, a.seq_len, a.image_size
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, a.vocab, (a.batch_size, seq), generator=g)
    pixels = torch.randn(a.batch_size, 3, image, image, generator=g)
    text = {"input_ids": tokens, "labels": tokens}
    no_dropout = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    tower = {"hidden_size": h, "intermediate_size": 4 * h, "num_hidden_layers": layers, "num_attention_heads": heads}
    return {
        "bert": (lambda: BertForMaskedLM(BertConfig(vocab_size=a.vocab, max_position_embeddings=seq, **tower,
                                                    **no_dropout, **EAGER)), lambda: text),
        "gpt2": (lambda: GPT2LMHeadModel(GPT2Config(vocab_size=a.vocab, n_positions=seq, n_embd=h, n_layer=layers,
                                                    n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                                    **EAGER)), lambda: text),
        "clip": (lambda: CLIPModel(CLIPConfig(
            text_config={"vocab_size": a.vocab, "max_position_embeddings": seq, **tower},
            vision_config={"image_size": image, "patch_size": 16, **tower}, projection_dim=h, **EAGER)),
            lambda: {"input_ids": tokens, "pixel_values": pixels, "return_loss": True}),
        "vit": (lambda: ViTForImageClassification(ViTConfig(image_size=image, patch_size=16, num_labels=10, **tower,
                                                            **no_dropout, **EAGER)),
                lambda: {"pixel_values": pixels, "labels": torch.arange(a.batch_size) % 10}),
        "llama": (lambda: LlamaForCausalLM(LlamaConfig(vocab_size=a.vocab, max_position_embeddings=seq,
                                                       num_key_value_heads=heads, **tower, **EAGER)), lambda: text),
    }


def _to(batch: dict[str, Any], device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    return {k: v.to(device, dtype=dtype if v.is_floating_point() else None) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}


class Trainer:
    """One model, its AdamW, and a timed training step."""

    def __init__(self, model: nn.Module, batch: dict[str, Any], device: torch.device) -> None:
        self.model, self.batch, self.device = model.train(), batch, device
        self.optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.times: list[float] = []
        self.cpu_times: list[float] = []  # the process's CPU seconds: less sensitive to a loaded machine

    def step(self, timed: bool = True) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = self.model(**self.batch).loss
        loss.float().backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        if timed:
            self.times.append(time.perf_counter() - start)
            self.cpu_times.append(time.process_time() - cpu_start)
        return loss.item()


def measure(name: str, build: Callable[[], nn.Module], batch: Callable[[], dict], a: argparse.Namespace) -> dict:
    device, dtype = torch.device(a.device), DTYPES[a.dtype]
    torch.manual_seed(0)
    original = build().to(device, dtype)
    replaced = copy.deepcopy(original)
    pairs = [replace_pairs()[p] for p in a.pairs.split(",")] if a.pairs else list(replace_pairs().values())
    counts = replace_modules(replaced, pairs, dtype, requested=False)
    data = _to(batch(), device, dtype)
    runs = {"original": Trainer(original, data, device), "replaced": Trainer(replaced, data, device)}
    first = {k: t.step(timed=False) for k, t in runs.items()}  # the same weights: the same loss, to roundoff
    for _ in range(a.warmup - 1):
        for trainer in runs.values():
            trainer.step(timed=False)
    order = list(runs.values())
    for i in range(a.repeats):
        for trainer in order if i % 2 == 0 else order[::-1]:
            trainer.step()
    orig, repl = stats(runs["original"].times), stats(runs["replaced"].times)
    orig_cpu, repl_cpu = stats(runs["original"].cpu_times), stats(runs["replaced"].cpu_times)
    what = ", ".join(f"{k} {v}" for k, v in counts.items() if v) or "nothing"
    return {"model": name, "replaced": what, "original_s": orig.as_dict(), "replaced_s": repl.as_dict(),
            "speedup": orig.median / repl.median, "original_cpu_s": orig_cpu.as_dict(),
            "replaced_cpu_s": repl_cpu.as_dict(), "cpu_speedup": orig_cpu.median / repl_cpu.median,
            "first_loss_diff": abs(first["original"] - first["replaced"]),
            "first_loss": first["original"]}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    a = parse_args(argv)
    table = builders(a)
    unknown = [m for m in a.models.split(",") if m not in table]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; choose from {sorted(table)}")
    results = []
    header = (f"{'model':<6} {'original ms':>12} {'replaced ms':>12} {'speed-up':>9} {'spread o/r':>11} "
              f"{'CPU ms o/r':>15} {'CPU speed-up':>12}  replaced")
    print(f"module_replace, {a.device} {a.dtype}, seq {a.seq_len}, image {a.image_size}, batch {a.batch_size}, "
          f"hidden {a.hidden}, {a.layers} layers, {a.heads} heads, {a.repeats} timed steps each\n{header}", flush=True)
    for name in a.models.split(","):
        r = measure(name, *table[name], a)
        results.append(r)
        print(f"{name:<6} {1e3 * r['original_s']['median']:>12.1f} {1e3 * r['replaced_s']['median']:>12.1f} "
              f"{r['speedup']:>8.2f}x {r['original_s']['spread']:>5.2f}/{r['replaced_s']['spread']:<5.2f} "
              f"{1e3 * r['original_cpu_s']['median']:>7.0f}/{1e3 * r['replaced_cpu_s']['median']:<7.0f} "
              f"{r['cpu_speedup']:>11.2f}x  "
              f"{r['replaced']} (first loss diff {r['first_loss_diff']:.1e})", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"date": str(date.today()), "args": vars(a), "machine": machine(),
                                            "results": results}, indent=2))
    return results


if __name__ == "__main__":
    main()
