"""The analyser: exact figures on a hand-computable MLP, plausible ones on transformers models, on fake tensors."""

from __future__ import annotations

import copy
import time

import pytest
import shard_models as sm
import torch
import toy_models
from torch import nn

from atorch.errors import SetupError
from atorch.strategy_search.costing.analyser import ModelStats, analyse, fingerprint

BATCH = 4
F32 = 4  # bytes


def mlp_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, 16), torch.randint(0, 8, (BATCH,))


def test_mlp_figures_match_hand_computation() -> None:
    model = toy_models.MLP(dim=32, depth=3, classes=8)  # inp 16->32, 3 blocks 32->32, head 32->8
    stats = analyse(model, mlp_batch(), "unpack_sequence", toy_models.mlp_loss)

    linears = [(16, 32), (32, 32), (32, 32), (32, 32), (32, 8)]
    params = sum(i * o + o for i, o in linears)
    assert stats.param_count == stats.trainable_param_count == params
    assert stats.param_bytes == stats.grad_bytes == stats.trainable_param_bytes == params * F32
    assert stats.frozen_param_bytes == stats.buffer_bytes == 0
    # FLOPs count matmuls: 2·in·out per sample forward. Backward: 2·in·out for each weight gradient, and
    # 2·in·out for each input gradient except the first layer's (its input, the batch, needs no gradient).
    fwd = sum(2 * i * o for i, o in linears)
    assert stats.fwd_flops_per_sample == fwd
    assert stats.fwd_bwd_flops_per_sample == fwd + 2 * fwd - 2 * 16 * 32
    # One block, Sequential(Linear, GELU): Linear saves its input, GELU its input (the Linear's output);
    # the weight is model state, not counted.
    (block,) = stats.blocks
    assert block.class_path == "torch.nn.modules.container.Sequential"
    assert block.count == 3
    assert block.param_bytes == (32 * 32 + 32) * F32
    assert block.activation_bytes == 2 * BATCH * 32 * F32
    # Outside the blocks: the input layer's input (the batch), the head's input, then what the loss saves
    # (log-softmax output, int64 targets, and at most a few bytes of scalars such as nll_loss's total weight).
    loss_saved = stats.activation_bytes_outside_blocks - BATCH * 16 * F32 - BATCH * 32 * F32
    assert BATCH * 8 * F32 + BATCH * 8 <= loss_saved <= BATCH * 8 * F32 + BATCH * 8 + 8
    assert block.activation_bytes_total == 3 * block.activation_bytes
    assert block.input_bytes_total == 3 * BATCH * 32 * F32  # what recompute keeps: each block's input
    assert block.param_bytes_total == 3 * block.param_bytes
    assert stats.activation_bytes == stats.activation_bytes_outside_blocks + block.activation_bytes_total
    assert stats.largest_layer is not None and stats.largest_layer.name == "blocks.0.0"
    assert stats.largest_activation is not None and stats.largest_activation.bytes == BATCH * 32 * F32
    assert stats.batch_size == BATCH and stats.seq_len is None


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, 4 tokens, 8) -> 2 heads of 4
        q = self.qkv(x).view(x.shape[0], 4, 2, 4).transpose(1, 2)
        return nn.functional.scaled_dot_product_attention(q, q, q).sum()


def test_autocast_activation_bytes_leave_the_weight_casts_out() -> None:
    """One Linear(64, 64) on an 8 x 64 fp32 input: backward needs its input and weight. In fp32 the input
    (8 x 64 x 4 = 2048 bytes) is saved and the weight is model state; under bf16 autocast the saved input
    is its 16-bit cast (1024 bytes) and the weight's 16-bit cast is left out (it does not grow with the
    batch; the cost model counts it apart)."""
    stats = analyse(nn.Linear(64, 64), torch.randn(8, 64))
    assert (stats.activation_bytes, stats.amp_activation_bytes) == (2048, 1024)
    gpt2 = analyse(toy_models.tiny_gpt2(), {"input_ids": torch.zeros(2, 16, dtype=torch.long),
                                             "labels": torch.zeros(2, 16, dtype=torch.long)}, "unpack_dict")
    assert 0.3 < gpt2.amp_activation_bytes / gpt2.activation_bytes < 0.9  # matmul outputs halve, norms do not



