"""Context parallel on real processes (gloo), against one process.

Usage: ``torchrun --nproc_per_node=N cp_worker.py GROUP`` (see GROUPS). Every rank trains the accelerated model with
ATorch's loop (forward with labels, ``loss.backward()``, ``optim.step()``) on its data rank's share of the batch; the
ranks of a context group read the same share and each runs 1/c of every sequence. One process trains the user's model
on every data rank's share (the mean of the shares' losses backpropagated: data parallel). Prints
``RESULT {scenario: {...} | {"error": ...} | {"refused": [...]}}``.
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
from worker_common import GLOBAL_BATCH, LR, repeated_batch, run_each

import atorch
from atorch.distributed import shutdown
from atorch.model_context import call_model
from atorch.state_names import StagedModel, state_roots, trained_param_names
from atorch.training import eval_logits, train_step

STEPS = 2


def qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=sm.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=sm.SEQ_LEN, use_cache=False))


def gpt_neox() -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=sm.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=sm.SEQ_LEN, use_cache=False, hidden_dropout=0.0, attention_dropout=0.0))


def mistral_window() -> nn.Module:
    """Mistral with a sliding window shorter than the sequence: each query sees its last 6 keys only."""
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(
        vocab_size=sm.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=sm.SEQ_LEN, sliding_window=6, use_cache=False))


def gemma2_softcap() -> nn.Module:
    """Gemma 2: capped attention scores (sdpa has no cap) and a sliding window on every other layer."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(
        vocab_size=sm.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=sm.SEQ_LEN, sliding_window=6,
        attn_logit_softcapping=5.0, use_cache=False, attn_implementation="eager"))


def mixtral() -> nn.Module:
    from ep_worker import mixtral as make  # with output_router_logits: the router's load-balancing loss

    return make()


def qwen3_moe() -> nn.Module:
    from ep_worker import qwen3_moe as make

    return make()


MODELS: dict[str, Callable[[], nn.Module]] = {"llama": sm.tiny_llama, "qwen2": qwen2, "gpt_neox": gpt_neox,
                                             "mixtral": mixtral, "qwen3_moe": qwen3_moe,
                                             "mistral_window": mistral_window, "gemma2_softcap": gemma2_softcap,
                                             "mlp": sm.FlatMLP, "bart": sm.tiny_bart}


def _make(name: str) -> nn.Module:
    torch.manual_seed(0)  # the same user model on every rank
    return MODELS[name]()


def _accelerate(model: nn.Module, strategy: list[Any], dataset: Any = None) -> Any:
    _, result, _ = atorch.auto_accelerate(
        model, torch.optim.SGD, repeated_batch(dataset or sm.TokenDataset()), sm.hf_loss,
        model_input_format="unpack_dict", optim_args={"lr": LR},
        dataloader_args={"batch_size": GLOBAL_BATCH, "shuffle": False}, load_strategy=strategy,
    )
    return result


