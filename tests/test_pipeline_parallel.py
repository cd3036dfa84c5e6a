"""pipeline_parallel: the balanced split, stage building, refusals, and training on real processes.

Three launches (gloo): pipeline 2 on 2 processes (with the family sweep: GPT-2, Llama, BERT-MLM, OPT,
GPT-NeoX, Phi-3, Gemma, Bloom, an nn.Sequential CNN, T5 and BART; a model seeded per rank);
pipeline 2 × data 2 (every schedule, and fsdp) and tensor 2 × pipeline 2 on 4; tensor 2 × pipeline 2 ×
data 2 with fsdp, and with sequence parallel and zero1 (Megatron's layout), on 8. Each scenario must train
like plain single-process fp32 training from rank 0's weights on the same global batches (losses; on
pipeline 2 alone also the first step's gradient norm); a stage must hold only its layers.
"""

from __future__ import annotations

from typing import Any

import pytest
import shard_models as sm
import torch
from launcher import HERE, run_json
from torch import nn
from workers.pp_worker import GROUPS

from atorch.opt_lib.pipeline_split import (
    StageModule,
    StandIn,
    balanced_split,
    build_stage,
    check_split,
    find_blocks,
    find_units,
    in_call_order,
    plan_stages,
)
from atorch.strategy import Strategy

WORKER = HERE / "workers" / "pp_worker.py"
# fp32: a pipeline computes the same operations as one process; only sums are taken in another order (the
# batch mean of the loss and the weight gradients accumulate over micro-batches and are then scaled by
# 1/m; data parallel adds the ranks' gradients; tensor parallel adds partial products). Each such sum
# differs by a few ulps (2^-23 ~ 1.2e-7 relative); over a few layers and 4 SGD steps (SGD does not
# amplify rounding as AdamW does near zero gradients) that stays near 1e-6 relative, so 1e-5 leaves margin.
FP32_TOL = (1e-5, 1e-6)
# bf16 autocast keeps 8 significant bits (2^-8 ~ 4e-3 per op), as in test_numerics.py.
BF16_TOL = (3e-2, 1e-3)
NPROC = {"pp2": 2, "pp2xdp2": 4, "tp2xpp2xdp2": 8}
# GPT-2's tied wte/lm_head weight (vocabulary 128 × width 32) is held by the first and the last stage.
# Families whose output head is tied to the input embedding: held by the first and the last stage.
TIED_COPY = {"gpt2": sm.VOCAB * 32, "bert_mlm": sm.VOCAB * 32, "opt": sm.VOCAB * 32, "bloom": sm.VOCAB * 32,
             "gemma": sm.VOCAB * 32, "t5": sm.VOCAB * 32, "bart": sm.VOCAB * 32, "t5_labels_only": sm.VOCAB * 32,
             "bart_labels_only": sm.VOCAB * 32}
REFUSED = {
    "refused/too few blocks": "the model has 2 repeated blocks, too few for 4 stages",
    "refused/micro-batches": "the per-rank batch of 8 samples does not split into 3 micro-batches",
    "refused/t5 in 4 stages": "an encoder-decoder model is split into 2 stages (its encoder and its decoder)",
    # Checked on one sample before anything is built: every rank refuses, none is left waiting for a stage.
    "refused/blocks not a chain": "the stages do not compute the model: on one sample their output differs",
}
# The gradient norm of the first step against the reference's (pipeline 2 alone: no data replicas). The same
# sums in another order, as for the losses; the norm adds the squares of all gradients (a few ulps each).
GRAD_NORM_RTOL = 1e-5