class DroppedBranches(nn.Module):
    """Each of ``rounds`` steps computes a branch that saves a tensor for backward and is then dropped (as a
    router's scores read only for their indices), then one that is kept: 2 x rounds saved storages of 8 x 32
    fp32, all distinct though a dropped one's storage is freed before the next is made."""

    def __init__(self, rounds: int) -> None:
        super().__init__()
        self.rounds = rounds
        self.proj = nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for _ in range(self.rounds):
            dropped = torch.sin(self.proj(out))  # sin saves the projection's output; both die with ``dropped``
            del dropped
            out = torch.cos(self.proj(out))  # saves a new storage of the same size
        return out.sum()


def test_a_storage_freed_mid_step_does_not_hide_the_next_one() -> None:
    """Saved storages are told apart by address; one freed mid-step handed its address to the next saved one,
    which was then not counted (a DeepSeek-V3's activations varied by up to 7% from one analysis to the next).
    Counted: the input and every projection output that sin or cos saved, and each cos output the next
    projection saved (the last one is only summed, which saves nothing)."""
    rounds = 6
    size = 8 * 32 * F32
    for _ in range(3):
        stats = analyse(DroppedBranches(rounds), torch.randn(8, 32))
        assert stats.activation_bytes == size + 2 * rounds * size + (rounds - 1) * size

def test_attention_is_counted_on_cpu() -> None:
    stats = analyse(Attention(), torch.randn(2, 4, 8), None)
    linear = 4 * 2 * 8 * 8  # per sample: 4 tokens x 2·in·out
    attention = 4 * 2 * 4 * 4 * 4  # QK^T and AV: 2 x 2·s·s·d_head per head, 2 heads (torch's sdpa formula)
    assert stats.fwd_flops_per_sample == linear + attention
    # Backward: the weight gradient only (the input needs none), attention 2.5x its forward (torch's formula).
    assert stats.fwd_bwd_flops_per_sample == 2 * linear + 3.5 * attention


def test_frozen_parameters_have_no_gradient_bytes() -> None:
    model = toy_models.MLP()
    model.head.requires_grad_(False)
    stats = analyse(model, mlp_batch(), "unpack_sequence", toy_models.mlp_loss)
    assert stats.frozen_param_bytes == (32 * 8 + 8) * F32
    assert stats.grad_bytes == stats.param_bytes - stats.frozen_param_bytes


def test_the_users_model_is_untouched_and_stats_round_trip_as_json() -> None:
    model = toy_models.MLP()
    before = copy.deepcopy(model.state_dict())
    params = [id(p) for p in model.parameters()]
    stats = analyse(model, mlp_batch(), "unpack_sequence", toy_models.mlp_loss)
    assert [id(p) for p in model.parameters()] == params
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None and p.device.type == "cpu" for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert ModelStats.model_validate_json(stats.model_dump_json()) == stats


def test_fingerprint_follows_structure_not_values() -> None:
    torch.manual_seed(0)
    a = toy_models.MLP()
    torch.manual_seed(1)
    b = toy_models.MLP()
    with torch.device("meta"):
        on_meta = toy_models.MLP()
    assert fingerprint(a) == fingerprint(b) == fingerprint(on_meta)
    assert fingerprint(toy_models.MLP(depth=4)) != fingerprint(a)  # a layer more
    assert fingerprint(toy_models.MLP(dim=48)) != fingerprint(a)  # other shapes
    assert fingerprint(toy_models.MLP().double()) != fingerprint(a)  # other dtype
    changed = toy_models.MLP()
    changed.blocks[1][1] = nn.ReLU()  # a parameter-free layer of another class
    assert fingerprint(changed) != fingerprint(a)


def test_a_meta_model_gives_the_stats_of_the_real_one() -> None:
    with torch.device("meta"):
        on_meta = toy_models.MLP()
    batch = mlp_batch()
    assert analyse(on_meta, batch, "unpack_sequence", toy_models.mlp_loss) == analyse(
        toy_models.MLP(), batch, "unpack_sequence", toy_models.mlp_loss)


class ReadsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) if x.sum() > 0 else -self.layer(x)  # data-dependent: no value on fake tensors


