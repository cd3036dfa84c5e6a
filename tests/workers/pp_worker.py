"""Pipeline parallel (alone, × data, × tensor) on real processes, against plain single-process fp32.

Usage: ``torchrun --nproc_per_node=N pp_worker.py GROUP`` (see GROUPS). Rank 0 also trains each model in
plain fp32 in one process on the whole global batch, and prints
``RESULT {"reference": {model: [...]}, "scenarios": {name: {...} or {"error": ...}}}``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # a worker process: CPU and gloo on every machine, like the rest of the suite
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import functools
import json
import sys
from typing import Any

import shard_models as sm
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Subset
from worker_common import GLOBAL_BATCH, LR, STEPS, gathered, reference_losses, run_each

import atorch
from atorch.optimizer import local_tensor
from atorch.training import train_step


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x)) + x


class SmallCNN(nn.Module):
    """A non-transformers CNN, its residual blocks in one nn.Sequential: 4 blocks make 4 stages of one
    block (interleaved_1f1b on 2 ranks), so a rank holds two StageModules and no two blocks in one stage."""

    def __init__(self, channels: int = 4, blocks: int = 4, classes: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*[ConvBlock(channels) for _ in range(blocks)])
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.blocks(torch.relu(self.stem(x))).mean(dim=(2, 3)))


def tiny_causal_lm(family: str, layers: int = 4) -> nn.Module:
    """A randomly initialised transformers causal LM of one family (width 32, 4 heads, vocabulary 128)."""
    import transformers

    common = {"vocab_size": sm.VOCAB, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64,
              "max_position_embeddings": sm.SEQ_LEN, "num_hidden_layers": layers}
    configs = {
        "OPT": {**common, "ffn_dim": 64, "word_embed_proj_dim": 32, "dropout": 0.0, "attention_dropout": 0.0},
        "GPTNeoX": {**common, "hidden_dropout": 0.0, "attention_dropout": 0.0},
        "Phi3": {**common, "num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
        "Gemma": {**common, "num_key_value_heads": 1, "head_dim": 8},  # one KV head: Gemma-2B's layout
        "Bloom": {"vocab_size": sm.VOCAB, "hidden_size": 32, "n_layer": layers, "n_head": 4},
        "Qwen2": {**common, "num_key_value_heads": 2, "use_cache": False},
    }
    config = getattr(transformers, f"{family}Config")(**configs[family])
    return getattr(transformers, f"{family}ForCausalLM")(config)


def tiny_bert_mlm(layers: int = 4) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(
        vocab_size=sm.VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=sm.SEQ_LEN, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def sequential_cnn() -> nn.Module:
    """The textbook pipeline: an nn.Sequential CNN, fed (image, label) batches (model_input_format
    'input_target': model(image), the whole batch to the loss)."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 8))