@pytest.fixture(scope="module", params=list(GROUPS))
def launch(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    group = request.param
    return group, run_json(WORKER, group, nproc=NPROC[group], timeout=420)


@pytest.mark.distributed
@pytest.mark.timeout(480)
def test_scenarios_train_like_the_reference(launch: tuple[str, dict[str, Any]]) -> None:
    group, report = launch
    nproc = NPROC[group]
    for scenario, (model_name, _) in GROUPS[group].items():
        entry = report["scenarios"][scenario]
        assert "error" not in entry, f"{scenario} failed: {entry['error']}"
        if scenario in REFUSED:
            assert any(REFUSED[scenario] in p for p in entry["refused"]), entry
            continue
        if scenario.startswith("forward/"):  # a hand-written forward points to train_step
            assert entry["forward_error"] and "atorch.train_step(result, [batch])" in entry["forward_error"], entry
            continue
        if scenario.startswith("seeded/"):  # each rank built its own model; all train rank 0's (the reference)
            assert len(set(entry["built"])) == nproc, entry["built"]
        reference = report["reference"][model_name]
        rtol, atol = BF16_TOL if "bf16" in scenario else FP32_TOL
        if "bf16" in scenario:  # bf16's tolerance is wider than 4 SGD steps move the loss: it must fall
            assert all(b < a for a, b in zip(entry["losses"], entry["losses"][1:], strict=False)), entry["losses"]
        else:  # the comparison can fail: training moves the loss by far more than the tolerance
            assert abs(reference[0] - reference[-1]) > 5 * (atol + rtol * max(map(abs, reference))), reference
        torch.testing.assert_close(
            torch.tensor(entry["losses"]), torch.tensor(reference), rtol=rtol, atol=atol,
            msg=lambda m, s=scenario, e=entry, r=reference: f"{s} losses {e['losses']} vs reference {r}: {m}",
        )
        if group == "pp2" and "bf16" not in scenario:
            want = report["reference_grad_norm"][model_name]
            assert abs(entry["grad_norm"] - want) <= GRAD_NORM_RTOL * want, (scenario, entry["grad_norm"], want)
        # train_step returns the same loss on every rank.
        assert len(set(entry["loss_on_ranks"])) == 1, entry["loss_on_ranks"]
        # Tied copies stay equal on every rank holding one (data ranks may hold different fsdp shards).
        if model_name == "gpt2" and "fsdp" not in scenario:
            assert len({t for t in entry["tied"] if t}) == 1, entry["tied"]  # 0: a rank holding no copy
        # Memory from local tensors: a stage holds only its layers (one rank of each pipeline position).
        local, whole, stages = entry["local"], entry["whole"], entry["first_stage"]
        assert len(local) == nproc and sorted(set(stages)) == [0, 1], stages
        first, last = local[stages.index(0)], local[stages.index(1)]
        assert max(local) < whole, (local, whole)
        if "fsdp" in scenario or "tp2" in scenario:  # sharded further: less than a whole stage each
            assert first + last < whole, (local, whole)
        else:  # the stages add up to the model, with the tied weight held twice
            assert first + last == whole + TIED_COPY.get(model_name, 0), (local, whole)


# ----- the split, in this process --------------------------------------------------------------------
def test_balanced_split_weighs_cost_not_layer_count() -> None:
    assert balanced_split([1, 1, 1, 1], 0, 0, 2) == [2, 2]
    assert balanced_split([1, 1, 1, 1], 0, 2, 2) == [3, 1]  # an expensive head leaves the last stage fewer blocks
    assert balanced_split([4, 1, 1, 1, 1], 0, 0, 2) == [1, 4]
    assert balanced_split([1, 1, 1, 1], 0, 0, 4) == [1, 1, 1, 1]


def test_plan_follows_parameter_cost() -> None:
    blocks_only = sm.SequentialViT(depth=4, classes=8)
    big_head = sm.SequentialViT(depth=4, classes=400)  # its head costs about 3 blocks
    for model, counts in ((blocks_only, [2, 2]), (big_head, [3, 1])):
        found, why = find_blocks(model)
        assert found is not None, why
        assert found.pre == ("embed",) and found.post == ("norm", "head")
        assert [len(o) for o in plan_stages(model, found, 2)] == counts


def test_gpt2_stages_keep_only_their_layers_and_the_users_names() -> None:
    model = sm.tiny_gpt2(layers=4)
    blocks, _ = find_blocks(model)
    assert blocks.container == "transformer.h" and blocks.pre == ("transformer.wte", "transformer.wpe",
                                                                   "transformer.drop")
    assert blocks.post == ("transformer.ln_f", "lm_head")
    first = build_stage(model, blocks, ("0", "1"), first=True, last=False)
    last = build_stage(model, blocks, ("2", "3"), first=False, last=True)
    whole = dict(model.named_parameters(remove_duplicate=False))
    for stage in (first, last):
        for name, param in stage.named_parameters(remove_duplicate=False):
            assert torch.equal(param, whole[name]), name  # the user's names and values
    names_first = {n for n, _ in first.named_parameters(remove_duplicate=False)}
    assert any(n.startswith("transformer.h.1.") for n in names_first)
    assert not any(n.startswith(("transformer.h.2.", "transformer.ln_f", "lm_head")) for n in names_first)
    assert isinstance(last.transformer.wte, StandIn) and isinstance(last.transformer.wpe, StandIn)
    assert not list(last.transformer.wte.parameters())  # a stand-in holds no weights
    assert isinstance(last.transformer.drop, nn.Dropout)  # no parameters: kept
    assert last.lm_head.weight.shape == (sm.VOCAB, 32)  # the tied head keeps its weight on the last stage
    # The stages run the model in two halves: the same logits as the whole model.
    ids = torch.randint(0, sm.VOCAB, (2, sm.SEQ_LEN))
    with torch.no_grad():
        hidden = StageModule(first, 0, True, False, None, "unpack_dict")(input_ids=ids)
        out = StageModule(last, 1, False, True, None, "unpack_dict")(hidden, input_ids=ids)
        assert torch.allclose(out, model(input_ids=ids).logits, atol=1e-5)


class _OPTLike(nn.Module):
    """Registers its final norm before its blocks (as OPT does) and calls its embedding with keywords only."""

    def __init__(self, parallel: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.final_norm = nn.LayerNorm(8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 4)
        self.parallel = parallel

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input=ids) * 3.0  # a scale between embedding and blocks (as Gemma's)
        if self.parallel:  # blocks that are not a chain: no split at the blocks computes this
            return self.head(self.final_norm(sum(torch.tanh(b(x)) for b in self.blocks)))
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(self.final_norm(x))


def test_stand_ins_keep_signatures_and_modules_are_sorted_by_call_order() -> None:
    torch.manual_seed(0)
    model, ids = _OPTLike(), torch.randint(0, 16, (2, 5))
    blocks, _ = find_blocks(model)
    assert blocks.pre == ("embed", "final_norm")  # by registration
    ordered = in_call_order(model, blocks, ids, None)
    assert ordered.pre == ("embed",) and ordered.post == ("final_norm", "head")
    assert check_split(model, ordered, plan_stages(model, ordered, 2), ids, None) is None
    # Registration order would give the last stage a stand-in for the final norm: the check sees the difference.
    assert "do not compute the model" in check_split(model, blocks, plan_stages(model, blocks, 2), ids, None)
    parallel = _OPTLike(parallel=True)
    why = check_split(parallel, in_call_order(parallel, blocks, ids, None), [("0", "1"), ("2", "3")], ids, None)
    assert why is not None and "differs from the whole model's" in why


def test_sequential_splits_at_its_children() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 4 * 4, 4))
    units, why = find_units(model)
    assert units is not None and units.container == "" and units.names == tuple(str(i) for i in range(6)), why
    owned = plan_stages(model, units, 2)
    assert [len(o) for o in owned] == [3, 3]  # by cost: the activations and Flatten cost (almost) nothing
    x = torch.randn(2, 3, 8, 8)
    assert check_split(model, units, owned, x, None) is None
    stage = build_stage(model, units, owned[1], False, True)
    assert list(stage._modules) == ["3", "4", "5"]  # the user's names