def _whole_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters this rank holds, whole, by the user's names (under pipeline parallel: its stages' only)."""
    out = {}
    for param, name in trained_param_names(model).items():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        out[name] = value.detach().clone()
    return out


def train_and_compare(model_name: str, strategy: list[Any], accumulate: int = 0) -> dict[str, Any]:
    user = _make(model_name)
    try:
        result = _accelerate(user, strategy)
    except atorch.StrategyError as exc:
        return {"refused": list(exc.problems)}
    staged = isinstance(result.model, StagedModel)  # pipeline stages: the schedule runs them (train_step)
    roots = state_roots(result.model)
    local_lengths: list[int] = []
    # the sequence length each rank embeds (and so every activation's): 1/c of the batch's (a later pipeline stage's
    # stand-in embedding is called on the same split input ids)
    handles = [root.get_input_embeddings().register_forward_hook(lambda m, a, o: local_lengths.append(o.shape[1]))
               for root in roots]
    loader, batches, mine = iter(result.dataloader), [], []
    for _ in range(STEPS):
        data = result.prepare_input(next(loader), result.args.device)
        if accumulate:  # atorch.train_step over micro-batches: the gradients averaged once, at the boundary
            parts = [{k: v.chunk(accumulate)[m] for k, v in data.items()} for m in range(accumulate)]
            mine.append(float(train_step(result, parts)))  # the mean over micro-batches and ranks
        elif staged:
            mine.append(float(train_step(result, [data])))
        else:
            mine.append(_step(result, data))
        batches.append(data)
    for handle in handles:
        handle.remove()
    inner = roots[0]
    per_rank = _gather([b["input_ids"] for b in batches])
    shares = _data_shares(per_rank)
    model = copy.deepcopy(user)
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    expected: list[float] = []
    for step in range(STEPS):
        losses = []
        for ids in shares:
            parts = ids[step].chunk(accumulate) if accumulate else [ids[step]]
            losses += [call_model(model, {"input_ids": p, "labels": p}, "unpack_dict").loss for p in parts]
        total = torch.stack(losses).mean()
        total.backward()
        optim.step()
        optim.zero_grad()
        expected.append(total.item())
    ours = _whole_params(result.model)
    held: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(held, sorted(ours))  # pipeline stages: every name is held by some rank
    reference = {n: p.detach() for n, p in model.named_parameters()}
    weight_diff = torch.tensor(max((ours[n] - w).abs().max().item() for n, w in reference.items() if n in ours))
    dist.all_reduce(weight_diff, op=dist.ReduceOp.MAX)
    # this rank's own loss against the reference's global one where the data is whole (data size 1), else each
    # rank's loss is its data share's: compared through the mean over ranks
    mean = torch.tensor(mine)
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(mean.tolist(), expected, strict=True)),
        "loss_drop": expected[0] - expected[-1],
        "weight_diff": weight_diff.item(),
        "names_match": sorted({n for names in held for n in names}) == sorted(reference) and all(
            n in reference for n in ours),
        "attention": inner.config._attn_implementation,
        "local_length": local_lengths[0] if local_lengths else None,
        "sequence_length": int(per_rank[0].shape[-1]),
        "dp_size": result.args.data_parallel_size,
    }


def _step(result: Any, data: dict[str, torch.Tensor]) -> float:
    """One step of ATorch's loop (forward with labels, backward, step): the loss."""
    loss = sm.hf_loss(data, call_model(result.model, data, "unpack_dict"))
    loss.backward()
    result.optim.step()
    result.optim.zero_grad()
    return loss.item()


def _train(result: Any) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """ATorch's loop for STEPS steps: the batches and the losses."""
    loader, batches, losses = iter(result.dataloader), [], []
    for _ in range(STEPS):
        data = result.prepare_input(next(loader), result.args.device)
        losses.append(_step(result, data))
        batches.append(data)
    return batches, losses


class PaddedTokens(torch.utils.data.Dataset):
    """The token dataset with 2-6 padded positions per sample (``side``: "right" or "left"): attention_mask 0 there,
    labels -100 there (what a tokenizer and a causal-LM collator give)."""

    def __init__(self, side: str) -> None:
        self.base, self.side = sm.TokenDataset(), side

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.base[index]["input_ids"].clone()
        pad = 2 + index % 5
        mask = torch.ones_like(ids)
        if self.side == "right":
            mask[-pad:] = 0
        else:
            mask[:pad] = 0
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def train_padded(model_name: str, strategy: list[Any], side: str) -> dict[str, Any]:
    """Padded batches (attention_mask and -100 labels) under context parallel against one process running the
    user's model with the same masks (transformers' own SDPA mask)."""
    user = _make(model_name)
    result = _accelerate(user, strategy, PaddedTokens(side))
    batches, mine = _train(result)
    per_rank = {key: _gather([b[key] for b in batches]) for key in ("input_ids", "attention_mask", "labels")}
    shares: list[int] = []  # one global rank per distinct data share (a context group's ranks read the same)
    for rank, ids in enumerate(per_rank["input_ids"]):
        if not any(torch.equal(ids, per_rank["input_ids"][r]) for r in shares):
            shares.append(rank)
    model = copy.deepcopy(user)
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    expected: list[float] = []
    for step in range(STEPS):
        losses = [model(**{key: per_rank[key][r][step] for key in per_rank}).loss for r in shares]
        total = torch.stack(losses).mean()
        total.backward()
        optim.step()
        optim.zero_grad()
        expected.append(total.item())
    ours = _whole_params(result.model)
    mean = torch.tensor(mine)
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(mean.tolist(), expected, strict=True)),
        "loss_drop": expected[0] - expected[-1],
        "weight_diff": max((ours[n] - p.detach()).abs().max().item() for n, p in model.named_parameters()),
        "padded": int((per_rank["attention_mask"][0] == 0).sum()),
        "finite": all(torch.isfinite(torch.tensor(mine)).tolist()),
    }


