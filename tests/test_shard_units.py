"""Choosing what is sharded and checkpointed: repeated blocks in any container, units in post-order,
tied weights kept in one unit (no processes needed)."""

from __future__ import annotations

from shard_models import MixerBlock, ResidualBlock, SequentialViT, Stage, StagedCNN, StagedMLP, tiny_bert_mlm
from torch import nn
from toy_models import mlp

from atorch.class_ref import class_path
from atorch.opt_lib.blocks import block_classes
from atorch.opt_lib.sharding import choose_units


def test_blocks_in_a_sequential_are_found() -> None:
    assert block_classes(SequentialViT()) == (class_path(MixerBlock),)


def test_residual_blocks_in_sequential_stages_are_found() -> None:
    # The stages (Sequentials held as attributes) are containers, not blocks: the blocks inside are.
    assert block_classes(StagedCNN()) == (class_path(ResidualBlock),)


def test_module_list_blocks_still_found() -> None:
    assert block_classes(mlp()) == (class_path(nn.Sequential),)
    assert block_classes(StagedMLP()) == (class_path(Stage),)  # the stages hold more than one stage's blocks


def test_repeated_composite_children_of_a_module_are_blocks() -> None:
    class Twin(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second, self.head = MixerBlock(), MixerBlock(), nn.Linear(32, 2)

    assert block_classes(Twin()) == (class_path(MixerBlock),)


def test_nothing_repeated_gives_no_blocks() -> None:
    assert block_classes(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))) == ()  # repeated leaves
    assert block_classes(nn.Sequential(MixerBlock(), nn.Linear(32, 2))) == ()
    assert block_classes(nn.Sequential(nn.ReLU(), nn.ReLU())) == ()  # no parameters


def test_units_are_deepest_first() -> None:
    model = StagedMLP()
    units = choose_units(model, (class_path(Stage), class_path(MixerBlock)), None)
    order = {id(m): i for i, m in enumerate(units)}
    assert len(units) == 6
    for stage in model.stages:
        assert all(order[id(block)] < order[id(stage)] for block in stage.blocks)
    # Classes plus size-based units: each module once, every unit after the units inside it.
    mixed = choose_units(model, (class_path(MixerBlock),), 1000)
    assert len({id(m) for m in mixed}) == len(mixed)
    names = {id(m): n for n, m in model.named_modules()}
    position = {names[id(m)]: i for i, m in enumerate(mixed)}
    for name, i in position.items():
        assert all(j < i for other, j in position.items() if other.startswith(name + ".")), position


def test_tied_weights_stay_in_one_unit() -> None:
    model = tiny_bert_mlm()
    units = choose_units(model, block_classes(model), 100)
    names = {n for n, m in model.named_modules() if any(m is u for u in units)}
    # word_embeddings.weight is also the MLM decoder's weight: no unit may hold one use without the other.
    assert not any(n == "bert.embeddings" or n.startswith("bert.embeddings.word") for n in names), names
    assert not any(n.startswith("cls.predictions.decoder") for n in names), names
    assert "bert.embeddings.position_embeddings" in names  # an untied part still becomes a unit
    assert any(n.startswith("bert.encoder.layer.") for n in names)


def test_a_plain_sequential_gets_units_by_size() -> None:
    """fsdp on an nn.Sequential CNN (no repeated blocks): its larger layers become units, not the root only."""
    from atorch.opt_lib.sharding import sequential_units

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU(), nn.Flatten(),
                          nn.Linear(16 * 4 * 4, 10))
    assert sequential_units(model) == [model[2], model[5]]  # 1168 and 2570 of 3962 parameters; conv1 has 224
    assert sequential_units(_sequential_with_own_forward()) == []  # not a plain Sequential: the usual rules


def _sequential_with_own_forward() -> nn.Module:
    class Net(nn.Sequential):
        def forward(self, x):  # a Sequential with its own forward is not split by size
            return super().forward(x) * 2

    return Net(nn.Linear(4, 4), nn.Linear(4, 4))
