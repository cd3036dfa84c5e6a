"""Small models and data shared by the tests (random weights, generated data, no downloads)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

SEQ_LEN = 32
VOCAB = 128


class MLP(nn.Module):
    """Repeated blocks in a ModuleList, so block detection, fsdp units and checkpoint find them."""

    def __init__(self, dim: int = 32, depth: int = 3, classes: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(16, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        # y (the labels) is accepted so batches can be passed with model_input_format="unpack_sequence"
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def mlp(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP()


def mlp_dataset(samples: int = 64, seed: int = 1) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(samples, 16, generator=g), torch.randint(0, 8, (samples,), generator=g))


def mlp_loss(data, output):  # ATorch's loss_func(data, output)
    return nn.functional.cross_entropy(output.float(), data[1])


def tiny_gpt2(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


class TokenDataset(Dataset):
    """Random token sequences; each item is {"input_ids", "labels"} for a causal LM."""

    def __init__(self, samples: int = 64, seed: int = 2, *, vocab: int = VOCAB, seq_len: int = SEQ_LEN,
                 first_token: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(first_token, vocab, (samples, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def gpt2_loss(data, output):
    return output.loss.float()


class VGGBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm = nn.GroupNorm(4, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.max_pool2d(torch.relu(self.norm(self.conv(x))), 2)


class SmallVGG(nn.Module):
    """Plain convolutions that halve a 32x32 image at each block (no residuals, group norm): not a ResNet."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([VGGBlock(3, 32), VGGBlock(32, 64), VGGBlock(64, 128)])
        self.head = nn.Linear(128 * 4 * 4, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.flatten(1))


class ConvClassifier(nn.Module):
    """A convolution, then two paired linear layers (a tensor-parallel plan derives from them), and a
    transformers-style ``get_input_embeddings`` that refuses with an error tensor parallel's build does not take
    for "no embedding": the tensor-parallel family cannot build on it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 8 * 8, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(torch.relu(self.conv(x)).flatten(1))))

    def get_input_embeddings(self) -> nn.Module:
        raise TypeError("a convolutional classifier has no token embedding")


def moe(experts: int = 4, top_k: int = 2, expert_width: int = 128) -> nn.Module:
    """A tiny Mixtral (2 MoE layers of ``experts`` experts, ``top_k`` per token): its experts hold most of its
    parameters, so splitting them shows in memory. Trained on TokenDataset with gpt2_loss."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=expert_width, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=experts, num_experts_per_tok=top_k,
        max_position_embeddings=SEQ_LEN, use_cache=False))