def test_models_that_cannot_be_split_are_explained() -> None:
    found, why = find_blocks(sm.tiny_t5())
    assert found is None and "sit in" in why and "lists" in why
    found, why = find_units(sm.tiny_t5())  # split as an encoder-decoder instead: encoder | decoder
    assert found is not None and found.kind == "encoder-decoder" and found.names == ("encoder", "decoder"), why
    found, why = find_blocks(sm.FlatMLP())
    assert found is None and "no repeated blocks" in why


PP = ("parallel_mode", {"dims": [["pipeline", 2], ["data", -1]]})


def test_strategy_checks() -> None:
    assert Strategy.load([PP, "pipeline_parallel"]).problems(4) == []
    tp_pp = ("parallel_mode", {"dims": [["pipeline", 2], ["data", -1], ["tensor", 2]]})
    assert Strategy.load([tp_pp, "tensor_parallel", "pipeline_parallel", "fsdp"]).problems(8) == []
    assert any("needs a 'pipeline' dimension" in p for p in Strategy.load(["pipeline_parallel"]).problems(2))
    assert any("'pipeline' is not used" in p for p in Strategy.load([PP]).problems(2))
    problems = Strategy.load([PP, ("pipeline_parallel", {"schedule": "gpipe", "virtual_stages": 2})]).problems(2)
    assert any("use schedule 'interleaved_1f1b'" in p for p in problems), problems
    problems = Strategy.load([PP, ("pipeline_parallel", {"schedule": "zbv", "virtual_stages": 3})]).problems(2)
    assert any("set virtual_stages to 2" in p for p in problems), problems
    assert Strategy.load([PP, ("pipeline_parallel", {"schedule": "dualpipev"})]).problems(4) == []
    problems = Strategy.load([PP, ("pipeline_parallel", {"schedule": "dualpipev", "micro_batches": 2})]).problems(4)
    assert any("'dualpipev' needs at least as many micro-batches as stages (4" in p for p in problems), problems
    problems = Strategy.load([PP, ("pipeline_parallel", {"schedule": "interleaved_1f1b", "virtual_stages": 1})]
                             ).problems(2)
    assert any("set virtual_stages to 2 or more" in p for p in problems), problems
    # tensor × pipeline × data with DDP on the data dimension: refused (DTensor), with the fix.
    problems = Strategy.load([tp_pp, "tensor_parallel", "pipeline_parallel"]).problems(8)
    assert any("add 'fsdp'" in p for p in problems), problems
    # zero1 there runs as FSDP2 over the data dimension (ZeroRedundancyOptimizer cannot partition DTensors):
    # Megatron's tensor + pipeline + distributed optimizer layout is accepted, also through mixed_parallel.
    three_d = ("parallel_mode", {"dims": [["tensor", 2], ["pipeline", 2], ["data", -1]]})
    assert Strategy.load([tp_pp, "tensor_parallel", "pipeline_parallel", "zero1"]).problems(8) == []
    assert Strategy.load([three_d, "mixed_parallel", "zero1"]).problems(8) == []
    assert Strategy.load([("parallel_mode", {"dims": [["tensor", 2], ["data", 2]]}), "tensor_parallel", "zero1"]
                         ).problems(4) == []
    # fp16: the schedule scales the loss (tests/test_booster_port.py)
    assert Strategy.load([PP, "pipeline_parallel", ("amp_native", {"dtype": "fp16"})]).problems(2) == []


