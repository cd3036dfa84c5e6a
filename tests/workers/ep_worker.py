"""Expert parallel on real processes (gloo), against one process.

Usage: ``torchrun --nproc_per_node=N ep_worker.py GROUP [DIR]`` (see GROUPS). Every rank trains the accelerated
model with ATorch's loop (forward, ``loss.backward()``, ``optim.step()``) on its share of the batch, and also, in
one process, the user's model on every rank's share: each step the mean of the per-share losses is backpropagated
(what data parallel over data × expert ranks computes; the router's auxiliary loss is a per-batch statistic, so it
is compared per share). Prints ``RESULT {scenario: {...} | {"error": ...} | {"refused": [...]}}``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import copy
import json
import sys
from collections.abc import Callable
from typing import Any

import shard_models as sm
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from worker_common import GLOBAL_BATCH, LR, STEPS, repeated_batch, run_each

import atorch
from atorch.distributed import shutdown
from atorch.model_context import call_model
from atorch.opt_lib.expert_parallel import is_expert_param
from atorch.state_names import trained_param_names
from atorch.training import train_step


def mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(
        vocab_size=sm.VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.1, max_position_embeddings=4 * sm.SEQ_LEN, use_cache=False))


def qwen3_moe(num_experts: int = 8) -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=sm.VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=num_experts, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, output_router_logits=True, router_aux_loss_coef=0.1,
        max_position_embeddings=4 * sm.SEQ_LEN, use_cache=False))


def qwen2_moe() -> nn.Module:
    """Qwen2-MoE: routed experts beside a gated shared expert (which stays whole on every rank)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=sm.VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
        shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, output_router_logits=True,
        router_aux_loss_coef=0.1, max_position_embeddings=4 * sm.SEQ_LEN, use_cache=False))


def qwen2_moe_dense_first() -> nn.Module:
    """Qwen2-MoE whose first layer has a dense MLP: split in two, the first stage has no router."""
    model = qwen2_moe()
    config = model.config
    config.mlp_only_layers = [0]
    torch.manual_seed(0)
    return type(model)(config)


def mixtral_no_plan() -> nn.Module:
    """Mixtral with its shipped ep_plan removed: the experts are found by atorch's own rule."""
    model = mixtral()
    model.ep_plan = {}
    return model


def qwen3_moe_3() -> nn.Module:
    """Three experts: an 'expert' size of 2 does not divide them."""
    return qwen3_moe(num_experts=3)


MODELS: dict[str, Callable[[], nn.Module]] = {"mixtral": mixtral, "qwen3_moe": qwen3_moe, "qwen2_moe": qwen2_moe,
                                             "qwen3_moe_3": qwen3_moe_3, "llama": sm.tiny_llama,
                                             "mixtral_no_plan": mixtral_no_plan,
                                             "qwen2_moe_dense_first": qwen2_moe_dense_first}


def _make(name: str) -> nn.Module:
    torch.manual_seed(0)  # the same user model on every rank
    return MODELS[name]()


def _accelerate(model: nn.Module, strategy: list[Any]) -> Any:
    _, result, _ = atorch.auto_accelerate(
        model, torch.optim.SGD, repeated_batch(sm.TokenDataset()), sm.hf_loss, model_input_format="unpack_dict",
        optim_args={"lr": LR}, dataloader_args={"batch_size": GLOBAL_BATCH, "shuffle": False},
        load_strategy=strategy,
    )
    return result


def _whole_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The user's names -> whole tensors (expert and FSDP shards gathered; collective)."""
    out = {}
    for name, param in model.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        out[name.removeprefix("module.")] = value.detach().clone()
    return out


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _gather_batches(batches: list[dict[str, torch.Tensor]]) -> list[list[dict[str, torch.Tensor]]]:
    """Every rank's batch of every step, by global rank."""
    ids = torch.stack([b["input_ids"] for b in batches])
    out = [torch.empty_like(ids) for _ in range(dist.get_world_size())]
    dist.all_gather(out, ids)
    return [[{"input_ids": t[s], "labels": t[s]} for s in range(len(batches))] for t in out]


