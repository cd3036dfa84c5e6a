"""Models for the sharding, block-detection, checkpoint and meta-device tests (random weights, no downloads)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import toy_models
from torch import nn
from torch.utils.data import Dataset, TensorDataset

VOCAB = 128
SEQ_LEN = 16


class MixerBlock(nn.Module):
    """A pre-norm residual MLP block, as in a timm-style ViT."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class SequentialViT(nn.Module):
    """Blocks held in ``nn.Sequential(*[Block() for _ in range(n)])``, the timm layout."""

    def __init__(self, dim: int = 32, depth: int = 3, classes: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(16, dim)
        self.blocks = nn.Sequential(*[MixerBlock(dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(x))))


class ResidualBlock(nn.Module):
    """A ResNet basic block (without batch norm, whose statistics depend on the local batch)."""

    def __init__(self, inp: int, out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inp, out, 3, stride=stride, padding=1)
        self.conv2 = nn.Conv2d(out, out, 3, padding=1)
        self.act = nn.ReLU()
        self.shortcut = nn.Conv2d(inp, out, 1, stride=stride) if stride != 1 or inp != out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv2(self.act(self.conv1(x))) + self.shortcut(x))


class StagedCNN(nn.Module):
    """Residual blocks in Sequential stages held as attributes (torchvision's ResNet layout)."""

    def __init__(self, classes: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.layer1 = nn.Sequential(ResidualBlock(4, 4), ResidualBlock(4, 4))
        self.layer2 = nn.Sequential(ResidualBlock(4, 8, stride=2), ResidualBlock(8, 8))
        self.fc = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        x = self.layer2(self.layer1(torch.relu(self.stem(x))))
        return self.fc(x.mean(dim=(2, 3)))


class Stage(nn.Module):
    """A stage of blocks: wrapping both Stage and MixerBlock nests units."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MixerBlock(dim) for _ in range(2))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.proj(x)


class StagedMLP(nn.Module):
    def __init__(self, dim: int = 32, classes: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(16, dim)
        self.stages = nn.ModuleList(Stage(dim) for _ in range(2))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(x)
        for stage in self.stages:
            x = stage(x)
        return self.head(x)


def vector_dataset(samples: int = 64, seed: int = 1) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(samples, 16, generator=g), torch.randint(0, 8, (samples,), generator=g))


def image_dataset(samples: int = 64, seed: int = 1) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(samples, 3, 8, 8, generator=g), torch.randint(0, 8, (samples,), generator=g))


def class_loss(data, output):
    return nn.functional.cross_entropy(output.float(), data[1])


def tiny_bert_mlm() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=SEQ_LEN, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(config)


def tiny_t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )
    return T5ForConditionalGeneration(config)


def tiny_bart() -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=SEQ_LEN,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False,
    )
    return BartForConditionalGeneration(config)


class Seq2SeqDataset(Dataset):
    """Random source sequences; the target is the source reversed (teacher forcing: the decoder reads
    the target shifted right behind start token 0). Items: {"input_ids", "decoder_input_ids", "labels"}."""

    def __init__(self, samples: int = 64, seed: int = 3) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(1, VOCAB, (samples, SEQ_LEN), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        source = self.tokens[index]
        target = source.flip(0)
        return {"input_ids": source, "decoder_input_ids": torch.cat([torch.zeros(1, dtype=torch.long), target[:-1]]),
                "labels": target}


class Seq2SeqLabelsOnly(Seq2SeqDataset):
    """The same samples as a user often writes them: {"input_ids", "labels"}, the model shifting the labels into
    the decoder's inputs itself."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = super().__getitem__(index)
        return {"input_ids": item["input_ids"], "labels": item["labels"]}


def tiny_gpt2(layers: int = 2) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=32, n_layer=layers, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


class TokenDataset(toy_models.TokenDataset):
    """Random token sequences of this module's sizes; each item is {"input_ids", "labels"} (labels = inputs)."""

    def __init__(self, samples: int = 64, seed: int = 2) -> None:
        super().__init__(samples, seed, vocab=VOCAB, seq_len=SEQ_LEN, first_token=1)


hf_loss = toy_models.gpt2_loss


class OddMLP(nn.Module):
    """An odd number of trainable parameters (809), as a 3-class head gives: DeepSpeed asserts its bucket is even."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.layers(x) * self.scale


class FlatMLP(nn.Module):
    """No repeated blocks anywhere: fsdp finds no units."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.layers(x)


def tiny_llama(layers: int = 2, heads: int = 4, kv_heads: int = 2, hidden: int = 32) -> nn.Module:
    """A randomly initialised transformers Llama (head_dim 8, grouped KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=8, max_position_embeddings=SEQ_LEN, use_cache=False,
    )
    return LlamaForCausalLM(config)


@dataclass(frozen=True)
class Setup:
    """How a worker builds a model, its data and its loss, and calls the model."""

    make: Callable[[], nn.Module]
    dataset: Callable[[], Any]
    loss: Callable[[Any, Any], torch.Tensor]
    input_format: str