def test_stages_are_built_without_a_process_group() -> None:
    """With communicate=False (the cost model's fake or meta models) a rank's stages come from the layout."""
    from atorch.apply import apply_strategy
    from atorch.distributed import DistEnv
    from atorch.model_context import ModelContext, UserSetup
    from atorch.parallel_layout import ParallelLayout

    strategy = Strategy.load([("parallel_mode", {"dims": [["pipeline", 2], ["data", 2]]}), "pipeline_parallel"])
    model = sm.tiny_gpt2(layers=4)
    held = {}
    for rank in (0, 3):  # (pipeline 0, data 0) and (pipeline 1, data 1)
        env = DistEnv(rank=rank, world_size=4, local_rank=rank, device=torch.device("cpu"), backend="gloo")
        setup = UserSetup(model=model, optim_func=torch.optim.SGD, loss_func=sm.hf_loss)
        ctx = ModelContext(setup, env, ParallelLayout((("pipeline", 2), ("data", 2)))).fresh()
        apply_strategy(ctx, strategy, communicate=False)
        held[rank] = (ctx.model.indices, sum(p.numel() for p in ctx.model.parameters()))
    assert held[0][0] == [0] and held[3][0] == [1]
    assert held[0][1] + held[3][1] == sum(p.numel() for p in model.parameters()) + sm.VOCAB * 32  # tied: twice


