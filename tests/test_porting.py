"""Code written for ATorch runs unchanged: its import paths, its result and status, its config keys."""

from __future__ import annotations

import logging

import pytest
import torch
from toy_models import mlp, mlp_dataset, mlp_loss

import atorch
from atorch.parallel_layout import ParallelLayout
from atorch.result import AccelerateResult

MLP_ARGS = dict(dataset=mlp_dataset(), loss_func=mlp_loss, model_input_format="unpack_sequence",
                optim_args={"lr": 0.1}, dataloader_args={"batch_size": 8})


def test_atorch_import_paths_are_the_same_objects() -> None:
    from atorch.auto import auto_accelerate
    from atorch.auto.accelerate import auto_accelerate as from_accelerate
    from atorch.auto.opt_lib.module_replace_optimization import register_replace_pair
    from atorch.auto.strategy import Strategy

    assert auto_accelerate is from_accelerate is atorch.auto_accelerate
    assert Strategy is atorch.Strategy
    assert register_replace_pair is atorch.register_replace_pair


def test_atorch_only_names_say_what_to_write_instead() -> None:
    with pytest.raises(ImportError, match=r"ds_3d_parallel takes a plain config.*'ds_3d_parallel', \{"):
        from atorch.auto.opt_lib.ds_3d_parallel_optimization import DeepSpeed3DParallelConfig  # noqa: F401


def test_result_unpacks_six_ways_with_the_scheduler_by_name() -> None:
    status, result, strategy = atorch.auto_accelerate(
        mlp(), torch.optim.SGD, **MLP_ARGS, load_strategy=["parallel_mode"],
        lr_scheduler_cls=torch.optim.lr_scheduler.StepLR, lr_scheduler_args={"step_size": 1})
    with result:
        model, optim, dataloader, loss_func, prepare_input, args = result  # ATorch's documented line
        assert status is True and strategy.names() == ["parallel_mode"]
        assert result._fields == ("model", "optim", "dataloader", "loss_func", "prepare_input", "args")
        assert (model, optim, args) == (result.model, result.optim, result.args) and loss_func is mlp_loss
        assert isinstance(result.lr_scheduler, torch.optim.lr_scheduler.StepLR)
        assert result.lr_scheduler.optimizer is optim and result.reason is None
        # namedtuple's own helpers keep the scheduler
        assert result._replace(loss_func=None).lr_scheduler is result.lr_scheduler


def test_no_lr_scheduler_is_none() -> None:
    result = AccelerateResult(*range(6))
    assert result.lr_scheduler is None and result.problems == () and tuple(result) == tuple(range(6))


def test_a_search_that_finds_nothing_returns_status_false(tmp_path, atorch_log) -> None:
    status, result, strategy = atorch.auto_accelerate(
        mlp(), torch.optim.SGD, **MLP_ARGS, memory_limit=1024,
        search={"storage": f"sqlite:///{tmp_path}/s.db", "dryrun": False})
    assert status is False and strategy is None
    assert tuple(result) == (None,) * 6 and result.lr_scheduler is None
    assert "no candidate fitted and ran" in result.reason and "raise memory_limit" in result.reason
    assert any(r.levelno == logging.ERROR and "found no strategy" in r.getMessage() for r in atorch_log.records)
    result.close()  # nothing to release, and no error


def test_invalid_input_still_raises_with_every_problem() -> None:
    with pytest.raises(atorch.StrategyError) as err:
        atorch.auto_accelerate(mlp(), torch.optim.SGD, **MLP_ARGS, load_strategy=["nope"], time_limit=-1)
    assert len(err.value.problems) >= 2


# ATorch's documented 16-rank example and the groups its documentation lists, dimension by dimension.
ATORCH_16 = [("tensor", 4), ("pipeline", 2), ("data", 2)]
ATORCH_16_GROUPS = {
    "tensor": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    "pipeline": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "data": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
}


def _groups(ranks: torch.Tensor, dim: int) -> list[list[int]]:
    """The process groups a DeviceMesh makes along ``dim`` of its rank tensor (torch sorts each group)."""
    return sorted(sorted(g) for g in ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist())


