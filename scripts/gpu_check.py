"""The CUDA paths on one GPU (NCCL, one process): strategies train, fp16 loss scaling, fp8's gate, the
dry-run's CUDA peak against the cost model, and a short automatic search. Prints one JSON report.

    torchrun --standalone --nproc_per_node 1 scripts/gpu_check.py

Runs on the machine's torch as installed (no transformers needed): the models are tests/toy_models'
MLP and a small BatchNorm CNN. Every case is reported (ok / failed with the error), none stops the rest.

The multi-GPU methods (``MULTI``: expert_parallel, sequence parallel across pipeline stages, context_parallel alone
and beside tensor_parallel, the DualPipeV schedule) run where the machine has enough GPUs (and transformers is
installed): the script launches each with torchrun on that many GPUs (``--multi NAME``), trains a small transformers
model two steps under NCCL and reports the losses against one process on one GPU; with too few GPUs the entry says
it is skipped and why. On a machine without a CUDA GPU every case is reported skipped, with that reason.

Four cases measure model families at a GPU's scale (transformers needed): ``families_vs_cost_model`` (the cost
model's step time and peak against dry-runs), ``families_search`` (automatic mode's pick in the user's loop against
the plausible strategies, interleaved), ``families_budget_search`` (the same under a memory limit: the trace's cost
against the dry-runs', out-of-memory dry-runs, the pick against the plausible strategies that fit) and
``repeated_dry_runs`` (one candidate dry-run again and again: whether a first run or one after idling measures
slower). ``--only a,b`` runs the named cases alone, in that order; ``--out FILE`` rewrites the report there after
every case.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
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


# ----- held-out families at a GPU's scale (bench/held_out.md: no fit used them) --------------------------
def _tokens(model: nn.Module, vocab: int, seq: int, samples: int) -> dict[str, Any]:
    ids = torch.randint(0, vocab, (samples, seq), generator=torch.Generator().manual_seed(1))
    return {"model": model, "dataset": [{"input_ids": t, "labels": t} for t in ids]}


def _family(name: str, scale: int) -> dict[str, Any]:
    """``name`` at a GPU's scale (``scale`` 1; 0: a CPU-sized copy for checking the script), random weights."""
    import transformers as tf

    torch.manual_seed(0)
    seq, samples = (512, 64) if scale else (32, 8)
    if name == "gpt2":  # the family the cost model's constants were tuned on: in sample
        return _tokens(tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=8192, n_positions=seq, n_embd=768 if scale else 64, n_layer=8 if scale else 2,
            n_head=12 if scale else 4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)), 8192, seq,
            samples)
    if name == "falcon":  # held out: parallel attention and MLP, multi-query attention
        return _tokens(tf.FalconForCausalLM(tf.FalconConfig(
            vocab_size=8192, hidden_size=1024 if scale else 64, num_hidden_layers=8 if scale else 2,
            num_attention_heads=16 if scale else 4, new_decoder_architecture=False, multi_query=True,
            parallel_attn=True, bias=False, hidden_dropout=0.0, attention_dropout=0.0, use_cache=False)), 8192, seq,
            samples)
    if name == "olmoe":  # held out: mixture of experts, 16 experts, top-2
        return _tokens(tf.OlmoeForCausalLM(tf.OlmoeConfig(
            vocab_size=8192, hidden_size=512 if scale else 64, intermediate_size=512 if scale else 64,
            num_hidden_layers=4 if scale else 2, num_attention_heads=8 if scale else 4,
            num_key_value_heads=8 if scale else 4, num_experts=16 if scale else 4, num_experts_per_tok=2,
            max_position_embeddings=seq, use_cache=False)), 8192, seq, samples)
    if name == "regnet":  # held out: grouped convolutions, squeeze-and-excitation, batch norm
        config = tf.RegNetConfig(num_channels=3, embedding_size=32, hidden_sizes=[64, 128, 256, 512] if scale else
                                 [16, 32, 64, 128], depths=[1, 2, 4, 1] if scale else [1, 1, 1, 1],
                                 groups_width=16 if scale else 8, num_labels=100)
        size = 128 if scale else 32
        g = torch.Generator().manual_seed(1)
        images = torch.randn(samples, 3, size, size, generator=g)
        labels = torch.randint(0, 100, (samples,), generator=g)
        return {"model": tf.RegNetForImageClassification(config),
                "dataset": [{"pixel_values": x, "labels": y} for x, y in zip(images, labels, strict=True)]}
    raise ValueError(name)


