"""The cost model's contract with the methods: what a method's cost facts claim holds in the program it builds.

For every example strategy of the numerics table (each method alone, its extra configs and every allowed pair:
tests/workers/numerics_worker.py, from the registry and the compatibility rules) that both the analytical model and
fake-tensor tracing handle, on a small zoo (the toy MLP, a tiny GPT-2 and a tiny Llama with random weights), the
analytical peak memory per rank is within ``BAND`` of the traced peak of the real build and two training steps at 2
ranks (torch's fake process group: no processes). And each method's on/off pair moves the analytical step time and
the traced memory the way its cost facts say (recompute: more compute, less memory; sharding: less memory; 16-bit
compute: faster matmuls where the profile says so). A method changed in its own module without its facts (say,
checkpoint recomputing every other block while its facts still say all) fails here. expert_parallel, which tracing
cannot run (its dispatch sizes the all-to-alls by the routing), is held to the same band and effect band against the
dry-run's measurement on real processes in tests/test_expert_parallel_costs.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import shard_models
import torch
import toy_models
from torch import nn
from workers.numerics_worker import scenarios

from atorch.model_context import UserSetup
from atorch.opt_lib import get_method
from atorch.strategy import Strategy
from atorch.strategy_search.costing.analyser import ModelStats, analyse
from atorch.strategy_search.costing.cost_model import Prediction, predict, strategy_facts
from atorch.strategy_search.costing.hardware import HardwareProfile
from atorch.strategy_search.costing.tracing import MemoryTracer, TraceError, fake_world, memory_twin, untraced_reason

WORLD = 2
MICRO_BATCH = 8  # samples per rank: the transformers' activations outweigh their parameters, as in training
# Analytical peak / traced peak - 1: within the search's own band for analytical figures (strategy_search/
# automatic.py ANALYTICAL_MEMORY_BAND, 8%) for every example here but the known errors below (measured on this zoo:
# singles -3% to +2% on the GPT-2 and Llama, -2% to -1% on the MLP; pairs on the GPT-2 +0.5% to +6%).
BAND = 0.08
# Known errors of the analytical model (model, example): the band is taken around them, so they can neither grow nor
# vanish unseen (a method whose program changes moves its error off the known one). Recompute's term for the block
# being recomputed (its activations and the gradient of its largest saved tensor) is conservative on the Llama's
# blocks (it was +23% to +32% on the GPT-2 and +42% on the Llama while it counted the block's saved bytes again);
# FSDP's root unit term, fitted on transformers, is low on the MLP, whose parameters are all it holds.
KNOWN_ERRORS: dict[tuple[str, str], float] = {
    ("mlp", "fsdp"): -0.167,
    ("llama", "checkpoint"): 0.107,
}
# What the cost model may credit a method with saving beyond what the traced program saves, as a share of the traced
# peak without the method (measured: at most +1.3%, the GPT-2's FSDP; recompute -12% and -21%: credited less), and
# the known error: FSDP on the MLP (its root unit term, above) credits +9.4%.
EFFECT_BAND = 0.03
KNOWN_EFFECT_BANDS: dict[tuple[str, str], float] = {("mlp", "fsdp"): 0.10}
# Tracing cannot build these on fake tensors ("_apply(): Couldn't swap ..." when the model's dtype or modules change
# under the fake mode): the search keeps the analytical figure for them; here they are left out.
NOT_TRACED = {"half", "module_replace"}


@dataclass(frozen=True)
class Zoo:
    make: Callable[[], nn.Module]
    batch: Callable[[], Any]
    input_format: str
    loss: Callable[[Any, Any], torch.Tensor]


def _tokens() -> dict[str, torch.Tensor]:
    ids = torch.zeros(MICRO_BATCH, toy_models.SEQ_LEN, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


def _mlp_batch() -> tuple[torch.Tensor, ...]:
    data = toy_models.mlp_dataset()
    return tuple(torch.stack([data[i][k] for i in range(MICRO_BATCH)]) for k in range(2))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=toy_models.VOCAB, n_positions=toy_models.SEQ_LEN, n_embd=64,
                                      n_layer=BLOCKS, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


# Four blocks: with two, recompute keeps one block's inputs and recomputes the other, and the analytical model's
# terms for the block being recomputed (its activations and their gradients) are a third of the whole (measured:
# GPT-2 +39%, Llama +53% at two blocks; within 8% at four)
BLOCKS = 4
ZOO = {
    "mlp": Zoo(toy_models.mlp, _mlp_batch, "unpack_sequence", toy_models.mlp_loss),
    "gpt2": Zoo(_gpt2, _tokens, "unpack_dict", toy_models.gpt2_loss),
    "llama": Zoo(lambda: shard_models.tiny_llama(layers=BLOCKS), _tokens, "unpack_dict", toy_models.gpt2_loss),
}


def _profile() -> HardwareProfile:
    """A CPU-like profile whose 16-bit matmuls are faster than fp32's (as on an accelerator)."""
    link = {"bus_bandwidth": 1e9, "latency_s": 1e-4, "size_bytes": 0}
    return HardwareProfile.from_table({
        "device_type": "cpu", "device_name": "test", "world_size": WORLD, "local_world_size": WORLD,
        "backend": "gloo", "torch_version": "any",
        "matmul_tflops": {"float32": 1.0, "bfloat16": 2.0, "float16": 2.0},
        "collectives": {"all_reduce": link, "all_gather": link, "reduce_scatter": link},
        "op_latency_s": 1e-5, "memory_bytes_per_s": 4e9, "memory_per_rank": 1 << 30,
    })


