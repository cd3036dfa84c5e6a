"""The README's training loop, run literally under every family of the default search space
(tests/test_readme_loop.py).

Usage: ``torchrun --nproc_per_node=N readme_loop_worker.py CASE`` with CASE ``mlp`` (2 processes: every sharding
method and implementation, precision, checkpointing) or ``llama`` (4 processes: a transformers Llama, whose space
adds tensor-parallel layouts beside and under sharding, and context-parallel ones: its space is built as for sequences
that reach ``context_parallel_from``). The strategies are not a hand list: they are the space's
own candidates (``SearchSpace(model, world, batch).enumerate()``, the automatic search's defaults), one per
family (a point without its micro-batch size), reduced to a covering set: every layout x sharding pair, then
families until every value of every key is taken at least once.

The loop (between ``<!-- loop:start -->`` and ``<!-- loop:end -->`` in README.md) is executed as written, with
``status`` and ``result`` from ``auto_accelerate``; the result says 2 micro-batches a step, as an automatic pick
with micro-batching does. Each family's final weights are compared with a single-process reference that trains
on the same global batches in the same order (the distributed sampler's order over the data ranks, shuffled anew each
epoch under data parallel), with the same accumulation and clipping. Rank 0 prints ``RESULT {json}``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import json
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, default_collate
from torch.utils.data.distributed import DistributedSampler

README = Path(__file__).resolve().parents[2] / "README.md"
EPOCHS, GLOBAL_BATCH, ACCUMULATION, MAX_NORM, LR = 2, 8, 2, 1.0, 0.1  # EPOCHS: the README loop's own
CASES = {"mlp": 2, "llama": 4}  # case -> processes


class DictDataset(Dataset):
    """The MLP's samples as dicts, so that the README's ``model(**data)`` applies."""

    def __init__(self) -> None:
        import toy_models

        self.inner = toy_models.mlp_dataset()

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x, y = self.inner[index]
        return {"x": x, "y": y}


def mlp_loss(data: dict[str, torch.Tensor], output: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output.float(), data["y"])


def lm_loss(data: dict[str, torch.Tensor], output: Any) -> torch.Tensor:
    return output.loss.float()


def case_setup(case: str) -> tuple[Callable[[], torch.nn.Module], Dataset, Callable[..., torch.Tensor]]:
    """(model factory: the same weights on every call, dataset, loss)."""
    if case == "mlp":
        import toy_models

        return toy_models.mlp, DictDataset(), mlp_loss
    import shard_models

    def llama() -> torch.nn.Module:
        torch.manual_seed(0)
        return shard_models.tiny_llama()

    return llama, shard_models.TokenDataset(), lm_loss


def families(model: torch.nn.Module, world: int, skip: Callable[[dict[str, Any]], bool],
             sequence: int | None = None) -> dict[str, Any]:
    """Name -> strategy: a covering set of the default space's families (see the module's docstring); with
    ``sequence``, the space the search builds for sequences that long when they reach ``context_parallel_from``
    (context-parallel layouts too)."""
    from atorch.strategy_search.search.space import SearchSpace

    by_family: dict[str, dict[str, Any]] = {}
    strategies: dict[str, Any] = {}
    space = SearchSpace(model, world, GLOBAL_BATCH, sequence_length=sequence,
                        **({"context_parallel_from": sequence} if sequence else {}))
    for cand in space.enumerate():
        point = {k: v for k, v in cand.point if k != "micro_batch_size"}
        name = json.dumps(point, sort_keys=True)
        if not skip(point) and name not in by_family:
            by_family[name], strategies[name] = point, cand.strategy
    chosen: list[str] = []
    groups: set[tuple[Any, ...]] = set()
    for name, point in by_family.items():  # every layout x sharding (and its implementation)
        group = (point.get("tensor", 1), point.get("pipeline", 1), point.get("expert", 1), point.get("context", 1),
                 point["sharding"], point.get(f"{point['sharding']}.implementation"))
        if group not in groups:
            groups.add(group)
            chosen.append(name)
    covered = {(k, json.dumps(v)) for name in chosen for k, v in by_family[name].items()}
    for name, point in by_family.items():  # then every value of every key at least once
        new = {(k, json.dumps(v)) for k, v in point.items()} - covered
        if new and name not in chosen:
            chosen.append(name)
            covered |= new
    return {name: strategies[name] for name in chosen}


def readme_loop() -> str:
    text = README.read_text(encoding="utf-8")
    match = re.search(r"<!-- loop:start -->\n```python\n(.*?)```\n<!-- loop:end -->", text, re.S)
    assert match, "README.md lost its <!-- loop:start/end --> block"
    return match.group(1)


def flat_weights(model: torch.nn.Module) -> torch.Tensor:
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([p.detach().float().flatten() for p in params])


def reference(make: Callable[[], torch.nn.Module], dataset: Dataset, loss_func: Callable[..., torch.Tensor],
              data_ranks: int) -> torch.Tensor:
    """One process, no atorch: the same global micro-batches, accumulation and clipping."""
    model = make()
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    local = GLOBAL_BATCH // data_ranks
    for epoch in range(EPOCHS):
        orders = []
        for rank in range(data_ranks):
            # atorch's dataloader shuffles by default under data parallel only (one data rank: torch's default)
            sampler = DistributedSampler(dataset, num_replicas=data_ranks, rank=rank, shuffle=data_ranks > 1)
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        for index in range(len(orders[0]) // local):
            batch = default_collate([dataset[i] for order in orders for i in order[index * local:(index + 1) * local]])
            (loss_func(batch, model(**batch)) / ACCUMULATION).backward()
            if (index + 1) % ACCUMULATION == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                optim.step()
                optim.zero_grad()
    return flat_weights(model)


def run(strategy: Any, make: Callable[[], torch.nn.Module], dataset: Dataset,
        loss_func: Callable[..., torch.Tensor]) -> dict[str, Any]:
    import atorch

    status, result, _ = atorch.auto_accelerate(
        make(), torch.optim.SGD, dataset, loss_func, model_input_format="unpack_dict",
        optim_args={"lr": LR}, dataloader_args={"batch_size": GLOBAL_BATCH}, load_strategy=strategy,
    )
    # what build_result hands out for an automatic pick of 2 micro-batches a step (the dataloader's batch is one)
    object.__setattr__(result.args, "gradient_accumulation_steps", ACCUMULATION)
    exec(readme_loop(), {"status": status, "result": result})  # the README's code, as written
    weights = flat_weights(result.model)
    mine = weights.clone()
    dist.broadcast(weights, src=0)
    replicas = (mine - weights).abs().max().reshape(1)
    dist.all_reduce(replicas, op=dist.ReduceOp.MAX)
    data_ranks = result.args.data_parallel_size
    result.close()
    return {"weights": mine, "replica_gap": replicas.item(), "data_ranks": data_ranks}


def main() -> None:
    from atorch.distributed import init_distributed

    case = sys.argv[1]
    init_distributed()
    make, dataset, loss_func = case_setup(case)
    # DeepSpeed's implementations are covered by the MLP case (its engine builds its ops once per process)
    skip = (lambda point: False) if case == "mlp" else (lambda point: "deepspeed" in point.values())
    # the Llama's sequences as long as the search's threshold: its context-parallel layouts too
    sequence = None if case == "mlp" else len(dataset[0]["input_ids"])
    strategies = families(make(), dist.get_world_size(), skip, sequence)
    start = flat_weights(make())
    expected: dict[int, torch.Tensor] = {}
    report: dict[str, Any] = {"strategies": {}}
    for name, strategy in strategies.items():
        try:
            entry = run(strategy, make, dataset, loss_func)
            ranks = entry.pop("data_ranks")
            if ranks not in expected:
                expected[ranks] = reference(make, dataset, loss_func, ranks)
                report["moved"] = (expected[ranks] - start).abs().max().item()
            entry["max_diff"] = (entry.pop("weights") - expected[ranks]).abs().max().item()
            entry["strategy"] = strategy.to_json(indent=None)
            report["strategies"][name] = entry
        except Exception as exc:  # reported per family; the others still run
            report["strategies"][name] = {"error": "".join(traceback.format_exception_only(exc)).strip()[-2000:]}
            print(f"[rank {dist.get_rank()}] {name} failed:\n{traceback.format_exc()}", file=sys.stderr)
        dist.barrier()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
