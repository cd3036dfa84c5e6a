"""FSDP2 peaks of five transformers families that no sweep, test or fit uses, against the cost model's root-unit term:
as it is (the root's gathered parameters + its head's gradients, ``head_param_bytes``) and as it was (2 x the root).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/memory_probe.py \
        mistral,stablelm,qwen3_moe,starcoder2,bert

Prints one ROW per FSDP candidate at data 2: the family, whether its head is tied, head / root, and the predicted peak
over the measured one, minus 1, before and after. Memory only (counted bytes): the machine's load does not move it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import search as bench  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from atorch.distributed import DistEnv  # noqa: E402
from atorch.dryrun.runner import DryRunSession  # noqa: E402
from atorch.strategy_search.costing.analyser import analyse  # noqa: E402
from atorch.strategy_search.costing.cost_model import predict  # noqa: E402
from atorch.strategy_search.costing.hardware import HardwareProfile  # noqa: E402
from atorch.strategy_search.search.automatic import optimizer_state_factor, sample_batch  # noqa: E402
from atorch.strategy_search.search.space import SearchSpace  # noqa: E402

SMALL = {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "max_position_embeddings": 64}


def mistral() -> dict[str, Any]:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=None, use_cache=False)
    return bench.tokens(MistralForCausalLM(config), 1024, 64)


def stablelm() -> dict[str, Any]:
    from transformers import StableLmConfig, StableLmForCausalLM

    torch.manual_seed(0)
    return bench.tokens(StableLmForCausalLM(StableLmConfig(**SMALL, num_key_value_heads=4, use_cache=False)), 1024, 64)


def qwen3_moe() -> dict[str, Any]:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(**SMALL, moe_intermediate_size=32, num_key_value_heads=2, num_experts=8,
                            num_experts_per_tok=2, use_cache=False)
    return bench.tokens(Qwen3MoeForCausalLM(config), 1024, 64)


def starcoder2() -> dict[str, Any]:
    from transformers import Starcoder2Config, Starcoder2ForCausalLM

    torch.manual_seed(0)
    config = Starcoder2Config(**SMALL, num_key_value_heads=2, use_cache=False, residual_dropout=0.0,
                              embedding_dropout=0.0, attention_dropout=0.0)
    return bench.tokens(Starcoder2ForCausalLM(config), 1024, 64)


def bert() -> dict[str, Any]:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(**SMALL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return bench.tokens(BertForMaskedLM(config), 1024, 64)


MODELS = {"mistral": mistral, "stablelm": stablelm, "qwen3_moe": qwen3_moe, "starcoder2": starcoder2, "bert": bert}
FSDP_FAMILIES = (["fsdp"], ["checkpoint", "fsdp"], ["amp_native", "fsdp"], ["amp_native", "checkpoint", "fsdp"])
GLOBAL_BATCH = 4


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    env = DistEnv(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    profile = HardwareProfile.model_validate(
        json.loads((HERE / "data" / "profile_cpu_2ranks_2026-11-25b.json").read_text()))
    for name in sys.argv[1].split(","):
        parts = MODELS[name]()
        model = parts["model"]
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        setup = bench.user_setup(parts, GLOBAL_BATCH)
        stats = analyse(model, sample_batch(setup, env, GLOBAL_BATCH // 2), parts["model_input_format"],
                        parts["loss_func"])
        root = stats.param_bytes - sum(b.param_bytes_total for b in stats.blocks)
        as_was = stats.model_copy(update={"head_param_bytes": root})  # root + root: the former 2 x root
        cands = [c for c in SearchSpace(model, 2, GLOBAL_BATCH).enumerate()
                 if [n for n, _ in c.strategy.to_list()][1:] in FSDP_FAMILIES and c.strategy.layout(2).data_size == 2]
        session = DryRunSession(setup, env, warmup=bench.WARMUP, steps=bench.STEPS, rejoin_timeout_s=600,
                                min_measure_s=0.2)
        session.heap.settle()
        factor = optimizer_state_factor(setup)
        for cand in cands:
            row = bench.run_candidate(session, env, cand, 300)
            layout = cand.strategy.layout(2)
            now = predict(stats, cand.strategy, layout, profile, GLOBAL_BATCH, cand.micro_batches,
                          optimizer_state_factor=factor).memory.peak
            was = predict(as_was, cand.strategy, layout, profile, GLOBAL_BATCH, cand.micro_batches,
                          optimizer_state_factor=factor).memory.peak
            if rank == 0 and row["peak"]:
                print(f"ROW {name} tied={tied} head/root={stats.head_param_bytes / root:.2f} "
                      f"root/total={root / stats.param_bytes:.2f} {bench.describe(cand, 2)} status={row['status']} "
                      f"before {was / row['peak'] - 1:+.3f} after {now / row['peak'] - 1:+.3f}", flush=True)
        session.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