def _gather(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's stacked ``tensors``, by global rank."""
    mine = torch.stack(tensors)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return out


def _data_shares(per_rank: list[torch.Tensor]) -> list[torch.Tensor]:
    """The distinct batches the ranks trained on (the context ranks of a data rank hold the same one)."""
    found: list[torch.Tensor] = []
    for ids in per_rank:
        if not any(torch.equal(ids, seen) for seen in found):
            found.append(ids)
    return found


def whole_logits(model_name: str, strategy: list[Any]) -> dict[str, Any]:
    """Without labels the logits come back whole, in sequence order: the same as one process's."""
    user = _make(model_name)
    result = _accelerate(user, strategy)
    ids = sm.TokenDataset()[0]["input_ids"][None].repeat(2, 1)
    with torch.no_grad():
        ours = call_model(result.model, {"input_ids": ids}, "unpack_dict").logits
        theirs = user(input_ids=ids).logits
    return {"shape_match": list(ours.shape) == list(theirs.shape), "logits_diff": (ours - theirs).abs().max().item()}


def pipelined_eval_logits(model_name: str, strategy: list[Any]) -> dict[str, Any]:
    """atorch.eval_logits under pipeline × context: the last stage's ranks get the whole logits, in sequence order
    (the same as one process's); the other stages get None."""
    user = _make(model_name)
    result = _accelerate(user, strategy)
    ids = sm.TokenDataset()[0]["input_ids"][None].repeat(4, 1)
    ours = eval_logits(result, {"input_ids": ids, "labels": ids})  # the schedule runs loss_func on the last stage
    with torch.no_grad():
        theirs = user(input_ids=ids).logits
    found = torch.tensor(-1.0 if ours is None else (ours - theirs).abs().max().item())
    shape_ok = torch.tensor(1.0 if ours is None or list(ours.shape) == list(theirs.shape) else 0.0)
    diffs = [torch.zeros(()) for _ in range(dist.get_world_size())]
    dist.all_gather(diffs, found)
    dist.all_reduce(shape_ok, op=dist.ReduceOp.MIN)
    return {"logits_diffs": [d.item() for d in diffs], "shape_match": bool(shape_ok.item())}


def refused_at_call(model_name: str, strategy: list[Any], **batch: Any) -> dict[str, Any]:
    result = _accelerate(_make(model_name), strategy)
    ids = batch.pop("input_ids")
    try:
        data = {"input_ids": ids, "labels": ids, **batch}
        if isinstance(result.model, StagedModel):  # the schedule checks the batch before any stage runs
            train_step(result, [data])
        else:
            call_model(result.model, data, "unpack_dict")
    except atorch.SetupError as exc:
        return {"refused": [str(exc)]}
    return {"accepted": True}


def search_with_context() -> dict[str, Any]:
    """The automatic search on a decoder whose sequences reach ``context_parallel_from`` (lowered to the toy's 16
    tokens), with context_parallel included: its context candidates predicted, dry-run and picked, and the user's
    loop trains under the pick."""
    storage = f"sqlite:///{os.environ.get('TMPDIR', '/tmp')}/atorch-cp-search-{os.environ['MASTER_PORT']}.db"
    _, result, strategy = atorch.auto_accelerate(
        _make("llama"), torch.optim.SGD, repeated_batch(sm.TokenDataset()), sm.hf_loss,
        model_input_format="unpack_dict", optim_args={"lr": LR},
        dataloader_args={"batch_size": GLOBAL_BATCH, "shuffle": False}, included=["context_parallel"],
        search={"context_parallel_from": 16, "max_trials": 3, "warmup_steps": 1, "measure_steps": 2,
                "min_measure_s": 0, "confirm_within": 0, "force": True, "storage": storage})
    _, losses = _train(result)
    return {"names": sorted(strategy.names()), "context": strategy.layout(dist.get_world_size()).size("context"),
            "dry_runs": result.args.search.get("dry_runs"), "losses": losses}


def _cp(context: int, data: int | None = None, extra: tuple[Any, ...] = ()) -> list[Any]:
    dims = [["context", context]] + ([["data", data]] if data is not None else [])
    return [("parallel_mode", {"dims": dims}), "context_parallel", *extra]


def _tcp(tensor: int, context: int, tp: dict[str, Any] | None = None, extra: tuple[Any, ...] = ()) -> list[Any]:
    """Tensor × context: each tensor rank's attention heads all-gather their K/V over its context group."""
    return [("parallel_mode", {"dims": [["tensor", tensor], ["context", context]]}), "context_parallel",
            ("tensor_parallel", tp) if tp else "tensor_parallel", *extra]


def _pcp(pipeline: int, context: int, schedule: str = "1f1b", extra: tuple[Any, ...] = ()) -> list[Any]:
    """Pipeline × context: every stage's model splits the micro-batch's sequences; the last computes its share of
    the loss."""
    return [("parallel_mode", {"dims": [["pipeline", pipeline], ["context", context]]}), "context_parallel",
            ("pipeline_parallel", {"schedule": schedule}), *extra]


_IDS = sm.TokenDataset()[0]["input_ids"][None]
GROUPS: dict[str, dict[str, Callable[[], dict[str, Any]]]] = {
    "two": {
        "llama_c2": lambda: train_and_compare("llama", _cp(2)),
        "qwen2_c2": lambda: train_and_compare("qwen2", _cp(2)),
        "gpt_neox_c2": lambda: train_and_compare("gpt_neox", _cp(2)),
        "llama_c2_fsdp": lambda: train_and_compare("llama", _cp(2, extra=("fsdp",))),
        "mistral_window_c2": lambda: train_and_compare("mistral_window", _cp(2)),
        "gemma2_softcap_c2": lambda: train_and_compare("gemma2_softcap", _cp(2)),
        "llama_c2_accumulated": lambda: train_and_compare("llama", _cp(2), accumulate=2),
        "llama_whole_logits": lambda: whole_logits("llama", _cp(2)),
        "mlp_refused": lambda: train_and_compare("mlp", _cp(2)),
        "bart_refused": lambda: train_and_compare("bart", _cp(2)),
        "uneven_refused": lambda: refused_at_call("llama", _cp(2), input_ids=_IDS[:, :14]),
        "llama_c2_padded_right": lambda: train_padded("llama", _cp(2), "right"),
        "qwen2_c2_padded_left": lambda: train_padded("qwen2", _cp(2), "left"),
        # mixtures of experts: the load-balancing loss over the whole sequence (with padding: its real tokens)
        "mixtral_c2": lambda: train_and_compare("mixtral", _cp(2)),
        "qwen3_moe_c2_padded_right": lambda: train_padded("qwen3_moe", _cp(2), "right"),
        "search_with_context": search_with_context,
        "mask_4d_refused": lambda: refused_at_call("llama", _cp(2), input_ids=_IDS,
                                                   attention_mask=torch.ones(1, 1, 16, 16)),
    },
    "eight": {
        "llama_t2_p2_c2_sp": lambda: train_and_compare("llama", [
            ("parallel_mode", {"dims": [["tensor", 2], ["pipeline", 2], ["context", 2]]}), "context_parallel",
            ("mixed_parallel", {"tensor": {"sequence_parallel": True}, "pipeline": {"schedule": "1f1b"}})]),
    },
    "four": {
        "llama_c2_d2": lambda: train_and_compare("llama", _cp(2, 2)),
        "qwen2_c2_d2_fsdp": lambda: train_and_compare("qwen2", _cp(2, 2, ("fsdp",))),
        "llama_c4": lambda: train_and_compare("llama", _cp(4)),
        "llama_t2_c2_sp": lambda: train_and_compare("llama", _tcp(2, 2, {"sequence_parallel": True})),
        "qwen2_t2_c2_fsdp": lambda: train_and_compare("qwen2", _tcp(2, 2, extra=("fsdp",))),
        "llama_c2_d2_padded_left": lambda: train_padded("llama", _cp(2, 2), "left"),
        "llama_p2_c2": lambda: train_and_compare("llama", _pcp(2, 2)),
        "llama_p2_c2_eval_logits": lambda: pipelined_eval_logits("llama", _pcp(2, 2)),
        "qwen2_p2_c2_gpipe_checkpoint_fsdp": lambda: train_and_compare(
            "qwen2", _pcp(2, 2, "gpipe", ("checkpoint", "fsdp"))),
        # refused before the schedule runs, on every rank (a refusal inside a stage would leave the next one waiting)
        "pipeline_padded_refused": lambda: refused_at_call(
            "llama", _pcp(2, 2), input_ids=_IDS.repeat(4, 1),
            attention_mask=torch.cat([torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 14, dtype=torch.long)], 1)),
        "pipeline_uneven_refused": lambda: refused_at_call("llama", _pcp(2, 2), input_ids=_IDS.repeat(4, 1)[:, :14]),
    },
}


def main() -> None:
    group = sys.argv[1]
    dist.init_process_group("gloo")
    scenarios = GROUPS[group]
    only = os.environ.get("CP_ONLY")
    if only:
        scenarios = {k: v for k, v in scenarios.items() if k in only.split(",")}
    report = run_each(scenarios)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(report))
    shutdown()  # ranks meet before gloo closes its connections (a lone teardown can abort a peer)


if __name__ == "__main__":
    main()