def _reference(model: nn.Module, per_rank: list[list[dict[str, torch.Tensor]]], shares: list[int]
               ) -> tuple[list[list[tuple[float, float]]], dict[str, torch.Tensor], float]:
    """One process: per step, the mean of the losses of the ranks in ``shares`` (every rank: each data × expert rank
    has its own share), backward, SGD. Returns (per global rank: per step (loss, aux loss)), final weights, the first
    step's gradient norm."""
    model = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    seen: list[list[tuple[float, float]]] = [[] for _ in per_rank]
    for step in range(len(per_rank[0])):
        outs = {}
        for rank, batches in enumerate(per_rank):
            outs[rank] = call_model(model, batches[step], "unpack_dict")
            seen[rank].append((outs[rank].loss.item(), outs[rank].aux_loss.item()))
        total = torch.stack([outs[r].loss for r in shares]).mean()  # ranks of one share train on the same batch
        total.backward()
        if step == 0:
            norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        optim.step()
        optim.zero_grad()
    return seen, {n: p.detach().clone() for n, p in model.named_parameters()}, norm


def train_and_compare(model_name: str, strategy: list[Any]) -> dict[str, Any]:
    user = _make(model_name)
    try:
        result = _accelerate(user, strategy)
    except atorch.StrategyError as exc:
        return {"refused": list(exc.problems)}
    batches, mine = [], []
    loader = iter(result.dataloader)
    for _ in range(STEPS):
        data = result.prepare_input(next(loader), result.args.device)
        out = call_model(result.model, data, "unpack_dict")
        loss = sm.hf_loss(data, out)
        loss.backward()
        if not batches:  # the global gradient's norm (clipping at a bound it stays under: no change)
            norm = float(result.optim.clip_grad_norm_(1e9))
        result.optim.step()
        result.optim.zero_grad()
        batches.append(data)
        mine.append((loss.item(), out.aux_loss.item()))
    per_rank = _gather_batches(batches)
    seen, weights, ref_norm = _reference(user, per_rank, list(range(dist.get_world_size())))
    ours = _whole_params(result.model)
    me = dist.get_rank()
    experts = [p for p in result.model.parameters() if is_expert_param(p)]
    dense = [p for p in result.model.parameters() if not is_expert_param(p)]
    return {
        "loss_diff": max(abs(a[0] - b[0]) for a, b in zip(mine, seen[me], strict=True)),
        "aux_diff": max(abs(a[1] - b[1]) for a, b in zip(mine, seen[me], strict=True)),
        "aux": [a[1] for a in mine],
        "loss_drop": seen[me][0][0] - seen[me][-1][0],
        "norm": norm, "norm_diff": abs(norm - ref_norm),
        "weight_diff": max((ours[n] - w).abs().max().item() for n, w in weights.items()),
        "names_match": sorted(ours) == sorted(weights),
        "expert_params": len(experts),
        "local_experts": sorted({p.to_local().shape[0] for p in experts}),
        "dp_size": result.args.data_parallel_size,
        # the share of the non-expert parameters this rank holds: 1 under DDP, about 1 / data ranks when sharded
        "dense_local_share": sum(_local(p).numel() for p in dense) / sum(p.numel() for p in dense),
    }