def _hf_loss(data: Any, output: Any) -> torch.Tensor:
    return output.loss.float()


def _analysed_setup(parts: dict[str, Any], batch: int, device: torch.device) -> tuple[Any, Any]:
    """A family's ``UserSetup`` (AdamW, the model's own loss) and the analysis of one batch on ``device``."""
    from atorch.model_context import UserSetup
    from atorch.strategy_search.costing.analyser import analyse

    sample = next(iter(torch.utils.data.DataLoader(parts["dataset"], batch_size=batch)))
    stats = analyse(parts["model"], {k: v.to(device) for k, v in sample.items()}, "unpack_dict", _hf_loss)
    setup = UserSetup(model=parts["model"], optim_func=torch.optim.AdamW, dataset=parts["dataset"],
                      loss_func=_hf_loss, model_input_format="unpack_dict", optim_args={"lr": 1e-4},
                      dataloader_args={"batch_size": batch, "shuffle": False})
    return setup, stats


FAMILIES = ("gpt2", "falcon", "olmoe", "regnet")
FAMILY_STRATEGIES = (["parallel_mode"], ["parallel_mode", ("amp_native", {"dtype": "bf16"})],
                     ["parallel_mode", ("amp_native", {"dtype": "bf16"}), "checkpoint"])


def families_vs_cost_model(scale: int = 1, batch: int = 8) -> dict[str, Any]:
    """Predicted against measured step time and peak on this GPU, for a tuned family (gpt2) and three held-out
    ones (a parallel-attention decoder, a mixture of experts, a grouped-convolution classifier), each in fp32,
    amp bf16 and amp bf16 with checkpointing: what the search ranks GPU candidates by."""
    from atorch.dryrun import dry_run
    from atorch.strategy import Strategy
    from atorch.strategy_search.costing.cost_model import predict
    from atorch.strategy_search.costing.hardware import measure_profile

    env = init_distributed()
    profile = measure_profile()
    out: dict[str, Any] = {"profile": {"matmul_tflops": profile.matmul_tflops, "device": profile.device_name}}
    for name in FAMILIES:
        parts = _family(name, scale)
        setup, stats = _analysed_setup(parts, batch, env.device)
        rows = []
        for items in FAMILY_STRATEGIES:
            strategy = Strategy.load(items)
            measured = dry_run(setup, env, strategy, warmup=2, steps=5)  # (a dry-run builds a copy of the model)
            pred = predict(stats, strategy, strategy.layout(1), profile, batch)
            rows.append({"strategy": str(strategy), "status": measured.status, "reason": measured.reason,
                         "measured_mib": round((measured.peak_bytes or 0) / 2**20, 1),
                         "predicted_mib": round(pred.memory.peak / 2**20, 1),
                         "measured_s": measured.step_time_s, "predicted_s": pred.time.step})
        out[name] = {"params_m": round(sum(p.numel() for p in parts["model"].parameters()) / 1e6, 2),
                     "analysed_on": stats.measured_on, "experts": stats.experts,
                     "active_param_m": round((stats.param_count - stats.expert_param_count * (
                         1 - stats.experts_per_token / stats.experts) if stats.experts else stats.param_count) / 1e6,
                         2),
                     "rows": rows}
    return out


PLAUSIBLE = (["parallel_mode"], ["parallel_mode", ("amp_native", {"dtype": "bf16"})],
             ["parallel_mode", ("amp_native", {"dtype": "fp16"})], ["parallel_mode", ("half", {"dtype": "bf16"})],
             ["parallel_mode", "checkpoint"], ["parallel_mode", ("amp_native", {"dtype": "bf16"}), "checkpoint"])


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _loop_rate(result: Any, steps: int) -> float:
    """Samples per second of the user's loop under ``result`` (the documented ``train_step``), ``steps`` steps."""
    accumulate = max(1, int(getattr(result.args, "gradient_accumulation_steps", 1) or 1))
    samples = result.dataloader.batch_size * accumulate

    def batches() -> Any:
        while True:
            yield from result.dataloader

    source = batches()
    atorch.train_step(result, [next(source) for _ in range(accumulate)])  # warm-up
    _sync()
    begin = time.perf_counter()
    for _ in range(steps):
        atorch.train_step(result, [next(source) for _ in range(accumulate)])
    _sync()
    return samples * steps / (time.perf_counter() - begin)


