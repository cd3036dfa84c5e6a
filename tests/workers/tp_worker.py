"""Tensor parallel (and tensor × data with fsdp) on real processes, against plain single-process fp32.

Usage: ``torchrun --nproc_per_node=N tp_worker.py GROUP`` where GROUP names the scenarios for N
processes (see GROUPS). Rank 0 also trains each model in plain fp32 in one process on the whole global
batch, and prints ``RESULT {"reference": {model: [...]}, "scenarios": {name: {...} or {"error": ...}}}``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import functools
import json
import logging
import sys
from typing import Any

import shard_models as sm
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils.data import Subset
from worker_common import GLOBAL_BATCH, LR, STEPS, gathered, losses_of, mean_over_ranks, reference_losses, run_each

import atorch
from atorch.model_context import call_model
from atorch.opt_lib.tp_sequence_vocab import plain, step_context
from atorch.training import eval_logits, train_step

MODELS = {
    "llama": sm.Setup(sm.tiny_llama, sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    "llama_3heads": sm.Setup(functools.partial(sm.tiny_llama, heads=3, kv_heads=1, hidden=24), sm.TokenDataset,
                             sm.hf_loss, "unpack_dict"),
    "gpt2": sm.Setup(sm.tiny_gpt2, sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    "vit": sm.Setup(sm.SequentialViT, sm.vector_dataset, sm.class_loss, "unpack_sequence"),
    "llama_own_loss": sm.Setup(sm.tiny_llama, sm.TokenDataset, lambda d, o: logits_loss(d, o), "unpack_dict"),
    "llama_vocab127": sm.Setup(lambda: _with_vocab(sm.tiny_llama(), 127), sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    "bert": sm.Setup(sm.tiny_bert_mlm, sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    "t5": sm.Setup(sm.tiny_t5, sm.Seq2SeqDataset, sm.hf_loss, "unpack_dict"),
    "bart": sm.Setup(sm.tiny_bart, sm.Seq2SeqDataset, sm.hf_loss, "unpack_dict"),
}
MODELS.update({  # the tensor-parallel sweep: families with and without a plan shipped by transformers
    "qwen2": sm.Setup(lambda: _hf("Qwen2", num_attention_heads=4, num_key_value_heads=2, head_dim=8), sm.TokenDataset,
                      sm.hf_loss, "unpack_dict"),
    "opt": sm.Setup(lambda: _hf("OPT", ffn_dim=64, num_attention_heads=4, word_embed_proj_dim=32, dropout=0.0),
                    sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    "gpt_neox": sm.Setup(lambda: _hf("GPTNeoX", num_attention_heads=4, hidden_dropout=0.0), sm.TokenDataset,
                         sm.hf_loss, "unpack_dict"),
    "phi3": sm.Setup(lambda: _hf("Phi3", num_attention_heads=4, num_key_value_heads=2, pad_token_id=0),
                     sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    "gemma_1kv": sm.Setup(lambda: _hf("Gemma", num_attention_heads=4, num_key_value_heads=1, head_dim=8),
                          sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    "bloom": sm.Setup(lambda: _hf("Bloom", n_head=4, n_layer=2), sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    "fused_mlp": sm.Setup(lambda: FusedMLPModel(), sm.vector_dataset, sm.class_loss, "unpack_sequence"),
    # 8 query heads over tensor 4 with fewer key/value heads than ranks: each replicated over 4 / kv ranks
    "gemma_8h_1kv": sm.Setup(lambda: _hf("Gemma", num_attention_heads=8, num_key_value_heads=1, head_dim=8),
                             sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    "llama_8h_2kv": sm.Setup(lambda: _hf("Llama", num_attention_heads=8, num_key_value_heads=2, head_dim=8),
                             sm.TokenDataset, sm.hf_loss, "unpack_dict"),
})
MODELS.update({  # decoder layouts with per-head q/k norms, fused q|k|v with parallel attention, multi-query attention
    "qwen3": sm.Setup(lambda: _hf("Qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=8), sm.TokenDataset,
                      sm.hf_loss, "unpack_dict"),
    "cohere_qk": sm.Setup(lambda: _hf("Cohere", num_attention_heads=4, num_key_value_heads=2, use_qk_norm=True,
                                      logit_scale=1.0, pad_token_id=0), sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    "falcon": sm.Setup(lambda: _hf("Falcon", num_attention_heads=4, parallel_attn=True, bias=True, multi_query=False,
                                   new_decoder_architecture=False, ffn_hidden_size=64, hidden_dropout=0.0,
                                   attention_dropout=0.0), sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    "stablelm_qk": sm.Setup(lambda: _hf("StableLm", num_attention_heads=4, num_key_value_heads=4, qk_layernorm=True,
                                        use_parallel_residual=True, hidden_dropout=0.0, attention_dropout=0.0),
                            sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    # OLMo2 without the plan transformers ships (which gathers q/k/v): its whole-width q/k norms on split heads
    "olmo2_split": sm.Setup(lambda: _without_plan(_hf("Olmo2", num_attention_heads=4, num_key_value_heads=2)),
                            sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    # learned scalars (XIELU) in the MLP, between its split layers; q/k norms over head_dim
    "apertus": sm.Setup(lambda: _hf("Apertus", num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    pad_token_id=0), sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    "bigcode_mqa": sm.Setup(lambda: _hf("GPTBigCode", num_attention_heads=4, multi_query=True, n_inner=64,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), sm.TokenDataset,
                            sm.hf_loss, "unpack_dict"),
    # a hybrid: an attention layer with a dense MLP, then a Mamba layer with a MoE MLP (its mixer reads
    # dt_proj.weight itself: kept whole, as are the experts)
    "jamba": sm.Setup(lambda: _hf("Jamba", num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                  num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=0,
                                  expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_d_conv=4,
                                  mamba_expand=2, pad_token_id=0), sm.TokenDataset, sm.hf_loss, "unpack_dict"),
})
# The plan a new user writes for Phi-3: its gate_up_proj is fused (the model splits it again after the call).
PHI3_PLAN = ("tensor_parallel", {"plan": {"*.gate_up_proj": "colwise", "*.down_proj": "rowwise"}})
FUSED_PLAN = ("tensor_parallel", {"plan": {"blocks.*.gate_up": "colwise", "blocks.*.down": "rowwise"}})
TP2 = ("parallel_mode", {"dims": [["tensor", 2], ["data", -1]]})  # tensor first: adjacent ranks
TP4 = ("parallel_mode", {"dims": [["tensor", 4], ["data", -1]]})
LOSS_PARALLEL = ("tensor_parallel", {"loss_parallel": True})
SEQUENCE_PARALLEL = ("tensor_parallel", {"sequence_parallel": True})
BOTH = ("tensor_parallel", {"loss_parallel": True, "sequence_parallel": True})
# launch group -> scenario name -> (model, load_strategy)
GROUPS: dict[str, dict[str, tuple[str, list[Any]]]] = {
    "tp2": {
        "llama/tp2": ("llama", [TP2, "tensor_parallel"]),
        "llama/tp2+checkpoint": ("llama", [TP2, "tensor_parallel", "checkpoint"]),
        "gpt2/tp2+module_replace": ("gpt2", [TP2, "module_replace", "tensor_parallel"]),
        "vit/tp2[pairs]": ("vit", [TP2, "tensor_parallel"]),
        "gpt2/tp2+amp_native[bf16]": ("gpt2", [TP2, "module_replace", ("amp_native", {"dtype": "bf16"}),
                                               "tensor_parallel"]),
        # fp16 loss scaling over DTensor and plain gradients, the flag agreed by every rank
        "gpt2/tp2+amp_native[fp16]": ("gpt2", [TP2, "module_replace", ("amp_native", {"dtype": "fp16"}),
                                               "tensor_parallel"]),
        "gpt2/tp2[module_replace added]": ("gpt2", [TP2, "tensor_parallel"]),
        "qwen2/tp2": ("qwen2", [TP2, "tensor_parallel"]),
        "opt/tp2": ("opt", [TP2, "tensor_parallel"]),
        "gpt_neox/tp2": ("gpt_neox", [TP2, "tensor_parallel"]),
        "phi3/tp2": ("phi3", [TP2, "tensor_parallel"]),
        "phi3/tp2[user plan, fused gate_up_proj]": ("phi3", [TP2, PHI3_PLAN]),
        "gemma_1kv/tp2": ("gemma_1kv", [TP2, "tensor_parallel"]),
        "bloom/tp2": ("bloom", [TP2, "tensor_parallel"]),
        "refused/fused layer split column-wise": ("fused_mlp", [TP2, FUSED_PLAN]),
        "refused/llama 3 heads": ("llama_3heads", [TP2, "tensor_parallel"]),
        "llama/tp2+loss_parallel": ("llama", [TP2, LOSS_PARALLEL]),
        "llama/tp2+sequence_parallel": ("llama", [TP2, SEQUENCE_PARALLEL]),
        "llama/tp2+loss_parallel+sequence_parallel+checkpoint": ("llama", [TP2, BOTH, "checkpoint"]),
        "llama_own_loss/tp2+loss_parallel": ("llama_own_loss", [TP2, LOSS_PARALLEL]),
        "gpt2/tp2+loss_parallel+sequence_parallel": ("gpt2", [TP2, "module_replace", BOTH]),
        "gpt2/tp2+sequence_parallel": ("gpt2", [TP2, "module_replace", SEQUENCE_PARALLEL]),
        "refused/vocab 127 under loss_parallel": ("llama_vocab127", [TP2, LOSS_PARALLEL]),
        "bert/tp2": ("bert", [TP2, "tensor_parallel"]),
        "t5/tp2": ("t5", [TP2, "tensor_parallel"]),
        "bart/tp2": ("bart", [TP2, "tensor_parallel"]),
    },
    "tp2xdp2": {
        "llama/tp2xdp2+fsdp": ("llama", [TP2, "tensor_parallel", "fsdp"]),
        "gpt2/tp2xdp2+fsdp": ("gpt2", [TP2, "module_replace", "tensor_parallel", "fsdp"]),
        "llama/tp2xdp2+fsdp+amp_native[fp16]": ("llama", [TP2, ("amp_native", {"dtype": "fp16"}),
                                                          "tensor_parallel", "fsdp"]),
        "llama/tp2xdp2+fsdp+loss_parallel+sequence_parallel": ("llama", [TP2, BOTH, "fsdp"]),
        # zero1 next to a tensor dimension: FSDP2 over the data dimension without resharding after forward
        "llama/tp2xdp2+zero1": ("llama", [TP2, "tensor_parallel", "zero1"]),
        "gpt2/tp2xdp2+zero1+sequence_parallel": ("gpt2", [TP2, "module_replace", SEQUENCE_PARALLEL, "zero1"]),
        "gpt2/tp2xdp2+fsdp+loss_parallel+sequence_parallel": ("gpt2", [TP2, "module_replace", BOTH, "fsdp"]),
        # Plain data parallel on the data dimension (replicas of the shards, gradients averaged).
        "llama/tp2xdp2[ddp]": ("llama", [TP2, "tensor_parallel"]),
        "gpt2/tp2xdp2+module_replace[ddp]": ("gpt2", [TP2, "module_replace", "tensor_parallel"]),
        "llama/tp2xdp2[ddp]+accumulation": ("llama", [TP2, "tensor_parallel"]),
    },
    "tp4": {
        "gemma_8h_1kv/tp4": ("gemma_8h_1kv", [TP4, "tensor_parallel"]),
        "llama_8h_2kv/tp4": ("llama_8h_2kv", [TP4, "tensor_parallel"]),
    },
}
# Decoder layouts: per-head q/k norms (Qwen3: one weight over head_dim; Cohere: one row per head), fused q|k|v per
# head with parallel attention and biases (Falcon), multi-query attention with a fused projection (GPT-BigCode).
LAYOUTS: dict[str, dict[str, tuple[str, list[Any]]]] = {}  # test_tp_layouts.py
LAYOUTS["layouts_tp2"] = {f"{m}/tp2": (m, [TP2, "tensor_parallel"]) for m in ("qwen3", "cohere_qk", "falcon",
                                                                            "stablelm_qk", "bigcode_mqa",
                                                                            "olmo2_split")}
# The build check on wrong plans: the first module whose output differs (a fused MLP split column-wise) and where
# the split block fails (GPT-BigCode's multi-query c_attn split as if each head had its own key and value).
LAYOUTS["layouts_tp2"]["apertus/tp2"] = ("apertus", [TP2, "tensor_parallel"])
LAYOUTS["layouts_tp2"]["jamba/tp2"] = ("jamba", [TP2, "tensor_parallel"])
# under sequence_parallel the attention's input arrives as a DTensor: the layers kept whole take it local
LAYOUTS["layouts_tp2"].update({f"{m}/tp2+sequence_parallel": (m, [TP2, SEQUENCE_PARALLEL])
                               for m in ("qwen3", "bigcode_mqa")})
LAYOUTS["layouts_tp2"].update({
    "refused/fused layer split column-wise[first difference]": ("fused_mlp", [TP2, FUSED_PLAN]),
    # a user's plan leaving XIELU's learned scalars out: the output agrees, their gradients do not
    "refused/learned scalars kept whole": ("apertus", [TP2, ("tensor_parallel", {"plan": {
        "*.mlp.up_proj": "colwise", "*.mlp.down_proj": "rowwise"}})]),
    "refused/multi-query c_attn split column-wise": ("bigcode_mqa", [TP2, ("tensor_parallel", {"plan": {
        "*.attn.c_attn": "colwise", "*.attn.c_proj": "rowwise"}})]),
})
# Checkpoints of the layouts saved under tensor 2, loaded under data 2 with fsdp (and read in one process).
CHECKPOINTS = {f"checkpoint/{m}/tp2 -> fsdp2": m for m in ("qwen3", "cohere_qk", "falcon", "stablelm_qk",
                                                             "bigcode_mqa")}
LAYOUTS["layouts_tp2"].update({name: (m, [TP2, "tensor_parallel"]) for name, m in CHECKPOINTS.items()})
LAYOUTS["layouts_tp4"] = {f"{m}/tp4": (m, [TP4, "tensor_parallel"]) for m in ("qwen3", "cohere_qk", "falcon",
                                                                            "stablelm_qk", "bigcode_mqa",
                                                                            "olmo2_split")}
# tensor 2 × data 2 with fsdp: the norms' DTensor weights and the kept-whole layers sharded over the data dimension
LAYOUTS["layouts_tp4"].update({f"{m}/tp2xdp2+fsdp": (m, [TP2, "tensor_parallel", "fsdp"])
                               for m in ("cohere_qk", "bigcode_mqa")})
# Tensor 2 × pipeline 2 on 4 processes (1f1b): the model's own plan and a replicated key/value head on stage copies.
TPxPP = ("parallel_mode", {"dims": [["tensor", 2], ["data", -1], ["pipeline", 2]]})  # tensor first: adjacent ranks
PIPELINED: dict[str, dict[str, tuple[str, list[Any]]]] = {
    "tp2xpp2": {f"{m}/tp2xpp2": (m, [TPxPP, "tensor_parallel", ("pipeline_parallel", {"schedule": "1f1b"})])
                for m in ("gpt2", "llama", "qwen2", "bert", "opt", "gpt_neox", "phi3", "gemma_1kv", "bloom", "t5",
                          "bart")},
}
PIPELINED["layouts_tp2xpp2"] = {
    f"{m}/tp2xpp2": (m, [TPxPP, "tensor_parallel", ("pipeline_parallel", {"schedule": "1f1b"})])
    for m in ("qwen3", "cohere_qk", "falcon", "stablelm_qk", "bigcode_mqa", "olmo2_split", "apertus")}
# sequence_parallel across the stages (the stages exchange sequence shards), through mixed_parallel as a user writes
# it, and with zero1 (FSDP2 over the data dimension, of size 1 here): Megatron's layout at small scale.
SP_PP = ("parallel_mode", {"dims": [["tensor", 2], ["pipeline", 2]]})
SP_MIXED = ("mixed_parallel", {"tensor": {"sequence_parallel": True}, "pipeline": {"schedule": "1f1b"}})
PIPELINED["tp2xpp2"].update({
    "llama/tp2xpp2+sequence_parallel": ("llama", [SP_PP, SP_MIXED]),
    "gpt2/tp2xpp2+sequence_parallel": ("gpt2", [SP_PP, "module_replace", SP_MIXED]),
    "llama/tp2xpp2+sequence_parallel+zero1": ("llama", [SP_PP, SP_MIXED, "zero1"]),
})


def planner_layout_scaled_down() -> list[Any]:
    """What ``atorch plan --emit-strategy`` writes for Llama 3 405B's published layout (tensor 8, pipeline 16, data,
    sequence parallel, ZeRO-1: tests/test_plan.py) at tensor 2 × pipeline 2 × data 1 (1f1b: 2 layers here)."""
    from atorch.strategy_search.cluster.cluster_plan import Layout, strategy_for

    return strategy_for(Layout(2, 2, 1, "zero1", "none", "1f1b", 1, True, 1, 4)).to_list()


PIPELINED["tp2xpp2"]["llama/tp2xpp2 planner's 405B layout scaled down [bf16]"] = ("llama", planner_layout_scaled_down())
# A wrong plan on the second stage only (its fused block split column-wise): the build check of that stage, run
# alone on stand-in hidden states, must refuse it.
PIPELINED["tp2xpp2"]["refused/fused layer split column-wise on the second stage"] = ("fused_mlp", [
    TPxPP, ("tensor_parallel", {"plan": {"*blocks.1.gate_up": "colwise", "*blocks.1.down": "rowwise"}}),
    ("pipeline_parallel", {"schedule": "1f1b"})])
# Scenarios whose steps each take their batch as this many micro-batches (gradient accumulation).
MICRO_BATCHES = {"llama/tp2xdp2[ddp]+accumulation": 2}


class FusedMLP(nn.Module):
    """gate and up in one Linear, split again after the call (as Phi-3's gate_up_proj): a plain column-wise split
    gives rank 0 the whole gate half, then chunk() halves it again: wrong numbers, no error."""

    def __init__(self, width: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.gate_up, self.down = nn.Linear(width, 2 * hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class FusedMLPModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(FusedMLP(), FusedMLP())
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.blocks(x))


def _hf(family: str, **extra: Any) -> nn.Module:
    """A tiny randomly initialised transformers causal LM of ``family`` (2 layers, width 32)."""
    import transformers

    config = getattr(transformers, f"{family}Config")(
        vocab_size=sm.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        max_position_embeddings=4 * sm.SEQ_LEN, use_cache=False, bos_token_id=None, eos_token_id=None, **extra)
    return getattr(transformers, f"{family}ForCausalLM")(config)


def _without_plan(model: nn.Module) -> nn.Module:
    model.config.base_model_tp_plan = None
    for module in model.modules():  # transformers copies the plan onto the model and its base model
        if getattr(module, "_tp_plan", None):
            module._tp_plan = None
    return model


def grad_norm(result: Any, setup: sm.Setup, batch: Any) -> float:
    """The whole gradient's norm after one forward and backward on ``batch`` (no step; the gradients are cleared)."""
    with step_context(result.model):
        data = result.prepare_input(batch, result.args.device)
        plain(setup.loss(data, call_model(result.model, data, setup.input_format))).backward()
    norm = float(result.optim.clip_grad_norm_(float("inf")))
    result.optim.zero_grad(set_to_none=True)
    return norm


def reference_grad_norm(model: nn.Module, setup: sm.Setup) -> float:
    """Single-process fp32: the same on the first global batch."""
    batch = next(iter(torch.utils.data.DataLoader(repeated_batch(setup.dataset()), batch_size=GLOBAL_BATCH)))
    setup.loss(batch, call_model(model, batch, setup.input_format)).backward()
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))