def train_accumulated(model_name: str, strategy: list[Any], micro: int = 2, router_loss: bool = True) -> dict[str, Any]:
    """atorch.train_step over ``micro`` micro-batches per rank (gradient accumulation: the data-parallel and the
    expert gradients are averaged once, at the boundary; under pipeline parallel the schedule runs them) against one
    process on the same micro-batches: the mean of every rank's losses (the ranks of a tensor or pipeline group read
    the same batch, each data × expert rank its own). ``router_loss=False``: the router's load-balancing loss off
    (pipeline parallel refuses it: a statistic over every stage's layers)."""
    user = _make(model_name)
    user.config.output_router_logits = router_loss
    try:
        result = _accelerate(user, strategy)
    except atorch.StrategyError as exc:
        return {"refused": list(exc.problems)}
    loader, batches, totals = iter(result.dataloader), [], []
    for _ in range(STEPS):
        data = result.prepare_input(next(loader), result.args.device)
        parts = [{k: v.chunk(micro)[m] for k, v in data.items()} for m in range(micro)]
        totals.append(float(train_step(result, parts)))  # the mean over micro-batches and data × expert ranks
        batches.append(data)
    per_rank = _gather_batches(batches)
    model = copy.deepcopy(user)
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    expected = []
    for step in range(STEPS):
        losses = [sm.hf_loss(None, call_model(model, {k: v.chunk(micro)[m] for k, v in per_rank[r][step].items()},
                                              "unpack_dict"))
                  for r in range(len(per_rank)) for m in range(micro)]
        total = torch.stack(losses).mean()
        total.backward()
        optim.step()
        optim.zero_grad()
        expected.append(total.item())
    ours = {}
    for param, name in trained_param_names(result.model).items():  # this rank's (stages'), experts gathered whole
        ours[name] = (param.full_tensor() if isinstance(param, DTensor) else param).detach()
    reference = dict(model.named_parameters())
    held: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(held, sorted(ours))
    weight_diff = torch.tensor(max((ours[n] - reference[n].detach()).abs().max().item() for n in ours))
    dist.all_reduce(weight_diff, op=dist.ReduceOp.MAX)
    experts = [p for p in result.model.parameters() if is_expert_param(p)]
    return {"loss_diff": max(abs(a - b) for a, b in zip(totals, expected, strict=True)),
            "loss_drop": expected[0] - expected[-1], "weight_diff": weight_diff.item(),
            "names_match": sorted({n for names in held for n in names}) == sorted(reference),
            "local_experts": sorted({p.to_local().shape[0] for p in experts})}


def train_pipelined(model_name: str, strategy: list[Any]) -> dict[str, Any]:
    """Experts beside pipeline stages: one micro-batch per train_step (the schedule splits it), no router loss."""
    return train_accumulated(model_name, strategy, micro=1, router_loss=False)


def train_pipelined_with_router_loss(model_name: str, strategy: list[Any], pipeline: int = 2) -> dict[str, Any]:
    """Pipeline stages with the router's load-balancing loss: the schedule's micro-batches (2 per stage) against
    one process on the same micro-batches, each with its own load-balancing loss (a per-batch statistic)."""
    return train_accumulated(model_name, strategy, micro=2 * pipeline, router_loss=True)


def _pp(pipeline: int, schedule: str = "1f1b", extra: tuple[Any, ...] = ()) -> list[Any]:
    return [("parallel_mode", {"dims": [["pipeline", pipeline], ["data", -1]]}),
            ("pipeline_parallel", {"schedule": schedule}), *extra]


def _ep(expert: int, data: int | None = None, extra: tuple[Any, ...] = ()) -> list[Any]:
    dims = [["expert", expert]] + ([["data", data]] if data is not None else [])
    return [("parallel_mode", {"dims": dims}), "expert_parallel", *extra]


def _ep_pp(expert: int, pipeline: int, extra: tuple[Any, ...] = ()) -> list[Any]:
    return [("parallel_mode", {"dims": [["pipeline", pipeline], ["expert", expert], ["data", -1]]}), "expert_parallel",
            ("pipeline_parallel", {"schedule": "1f1b"}), *extra]


def _ep_tp(tensor: int, expert: int, tp: dict[str, Any] | None = None, extra: tuple[Any, ...] = ()) -> list[Any]:
    return [("parallel_mode", {"dims": [["tensor", tensor], ["expert", expert], ["data", -1]]}), "expert_parallel",
            ("tensor_parallel", tp) if tp else "tensor_parallel", *extra]


def _ep_cp(expert: int, context: int, extra: tuple[Any, ...] = ()) -> list[Any]:
    return [("parallel_mode", {"dims": [["expert", expert], ["context", context], ["data", -1]]}), "expert_parallel",
            "context_parallel", *extra]