def test_parallel_mode_orders_ranks_as_atorch_documents() -> None:
    strategy = atorch.Strategy.load([("parallel_mode", (ATORCH_16, None)), "tensor_parallel", "pipeline_parallel"])
    layout = strategy.layout(16)
    assert layout.dims == tuple(ATORCH_16)
    ranks = layout.ranks()  # the tensor the DeviceMesh is built from
    for dim, (name, _) in enumerate(ATORCH_16):
        assert _groups(ranks, dim) == ATORCH_16_GROUPS[name], name
        assert layout.groups_follow_coordinates(name)  # FSDP2's group ranks = DTensor's coordinates (DCP)
    for rank in range(16):  # each rank's coordinate is its place in its group of every dimension
        coordinate = layout.coordinate(rank)
        for name, groups in ATORCH_16_GROUPS.items():
            group = next(g for g in groups if rank in g)
            assert coordinate[name] == group.index(rank), (rank, name)
        assert layout.data_rank(rank) == rank // 8
    # ATorch's fitting: ([("tensor", 2), ("pipeline", 2), ("data", 2)], None) at 16 becomes data 4
    fitted = atorch.Strategy.load(
        [("parallel_mode", ([("tensor", 2), ("pipeline", 2), ("data", 2)], None)), "mixed_parallel"]).layout(16)
    assert fitted.dims == (("tensor", 2), ("pipeline", 2), ("data", 4))
    # no "data" listed: it goes outermost, the listed dimensions keep consecutive ranks
    no_data = atorch.Strategy.load([("parallel_mode", ([("tensor", 2)], None)), "tensor_parallel"]).layout(4)
    assert no_data.dims == (("tensor", 2), ("data", 2)) and _groups(no_data.ranks(), 0) == [[0, 1], [2, 3]]


def test_a_rank_order_places_ranks_in_atorchs_position_order() -> None:
    # position p (first dimension fastest) holds rank_order[p]
    layout = ParallelLayout((("tensor", 2), ("data", 2)), rank_order=(3, 2, 1, 0))
    assert _groups(layout.ranks(), 0) == [[0, 1], [2, 3]] and layout.coordinate(3) == {"tensor": 0, "data": 0}
    assert layout.coordinate(0) == {"tensor": 1, "data": 1} and not layout.groups_follow_coordinates("tensor")


def test_deepspeed_topology_matches_the_layout() -> None:
    pytest.importorskip("deepspeed")
    from atorch.opt_lib.ds_3d_parallel import topology_of

    layout = ParallelLayout((("tensor", 2), ("pipeline", 2), ("data", 2)))
    topology = topology_of(layout)
    for name, axis in (("tensor", "model"), ("pipeline", "pipe"), ("data", "data")):
        assert sorted(topology.get_axis_comm_lists(axis)) == _groups(layout.ranks(), layout.names.index(name))
    for rank in range(8):
        coord = topology.get_coord(rank)
        assert (coord.model, coord.pipe, coord.data) == tuple(layout.coordinate(rank).values())


def test_the_search_keeps_tensor_groups_on_consecutive_ranks() -> None:
    from toy_models import tiny_gpt2

    from atorch.strategy_search.search.space import SearchSpace

    space = SearchSpace(tiny_gpt2(), 8, 16, loop="train_step", precision="low")
    layouts = {c.strategy.layout(8) for c in space.enumerate()}
    split = [layout for layout in layouts if layout.size("tensor") > 1]
    assert split, "no tensor-parallel candidate at 8 ranks"
    for layout in split:  # tensor first (fastest), then pipeline, data outermost
        assert layout.names[0] == "tensor" and layout.names[-1] == "data", layout
        tp = layout.size("tensor")
        assert _groups(layout.ranks(), 0) == [list(range(i, i + tp)) for i in range(0, 8, tp)], layout


def test_tensor_groups_that_span_nodes_are_counted() -> None:
    atorch_order = ParallelLayout(tuple(ATORCH_16))
    assert atorch_order.groups_across_nodes("tensor", 8) == 0 and atorch_order.groups_across_nodes("data", 8) == 8
    assert [atorch_order.stride(n) for n in ("tensor", "pipeline", "data")] == [1, 4, 8]  # the cost model's strides
    tensor_last = ParallelLayout((("data", 2), ("pipeline", 2), ("tensor", 4)))  # tensor varies slowest
    assert tensor_last.groups_across_nodes("tensor", 8) == 4 and tensor_last.groups_across_nodes("tensor", 16) == 0


# ----- ATorch's config keys ----------------------------------------------------------------------------
def test_atorch_config_keys_are_read_with_their_meaning() -> None:
    import functools

    from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy, transformer_auto_wrap_policy

    def config(*item: object) -> dict:
        return atorch.Strategy.load([item]).get(item[0]).model_dump()

    # fp8's documented default dict, as ATorch prints it, plus verbose
    fp8 = {"include": None, "exclude": None, "margin": 0, "interval": 1, "fp8_format": "HYBRID",
           "amax_history_len": 1024, "amax_compute_algo": "max", "reduce_amax": True}
    assert config("fp8", {**fp8, "verbose": True}) == {**fp8, "verbose": True}
    assert config("amp_native", "bf16")["dtype"] == "bf16" == config("amp_native", torch.bfloat16)["dtype"]
    fsdp = config("fsdp", {"atorch_size_based_min_num_params": 1000, "atorch_ignored_cls": ("head",),
                           "fsdp_wrap_params_outmost": True, "sharding_strategy": ShardingStrategy.SHARD_GRAD_OP,
                           "backward_prefetch": BackwardPrefetch.BACKWARD_PRE})
    assert (fsdp["wrap_min_num_params"], fsdp["ignored_modules"]) == (1000, ("head",))
    assert fsdp["wrap_trainable_outmost"] and fsdp["reshard_after_forward"] is False
    assert config("fsdp", {"wrap_trainable_outmost": True, "sharding_strategy": "FULL_SHARD"})["reshard_after_forward"]
    layer = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={torch.nn.Linear})
    assert config("fsdp", {"auto_wrap_policy": layer})["atorch_wrap_cls"] == ("torch.nn.modules.linear.Linear",)
    assert config("zero2", {"auto_wrap_policy": ModuleWrapPolicy({torch.nn.Linear})})["atorch_wrap_cls"] == (
        "torch.nn.modules.linear.Linear",)
    sized = functools.partial(size_based_auto_wrap_policy, min_num_params=500)
    assert config("fsdp", {"auto_wrap_policy": sized})["wrap_min_num_params"] == 500
    assert config("zero2", {"not_use_fsdp": False, "sharding_strategy": "SHARD_GRAD_OP"})["implementation"] == "fsdp2"