def test_checkpoint_finds_the_blocks_of_a_non_transformers_model_on_its_stages() -> None:
    """Two stages on a rank (interleaved_1f1b) of a CNN without _no_split_modules: checkpoint wraps the model's
    blocks, not the StageModules (which looked like repeated blocks: the wrapped stage then hid its index)."""
    from workers.pp_worker import ConvBlock, SmallCNN

    from atorch.apply import apply_strategy
    from atorch.distributed import DistEnv
    from atorch.model_context import ModelContext, UserSetup
    from atorch.opt_lib.pipeline_split import StageModule
    from atorch.parallel_layout import ParallelLayout

    strategy = Strategy.load([("parallel_mode", {"dims": [["pipeline", 2]]}),
                              ("pipeline_parallel", {"schedule": "interleaved_1f1b"}), "checkpoint"])
    env = DistEnv(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), backend="gloo")
    setup = UserSetup(model=SmallCNN(), optim_func=torch.optim.SGD, loss_func=sm.class_loss,
                      model_input_format="unpack_sequence")
    ctx = ModelContext(setup, env, ParallelLayout((("pipeline", 2),))).fresh()
    apply_strategy(ctx, strategy, communicate=False)
    stages = list(ctx.model.stages)
    assert [type(s) for s in stages] == [StageModule, StageModule] and ctx.model.indices == [0, 2]
    wrapped = [type(m._checkpoint_wrapped_module) for m in ctx.model.modules()
               if hasattr(m, "_checkpoint_wrapped_module")]
    assert wrapped == [ConvBlock, ConvBlock], wrapped


def test_mixed_parallel_stands_for_tensor_and_pipeline_parallel() -> None:
    from atorch.opt_lib.mixed_parallel import expand_mixed

    three_d = ("parallel_mode", {"dims": [["tensor", 2], ["pipeline", 2], ["data", -1]]})
    atorch_form = ("mixed_parallel", {"pipe_config": {"chunks": 4, "pipe_schedule": "Interleaved1F1B"}})
    strategy = Strategy.load([three_d, "module_replace", atorch_form, "fsdp"])
    assert strategy.problems(8) == []
    configs = expand_mixed({item.name: item.config for item in strategy.methods})
    assert "mixed_parallel" not in configs and configs["pipeline_parallel"].schedule == "interleaved_1f1b"
    assert configs["pipeline_parallel"].micro_batches == 4 and "tensor_parallel" in configs
    pipeline_only = ("parallel_mode", {"dims": [["pipeline", 2], ["data", -1]]})
    assert "tensor_parallel" not in expand_mixed(
        {i.name: i.config for i in Strategy.load([pipeline_only, "mixed_parallel"]).methods})
    # Its limits are those of the methods it stands for: DDP cannot replicate DTensors, so a data
    # dimension next to a tensor one needs fsdp; and it is not combined with the methods themselves.
    problems = Strategy.load([three_d, "mixed_parallel"]).problems(8)
    assert any("add 'fsdp'" in p for p in problems), problems
    problems = Strategy.load([three_d, "mixed_parallel", "pipeline_parallel", "fsdp"]).problems(8)
    assert any("drop 'pipeline_parallel'" in p for p in problems), problems
    assert any("needs a 'tensor' and/or 'pipeline' dimension" in p
               for p in Strategy.load(["mixed_parallel"]).problems(2))