def logits_loss(data: dict[str, torch.Tensor], output: Any) -> torch.Tensor:
    """The user's own next-token cross-entropy on output.logits (sharded over the vocabulary under loss_parallel)."""
    return nn.functional.cross_entropy(output.logits[:, :-1].flatten(0, 1), data["labels"][:, 1:].flatten())


def _with_vocab(model: nn.Module, vocab: int) -> nn.Module:
    model.resize_token_embeddings(vocab)
    return model


def repeated_batch(dataset: Any) -> Subset:
    """The first global batch, once per step: memorised, so the loss falls far more than the tolerance."""
    return Subset(dataset, [i % GLOBAL_BATCH for i in range((STEPS + 1) * GLOBAL_BATCH)])


def make(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name].make()


def _split_over_tensor(param: torch.Tensor) -> bool:
    """A DTensor sharded along the 'tensor' mesh dimension (a row-parallel bias is replicated there)."""
    names = param.device_mesh.mesh_dim_names or () if isinstance(param, DTensor) else ()
    return "tensor" in names and param.placements[names.index("tensor")].is_shard()


def split_fraction(model: Any) -> dict[str, Any]:
    """Parameters held on this rank, from local tensors: those split over the tensor dimension, and all."""
    split_local = split_global = local = whole = 0
    for param in model.parameters():
        here = param.to_local().numel() if isinstance(param, DTensor) else param.numel()
        local, whole = local + here, whole + param.numel()
        if _split_over_tensor(param):
            split_local, split_global = split_local + here, split_global + param.numel()
    entry = {"split_local": split_local, "split_global": split_global, "local": local, "whole": whole}
    if hasattr(model, "get_output_embeddings"):  # the LM head (split under loss_parallel; tied or not)
        weight = model.get_output_embeddings().weight
        entry.update(head_local=(weight.to_local() if isinstance(weight, DTensor) else weight).numel(),
                     head_global=weight.numel(), tied=weight is model.get_input_embeddings().weight)
    return entry