def _names(items: list[Any]) -> set[str]:
    return {item if isinstance(item, str) else item[0] for item in items}


def _examples() -> dict[str, list[Any]]:
    """The numerics table's strategies that tracing and the analytical model both handle."""
    out = {}
    for name, items in scenarios().items():
        strategy = Strategy.load(items)
        if not _names(items) & NOT_TRACED and untraced_reason(strategy, WORLD) is None:
            out[name] = items
    return out


EXAMPLES = _examples()
# each method with its default config on every model; its extra configs and the pairs on the GPT-2 (the time limit)
SINGLES = {name: items for name, items in EXAMPLES.items() if len(items) == 1 and "[" not in name}
MORE = {name: items for name, items in EXAMPLES.items() if name not in SINGLES}


@dataclass
class Figures:
    name: str
    stats: ModelStats
    tracer: MemoryTracer
    traced: dict[str, int]

    def predicted(self, items: list[Any]) -> Prediction:
        strategy = Strategy.load(items)
        return predict(self.stats, strategy, strategy.layout(WORLD), _profile(), MICRO_BATCH * WORLD)

    def peak(self, items: list[Any]) -> int:
        """The traced peak of rank 0, once per program (fp16 autocast is traced as bf16; parallel_mode's default
        layout at 2 ranks is what no parallel_mode gives)."""
        program = memory_twin(Strategy.load([i for i in items if i != "parallel_mode"]))
        key = json.dumps(program.to_list(), sort_keys=True, default=str)
        if key not in self.traced:
            with fake_world(WORLD):
                self.traced[key] = self.tracer.trace(program, MICRO_BATCH).peak
        return self.traced[key]


@pytest.fixture(scope="module", params=list(ZOO))
def figures(request: pytest.FixtureRequest) -> Figures:
    zoo = ZOO[request.param]
    torch.manual_seed(0)
    model, batch = zoo.make(), zoo.batch()
    setup = UserSetup(model=model, optim_func=torch.optim.AdamW, dataset=None, loss_func=zoo.loss,
                      model_input_format=zoo.input_format, optim_args={"lr": 1e-3},
                      dataloader_args={"batch_size": MICRO_BATCH})
    stats = analyse(model, batch, zoo.input_format, zoo.loss)
    return Figures(request.param, stats, MemoryTracer(setup, batch, WORLD), {})


def _within_band(figures: Figures, examples: dict[str, list[Any]]) -> None:
    errors = {}
    for name, items in examples.items():
        try:
            traced = figures.peak(items)
        except TraceError as exc:
            if "match no module" in str(exc):  # an example naming another model's modules (ignored_modules)
                continue
            raise AssertionError(f"{name}: not traced ({exc}); add its method to NOT_TRACED if tracing cannot") \
                from exc
        errors[name] = figures.predicted(items).memory.peak / traced - 1
    worst = {}
    for name, error in errors.items():
        known = KNOWN_ERRORS.get((figures.name, name), 0.0)
        if abs(error - known) > BAND:
            worst[name] = f"{error:+.1%} (known {known:+.1%}, band {BAND:.0%})"
    assert not worst, f"analytical peak off the traced one: {worst}"


def test_every_single_method_s_peak_is_within_the_band(figures: Figures) -> None:
    _within_band(figures, SINGLES)


def test_extra_configs_and_allowed_pairs_peaks_are_within_the_band(figures: Figures) -> None:
    if figures.name != "gpt2":
        pytest.skip("extra configs and pairs are checked on the GPT-2")
    _within_band(figures, MORE)


def test_each_method_moves_time_and_memory_the_way_its_facts_claim(figures: Figures) -> None:
    off: list[Any] = []
    profile = _profile()
    for name, items in SINGLES.items():
        method = _names(items).pop()
        strategy = Strategy.load(items)
        facts = get_method(method).cost_facts(strategy.get(method), strategy.layout(WORLD))
        on_time, off_time = figures.predicted(items).time, figures.predicted(off).time
        if facts.recompute > 0:  # one more forward of the recomputed blocks
            assert on_time.compute > off_time.compute, name
        if facts.recompute > 0 or facts.parameters or facts.gradients or facts.optimizer_state:
            # fewer bytes: only the recomputed blocks' inputs kept; a shard of the state on each of 2 ranks. The
            # model may credit the method with less than the program saves, never with more (beyond EFFECT_BAND
            # of the peak): the search would fill memory the program does not free.
            traced_on, traced_off = figures.peak(items), figures.peak(off)
            claimed = figures.predicted(off).memory.peak - figures.predicted(items).memory.peak
            assert traced_on <= traced_off and claimed >= 0, name
            band = KNOWN_EFFECT_BANDS.get((figures.name, method), EFFECT_BAND)
            assert claimed - (traced_off - traced_on) <= band * traced_off, (
                f"{name}: the cost model credits {claimed} bytes saved, the traced program saves "
                f"{traced_off - traced_on} (peak {traced_off} without it)")
        dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[
            get_method(method).compute_dtype(strategy.get(method), "fp32")]  # the method's own compute dtype
        if dtype != "float32":
            faster = profile.matmul_tflops[dtype] > profile.matmul_tflops["float32"]
            assert (on_time.compute < off_time.compute) == faster, name
        assert strategy_facts(strategy, strategy.layout(WORLD)).recompute == facts.recompute, name


