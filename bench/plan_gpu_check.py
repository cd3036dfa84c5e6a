"""One-GPU check of the figures `atorch plan` predicts with (plain torch: runs where atorch is not installed).

Measures on the GPU it runs on: bf16 matmul throughput (a square 8192 matmul and a transformer layer's
shapes), elementwise bandwidth (a large add), and the median step time of a GPT-style model trained as
atorch's ``amp_native`` bf16 strategy trains it (fp32 weights, bf16 autocast, fused SDPA attention, AdamW).
Writes JSON (bench/plan_gpu_check_h100.json: one H100); ``python bench/plan.py --gpu-check FILE`` compares
each step and peak memory with the cost model's prediction for the same shape (bench/README.md).

    python bench/plan_gpu_check.py --out gpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F


def timed(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_tflops(m: int, k: int, n: int) -> float:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return 2 * m * k * n / timed(lambda: a @ b, 20) / 1e12


def bandwidth() -> float:
    a, b, c = (torch.ones(1 << 28, device="cuda") for _ in range(3))  # 1 GiB each
    return 3 * a.numel() * 4 / timed(lambda: torch.add(a, b, out=c))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(att)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos.weight[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.embed.weight.T  # tied head


def train_step_s(layers: int, hidden: int, heads: int, vocab: int, batch: int, seq: int) -> dict:
    model = GPT(layers, hidden, heads, vocab, seq).cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab, (batch, seq + 1), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", torch.bfloat16):
            logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.reset_peak_memory_stats()
    seconds = timed(step, 10)
    return {"step_s": seconds, "peak": torch.cuda.max_memory_allocated()}


RUNS = ((16, 2048, 16, 4), (8, 4096, 32, 2), (24, 1024, 16, 8))  # layers, hidden, heads, micro-batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = {"dev": torch.cuda.get_device_name(), "torch": torch.__version__,
           "sq8192": matmul_tflops(8192, 8192, 8192), "bw": bandwidth(), "runs": []}
    for layers, hidden, heads, batch in RUNS:
        tokens = batch * 2048
        out["runs"].append({"L": layers, "h": hidden, "a": heads, "b": batch,
                            **train_step_s(layers, hidden, heads, 51200, batch, 2048),
                            "qkv": matmul_tflops(tokens, hidden, 3 * hidden),
                            "fc1": matmul_tflops(tokens, hidden, 4 * hidden),
                            "fc2": matmul_tflops(tokens, 4 * hidden, hidden)})
        torch.cuda.empty_cache()
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