class ParallelBlocks(nn.Module):
    """Repeated blocks that are not a chain (each reads the input; their outputs are summed): no split at
    the blocks computes this model."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(sum(torch.tanh(block(x)) for block in self.blocks))


def lm(make: Any) -> sm.Setup:
    return sm.Setup(make, sm.TokenDataset, sm.hf_loss, "unpack_dict")


MODELS = {
    "cnn": sm.Setup(SmallCNN, sm.image_dataset, sm.class_loss, "unpack_sequence"),
    "gpt2": sm.Setup(functools.partial(sm.tiny_gpt2, layers=4), sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    "llama": sm.Setup(functools.partial(sm.tiny_llama, layers=4), sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    "gpt2_2layers": sm.Setup(sm.tiny_gpt2, sm.TokenDataset, sm.hf_loss, "unpack_dict"),
    # The families of the sweep (pipeline 2 on 2 processes).
    "bert_mlm": lm(tiny_bert_mlm),
    **{name: lm(functools.partial(tiny_causal_lm, family)) for name, family in (
        ("opt", "OPT"), ("gpt_neox", "GPTNeoX"), ("phi3", "Phi3"), ("gemma", "Gemma"), ("bloom", "Bloom"))},
    "sequential_cnn": sm.Setup(sequential_cnn, sm.image_dataset, sm.class_loss, "input_target"),
    "t5": sm.Setup(sm.tiny_t5, sm.Seq2SeqDataset, sm.hf_loss, "unpack_dict"),
    "bart": sm.Setup(sm.tiny_bart, sm.Seq2SeqDataset, sm.hf_loss, "unpack_dict"),
    # labels alone: each stage makes the decoder's inputs from them, as the model's forward does
    "t5_labels_only": sm.Setup(sm.tiny_t5, sm.Seq2SeqLabelsOnly, sm.hf_loss, "unpack_dict"),
    "bart_labels_only": sm.Setup(sm.tiny_bart, sm.Seq2SeqLabelsOnly, sm.hf_loss, "unpack_dict"),
    "parallel_blocks": sm.Setup(ParallelBlocks, sm.vector_dataset, sm.class_loss, "input_target"),
    # Built with a different seed on every rank: pipeline parallel must train rank 0's model.
    "qwen2_seeded_per_rank": lm(functools.partial(tiny_causal_lm, "Qwen2")),
}
SWEEP = ("gpt2", "llama", "bert_mlm", "opt", "gpt_neox", "phi3", "gemma", "bloom", "sequential_cnn", "t5", "bart",
         "t5_labels_only", "bart_labels_only")
SEEDED_PER_RANK = ("qwen2_seeded_per_rank",)


def mode(*dims: tuple[str, int]) -> tuple[str, dict[str, Any]]:
    return ("parallel_mode", {"dims": [list(d) for d in dims]})


PP2 = mode(("pipeline", 2), ("data", -1))
TPxPP = mode(("tensor", 2), ("data", -1), ("pipeline", 2))  # the first listed varies fastest


def pp(schedule: str, **extra: Any) -> tuple[str, dict[str, Any]]:
    return ("pipeline_parallel", {"schedule": schedule, **extra})


# launch group -> scenario name -> (model, load_strategy)
GROUPS: dict[str, dict[str, tuple[str, list[Any]]]] = {
    "pp2": {
        "gpt2/pp2[1f1b]": ("gpt2", [PP2, pp("1f1b")]),
        "llama/pp2[gpipe]": ("llama", [PP2, pp("gpipe")]),
        "gpt2/pp2[interleaved_1f1b]+checkpoint": ("gpt2", [PP2, pp("interleaved_1f1b"), "checkpoint"]),
        "cnn/pp2[interleaved_1f1b]+checkpoint": ("cnn", [PP2, pp("interleaved_1f1b"), "checkpoint"]),
        "gpt2/pp2+amp_native[bf16]": ("gpt2", [PP2, pp("1f1b"), ("amp_native", {"dtype": "bf16"})]),
        "forward/pp2": ("gpt2", [PP2, pp("1f1b")]),
        "refused/too few blocks": ("gpt2_2layers", [PP2, pp("interleaved_1f1b")]),
        "refused/micro-batches": ("gpt2", [PP2, pp("1f1b", micro_batches=3)]),
        "refused/t5 in 4 stages": ("t5", [PP2, pp("interleaved_1f1b")]),
        "refused/blocks not a chain": ("parallel_blocks", [PP2, pp("1f1b")]),
        **{f"sweep/{m}": (m, [PP2, pp("1f1b")]) for m in SWEEP if m not in ("gpt2", "llama")},
        "seeded/qwen2_seeded_per_rank": ("qwen2_seeded_per_rank", [PP2, pp("1f1b")]),
    },
    "pp2xdp2": {
        **{f"{m}/pp2xdp2[{s}]": (m, [PP2, pp(s)]) for m in ("gpt2", "llama")
           for s in ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv")},
        "gpt2/pp2xdp2[dualpipev]": ("gpt2", [PP2, pp("dualpipev")]),
        "gpt2/pp2xdp2+fsdp[1f1b]": ("gpt2", [PP2, pp("1f1b"), "fsdp"]),
        "gpt2/tp2xpp2": ("gpt2", [TPxPP, "module_replace", "tensor_parallel", pp("1f1b")]),
        "llama/tp2xpp2": ("llama", [TPxPP, "tensor_parallel", pp("1f1b")]),
    },
    # 8 processes, ATorch's mixed-parallel order (tensor first): tensor 2 × pipeline 2 × data 2 with fsdp,
    # as mixed_parallel in ATorch's config form (Llama's tensor 2 × pipeline 2 runs in the 4-process group).
    "tp2xpp2xdp2": {
        "gpt2/mixed_parallel[tp2xpp2xdp2]+fsdp": ("gpt2", [
            mode(("tensor", 2), ("pipeline", 2), ("data", 2)), "module_replace",
            ("mixed_parallel", {"pipe_config": {"pipe_schedule": "Interleaved1F1B"}}), "fsdp"]),
        # Megatron's layout: sequence parallel across the stages, zero1 (FSDP2 over the data dimension there)
        "llama/mixed_parallel[tp2xpp2xdp2]+sequence_parallel+zero1": ("llama", [
            mode(("tensor", 2), ("pipeline", 2), ("data", 2)),
            ("mixed_parallel", {"tensor": {"sequence_parallel": True}, "pipeline": {"schedule": "1f1b"}}), "zero1"]),
    },
}


def repeated_batch(dataset: Any) -> Subset:
    """The first global batch, once per step: memorised, so the loss falls far more than the tolerance."""
    return Subset(dataset, [i % GLOBAL_BATCH for i in range((STEPS + 1) * GLOBAL_BATCH)])


def make(name: str, rank: int = 0) -> nn.Module:
    """The model, seeded 0; a model of SEEDED_PER_RANK seeded with the rank (rank 0: as the reference)."""
    torch.manual_seed(rank if name in SEEDED_PER_RANK else 0)
    return MODELS[name].make()



def local_param_count(model: nn.Module) -> int:
    """Parameters held on this rank, from local tensors (tied copies within one module counted once)."""
    return sum(local_tensor(p).numel() for p in model.parameters())


def tied_checksum(model: nn.Module) -> float:
    """The sum of this rank's copies of GPT-2's tied wte/lm_head weight (0 if none)."""
    for name, param in model.named_parameters():
        if name.endswith("wte.weight") or name.endswith("lm_head.weight"):
            return float(local_tensor(param).detach().double().sum())
    return 0.0


def grad_norm(model: nn.Module) -> float:
    """The gradient norm of the whole model from the stages' gradients (collective over all ranks): a tied
    parameter counts once, on the lowest rank holding a copy (its copies' gradients are summed)."""
    params = {name: param for stage in model.stages for name, param in stage.module.named_parameters()}
    skip: set[str] = set()
    for group in getattr(model, "tied", ()):
        held = [name for name in group if name in params]
        holders = gathered(1.0 if held else 0.0)
        if held and holders.index(1.0) != dist.get_rank():
            skip.update(held)
    total = torch.zeros((), dtype=torch.float64)
    for name, param in params.items():
        if param.grad is not None and name not in skip:
            total += local_tensor(param.grad).double().pow(2).sum()
    dist.all_reduce(total)
    return total.sqrt().item()


def reference_grad_norm(model: nn.Module, dataset: Any, setup: sm.Setup) -> float:
    """The first step's gradient norm in plain single-process fp32 on the whole global batch."""
    from torch.utils.data import DataLoader

    from atorch.model_context import call_model

    batch = next(iter(DataLoader(dataset, batch_size=GLOBAL_BATCH)))
    setup.loss(batch, call_model(model, batch, setup.input_format)).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).double().norm().item()