def repeated_dry_runs(scale: int = 1, batch: int = 8, runs: int = 4, idle_s: float = 3.0) -> dict[str, Any]:
    """One candidate dry-run ``runs`` times in a row right after the model's analysis (the GPU idle meanwhile), then
    twice after ``idle_s`` of idling: whether a search's first dry-run (or one after a pause) measures slower than
    the same candidate's later ones, and by how much (median step of each run)."""
    from atorch.dryrun.runner import DryRunSession
    from atorch.strategy import Strategy

    env = init_distributed()

    out: dict[str, Any] = {}
    for name in ("regnet", "gpt2"):
        for items in (["parallel_mode"], ["parallel_mode", ("amp_native", {"dtype": "bf16"})]):
            setup, _ = _analysed_setup(_family(name, scale), batch, env.device)  # the analysis: a search's first phase
            session = DryRunSession(setup, env, warmup=2, steps=5)
            steps = []
            for run in range(runs + 2):
                if run == runs:
                    time.sleep(idle_s)
                steps.append(session.run(Strategy.load(items)).step_time_s)
            out[f"{name} {'amp bf16' if len(items) > 1 else 'fp32'}"] = {
                "step_s": [round(v or 0.0, 5) for v in steps],
                "first_over_rest": round(steps[0] / statistics.median(steps[1:runs]), 2),
                "after_idle_over_rest": round(steps[runs] / statistics.median(steps[1:runs]), 2)}
    return out


def _best_default(median: dict[str, float]) -> str:
    """The fastest plausible strategy that the default search may pick: ``half`` (16-bit weights and optimizer
    state) only enters it with ``precision="low"``, so it is reported beside the best, not as it."""
    return max((key for key in median if key not in ("pick", str(PLAUSIBLE[3]))), key=median.__getitem__)


def families_search(scale: int = 1, batch: int = 8, rounds: int = 3, steps: int = 6) -> dict[str, Any]:
    """Automatic mode on each family of ``families_vs_cost_model`` on this GPU: its pick's rate in the user's loop
    against the best of the plausible one-GPU strategies of its default precision (fp32, amp, checkpointing),
    measured in interleaved rounds (medians), ``half`` beside it, and the search's wall time against measuring
    those candidates once."""
    def accelerate(name: str, strategy: Any, **kwargs: Any) -> tuple[Any, Any]:
        parts = _family(name, scale)
        _, result, chosen = atorch.auto_accelerate(
            parts["model"], torch.optim.AdamW, parts["dataset"], _hf_loss, optim_args={"lr": 1e-4},
            model_input_format="unpack_dict", dataloader_args={"batch_size": batch, "shuffle": False},
            load_strategy=strategy, **kwargs)
        return result, chosen

    out: dict[str, Any] = {}
    for name in FAMILIES:
        begin = time.perf_counter()
        picked, chosen = accelerate(name, None, search={"force": True})
        search_s = time.perf_counter() - begin
        runs = {"pick": picked}
        for items in PLAUSIBLE:
            begin = time.perf_counter()
            runs[str(items)], _ = accelerate(name, items)
            runs[str(items)].build_s = time.perf_counter() - begin
        rates: dict[str, list[float]] = {key: [] for key in runs}
        once_s = 0.0
        for _ in range(rounds):
            for key, result in runs.items():
                begin = time.perf_counter()
                rates[key].append(_loop_rate(result, steps))
                once_s += (time.perf_counter() - begin) / rounds if key != "pick" else 0.0
        once_s += sum(r.build_s for key, r in runs.items() if key != "pick")
        median = {key: statistics.median(v) for key, v in rates.items()}
        best = _best_default(median)
        for result in runs.values():
            result.close()
        out[name] = {"pick": str(chosen), "accumulate": int(getattr(picked.args, "gradient_accumulation_steps", 1)),
                     "samples_per_s": {k: round(v, 1) for k, v in median.items()}, "best": best,
                     "pick_over_best": round(median["pick"] / max(median[best], median["pick"]), 3),
                     "half_over_best": round(median[str(PLAUSIBLE[3])] / median[best], 3),
                     "search_s": round(search_s, 1), "measuring_once_s": round(once_s, 1),
                     "search_over_measuring": round(search_s / once_s, 2)}
    return out