@pytest.mark.parametrize(("item", "equivalent"), [
    (("zero2", {"not_use_fsdp": True}), "zero2 {'implementation': 'deepspeed'}"),
    (("fsdp", {"sharding_strategy": "NO_SHARD"}), "keep 'parallel_mode' (DDP)"),
    (("fsdp", {"sharding_strategy": "HYBRID_SHARD"}), "hybrid sharding"),
    (("zero2", {"sharding_strategy": "FULL_SHARD"}), "use 'fsdp' instead of 'zero2'"),
    (("fsdp", {"mixed_precision": {"param_dtype": torch.bfloat16}}), "('amp_native', {'dtype': 'bf16'})"),
    (("fsdp", {"auto_wrap_policy": lambda *a, **k: True}), "atorch_wrap_cls=(MyBlock,)"),
    (("fsdp", {"atorch_ignored_cls": ("a",), "ignored_modules": ("b",)}), "ATorch's name for ignored_modules"),
    (("parallel_mode", ([("zero", 4)], None)), "write ('data', 4)"),
    (("parallel_mode", ([("zero", 2), ("data", 2)], None)), "hybrid sharding"),
])
def test_atorch_keys_without_an_equivalent_name_it(item: tuple, equivalent: str) -> None:
    with pytest.raises(atorch.StrategyError) as err:
        atorch.Strategy.load([item])
    assert equivalent in str(err.value)


class _LoraLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(8, 8)
        self.base.requires_grad_(False)
        self.lora_a, self.lora_b = torch.nn.Linear(8, 2, bias=False), torch.nn.Linear(2, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class _LoraNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_LoraLinear() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


def test_wrap_trainable_outmost_puts_the_adapters_in_the_root_unit() -> None:
    from torch.distributed.fsdp import FSDPModule

    from atorch.training import train_step

    torch.manual_seed(0)
    data = [torch.randn(8) for _ in range(8)]
    _, result, _ = atorch.auto_accelerate(
        _LoraNet(), torch.optim.SGD, data, lambda batch, out: (out - batch).pow(2).mean(),
        dataloader_args={"batch_size": 4}, optim_args={"lr": 0.1},
        load_strategy=[("fsdp", {"atorch_wrap_cls": (_LoraLinear,), "fsdp_wrap_params_outmost": True})])
    with result:
        units = {name for name, m in result.model.named_modules() if isinstance(m, FSDPModule)}
        assert units == {"", "blocks.0.base", "blocks.1.base"}  # the frozen parts; adapters in the root
        before = {k: v.full_tensor().clone() for k, v in result.model.state_dict().items()}
        loss = float(train_step(result, [next(iter(result.dataloader))]))
        after = {k: v.full_tensor() for k, v in result.model.state_dict().items()}
        assert torch.isfinite(torch.tensor(loss))
        assert all(torch.equal(before[k], after[k]) == (".base." in k) for k in before), "only adapters train"


def test_optim_func_none_builds_no_optimizer() -> None:
    status, result, _ = atorch.auto_accelerate(mlp(), None, **{**MLP_ARGS, "optim_args": None},
                                               load_strategy=["parallel_mode", ("amp_native", "fp16")])
    with result:
        model, optim, dataloader, _, prepare_input, args = result
        assert status and optim is None and result.lr_scheduler is None and not args.use_optim_backward
        x, y = prepare_input(next(iter(dataloader)))
        with torch.no_grad():
            assert model(x).dtype == torch.float16  # autocast still applies, without loss scaling


def test_optim_func_none_refuses_what_needs_an_optimizer() -> None:
    with pytest.raises(atorch.StrategyError) as err:
        atorch.auto_accelerate(mlp(), None, **MLP_ARGS, load_strategy=["zero1"],
                               lr_scheduler_cls=torch.optim.lr_scheduler.StepLR, lr_scheduler_args={"step_size": 1})
    text = str(err.value)
    assert "'zero1' shards the optimizer's state: give optim_func" in text and "lr_scheduler_cls needs" in text
    with pytest.raises(atorch.StrategyError, match="automatic search measures training steps"):
        atorch.auto_accelerate(mlp(), None, **MLP_ARGS)