def _logits_layout(result: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The vocabulary width of the logits this rank holds, and what a forward with gradients outside train_step
    (outside loss_parallel()) gives."""
    data = result.prepare_input(batch, result.args.device)
    with torch.no_grad():
        logits = result.model(**data).logits
    local = logits.to_local() if isinstance(logits, DTensor) else logits
    found: dict[str, Any] = {"logits_local_vocab": local.shape[-1],
                             "eval_logits_vocab": eval_logits(result, batch).shape[-1]}
    try:
        result.model(**data)
        found["outside_step"] = "ran"
    except atorch.SetupError as exc:
        found["outside_step"] = str(exc)
    # The collectives of one forward, loss and backward (as train_step runs them), by name.
    comms = CommDebugMode()
    with comms, step_context(result.model):
        result.loss_func(data, result.model(**data)).backward()
    found["collectives"] = {str(op).rpartition(".")[2]: n for op, n in comms.get_comm_counts().items()}
    return found


def accumulated_losses(result: Any, setup: sm.Setup, micro: int) -> list[float]:
    """Like losses_of, each step's batch split into ``micro`` micro-batches (train_step sets the boundary)."""
    batches = iter(result.dataloader)
    losses = []
    for _ in range(STEPS):
        batch = next(batches)
        size = len(batch["input_ids"]) // micro
        parts = [{k: v[i * size:(i + 1) * size] for k, v in batch.items()} for i in range(micro)]
        losses.append(mean_over_ranks(train_step(result, parts)))
    with torch.no_grad():
        data = result.prepare_input(next(batches), result.args.device)
        losses.append(mean_over_ranks(setup.loss(data, call_model(result.model, data, setup.input_format))))
    return losses


class TensorParallelLog(logging.Handler):
    """The tensor_parallel lines of atorch's log (rank 0 logs at INFO): plan source, additions, the build check."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("tensor_parallel:"):
            self.lines.append(record.getMessage())


def run_scenario(model_name: str, strategy: list[Any], micro: int = 1) -> dict[str, Any]:
    setup = MODELS[model_name]
    model, dataset = make(model_name), repeated_batch(setup.dataset())
    log = TensorParallelLog()
    logging.getLogger("atorch").addHandler(log)
    try:
        _, result, _ = atorch.auto_accelerate(
            model, torch.optim.SGD, dataset, setup.loss, model_input_format=setup.input_format,
            optim_args={"lr": LR}, dataloader_args={"batch_size": GLOBAL_BATCH, "shuffle": False},
            load_strategy=strategy,
        )
    except atorch.StrategyError as exc:
        return {"refused": list(exc.problems)}
    finally:
        logging.getLogger("atorch").removeHandler(log)
    entry: dict[str, Any] = {"log": log.lines, "memory": split_fraction(result.model),
                             "dp_size": result.args.data_parallel_size,
                             "split": [n for n, p in result.model.named_parameters() if _split_over_tensor(p)]}
    first = next(iter(result.dataloader))
    # The batch this rank sees, to show that the ranks of one tensor group see the same batch.
    tokens = first["input_ids"] if isinstance(first, dict) else first[0]
    seen = torch.tensor([float(tokens.double().sum())])
    gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, seen)
    entry["batch_sums"] = [g.item() for g in gathered]
    if micro == 1 and result.args.data_parallel_size == 1 and "amp_native" not in str(strategy):
        entry["grad_norm"] = grad_norm(result, setup, first)
    entry["losses"] = (losses_of(result, STEPS, setup.loss, setup.input_format) if micro == 1
                       else accumulated_losses(result, setup, micro))
    if model_name.split("_")[0] in ("llama", "gpt2"):  # the decoder LMs loss_parallel is tested on
        entry.update(_logits_layout(result, first))
    result.close()
    return entry


def run_pipelined(model_name: str, strategy: list[Any]) -> dict[str, Any]:
    """STEPS training steps under a pipeline layout (the last stage's loss, the same on every rank)."""
    setup = MODELS[model_name]
    # Every rank's build-check lines (the other ranks log at WARNING only): each stage's check must run.
    log, check_logger = TensorParallelLog(), logging.getLogger("atorch.opt_lib.tp_check")
    level = check_logger.level
    check_logger.setLevel(logging.INFO)
    check_logger.addHandler(log)
    try:
        _, result, _ = atorch.auto_accelerate(
            make(model_name), torch.optim.SGD, repeated_batch(setup.dataset()), setup.loss,
            model_input_format=setup.input_format, optim_args={"lr": LR},
            dataloader_args={"batch_size": GLOBAL_BATCH, "shuffle": False}, load_strategy=strategy,
        )
    except atorch.StrategyError as exc:
        return {"refused": list(exc.problems)}
    finally:
        check_logger.removeHandler(log)
        check_logger.setLevel(level)
    checked = gathered(float(any("build checked on one sample" in line for line in log.lines)))
    # What this rank's non-last stages hand the schedule to send (sequence_parallel: the local sequence shard).
    sent: set[tuple[int, ...]] = set()
    hooks = [stage.register_forward_hook(lambda m, a, out: sent.add(tuple(out.shape)))
             for stage in result.model.stages if not getattr(stage, "last", True)]
    batches = iter(result.dataloader)
    norms: list[float] = []  # the first step's, after the tied gradients are summed, before the update
    hook = result.optim.optimizer.register_step_pre_hook(lambda *_: norms.append(pipelined_grad_norm(result.model)))
    entry = {"losses": [train_step(result, [next(batches)]).item() for _ in range(STEPS)],
             "split": [n for n, p in result.model.named_parameters() if _split_over_tensor(p)], "checked": checked}
    hook.remove()
    for handle in hooks:
        handle.remove()
    entry["grad_norm"], entry["sent"] = norms[0], sorted(sent)
    result.close()
    return entry



def run_checkpoint(model_name: str, strategy: list[Any]) -> dict[str, Any]:
    """Two steps under ``strategy``, saved; loaded under data 2 with fsdp from other weights: the weights it holds
    (the consolidated export) must equal the saved ones, and those load into the plain model in one process."""
    import tempfile

    setup = MODELS[model_name]

    def build(layout: list[Any], seed: int) -> Any:
        torch.manual_seed(seed)
        return atorch.auto_accelerate(
            setup.make(), torch.optim.SGD, repeated_batch(setup.dataset()), setup.loss,
            model_input_format=setup.input_format, optim_args={"lr": LR},
            dataloader_args={"batch_size": GLOBAL_BATCH, "shuffle": False}, load_strategy=layout)[1]

    holder = [tempfile.mkdtemp(prefix="atorch-tp-layouts-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder)
    root = holder[0]
    result = build(strategy, seed=0)
    batches = iter(result.dataloader)
    for _ in range(2):
        train_step(result, [next(batches)])
    atorch.save_checkpoint(f"{root}/ckpt", result, step=2)
    atorch.export_consolidated(f"{root}/saved.pt", result)
    result.close()
    other = build([("parallel_mode", {"dims": [["data", 2]]}), "fsdp"], seed=5)
    atorch.load_checkpoint(f"{root}/ckpt", other)
    atorch.export_consolidated(f"{root}/loaded.pt", other)
    other.close()
    if dist.get_rank() != 0:
        return {}
    saved, loaded = (torch.load(f"{root}/{n}.pt", weights_only=True) for n in ("saved", "loaded"))
    plain = make(model_name)
    missing = plain.load_state_dict(saved, strict=True)
    return {"keys": len(saved), "same_keys": sorted(saved) == sorted(loaded),
            "differ": sorted(k for k in saved if k in loaded and not torch.equal(saved[k], loaded[k])),
            "moved": sum(not torch.equal(saved[k], v) for k, v in make(model_name).state_dict().items() if k in saved),
            "strict_load": not missing.missing_keys and not missing.unexpected_keys}


def pipelined_grad_norm(model: nn.Module) -> float:
    """The whole model's gradient norm under tensor 2 × pipeline 2 (a collective over all ranks): a split
    parameter adds its local shard's squares on both ranks of its tensor group; a whole one (replicated over the
    group) is counted by the group's first rank only (tensor is listed first: adjacent ranks, even first); a tied
    weight held by both stages once, by the lowest counting rank that holds it (its copies' gradients are summed)."""
    first_of_group = dist.get_rank() % 2 == 0
    params = {name: param for stage in model.stages for name, param in stage.module.named_parameters()}
    skip: set[str] = set()
    for group in getattr(model, "tied", ()):
        held = [name for name in group if name in params]
        holders = gathered(1.0 if held and first_of_group else 0.0)
        if held and (not first_of_group or holders.index(1.0) != dist.get_rank()):
            skip.update(held)
    total = torch.zeros((), dtype=torch.float64)
    for name, param in params.items():
        if param.grad is None:
            continue
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            # sequence_parallel: a norm's weight gradient from the sequence shards, summed by DTensor where used
            # (a collective of the tensor group, whose ranks hold the same parameters in the same order)
            grad = grad.redistribute(grad.device_mesh, [Replicate() if p.is_partial() else p for p in grad.placements])
        if name in skip or not (first_of_group or _split_over_tensor(param)):
            continue
        grad = grad.to_local() if isinstance(grad, DTensor) else grad
        total += grad.double().pow(2).sum()
    dist.all_reduce(total)
    return total.sqrt().item()


def main() -> None:
    pipelined = sys.argv[1] in PIPELINED
    scenarios = (PIPELINED if pipelined else {**GROUPS, **LAYOUTS})[sys.argv[1]]
    if sys.argv[2:]:  # optional scenario names, for a quick run by hand
        scenarios = {name: scenario for name, scenario in scenarios.items() if name in sys.argv[2:]}
    report: dict[str, Any] = {"reference": {}, "reference_grad_norm": {}, "scenarios": run_each({
        name: functools.partial(run_pipelined, model, strategy) if pipelined
        else functools.partial(run_checkpoint, model, strategy) if name in CHECKPOINTS
        else functools.partial(run_scenario, model, strategy, MICRO_BATCHES.get(name, 1))
        for name, (model, strategy) in scenarios.items()
    })}
    if dist.get_rank() == 0:
        for model_name in sorted({m for name, (m, _) in scenarios.items()
                                  if not name.startswith(("refused/", "checkpoint/"))}):
            setup = MODELS[model_name]
            report["reference"][model_name] = reference_losses(
                make(model_name), repeated_batch(setup.dataset()), setup.loss, setup.input_format,
                lambda p: torch.optim.SGD(p, lr=LR), STEPS, GLOBAL_BATCH,
            )
            report["reference_grad_norm"][model_name] = reference_grad_norm(make(model_name), setup)
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