def _built_alone(parts: dict[str, Any], batch: int, steps: int, strategy: Any, **kwargs: Any) -> dict[str, Any]:
    """``auto_accelerate`` with ``strategy`` (None: the search) and what it allocates: its peak in the user's loop over
    what was allocated before its build, its median loop rate over 3 measures of ``steps`` steps, its build time."""
    _sync()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    begin = time.perf_counter()
    _, result, chosen = atorch.auto_accelerate(
        parts["model"], torch.optim.AdamW, parts["dataset"], _hf_loss, optim_args={"lr": 1e-4},
        model_input_format="unpack_dict", dataloader_args={"batch_size": batch, "shuffle": False},
        load_strategy=strategy, **kwargs)
    built_s = time.perf_counter() - begin
    rates = [_loop_rate(result, steps) for _ in range(3)]
    row = {"strategy": str(chosen), "samples_per_s": round(statistics.median(rates), 1),
           "peak_mib": round((torch.cuda.max_memory_allocated() - before) / 2**20, 1), "build_s": round(built_s, 1),
           "search": dict(getattr(result.args, "search", None) or {})}
    result.close()
    return row


def families_budget_search(scale: int = 1, batch: int = 8, share: float = 0.6, steps: int = 6) -> dict[str, Any]:
    """Automatic mode under a memory limit on this GPU (``share`` of plain fp32 DDP's dry-run peak): where the
    search's time went (the memory trace against its dry-runs), its out-of-memory dry-runs, and its pick against
    the plausible strategies that fit, each built alone and measured in the user's loop (its peak over what was
    allocated before its build, median of 3 rates of ``steps`` steps)."""
    import optuna

    from atorch.dryrun import dry_run
    from atorch.strategy import Strategy

    env = init_distributed()
    out: dict[str, Any] = {}
    for name in FAMILIES:
        parts = _family(name, scale)
        setup, _ = _analysed_setup(parts, batch, env.device)
        limit = int(share * (dry_run(setup, env, Strategy.load(["parallel_mode"]), warmup=1, steps=2).peak_bytes or 0))
        storage = f"sqlite:////tmp/gpu_check_budget_{name}_{os.getpid()}.db"

        pick = _built_alone(parts, batch, steps, None, memory_limit=limit, search={"force": True, "storage": storage})
        study = optuna.load_study(study_name=optuna.get_all_study_summaries(storage=storage)[0].study_name,
                                  storage=storage)
        runs = [t.user_attrs for t in study.get_trials() if "measured" in t.user_attrs
                and t.user_attrs.get("status") != "duplicate"] + study.user_attrs.get("confirmations", [])
        plausible = [_built_alone(parts, batch, steps, items) for items in PLAUSIBLE if items is not PLAUSIBLE[3]]
        fitting = [row for row in plausible if row["peak_mib"] * 2**20 <= limit]
        best = max(fitting, key=lambda row: row["samples_per_s"], default=None)
        search = pick.pop("search")
        out[name] = {"limit_mib": round(limit / 2**20, 1), "pick": pick, "dry_runs": len(runs),
                     "out_of_memory": sum(r.get("status") == "oom" for r in runs),
                     "phases_s": search.get("phases", {}), "stop_reason": search.get("stop_reason", ""),
                     "plausible": plausible, "best_fitting": None if best is None else best["strategy"],
                     "pick_over_best_fitting": None if best is None else round(
                         pick["samples_per_s"] / max(best["samples_per_s"], pick["samples_per_s"]), 3),
                     "pick_fits": pick["peak_mib"] * 2**20 <= limit}
    return out


