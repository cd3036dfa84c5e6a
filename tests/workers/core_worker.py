"""Core behaviour on 2 real ranks (launched by tests/test_core.py).

Scenarios, each reported under its name in ``RESULT {json}`` by rank 0:
- ``agreement``: a strategy file that exists on rank 0 only; every rank must raise the same error.
- ``build_failure``: an optim_func that raises on rank 1 only, under fsdp; every rank must raise its error.
- ``global_loss``: train_step returns the mean loss over data-parallel ranks, equal on every rank.
- ``param_names``: optim_param_func sees the user's own module and names under every strategy.
- ``rank_order``: DDP with a permuted rank order saves a checkpoint that reloads at 2 ranks (and, in
  the test, at 1); fsdp with that order is refused before building.
- ``close_cycles``: build, train and close an fsdp result CYCLES times; live tensor bytes after
  each close.
- ``meshes``: the number of process groups does not grow with the number of results built.
- ``rng``: building does not draw from the user's random generator.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import gc
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import toy_models

import atorch
from atorch.distributed import init_distributed
from atorch.training import train_step

CYCLES = 20
STRATEGIES: dict[str, list[Any]] = {
    "ddp": ["parallel_mode"], "zero1": ["zero1"], "zero2": ["zero2"], "fsdp": ["fsdp"],
    "checkpoint_fsdp": ["checkpoint", "fsdp"], "checkpoint_ddp": ["checkpoint"],
    "amp_zero2": [("amp_native", {"dtype": "bf16"}), "zero2"],
}


def build(strategy: Any, model: torch.nn.Module | None = None, **kwargs: Any) -> Any:
    options: dict[str, Any] = dict(
        dataset=toy_models.mlp_dataset(), loss_func=toy_models.mlp_loss, model_input_format="unpack_sequence",
        optim_args={"lr": 1e-2}, dataloader_args={"batch_size": 8},
    )
    options.update(kwargs)
    model = model if model is not None else toy_models.mlp()
    _, result, _ = atorch.auto_accelerate(model, torch.optim.AdamW, load_strategy=strategy, **options)
    return result


def gathered(value: float) -> list[float]:
    values = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(values, torch.tensor([value], dtype=torch.float64))
    return [v.item() for v in values]


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage Python can reach (what a leak would keep)."""
    seen: set[int] = set()
    total = 0
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor):
            continue
        try:
            storage = obj.untyped_storage()
            pointer = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # no storage (a DTensor wrapper, a fake tensor)
            continue
        if pointer not in seen and storage.device.type != "meta":
            seen.add(pointer)
            total += storage.nbytes()
    return total


# ----- scenarios ----------------------------------------------------------------------------
def agreement(tmp: Path) -> dict[str, Any]:
    path = tmp / "strategy.json"
    if dist.get_rank() == 0:
        atorch.Strategy.load(["fsdp"]).save(path)
    else:
        path = tmp / "only-on-rank-0" / "strategy.json"
    try:
        build(str(path))
    except atorch.StrategyError as exc:
        return {"error": str(exc)}
    return {"error": None}