def checkpoint_round_trip(directory: str, saved_as: list[Any], loaded_as: list[Any]) -> dict[str, Any]:
    """Saved under ``saved_as``, loaded under plain data parallel and under ``loaded_as``: the same weights under
    the user's names."""
    saved = _accelerate(_make("mixtral"), saved_as)
    loader = iter(saved.dataloader)
    for _ in range(2):  # train a little so the weights differ from the initial ones
        data = saved.prepare_input(next(loader), saved.args.device)
        sm.hf_loss(data, call_model(saved.model, data, "unpack_dict")).backward()
        saved.optim.step()
        saved.optim.zero_grad()
    before = _whole_params(saved.model)
    path = os.path.join(directory, "ckpt")
    atorch.save_checkpoint(path, saved, step=2)
    plain = _accelerate(_make("mixtral"), ["parallel_mode"])
    meta = atorch.load_checkpoint(path, plain)
    after = _whole_params(plain.model)
    back = _accelerate(_make("mixtral"), loaded_as)
    atorch.load_checkpoint(path, back)
    again = _whole_params(back.model)
    return {"step": meta.get("step"), "names_match": sorted(before) == sorted(after),
            "plain_diff": max((before[n] - after[n]).abs().max().item() for n in before),
            "ep_diff": max((before[n] - again[n]).abs().max().item() for n in before)}