# ----- multi-GPU methods: name -> (GPUs, strategy, model); each launched by torchrun on that many GPUs --------
MULTI: dict[str, tuple[int, list[Any], str]] = {
    "expert_parallel": (2, [("parallel_mode", {"dims": [["expert", 2], ["data", -1]]}), "expert_parallel"],
                        "mixtral"),
    # Megatron's layout at small scale: the stages exchange sequence shards
    "sequence_parallel_over_pipeline": (4, [("parallel_mode", {"dims": [["tensor", 2], ["pipeline", 2]]}),
                                            ("mixed_parallel", {"tensor": {"sequence_parallel": True},
                                                                "pipeline": {"schedule": "1f1b"}})], "llama"),
    "context_parallel": (2, [("parallel_mode", {"dims": [["context", 2], ["data", -1]]}), "context_parallel"],
                         "llama"),
    # Llama 3's long-context layout without its pipeline: each tensor rank gathers its heads' K/V (NCCL's
    # reduce-scatter in backward, where gloo runs an all-reduce)
    "tensor_context_parallel": (4, [("parallel_mode", {"dims": [["tensor", 2], ["context", 2], ["data", -1]]}),
                                    "context_parallel", ("tensor_parallel", {"sequence_parallel": True})], "llama"),
    # Llama 3's long-context layout with its pipeline: every stage splits the sequences, the last its loss
    "tensor_pipeline_context_parallel": (8, [("parallel_mode", {"dims": [["tensor", 2], ["pipeline", 2],
                                                                         ["context", 2]]}), "context_parallel",
                                             ("mixed_parallel", {"tensor": {"sequence_parallel": True},
                                                                 "pipeline": {"schedule": "1f1b"}})], "llama"),
    # experts beside tensor ranks: each tensor position's expert group dispatches its tokens
    "tensor_expert_parallel": (4, [("parallel_mode", {"dims": [["tensor", 2], ["expert", 2], ["data", -1]]}),
                                   "expert_parallel", "tensor_parallel"], "mixtral"),
    # with sequence parallel: each MoE layer gathers the sequence, computes it whole and returns the rank's shard
    "tensor_expert_sequence_parallel": (4, [("parallel_mode", {"dims": [["tensor", 2], ["expert", 2], ["data", -1]]}),
                                            "expert_parallel", ("tensor_parallel", {"sequence_parallel": True})],
                                        "mixtral"),
    # DeepSeek-V3's schedule in its folded form (torch's DualPipeV): two stages per GPU in a V, 4 micro-batches
    "pipeline_dualpipev": (2, [("parallel_mode", {"dims": [["pipeline", 2]]}),
                               ("pipeline_parallel", {"schedule": "dualpipev"})], "llama"),
    # DeepSeek-V3's layout at small scale: each stage's experts over its expert group
    "pipeline_expert_parallel": (4, [("parallel_mode", {"dims": [["pipeline", 2], ["expert", 2], ["data", -1]]}),
                                     "expert_parallel", ("pipeline_parallel", {"schedule": "1f1b"})], "mixtral"),
    # the router's load-balancing loss across stages: each stage sends its routing statistics on with its hidden
    # states, the last computes the loss of each of the schedule's 4 micro-batches
    "pipeline_router_loss": (2, [("parallel_mode", {"dims": [["pipeline", 2]]}),
                                 ("pipeline_parallel", {"schedule": "1f1b"})], "mixtral_router_loss"),
}
# The schedule's micro-batches per step where the loss is a per-batch statistic (the router's load-balancing loss):
# one process averages their losses; elsewhere the batch's mean loss is the same whatever the split.
MULTI_MICRO_BATCHES = {"mixtral_router_loss": 4}
MULTI_STEPS, MULTI_BATCH, MULTI_LR, MULTI_TOLERANCE = 2, 8, 0.1, 1e-4  # fp32, TF32 off: a few ulp of a loss of 5


def _transformers_model(kind: str) -> nn.Module:
    from shard_models import SEQ_LEN, VOCAB

    if kind.startswith("mixtral"):
        from transformers import MixtralConfig, MixtralForCausalLM

        # without the router's loss (mixtral) the loss is the batch's mean
        router_loss = kind == "mixtral_router_loss"
        return MixtralForCausalLM(MixtralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=SEQ_LEN, use_cache=False, output_router_logits=router_loss,
            router_aux_loss_coef=0.1))
    from shard_models import tiny_llama

    return tiny_llama(layers=4)  # 4 layers: one per stage and chunk under the pipeline


