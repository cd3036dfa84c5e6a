"""The build check before the search (atorch.strategy_search.search.buildable): one build per method family on fake
tensors; a family that does not build leaves the search (never seeded or dry-run) and the report names it."""

from __future__ import annotations

from pathlib import Path

import optuna
import torch
import toy_models
from search_doubles import Pred, Run

from atorch.model_context import UserSetup
from atorch.strategy_search.search.buildable import (
    MICRO_BATCH_RULE,
    BuildCheck,
    build_shares,
    check_families,
    cover,
    ruled_out_by,
    too_small_micro_batches,
)
from atorch.strategy_search.search.planner import Planner
from atorch.strategy_search.search.report import write_report
from atorch.strategy_search.search.space import Candidate, SearchSpace

MiB = 2**20
WORLD, BATCH = 2, 8


def conv_setup() -> tuple[UserSetup, tuple[torch.Tensor, torch.Tensor]]:
    model = toy_models.ConvClassifier()
    setup = UserSetup(model=model, optim_func=torch.optim.SGD, optim_args={"lr": 0.1},
                      loss_func=lambda data, out: torch.nn.functional.cross_entropy(out, data[1]),
                      model_input_format="unpack_sequence", dataloader_args={"batch_size": BATCH})
    return setup, (torch.randn(BATCH // WORLD, 3, 8, 8), torch.zeros(BATCH // WORLD, dtype=torch.long))


def test_a_family_that_does_not_build_is_never_dry_run_and_the_report_says_why(tmp_path: Path) -> None:
    setup, batch = conv_setup()
    space = SearchSpace(setup.model, WORLD, BATCH)
    tensor = [c for c in space.enumerate() if dict(c.point).get("tensor", 1) > 1]
    assert tensor, "the space varies tensor parallel on this model (a plan derives from its linear pair)"

    checked = check_families(setup, batch, WORLD, torch.device("cpu"), space.enumerate())
    ((method, layout), why), = checked.unbuildable.items()
    assert method == "tensor_parallel" and '"tensor": 2' in layout
    assert why == "TypeError: a convolutional classifier has no token embedding"
    # one build per method of each layout, the simplest candidates first: a handful, not the space's 72
    assert 1 < checked.builds <= 10 and checked.seconds < 60, checked

    calls: list[Candidate] = []

    def predict(cand: Candidate) -> Pred:  # the cost model likes tensor parallel best
        return Pred(100 * MiB, 0.1 if dict(cand.point).get("tensor", 1) > 1 else 1.0)

    def measure(cand: Candidate) -> Run:
        calls.append(cand)
        return Run("ok", 10.0, 100 * MiB)

    storage = f"sqlite:///{tmp_path}/s.db"
    result = Planner(space, storage=storage, study_key="atorch-search-conv", predict=predict, measure=measure,
                     memory_budget=1000 * MiB, max_trials=6, top_k=3, prepare=lambda cands: check_families(
                         setup, batch, WORLD, torch.device("cpu"), cands).unbuildable).search()
    assert calls and result.candidate is not None
    assert not [c for c in calls if dict(c.point).get("tensor", 1) > 1], "a ruled-out family was dry-run"
    study = optuna.load_study(study_name="atorch-search-conv", storage=storage)
    skipped = [t.user_attrs for t in study.trials if t.user_attrs.get("status") == "skipped"]
    assert all("no token embedding" in a["reason"] for a in skipped if '"tensor": 2' in a["key"])
    assert study.user_attrs["unbuildable"] == [{"method": "tensor_parallel", "layout": layout, "reason": why}]

    page = write_report(storage, tmp_path / "report.html").read_text()
    assert "Ruled out before the search" in page and "no token embedding" in page and "tensor_parallel" in page


def test_the_check_shared_over_the_ranks_finds_what_one_rank_finds() -> None:
    """The builds are dealt to the ranks (automatic.check_on_every_rank): every build of the whole check is in one
    share, and the shares' findings, merged as the leader merges what the followers send, are the whole check's."""
    setup, batch = conv_setup()
    cands = SearchSpace(setup.model, WORLD, BATCH).enumerate()
    whole = check_families(setup, batch, WORLD, torch.device("cpu"), cands)
    shares = build_shares(cands, WORLD, 2)
    assert all(shares) and sorted(c.key for s in shares for c in s) == sorted(c.key for c in cover(cands, WORLD))
    found = [check_families(setup, batch, WORLD, torch.device("cpu"), share) for share in shares]
    merged = BuildCheck()
    for share in found:  # as the leader gathers them: every share through JSON
        merged.merge(BuildCheck.from_wire(share.to_wire()))
    assert merged.unbuildable == whole.unbuildable and len(merged.unbuildable) == 1, merged
    # every build of the cover made once; the whole check skipped the failed method's later builds at its layout
    assert merged.builds == len(cover(cands, WORLD)) > whole.builds and merged.unchecked == whole.unchecked
    assert [len(s) for s in build_shares(cands, WORLD, 1)] == [merged.builds]


class HeadBiasAttention(torch.nn.Module):
    """Self-attention with a learned bias per head (as Swin's relative-position table): the bias keeps every head,
    so a split of the heads over ranks cannot add it. Only running a sample shows that, not the plan."""

    def __init__(self, width: int = 32, heads: int = 4, length: int = 8, head_bias: bool = True) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, width // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (torch.nn.Linear(width, width) for _ in range(4))
        self.head_bias = torch.nn.Parameter(torch.zeros(heads if head_bias else 1, length, length))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = q @ k.transpose(-1, -2) / self.head_dim ** 0.5 + self.head_bias
        return self.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1))