def run_scenario(name: str, model_name: str, strategy: list[Any]) -> dict[str, Any]:
    setup = MODELS[model_name]
    model, dataset = make(model_name, int(os.environ["RANK"])), repeated_batch(setup.dataset())
    try:
        _, result, _ = atorch.auto_accelerate(
            model, torch.optim.SGD, dataset, setup.loss, model_input_format=setup.input_format,
            optim_args={"lr": LR}, dataloader_args={"batch_size": GLOBAL_BATCH, "shuffle": False},
            load_strategy=strategy,
        )
    except atorch.StrategyError as exc:
        return {"refused": list(exc.problems)}
    entry: dict[str, Any] = {"whole": sum(p.numel() for p in model.parameters()),
                             "built": gathered(float(sum(p.detach().double().sum() for p in model.parameters())))}
    if name.startswith("forward/"):
        batch = result.prepare_input(next(iter(result.dataloader)), result.args.device)
        try:
            result.model(**batch)
            entry["forward_error"] = None
        except atorch.SetupError as exc:
            entry["forward_error"] = str(exc)
        result.close()
        return entry
    entry["local"] = gathered(local_param_count(result.model))
    entry["first_stage"] = gathered(min(result.model.indices))  # the first stage each rank holds
    batches = iter(result.dataloader)
    norms: list[float] = []
    hook = result.optim.optimizer.register_step_pre_hook(lambda *_: norms.append(grad_norm(result.model)))
    entry["losses"] = [train_step(result, [next(batches)]).item() for _ in range(STEPS)]
    hook.remove()
    entry["grad_norm"] = norms[0]
    entry["loss_on_ranks"] = gathered(entry["losses"][-1])
    entry["tied"] = gathered(tied_checksum(result.model))
    result.close()
    return entry


def main() -> None:
    scenarios = GROUPS[sys.argv[1]]
    only = sys.argv[2:]  # optional scenario names, for a quick run by hand
    report: dict[str, Any] = {"reference": {}, "scenarios": run_each({
        name: functools.partial(run_scenario, name, model, strategy)
        for name, (model, strategy) in scenarios.items() if not only or name in only
    })}
    if dist.get_rank() == 0:
        for model_name in sorted({m for n, (m, _) in scenarios.items() if not n.startswith(("refused/", "forward/"))}):
            setup = MODELS[model_name]
            report["reference"][model_name] = reference_losses(
                make(model_name), repeated_batch(setup.dataset()), setup.loss, setup.input_format,
                lambda p: torch.optim.SGD(p, lr=LR), STEPS, GLOBAL_BATCH,
            )[:STEPS]
            report.setdefault("reference_grad_norm", {})[model_name] = reference_grad_norm(
                make(model_name), repeated_batch(setup.dataset()), setup)
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