def multi_rank(name: str) -> None:
    """One rank of a MULTI case (under torchrun): train, and on rank 0 compare with one process on its GPU."""
    import copy

    import shard_models as sm
    from worker_common import repeated_batch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    _, strategy, kind = MULTI[name]
    torch.manual_seed(0)
    user = _transformers_model(kind)
    reference = copy.deepcopy(user)
    _, result, _ = atorch.auto_accelerate(
        user, torch.optim.SGD, repeated_batch(sm.TokenDataset()), sm.hf_loss, model_input_format="unpack_dict",
        optim_args={"lr": MULTI_LR}, dataloader_args={"batch_size": MULTI_BATCH, "shuffle": False},
        load_strategy=strategy)
    batches = iter(result.dataloader)
    losses = [float(atorch.train_step(result, [next(batches)])) for _ in range(MULTI_STEPS)]
    if torch.distributed.get_rank() == 0:  # the global batch is the same each step: one process trains on it
        device = result.args.device  # its GPU (a CPU run of one case, for checking the script: the CPU)
        model, ids = reference.to(device), torch.stack([sm.TokenDataset()[i]["input_ids"] for i in range(MULTI_BATCH)])
        optim, expected = torch.optim.SGD(model.parameters(), lr=MULTI_LR), []
        for _ in range(MULTI_STEPS):
            parts = ids.to(device).chunk(MULTI_MICRO_BATCHES.get(kind, 1))
            loss = torch.stack([model(input_ids=part, labels=part).loss for part in parts]).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            expected.append(loss.item())
        diff = max(abs(a - b) for a, b in zip(losses, expected, strict=True))
        print("MULTI " + json.dumps({"losses": losses, "one_process": expected, "loss_diff": diff,
                                     "matches": diff <= MULTI_TOLERANCE, "strategy": str(strategy)}), flush=True)
    result.close()


def multi_case(name: str, timeout: float = 600.0) -> dict[str, Any]:
    """Launch MULTI[name] on its GPUs, or say why it is skipped."""
    gpus = MULTI[name][0]
    if torch.cuda.device_count() < gpus:
        return {"skipped": f"needs {gpus} GPUs, this machine has {torch.cuda.device_count()}"}
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"skipped": "needs transformers (pip install transformers): the check trains a transformers model"}
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                     "TORCHELASTIC", "GROUP_", "ROLE_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "tests"), str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
                           __file__, "--multi", name], capture_output=True, text=True, timeout=timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("MULTI ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"torchrun exited {proc.returncode}: {(proc.stderr or proc.stdout)[-1200:]}")
    found = json.loads(lines[-1][len("MULTI "):])
    if not found["matches"]:
        raise AssertionError(f"losses differ from one process by {found['loss_diff']:.3g}: {found}")
    return found


def main() -> None:
    if "--multi" in sys.argv:  # one rank of a multi-GPU case (launched by multi_case)
        init_distributed()
        multi_rank(sys.argv[sys.argv.index("--multi") + 1])
        return
    init_distributed()
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    report: dict[str, Any] = {"torch": torch.__version__, "gpu": gpu, "backend": backend}
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
        "families_vs_cost_model": families_vs_cost_model,
        "families_search": families_search,
        "families_budget_search": families_budget_search,
        "repeated_dry_runs": repeated_dry_runs,
        **{name: (lambda name=name: multi_case(name)) for name in MULTI},
    }
    if "--only" in sys.argv:  # a subset of the cases, by name (comma-separated), run in that order
        keep = sys.argv[sys.argv.index("--only") + 1].split(",")
        cases = {name: cases[name] for name in keep if name in cases}
    # --out FILE: the report so far, rewritten after every case (a run cut short by a time limit keeps what ran)
    out = Path(sys.argv[sys.argv.index("--out") + 1]) if "--out" in sys.argv else None
    no_gpu = None if gpu else f"no CUDA GPU on this machine (torch {torch.__version__}): it checks the GPU paths"
    for name, case in cases.items():
        try:
            # (a MULTI case says how many GPUs it needs)
            found = {"skipped": no_gpu} if no_gpu and name not in MULTI else case()
            skipped = isinstance(found.get("skipped"), str)  # a case not run (a trained case's dict: methods skipped)
            report[name] = {"ok": None if skipped else True, **found}  # a skip: neither
        except Exception as exc:  # noqa: BLE001  (every case is reported)
            report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1500],
                            "where": traceback.format_exc()[-1500:]}
        if out is not None:
            out.write_text(json.dumps(report, default=str, indent=1))
    print("REPORT " + json.dumps(report, default=str), flush=True)


if __name__ == "__main__":
    main()