def test_selective_checkpoint_wraps_every_kth_block_and_the_cost_model_follows(figures: Figures) -> None:
    """checkpoint's ``every: 2`` recomputes half the blocks; its facts say so, and the predicted peak and compute
    fall between recomputing none and all of them, as the traced peak does."""
    from types import SimpleNamespace

    from atorch.opt_lib.activation_checkpoint import checkpoint_blocks

    if figures.name == "mlp":
        pytest.skip("the MLP's peak is its optimizer step: recompute moves no peak")
    model = ZOO[figures.name].make()
    config = get_method("checkpoint").parse_config({"every": 2})
    checkpoint_blocks(SimpleNamespace(model=model), config)
    wrapped = sum(type(m).__name__ == "CheckpointWrapper" for m in model.modules())
    assert wrapped == BLOCKS // 2
    assert get_method("checkpoint").cost_facts(config, Strategy.load([]).layout(WORLD)).recompute == 0.5
    none, half, every = [], [("checkpoint", {"every": 2})], ["checkpoint"]
    predicted = [figures.predicted(items) for items in (none, half, every)]
    assert predicted[0].memory.peak > predicted[1].memory.peak > predicted[2].memory.peak
    assert predicted[0].time.compute < predicted[1].time.compute < predicted[2].time.compute
    traced = [figures.peak(items) for items in (none, half, every)]
    assert traced[0] > traced[1] > traced[2]
    # within the band below the trace, and no further above it than full recompute's known error (KNOWN_ERRORS)
    known = KNOWN_ERRORS.get((figures.name, "checkpoint"), 0.0)
    assert -BAND <= predicted[1].memory.peak / traced[1] - 1 <= known + BAND, (predicted[1].memory.peak, traced[1])


def test_a_traced_sibling_s_error_corrects_the_analytical_peak_of_another_sharding(figures: Figures) -> None:
    # The search corrects an untraced candidate (DeepSpeed's engine cannot be traced) by the error the trace found on
    # a sibling: the same step under another sharding. Here every sibling is traced, so each correction is checked
    # against the sibling's own trace. Under checkpoint on the Llama (an error the shardings share, on the
    # activations: KNOWN_ERRORS) the corrected figure lands within 5% of the trace; elsewhere the errors are within
    # the band and nothing is corrected, nor raised by the MLP's FSDP alone (SiblingErrors).
    from atorch.strategy_search.search.candidates import SiblingErrors

    corrected_band = 0.05
    for recompute in (True, False):
        group = {sharding: ["parallel_mode", *(["checkpoint"] if recompute else []), *[sharding][:sharding != "ddp"]]
                 for sharding in ("ddp", "zero1", "zero2", "fsdp")}
        if figures.name == "mlp" and recompute:
            continue  # no repeated block to recompute
        rows = []
        for source, items in group.items():
            errors = SiblingErrors(BAND)
            errors.add({"checkpoint": recompute, "sharding": source}, figures.peak(items),
                       figures.predicted(items).memory.peak)
            seen = figures.predicted(items).memory.peak / figures.peak(items) - 1
            for target, other in group.items():
                if target == source:
                    continue
                memory = figures.predicted(other).memory
                fixed = errors.corrected({"checkpoint": recompute, "sharding": target}, memory.peak,
                                         memory.activations)
                truth = figures.peak(other)
                rows.append((source, seen, target, memory.peak / truth - 1,
                             None if fixed is None else fixed / truth - 1))
        if figures.name == "llama" and recompute:  # the known over-prediction under checkpoint (KNOWN_ERRORS)
            assert any(fixed is not None for *_, fixed in rows), rows
        for row in rows:
            source_error, fixed = row[1], row[-1]
            # a source within the band of its figure corrects nothing, nor one alone under its peak (seen < 0: a
            # raise needs two shardings to agree; FSDP's root unit on the MLP, -17%, is that sharding's own error)
            beyond = abs(source_error / (1 + source_error)) > BAND
            assert (fixed is not None) == (beyond and source_error > 0), (figures.name, recompute, row)
            # a correction never puts a sibling under its peak by more than the corrected band (the side a dry-run
            # pays for with an out-of-memory run)
            assert fixed is None or fixed >= -corrected_band, (figures.name, recompute, row)
            if recompute and fixed is not None:  # the error the shardings share: corrected to within the band
                assert abs(fixed) <= corrected_band, (figures.name, recompute, row)