GROUPS: dict[str, dict[str, Callable[..., dict[str, Any]]]] = {
    "two": {
        "mixtral_e2": lambda d: train_and_compare("mixtral", _ep(2)),
        "qwen3_e2": lambda d: train_and_compare("qwen3_moe", _ep(2)),
        "mixtral_e2_fsdp": lambda d: train_and_compare("mixtral", _ep(2, extra=("fsdp",))),
        "qwen3_e2_zero1": lambda d: train_and_compare("qwen3_moe", _ep(2, extra=("zero1",))),
        "qwen2_e2": lambda d: train_and_compare("qwen2_moe", _ep(2)),
        "mixtral_own_plan_e2": lambda d: train_and_compare("mixtral_no_plan", _ep(2)),
        "mixtral_e2_accumulated": lambda d: train_accumulated("mixtral", _ep(2)),
        # tensor 2 with sequence parallel and no expert dimension: every rank keeps every expert (Qwen2-MoE's shared
        # expert split by the tensor plan inside its MoE layer, which takes the whole sequence)
        "qwen2_t2_sp": lambda d: train_and_compare("qwen2_moe", [("parallel_mode", {"dims": [["tensor", 2]]}),
                                                                ("tensor_parallel", {"sequence_parallel": True})]),
        "qwen3_e2_fsdp_accumulated": lambda d: train_accumulated("qwen3_moe", _ep(2, extra=("fsdp",))),
        # the router's load-balancing loss over every stage's layers: each stage passes its router logits on
        "mixtral_p2_router_loss": lambda d: train_pipelined_with_router_loss("mixtral", _pp(2)),
        "qwen2_dense_first_p2_router_loss_gpipe": lambda d: train_pipelined_with_router_loss(
            "qwen2_moe_dense_first", _pp(2, "gpipe")),
        # recomputed blocks call their routers again in backward: only the stage's forward records them
        "mixtral_p2_checkpoint_router_loss": lambda d: train_pipelined_with_router_loss(
            "mixtral", _pp(2, extra=("checkpoint",))),
        "three_experts_refused": lambda d: train_and_compare("qwen3_moe_3", _ep(2)),
        "dense_model_refused": lambda d: train_and_compare("llama", _ep(2)),
        "checkpoint": lambda d: checkpoint_round_trip(d, _ep(2), _ep(2, extra=("fsdp",))),
    },
    "eight": {
        # tensor 2 × pipeline 2 × expert 2: each stage's attention split over its tensor ranks, its experts over its
        # expert group
        # with the router's load-balancing loss: the routing statistics passed on between stages, the same on every
        # tensor rank
        "mixtral_t2_p2_e2": lambda d: train_pipelined_with_router_loss("mixtral", [
            ("parallel_mode", {"dims": [["tensor", 2], ["pipeline", 2], ["expert", 2]]}), "expert_parallel",
            ("mixed_parallel", {"pipeline": {"schedule": "1f1b"}})]),
    },
    "four": {
        "mixtral_e2_d2": lambda d: train_and_compare("mixtral", _ep(2, 2)),
        "qwen3_e2_d2_fsdp": lambda d: train_and_compare("qwen3_moe", _ep(2, 2, ("fsdp",))),
        "mixtral_e4": lambda d: train_and_compare("mixtral", _ep(4)),
        "mixtral_e2_d2_zero1": lambda d: train_and_compare("mixtral", _ep(2, 2, ("zero1",))),
        "qwen3_e4": lambda d: train_and_compare("qwen3_moe", _ep(4)),
        "checkpoint_e2d2_to_e4": lambda d: checkpoint_round_trip(d, _ep(2, 2), _ep(4)),
        # experts beside context ranks: the router logits gathered over the context group, the expert gradients
        # averaged over data × context
        "mixtral_e2_c2": lambda d: train_and_compare("mixtral", _ep_cp(2, 2)),
        "qwen3_e2_c2_fsdp": lambda d: train_and_compare("qwen3_moe", _ep_cp(2, 2, ("fsdp",))),
        # experts beside pipeline stages (DeepSeek-V3's and Megatron-Bridge's Qwen3-30B-A3B's layouts, small): each
        # stage's MoE layers split, the expert gradients averaged after each schedule
        "mixtral_p2_e2": lambda d: train_pipelined("mixtral", _ep_pp(2, 2)),
        "qwen3_p2_e2_fsdp": lambda d: train_pipelined("qwen3_moe", _ep_pp(2, 2, ("fsdp",))),
        "qwen2_p2_e2_zero1": lambda d: train_pipelined("qwen2_moe", _ep_pp(2, 2, ("zero1",))),
        "mixtral_p2_e2_router_loss": lambda d: train_pipelined_with_router_loss("mixtral", _ep_pp(2, 2)),
        "qwen3_p2_e2_fsdp_router_loss": lambda d: train_pipelined_with_router_loss("qwen3_moe",
                                                                                   _ep_pp(2, 2, ("fsdp",))),
        # context ranks beside pipeline stages: each stage sums its routing statistics over the sequence's shares
        "mixtral_p2_c2_router_loss": lambda d: train_pipelined_with_router_loss("mixtral", [
            ("parallel_mode", {"dims": [["pipeline", 2], ["context", 2]]}), "context_parallel",
            ("pipeline_parallel", {"schedule": "1f1b"})]),
        # experts beside tensor ranks: each tensor position's expert group dispatches its own tokens (with
        # sequence parallel, its slice of the sequence)
        "mixtral_t2_e2": lambda d: train_and_compare("mixtral", _ep_tp(2, 2)),
        "qwen3_t2_e2_fsdp": lambda d: train_and_compare("qwen3_moe", _ep_tp(2, 2, extra=("fsdp",))),
        "qwen2_t2_e2_zero1": lambda d: train_and_compare("qwen2_moe", _ep_tp(2, 2, extra=("zero1",))),
        # with sequence parallel: each MoE layer gathers the sequence, computes it whole (its experts split over the
        # expert group) and returns this rank's shard to the residual stream
        "mixtral_t2_e2_sp": lambda d: train_and_compare("mixtral", _ep_tp(2, 2, {"sequence_parallel": True})),
        "qwen2_t2_e2_sp_fsdp": lambda d: train_and_compare("qwen2_moe", _ep_tp(2, 2, {"sequence_parallel": True},
                                                                              ("fsdp",))),
    },
}


def main() -> None:
    group, directory = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "/tmp"
    dist.init_process_group("gloo")
    scenarios = {name: (lambda f=f: f(directory)) for name, f in GROUPS[group].items()}
    only = os.environ.get("EP_ONLY")
    if only:
        scenarios = {k: v for k, v in scenarios.items() if k in only.split(",")}
    report = run_each(scenarios)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(report))
    shutdown()  # ranks meet before gloo closes its connections (a lone teardown can abort a peer)


if __name__ == "__main__":
    main()