def test_a_model_that_reads_values_is_measured_on_real_tensors(atorch_log) -> None:
    """The fake run cannot branch on a value; one real step on the sample batch measures it instead (never blind),
    and the log says which path was taken. On the meta device there is no real step: a clear error that does
    not blame the user's input format."""
    model = ReadsValues()
    before = copy.deepcopy(model.state_dict())
    stats = analyse(model, torch.randn(BATCH, 16))
    assert stats.measured_on == "real"
    assert stats.fwd_flops_per_sample == 2 * 16 * 8 and stats.param_count == 16 * 8 + 8
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "the user's model was touched"
    assert all(p.grad is None for p in model.parameters())
    assert "analysed ReadsValues on real tensors" in atorch_log.text
    assert analyse(toy_models.MLP(), mlp_batch(), "unpack_sequence", toy_models.mlp_loss).measured_on == "fake"
    with torch.device("meta"):
        on_meta = ReadsValues()
    with pytest.raises(SetupError, match="on the meta device") as info:
        analyse(on_meta, torch.randn(BATCH, 16))
    assert "model_input_format" not in str(info.value)
    with pytest.raises(SetupError, match="model_input_format"):  # the user's mistake is still named as such
        analyse(toy_models.MLP(), {"x": torch.randn(BATCH, 16)}, "unpack_sequence")


def tiny_mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        use_cache=False))


def test_a_mixture_of_experts_model_is_analysed_as_such() -> None:
    """transformers runs the experts through aten._grouped_mm, whose fake kernel takes only bf16: the analysis
    runs it anyway (on fake tensors), counts its FLOPs at top-k routing as a real step does, and reports the
    experts: total against active parameters."""
    from torch.utils.flop_counter import FlopCounterMode

    from atorch.strategy_search.costing.analyser import _EXTRA_FLOPS

    model = tiny_mixtral()
    ids = torch.randint(0, 128, (BATCH, 32))
    stats = analyse(model, {"input_ids": ids, "labels": ids}, "unpack_dict")
    assert stats.measured_on == "fake"
    with FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOPS) as real:
        model(input_ids=ids, labels=ids).loss.backward()
    assert stats.fwd_bwd_flops_per_sample == real.get_total_flops() / BATCH
    # 4 experts of 3 (32 x 64) matrices in each of 2 layers; a token runs 2 of them
    expert_params = 2 * 4 * 3 * 32 * 64
    assert (stats.experts, stats.experts_per_token, stats.expert_param_count) == (4, 2, expert_params)
    assert stats.active_param_count == stats.param_count - expert_params // 2
    # FLOPs at top-2 of 4: far below every token through every expert
    dense_expert_flops = 2 * 2 * 4 * 3 * 32 * 64 * 32  # fwd, 2 layers, 4 experts, 3 matmuls, 32 tokens
    assert stats.fwd_flops_per_sample < dense_expert_flops


def test_non_transformer_models() -> None:
    images = (torch.randn(BATCH, 3, 8, 8), torch.randint(0, 8, (BATCH,)))
    cnn = analyse(sm.StagedCNN(), images, "unpack_sequence", sm.class_loss)
    assert cnn.fwd_flops_per_sample > 0 and cnn.blocks and cnn.blocks[0].count >= 2
    assert not any(b.attention for b in cnn.blocks)  # convolutions only: no attention term under recompute
    vit = analyse(sm.SequentialViT(), mlp_batch(), "unpack_sequence", sm.class_loss)
    (block,) = vit.blocks
    assert block.class_path.endswith("MixerBlock") and block.count == 3 and block.activation_bytes > 0


# ----- transformers models: tiny configs, random weights -------------------------------------------------

SEQ = 16
D = 64
LAYERS = 2
VOCAB = 256


def gpt2(dropout: float = 0.1) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=D, n_layer=LAYERS, n_head=4,
                                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout))


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=4 * D,
                                        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=SEQ))


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, intermediate_size=4 * D, max_position_embeddings=SEQ))


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=D, d_kv=16, d_ff=4 * D,
                                               num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=4,
                                               decoder_start_token_id=0, pad_token_id=0))


def vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=4,
                                               intermediate_size=4 * D, image_size=16, patch_size=4,
                                               num_labels=8))


def tokens() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids}