def build_failure(_: Path) -> dict[str, Any]:
    def optim_func(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
        if dist.get_rank() == 1:
            raise RuntimeError("this optimizer cannot be made on rank 1")
        return torch.optim.SGD(params, **kwargs)

    try:
        atorch.auto_accelerate(toy_models.mlp(), optim_func, load_strategy=["fsdp"],
                               dataset=toy_models.mlp_dataset(), loss_func=toy_models.mlp_loss,
                               model_input_format="unpack_sequence", optim_args={"lr": 1e-2},
                               dataloader_args={"batch_size": 8})
    except atorch.StrategyError as exc:
        return {"error": str(exc)}
    return {"error": None}


def global_loss(_: Path) -> dict[str, Any]:
    result = build(["parallel_mode"])
    batch = next(iter(result.dataloader))
    returned = train_step(result, [batch]).item()
    return {"returned": gathered(returned)}


def param_names(_: Path) -> dict[str, Any]:
    user_model = toy_models.mlp()
    user_names = sorted(n for n, _ in user_model.named_parameters())
    report: dict[str, Any] = {"user_names": user_names}
    for name, strategy in STRATEGIES.items():
        seen: list[str] = []

        def groups(model: torch.nn.Module, seen: list[str] = seen) -> list[dict[str, Any]]:
            named = list(model.named_parameters())
            seen.extend(n for n, _ in named)
            return [{"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
                    {"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": 0.1}]

        result = build(strategy, model=user_model, optim_param_func=groups)
        inner = result.optim.optimizer
        param_groups = inner.param_groups
        report[name] = {"seen": sorted(seen), "group_sizes": [len(g["params"]) for g in param_groups],
                        "decays": [g["weight_decay"] for g in param_groups]}
        train_step(result, [next(iter(result.dataloader))])
        result.close()
    return report


def rank_order(tmp: Path) -> dict[str, Any]:
    order = ("parallel_mode", {"dims": [["data", 2]], "rank_order": [1, 0]})
    result = build([order])
    batches = iter(result.dataloader)
    for _ in range(2):
        train_step(result, [next(batches)])
    full = {k: v.detach().clone() for k, v in result.model.module.state_dict().items()}
    atorch.save_checkpoint(tmp / "ckpt", result, step=2)
    reloaded = build([order], model=toy_models.mlp(seed=5))
    atorch.load_checkpoint(tmp / "ckpt", reloaded)
    same = all(torch.equal(full[k], v) for k, v in reloaded.model.module.state_dict().items())
    torch.save(full, tmp / f"weights-{dist.get_rank()}.pt")
    try:
        build([order, "fsdp"])
        refused = None
    except atorch.StrategyError as exc:
        refused = str(exc)
    return {"reloaded_equal": same, "data_rank": result.args.data_parallel_rank, "fsdp_refused": refused,
            "checkpoint": str(tmp / "ckpt"), "weights": str(tmp / "weights-0.pt")}


def close_cycles(_: Path) -> dict[str, Any]:
    gc.collect()
    gc.disable()  # closing must free the tensors by itself, not the cycle collector
    try:
        model, dataset = toy_models.mlp(), toy_models.mlp_dataset()  # the user's: kept throughout
        baseline = live_tensor_bytes()
        after_close, built = [], []
        for _ in range(CYCLES):
            result = build(["fsdp"], model=model, dataset=dataset)
            train_step(result, [next(iter(result.dataloader))])
            built.append(live_tensor_bytes())
            result.close()
            after_close.append(live_tensor_bytes())
            del result
        return {"baseline": baseline, "built": built, "after_close": after_close}
    finally:
        gc.enable()


def dropped(_: Path) -> dict[str, Any]:
    """A DDP result that is dropped (not closed) is freed by reference counting alone."""
    gc.collect()
    gc.disable()
    try:
        baseline = live_tensor_bytes()
        after = []
        for _ in range(3):
            result = build(["parallel_mode", ("amp_native", {"dtype": "bf16"}), "checkpoint"])
            train_step(result, [next(iter(result.dataloader))])
            del result
            after.append(live_tensor_bytes())
        return {"baseline": baseline, "after_drop": after}
    finally:
        gc.enable()


def meshes(_: Path) -> dict[str, Any]:
    from torch.distributed.distributed_c10d import _world

    counts = []
    for _ in range(3):
        result = build(["fsdp"])
        result.close()
        counts.append(len(_world.pg_map))
    return {"groups": counts}


def rng(_: Path) -> dict[str, Any]:
    model = toy_models.tiny_gpt2()  # Conv1D layers: module_replace makes new nn.Linear layers
    torch.manual_seed(123)
    expected = torch.rand(4).tolist()
    torch.manual_seed(123)
    result = build(["parallel_mode", "module_replace", "checkpoint"], model=model, dataset=toy_models.TokenDataset(),
                   loss_func=toy_models.gpt2_loss, model_input_format="unpack_dict")
    drawn = torch.rand(4).tolist()
    result.close()
    return {"expected": expected, "drawn": drawn}


def timeout(_: Path) -> dict[str, Any]:
    """A collective that a peer never joins raises within the caller's bound, not the group's."""
    import time

    from atorch.distributed import collective_timeout

    result = build(["fsdp"])
    outcome: dict[str, Any] = {}
    if dist.get_rank() == 0:
        start = time.monotonic()
        try:
            with collective_timeout(3.0):
                train_step(result, [next(iter(result.dataloader))])  # rank 1 is not there
            outcome["raised"] = None
        except Exception as exc:  # noqa: BLE001  (whatever torch raises for a timed-out collective)
            outcome["raised"] = type(exc).__name__
        outcome["seconds"] = time.monotonic() - start
    else:
        time.sleep(8.0)
    return outcome


SCENARIOS = {f.__name__: f for f in (agreement, build_failure, global_loss, param_names, rank_order, close_cycles,
                                     dropped, meshes, rng)}


def main(tmp: str) -> None:
    init_distributed()
    if tmp == "timeout":  # its own launch: the timed-out collective leaves the group unusable
        outcome = timeout(Path(tmp))
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps({"timeout": outcome}), flush=True)
        os._exit(0)  # no tear-down handshake with a peer that is still asleep
    report: dict[str, Any] = {}
    for name, scenario in SCENARIOS.items():
        try:
            report[name] = scenario(Path(tmp))
        except Exception as exc:  # reported per scenario; the others still run
            report[name] = {"failed": "".join(traceback.format_exception_only(exc)).strip()[-2000:]}
            print(f"[rank {dist.get_rank()}] {name} failed:\n{traceback.format_exc()}", file=sys.stderr)
        dist.barrier()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