class HeadBiasBlock(torch.nn.Module):
    def __init__(self, head_bias: bool) -> None:
        super().__init__()
        self.attn = HeadBiasAttention(head_bias=head_bias)
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.down(torch.relu(self.up(x)))


class HeadBiasModel(torch.nn.Module):
    def __init__(self, head_bias: bool = True) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(16, 32)  # under autocast the blocks receive 16-bit hidden states
        self.blocks = torch.nn.ModuleList(HeadBiasBlock(head_bias) for _ in range(2))
        self.head = torch.nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


def head_bias_setup(head_bias: bool) -> tuple[UserSetup, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    data = [(torch.randn(8, 16), torch.tensor(i % 3)) for i in range(16)]
    setup = UserSetup(model=HeadBiasModel(head_bias), optim_func=torch.optim.SGD, optim_args={"lr": 0.1},
                      dataset=data, loss_func=lambda d, out: torch.nn.functional.cross_entropy(out, d[1]),
                      model_input_format="input_target", dataloader_args={"batch_size": BATCH})
    return setup, (torch.randn(BATCH // WORLD, 8, 16), torch.zeros(BATCH // WORLD, dtype=torch.long))


def test_a_split_that_cannot_compute_a_sample_is_ruled_out_before_any_dry_run() -> None:
    # The plan derives (q/k/v/o and the MLP pair split), the build succeeds, but the split attention's local heads
    # meet a bias of all heads: the build check runs the split block on one sample, as the real build's check does.
    setup, batch = head_bias_setup(head_bias=True)
    space = SearchSpace(setup.model, WORLD, BATCH)
    assert [c for c in space.enumerate() if dict(c.point).get("tensor", 1) > 1]
    # as in a job, this process has used torch's intra-op threads before the check forks (a forked child's
    # parallel kernel hung on the pool it did not inherit)
    square = torch.randn(1024, 1024)
    for _ in range(3):
        square @ square
    checked = check_families(setup, batch, WORLD, torch.device("cpu"), space.enumerate())
    assert len(checked.unbuildable) == 1, checked
    ((method, layout), why), = checked.unbuildable.items()
    assert method == "tensor_parallel" and '"tensor": 2' in layout
    # the reason a user reads names the module, the line and the error, not only StrategyError's header
    assert "fails on one sample in blocks.0.attn (HeadBiasAttention) forward" in why, why
    assert "head_bias" in why and "must match the size" in why, why


class PlainBlock(HeadBiasBlock):
    """A block class of its own whose attention has one bias for all heads: it splits fine."""

    def __init__(self) -> None:
        super().__init__(head_bias=False)


class HybridModel(HeadBiasModel):
    """Two block classes, as a hybrid model's (Jamba: attention and Mamba layers): the first splits, the second
    (a bias per head) cannot compute a sample split."""

    _no_split_modules = ["PlainBlock", "HeadBiasBlock"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([PlainBlock(), HeadBiasBlock(head_bias=True)])


def test_every_block_class_is_checked_not_only_the_first() -> None:
    # Checking only the first block (which splits fine) let the tensor-parallel family into the search, to fail at
    # each candidate's first step (the helper's Jamba run: 4 of 6 dry-runs).
    setup, batch = head_bias_setup(head_bias=True)
    setup = UserSetup(**{**setup.__dict__, "model": HybridModel()})
    space = SearchSpace(setup.model, WORLD, BATCH)
    tensor = [c for c in space.enumerate() if dict(c.point).get("tensor", 1) > 1]
    checked = check_families(setup, batch, WORLD, torch.device("cpu"), tensor[:1])
    ((method, _), why), = checked.unbuildable.items()
    assert method == "tensor_parallel" and "fails on one sample in blocks.1.attn (HeadBiasAttention)" in why, why


def test_a_layer_whose_weight_the_model_reads_itself_is_kept_whole() -> None:
    # Jamba's Mamba mixer computes with dt_proj.weight itself (it never calls dt_proj): the pair found by module order
    # (dt_proj, out_proj) is left out at every Mamba layer, the attention and MLP layers are split, and the family
    # builds (it trains like one process: test_tp_layouts.py's jamba/tp2).
    from transformers import JambaConfig, JambaForCausalLM

    torch.manual_seed(0)
    config = JambaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                         expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=0,
                         mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, max_position_embeddings=32,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    tokens = torch.randint(3, 128, (16, 16))
    setup = UserSetup(model=JambaForCausalLM(config), optim_func=torch.optim.SGD, optim_args={"lr": 0.1},
                      dataset=[{"input_ids": t, "labels": t} for t in tokens], loss_func=lambda d, out: out.loss,
                      model_input_format="unpack_dict", dataloader_args={"batch_size": BATCH})
    space = SearchSpace(setup.model, WORLD, BATCH)
    tensor = [c for c in space.enumerate() if dict(c.point).get("tensor", 1) > 1]
    assert tensor, [c.strategy.names() for c in space.enumerate()]
    batch = {"input_ids": tokens[: BATCH // WORLD], "labels": tokens[: BATCH // WORLD]}
    checked = check_families(setup, batch, WORLD, torch.device("cpu"), tensor[:1])
    assert checked.builds == 1 and not checked.unbuildable, checked


def test_the_split_check_computes_under_the_autocast_the_block_ran_under() -> None:
    # A bias of one head splits fine; under amp_native the blocks' input (the embedding's output) is bf16: the
    # check's runs of the split and the unsplit block take it under the same autocast, not against fp32 weights.
    setup, batch = head_bias_setup(head_bias=False)
    space = SearchSpace(setup.model, WORLD, BATCH, supported_dtypes=["bf16"])
    amp = [c for c in space.enumerate() if dict(c.point).get("tensor", 1) > 1
           and set(c.strategy.names()) == {"parallel_mode", "tensor_parallel", "amp_native"}]
    assert amp, [c.strategy.names() for c in space.enumerate()]
    checked = check_families(setup, batch, WORLD, torch.device("cpu"), amp[:1])
    assert checked.builds == 1 and not checked.unbuildable and not checked.unchecked, checked


class PooledNormClassifier(torch.nn.Module):
    """Convolutions, then a BatchNorm over the pooled features (one value per channel and sample, as MobileViT's
    head): it cannot train on a micro-batch of one sample ("Expected more than 1 value per channel")."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.norm = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.conv(x)).mean((2, 3))))


def pooled_norm_setup(model: torch.nn.Module) -> UserSetup:
    return UserSetup(model=model, optim_func=torch.optim.SGD, optim_args={"lr": 0.1},
                     loss_func=lambda data, out: torch.nn.functional.cross_entropy(out, data[1]),
                     model_input_format="unpack_sequence", dataloader_args={"batch_size": BATCH})


def batch_of(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 8, 8), torch.zeros(n, dtype=torch.long)


def test_a_micro_batch_too_small_for_the_model_is_ruled_out_before_any_dry_run(tmp_path: Path) -> None:
    setup = pooled_norm_setup(PooledNormClassifier())
    per_rank = BATCH // WORLD
    space = SearchSpace(setup.model, WORLD, BATCH)
    sizes = sorted({c.micro_batch_size for c in space.enumerate()})
    assert sizes[0] == 1 and per_rank in sizes, sizes

    rules = too_small_micro_batches(setup, batch_of, per_rank, sizes)
    ((method, at), why), = rules.items()
    assert (method, at) == (MICRO_BATCH_RULE, "1")
    assert "a micro-batch of 1 sample per rank fails" in why and "Expected more than 1 value per channel" in why
    assert "model_input_format" not in why  # the model's own error, not the wording that blames the user's call
    assert ruled_out_by(rules, ["fsdp"], "any", 1) == why and ruled_out_by(rules, ["fsdp"], "any", 2) == ""
    # a model that trains on one sample (its BatchNorm2d has 8 x 8 values per channel) keeps every size
    assert too_small_micro_batches(pooled_norm_setup(toy_models.ConvClassifier()), batch_of, per_rank, sizes) == {}

    calls: list[Candidate] = []

    def measure(cand: Candidate) -> Run:
        calls.append(cand)
        return Run("ok", 10.0 * cand.micro_batch_size, 100 * MiB)

    storage = f"sqlite:///{tmp_path}/s.db"
    # the cost model likes the smallest micro-batch best: without the rule it is dry-run first
    result = Planner(space, storage=storage, study_key="atorch-search-norm", measure=measure,
                     predict=lambda cand: Pred(100 * MiB, 0.01 * cand.micro_batch_size), memory_budget=1000 * MiB,
                     max_trials=6, top_k=3, prepare=lambda cands: rules).search()
    assert calls and result.candidate is not None
    assert all(c.micro_batch_size > 1 for c in calls), [c.micro_batch_size for c in calls]
    study = optuna.load_study(study_name="atorch-search-norm", storage=storage)
    assert study.user_attrs["unbuildable"] == [{"method": MICRO_BATCH_RULE, "layout": "1", "reason": why}]
    page = write_report(storage, tmp_path / "report.html").read_text()
    assert "a micro-batch of 1 sample per rank fails" in page


def test_a_dry_run_that_fails_for_its_micro_batch_size_rules_out_that_size(tmp_path: Path) -> None:
    """Where the check could not tell (it ran out of time, or the fake run failed on the whole batch), the first
    dry-run that fails for its size rules the size out: no other candidate at it is dry-run."""
    setup = pooled_norm_setup(PooledNormClassifier())
    space = SearchSpace(setup.model, WORLD, BATCH)
    calls: list[Candidate] = []

    def measure(cand: Candidate) -> Run:
        calls.append(cand)
        if cand.micro_batch_size == 1:
            return Run("failed", 0.0, 0.0, "rank 0: warm-up step 1: ValueError: Expected more than 1 value per "
                                           "channel when training, got input size torch.Size([1, 16])")
        return Run("ok", 10.0 * cand.micro_batch_size, 100 * MiB)

    storage = f"sqlite:///{tmp_path}/s.db"
    Planner(space, storage=storage, study_key="atorch-search-norm-run", measure=measure,
            predict=lambda cand: Pred(100 * MiB, 0.01 * cand.micro_batch_size), memory_budget=1000 * MiB,
            max_trials=6, top_k=4).search()
    assert [c.micro_batch_size for c in calls].count(1) == 1, [c.micro_batch_size for c in calls]
    study = optuna.load_study(study_name="atorch-search-norm-run", storage=storage)
    skipped = [t.user_attrs for t in study.trials if t.user_attrs.get("status") == "skipped"]
    assert any("a micro-batch of 1 sample per rank fails" in a["reason"] for a in skipped), skipped
