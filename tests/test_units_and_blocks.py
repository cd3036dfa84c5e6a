"""Size parsing (memory_limit) and detection of a model's repeated blocks."""

from __future__ import annotations

import pytest
from class_paths import resolve_class
from torch import nn
from toy_models import mlp, tiny_gpt2
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from atorch.class_ref import class_path
from atorch.opt_lib.blocks import block_classes, outermost
from atorch.units import parse_bytes


@pytest.mark.parametrize(
    "value, expected",
    [
        ("6GiB", 6 * 2**30),
        ("6 gib", 6 * 2**30),
        ("512MB", 512 * 10**6),
        ("1.5KiB", 1536),
        (" 2 TB ", 2 * 10**12),
        ("100", 100),
        ("100B", 100),
        (4096, 4096),
        (2.0e9, 2 * 10**9),
        (None, None),
    ],
)
def test_parse_bytes_accepts_sizes(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize(
    "value, message",
    [
        ("6 parsecs", "unknown unit 'parsecs'"),
        ("GiB", "is not a size"),
        ("-1GiB", "is not a size"),
        ("6 GiB extra", "is not a size"),
        (-1, "must be positive"),
        (0, "must be positive"),
        ("0.1B", "must be positive"),
        (True, "must be a byte count"),
        ([6], "is not a size"),
    ],
)
def test_parse_bytes_refuses_with_the_reason(value, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_bytes(value)
    assert "memory_limit" in str(info.value)


def test_gpt2_blocks_come_from_no_split_modules():
    found = block_classes(tiny_gpt2())
    assert found == ("transformers.models.gpt2.modeling_gpt2.GPT2Block",)
    assert resolve_class(found[0]) is GPT2Block


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)


class Layer(nn.Module):
    """A block that holds a mixer; both declared, as transformers' Mamba declares MambaBlock and MambaMixer."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mixer = nn.LayerNorm(8), Mixer()


class Stack(nn.Module):
    _no_split_modules = ["Layer", "Mixer"]

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))
        self.extra = Mixer()  # a declared class outside any other: kept


def test_declared_blocks_nested_in_declared_blocks_are_not_blocks_again():
    model = Stack()
    assert block_classes(model) == tuple(sorted((class_path(Layer), class_path(Mixer))))
    # what checkpoint wraps of those classes: each layer and the mixer outside them, not the mixers inside
    wrapped = outermost(model, lambda m: isinstance(m, (Layer, Mixer)))
    assert wrapped == [*model.layers, model.extra]
    del model.extra
    assert block_classes(model) == (class_path(Layer),)  # checkpointing each mixer again would recompute it twice


def test_mlp_blocks_are_the_module_list_class():
    model = mlp()
    assert block_classes(model) == (class_path(nn.Sequential),)
    assert type(model.blocks[0]) is nn.Sequential


class TwoStacks(nn.Module):
    """Two ModuleLists of identical blocks: the one holding more parameters is the block list."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.ModuleList(nn.Linear(4, 4) for _ in range(6))
        self.large = nn.ModuleList(nn.Sequential(nn.Linear(32, 32)) for _ in range(2))
        self.mixed = nn.ModuleList([nn.Linear(64, 64), nn.Sequential(nn.Linear(64, 64))])  # not repeated
        self.acts = nn.ModuleList(nn.ReLU() for _ in range(8))  # no parameters


def test_largest_uniform_module_list_wins():
    assert block_classes(TwoStacks()) == (class_path(nn.Sequential),)


def test_no_blocks_found():
    assert block_classes(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))) == ()
    assert block_classes(nn.ModuleList([nn.Linear(4, 4)])) == ()  # a single entry is not repeated
    model = TwoStacks()
    del model.small, model.large
    assert block_classes(model) == ()


def test_size_based_units_skip_containers_and_tied_weights() -> None:
    from atorch.opt_lib.sharding import _size_based_targets

    model = mlp()
    units = _size_based_targets(model, 1000)
    # Children first: each block's Linear (1,056 parameters) is a unit; the rest (input and head
    # layers, 808 parameters) stays with the root, and the ModuleList cannot be a unit (no forward).
    assert units == [block[0] for block in model.blocks]
    gpt2 = tiny_gpt2()
    names = {name for name, module in gpt2.named_modules() for unit in _size_based_targets(gpt2, 1000)
             if module is unit}
    assert names and "transformer.wte" not in names and "lm_head" not in names  # tied: left to the root
    assert {n for n in names if not n.startswith("transformer.h.")} == {"transformer.wpe"}, sorted(names)