MODELS = {  # name -> (make, batch, block class name, blocks)
    "gpt2": (gpt2, tokens, "GPT2Block", LAYERS),
    "llama": (llama, tokens, "LlamaDecoderLayer", LAYERS),
    "bert": (bert, tokens, "BertLayer", LAYERS),
    "t5": (t5, tokens, "T5Block", 2 * LAYERS),  # encoder and decoder blocks share the class
    "vit": (vit, lambda: {"pixel_values": torch.randn(BATCH, 3, 16, 16), "labels": torch.randint(0, 8, (BATCH,))},
            "ViTLayer", LAYERS),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_transformers_models(name: str) -> None:
    make, batch, block_name, count = MODELS[name]
    torch.manual_seed(0)
    model = make()
    start = time.perf_counter()
    stats = analyse(model, batch(), "unpack_dict")
    elapsed = time.perf_counter() - start
    assert elapsed < 30, f"analysing a tiny {name} took {elapsed:.1f} s"
    assert stats.param_count == sum(p.numel() for p in model.parameters())
    # The classes block_classes gives (transformers' _no_split_modules: BERT's also names its embeddings).
    (block,) = [b for b in stats.blocks if b.class_path.endswith(block_name)]
    assert block.count == count
    assert block.attention  # every family's block runs attention (the cost model's recompute term reads it)
    assert 0 < block.activation_bytes_total <= count * block.activation_bytes
    assert block.activation_bytes_total + stats.activation_bytes_outside_blocks <= stats.activation_bytes
    # Every matmul's inputs need gradients (embeddings are trained), so backward does about twice the
    # forward's matmul work; attention's backward is counted as 2.5x its forward (torch's sdpa formula),
    # so the ratio is 3 plus a little: 2.9..3.3 leaves room for that and nothing else.
    assert 2.9 <= stats.fwd_bwd_flops_per_sample / stats.fwd_flops_per_sample <= 3.3
    assert stats.fingerprint == fingerprint(make())  # a second instance of the config
    with torch.device("meta"):
        assert fingerprint(make()) == stats.fingerprint


def test_layers_tensor_parallel_splits_are_counted() -> None:
    """GPT-2's plan splits four layers a block (c_attn, attn.c_proj, c_fc, mlp.c_proj), each with a weight and
    a bias: the cost model prices DTensor's dispatch on them. A CNN has nothing the plan splits."""
    stats = analyse(gpt2(), tokens(), "unpack_dict")
    assert (stats.tp_split_layers, stats.tp_split_params) == (4 * LAYERS, 8 * LAYERS)
    images = (torch.randn(BATCH, 3, 8, 8), torch.randint(0, 8, (BATCH,)))
    cnn = analyse(sm.StagedCNN(), images, "unpack_sequence", sm.class_loss)
    assert (cnn.tp_split_layers, cnn.tp_split_params) == (0, 0)


def test_gpt2_flops_follow_the_6n_rule() -> None:
    model = gpt2()
    stats = analyse(model, tokens(), "unpack_dict")
    assert stats.seq_len == SEQ and stats.batch_size == BATCH
    per_token = stats.fwd_bwd_flops_per_sample / SEQ
    six_n = 6 * stats.param_count
    # 6N (2 FLOPs per parameter forward, 4 backward) leaves out, as fractions of N at this config
    # (N ≈ 117k): position embeddings, which hold parameters but do no matmul (SEQ·D ≈ 0.9%), biases and
    # layer norms (≈ 1%), and adds nothing for attention's score matmuls (12·SEQ·D·LAYERS / 6N ≈ 3.5%, a
    # little more with sdpa's backward formula). The LM head shares the token embedding and does
    # VOCAB·D multiply-adds per token (14% of N), so missing it, or a missing backward (-67%), fails a 10%
    # tolerance, which the terms above (< 6% together) pass.
    assert abs(per_token / six_n - 1) < 0.10, (per_token, six_n)


def test_gpt2_block_activations_are_plausible() -> None:
    stats = analyse(gpt2(dropout=0.0), tokens(), "unpack_dict")
    (block,) = stats.blocks
    values = block.activation_bytes / (F32 * BATCH * SEQ * D)  # fp32 tensors of batch x seq x hidden
    # Lower bound: what a block with fused kernels keeps (Korthikanti et al., 34 bytes per token·hidden in
    # fp16 without tensor parallelism; less the 2 bytes of dropout masks, 16 two-byte values). Upper bound:
    # transformers' GPT-2 runs gelu_new as separate elementwise ops, which keep up to 4 more 4h-wide
    # intermediates (16 values), plus a few copies of the attention's inputs: at most 40.
    assert 16 <= values <= 40, values


def test_gpt2_on_meta_device_and_frozen_embeddings() -> None:
    real = analyse(gpt2(), tokens(), "unpack_dict")
    with torch.device("meta"):
        on_meta = gpt2()
    assert analyse(on_meta, tokens(), "unpack_dict") == real
    frozen = gpt2()
    frozen.transformer.wte.requires_grad_(False)  # tied to the LM head: both frozen
    stats = analyse(frozen, tokens(), "unpack_dict")
    assert stats.frozen_param_bytes == VOCAB * D * F32
    assert stats.fingerprint != real.fingerprint


def test_op_counts_match_a_real_step() -> None:
    """The analyser's operation counts (fake tensors) equal those of a real step of the same model,
    counted independently; forward ones do not depend on the batch size."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
            if func.namespace == "aten" and func.overloadpacket is not torch.ops.aten.detach:
                self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = toy_models.MLP(dim=8, depth=2, classes=4)
    x = torch.randn(BATCH, 16)
    stats = analyse(model, (x,), "unpack_sequence", lambda data, output: output.sum())
    with Count() as fwd:
        loss = model(x).sum()
    with Count() as bwd:
        loss.backward()
    # Forward: per Linear a transpose and an addmm (4 Linears), per block a GELU and the residual add (2),
    # and the sum: 4 x 2 + 2 x 2 + 1 = 13.
    assert stats.fwd_ops == len(fwd.ops) == 13
    assert stats.bwd_ops == len(bwd.ops)
    assert stats.fwd_lowp_ops == fwd.ops.count("addmm") == 4  # what autocast would cast inputs for
    assert stats.block_fwd_ops == 2 * 3  # per block: t, addmm, gelu (the residual add is outside the block)
    assert stats.param_tensors == 8
    wider = analyse(model, (torch.randn(3 * BATCH, 16),), "unpack_sequence", lambda data, output: output.sum())
    assert (wider.fwd_ops, wider.bwd_ops) == (stats.fwd_ops, stats.bwd_ops)


def test_the_head_is_what_the_root_uses_after_the_last_block() -> None:
    """``head_param_bytes``: the parameters outside the blocks that the forward uses after its last block, whose
    gradients FSDP2 holds unsharded from the start of backward (cost_model: the root unit's term). Untied (Llama):
    the output projection and the final norm, not the token embedding; tied (GPT-2): the embedding is the head."""
    untied = analyse(llama(), tokens(), "unpack_dict")
    assert untied.head_param_bytes == F32 * (VOCAB * D + D)  # lm_head, final RMSNorm
    tied = analyse(gpt2(dropout=0.0), tokens(), "unpack_dict")
    assert tied.head_param_bytes == F32 * (VOCAB * D + 2 * D)  # wte (as lm_head), final LayerNorm's weight and bias
    # what FSDP2 holds besides the blocks: the root's gathered parameters and the head's gradients
    from atorch.parallel_layout import ParallelLayout
    from atorch.strategy import Strategy
    from atorch.strategy_search.costing.cost_model import predict
    from atorch.strategy_search.costing.hardware import HardwareProfile

    link = {"bus_bandwidth": 1e9, "latency_s": 1e-4, "size_bytes": 0}
    profile = HardwareProfile.from_table({
        "device_type": "cpu", "device_name": "test", "world_size": 2, "local_world_size": 2, "backend": "gloo",
        "torch_version": "any", "matmul_tflops": {"float32": 1.0}, "op_latency_s": 1e-5, "memory_per_rank": 1 << 30,
        "memory_bytes_per_s": 4e9,
        "collectives": {name: link for name in ("all_reduce", "all_gather", "reduce_scatter")}})
    fsdp = Strategy.load(["parallel_mode", "fsdp"])
    root = untied.param_bytes - sum(b.param_bytes_total for b in untied.blocks)
    with_head = predict(untied, fsdp, ParallelLayout.data_parallel(2), profile, 2 * BATCH).memory
    without = predict(untied.model_copy(update={"head_param_bytes": 0}), fsdp, ParallelLayout.data_parallel(2),
                      profile, 2 * BATCH).memory
    assert with_head.peak - without.peak == untied.head_param_bytes < root
