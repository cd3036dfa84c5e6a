"""The CUDA paths on one GPU (NCCL, one process): strategies train, fp16 loss scaling, fp8's gate, the
dry-run's CUDA peak against the cost model, and a short automatic search. Prints one JSON report.

    torchrun --standalone --nproc_per_node 1 scripts/gpu_check.py

Runs on the machine's torch as installed (no transformers needed): the models are tests/toy_models'
MLP and a small BatchNorm CNN. Every case is reported (ok / failed with the error), none stops the rest.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import atorch  # noqa: E402
from atorch.distributed import init_distributed  # noqa: E402

STEPS = 6


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                  nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.body(x)


def _data(samples: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 3, 16, 16, generator=g)
    y = (x[:, 0].mean(dim=(1, 2)) > 0).long() + 2 * (x[:, 1].mean(dim=(1, 2)) > 0).long()
    return TensorDataset(x, y)


def _loss(data: Any, output: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.float(), data[1])


def train(strategy: Any, **kwargs: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    status, result, chosen = atorch.auto_accelerate(
        ConvNet(), torch.optim.AdamW, _data(), _loss, optim_args={"lr": 1e-2}, model_input_format="unpack_sequence",
        dataloader_args={"batch_size": 32}, load_strategy=strategy, **kwargs)
    losses, batches = [], iter(result.dataloader)
    torch.cuda.reset_peak_memory_stats()
    begin = time.perf_counter()
    for _ in range(STEPS):
        losses.append(float(atorch.train_step(result, [next(batches)])))
    torch.cuda.synchronize()
    out = {"losses": [round(v, 4) for v in losses], "strategy": str(chosen), "s_per_step": (time.perf_counter() - begin)
           / STEPS, "peak_mib": torch.cuda.max_memory_allocated() / 2**20, "device": str(result.args.device),
           "skipped": getattr(result.args, "skipped", None)}
    scaler = getattr(result.optim, "grad_scaler", None)
    if scaler is not None:
        out["loss_scale"] = float(scaler.get_scale())
    assert all(map(torch.isfinite, map(torch.tensor, losses))) or scaler is not None, losses
    result.close()
    return out


def dry_run_vs_cost_model() -> dict[str, Any]:
    from atorch.dryrun import dry_run
    from atorch.model_context import UserSetup
    from atorch.strategy import Strategy
    from atorch.strategy_search.costing.analyser import analyse
    from atorch.strategy_search.costing.cost_model import predict
    from atorch.strategy_search.costing.hardware import measure_profile

    env = init_distributed()
    profile = measure_profile()
    rows = []
    batch = next(iter(torch.utils.data.DataLoader(_data(), batch_size=32)))
    stats = analyse(ConvNet(), [t.cuda() for t in batch], "unpack_sequence", _loss)
    for items in (["parallel_mode"], ["parallel_mode", ("amp_native", {"dtype": "bf16"})], ["parallel_mode", "fsdp"],
                  ["parallel_mode", ("checkpoint", {"wrap_class": ["Conv2d"]})]):
        strategy = Strategy.load(items)
        setup = UserSetup(model=ConvNet(), optim_func=torch.optim.AdamW, dataset=_data(), loss_func=_loss,
                          model_input_format="unpack_sequence", optim_args={"lr": 1e-3},
                          dataloader_args={"batch_size": 32})
        measured = dry_run(setup, env, strategy, warmup=2, steps=3)
        pred = predict(stats, strategy, strategy.layout(1), profile, 32)
        rows.append({"strategy": str(strategy), "status": measured.status, "reason": measured.reason,
                     "measured_mib": (measured.peak_bytes or 0) / 2**20, "predicted_mib": pred.memory.peak / 2**20,
                     "measured_s": measured.step_time_s, "predicted_s": pred.time.step})
    return {"profile": {"matmul_tflops": profile.matmul_tflops, "device": profile.device_name}, "rows": rows}


def optimizer_step_vs_cost_model() -> dict[str, Any]:
    """A model whose peak is its optimizer step (wide MLP, tiny batch): foreach AdamW holds a temporary of
    every parameter at once (the cost model's CUDA term); the single-tensor loop (foreach=False) only
    the largest parameter's."""
    from toy_models import MLP, mlp_dataset, mlp_loss

    from atorch.dryrun import dry_run
    from atorch.model_context import UserSetup
    from atorch.strategy import Strategy
    from atorch.strategy_search.costing.analyser import analyse
    from atorch.strategy_search.costing.cost_model import predict
    from atorch.strategy_search.costing.hardware import measure_profile

    env = init_distributed()
    profile = measure_profile()
    strategy = Strategy.load(["parallel_mode"])
    data = mlp_dataset(samples=64)
    batch = next(iter(torch.utils.data.DataLoader(data, batch_size=4)))
    stats = analyse(MLP(dim=2048, depth=4), [t.cuda() for t in batch], "unpack_sequence", mlp_loss)
    pred = predict(stats, strategy, strategy.layout(1), profile, 4)
    rows = []
    for foreach in (None, False):
        setup = UserSetup(model=MLP(dim=2048, depth=4), optim_func=torch.optim.AdamW, dataset=data, loss_func=mlp_loss,
                          model_input_format="unpack_sequence", optim_args={"lr": 1e-3, "foreach": foreach},
                          dataloader_args={"batch_size": 4})
        measured = dry_run(setup, env, strategy, warmup=2, steps=3)
        rows.append({"foreach": foreach, "status": measured.status, "reason": measured.reason,
                     "measured_mib": (measured.peak_bytes or 0) / 2**20})
    return {"param_mib": stats.param_bytes / 2**20, "predicted_mib": pred.memory.peak / 2**20,
            "predicted_phase": pred.memory.peak_phase, "rows": rows}


def main() -> None:
    init_distributed()
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    report: dict[str, Any] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "backend": backend}
    cases = {
        "ddp": lambda: train(["parallel_mode"]),
        "amp_bf16": lambda: train(["parallel_mode", ("amp_native", {"dtype": "bf16"})]),
        "amp_fp16_scaler": lambda: train(["parallel_mode", ("amp_native", {"dtype": "fp16"})]),
        "half_bf16": lambda: train(["parallel_mode", ("half", {"dtype": "bf16"})]),
        "fsdp_bf16": lambda: train(["parallel_mode", "fsdp", ("amp_native", {"dtype": "bf16"})]),
        "zero1": lambda: train(["parallel_mode", "zero1"]),
        "zero2_fp16": lambda: train(["parallel_mode", "zero2", ("amp_native", {"dtype": "fp16"})]),
        "checkpoint": lambda: train(["parallel_mode", ("checkpoint", {"wrap_class": ["Conv2d"]})]),
        "fp8": lambda: train(["parallel_mode", "fp8", ("amp_native", {"dtype": "bf16"})]),
        "default_strategy": lambda: train(None, search={"dryrun": False}),
        "dry_run_vs_cost_model": dry_run_vs_cost_model,
        "optimizer_step_vs_cost_model": optimizer_step_vs_cost_model,
        "search": lambda: train(None, search={"max_trials": 3, "force": True}),
    }
    for name, case in cases.items():
        try:
            report[name] = {"ok": True, **case()}
        except Exception as exc:  # noqa: BLE001  (every case is reported)
            report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1500],
                            "where": traceback.format_exc()[-1500:]}
    print("REPORT " + json.dumps(report, default=str), flush=True)


if __name__ == "__main__":
    main()
