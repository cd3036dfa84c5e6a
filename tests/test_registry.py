"""The registry's declarations are consistent, and each method's search space is one a planner can use."""

from __future__ import annotations

import math

import optuna
import pytest
import torch
from toy_models import mlp

from atorch.distributed import DistEnv
from atorch.model_context import ModelContext, UserSetup
from atorch.opt_lib import RULES, Categorical, get_method, method_names
from atorch.opt_lib.registry import METHOD_MODULES
from atorch.parallel_layout import ParallelLayout
from atorch.strategy import Strategy

GROUPS = {"parallel", "precision", "memory", "module"}


@pytest.fixture
def ctx() -> ModelContext:
    # A context at world size 2 that is never built: search spaces and checks only read it.
    env = DistEnv(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), backend="gloo")
    return ModelContext(UserSetup(model=mlp(), optim_func=torch.optim.SGD), env, ParallelLayout.data_parallel(2))


def test_every_method_is_registered_once_in_apply_order() -> None:
    assert method_names() == list(METHOD_MODULES)
    for name in method_names():
        method = get_method(name)
        assert method.name == name and method.group in GROUPS and method.summary


def test_apply_names_no_method() -> None:
    """apply_strategy runs every method's own hooks in the registry's order: it branches on no method's name."""
    import ast
    import inspect

    from atorch import apply

    literals = {n.value for n in ast.walk(ast.parse(inspect.getsource(apply))) if isinstance(n, ast.Constant)}
    assert not literals & set(method_names())


def test_conflict_table_names_registered_methods_only() -> None:
    for rule in RULES:
        assert set(rule.methods) <= set(method_names()), rule
        assert len(set(rule.methods)) == len(rule.methods) >= 2, rule


@pytest.mark.parametrize("name", method_names())
def test_default_config_round_trips_through_json(name: str) -> None:
    strategy = Strategy.load([name])
    assert Strategy.load(strategy.to_json()) == strategy


@pytest.mark.parametrize("name", method_names())
def test_search_space_grid_gives_valid_distinct_configs_with_optuna(name: str, ctx: ModelContext) -> None:
    """Every point of a method's space, drawn by a real Optuna study, is a config it accepts, and
    distinct points give distinct configs."""
    method = get_method(name)
    space = method.search_space(ctx)
    assert set(space) <= set(method.Config.model_fields), f"{name}: dimensions must be config keys"
    assert all(isinstance(dim, Categorical) for dim in space.values()), "extend this test for IntRange"
    grid = {key: list(dim.choices) for key, dim in space.items()}
    size = math.prod(len(choices) for choices in grid.values())
    # Seeded random draws, many more than grid points: deterministic, and they cover the grid.
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    distributions = {key: optuna.distributions.CategoricalDistribution(dim.choices) for key, dim in space.items()}
    configs = []
    for _ in range(10 * size):
        trial = study.ask(distributions)
        configs.append(method.parse_config(dict(trial.params)))
        study.tell(trial, 0.0)
    assert len(set(configs)) == size, f"{name}: {len(set(configs))} distinct configs for {size} grid points"


@pytest.mark.parametrize("name", method_names())
def test_every_config_key_is_documented(name: str) -> None:
    """The reference tables of docs/methods.md are generated from these descriptions."""
    for key, field in get_method(name).Config.model_fields.items():
        assert field.description, f"{name}.{key} has no description"



@pytest.mark.parametrize(("items", "dtype"), [
    (["parallel_mode"], "fp32"), ([("half", "bf16")], "bf16"), ([("amp_native", "fp16")], "fp16"),
    # fp8's matmuls outside its layers: bf16, unless a cast or autocast says otherwise
    (["fp8"], "bf16"), (["fp8", ("amp_native", "fp16")], "fp16"), ([("half", "fp16"), "fp8"], "fp16"),
])
def test_the_compute_dtype_is_the_methods_own(items: list, dtype: str) -> None:
    """One derivation for the dry-run's numerics check, the cost model and Lightning's precision methods."""
    from atorch.dryrun.numerics import compute_dtype
    from atorch.lightning.engine import precision_methods
    from atorch.strategy_search.costing.cost_model import _compute_dtype

    strategy = Strategy.load(items)
    assert strategy.compute_dtype() == compute_dtype(strategy) == dtype
    assert _compute_dtype(strategy) == {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    assert set(precision_methods()) == {"half", "fp8", "amp_native"}


@pytest.mark.parametrize(("items", "reason"), [
    ([("parallel_mode", {"dims": [["pipeline", 2]]}), "pipeline_parallel"],
     "pipeline schedules are built by a communicating step"),
    (["parallel_mode", ("zero1", {"implementation": "deepspeed"})], "DeepSpeed's engine communicates as it is built"),
    (["parallel_mode", ("zero2", {"implementation": "deepspeed"})], "DeepSpeed's engine communicates as it is built"),
    (["parallel_mode", "fp8"], "fp8 layers are not traced"),
    ([("parallel_mode", {"dims": [["tensor", 2], ["data", 2]]}), "tensor_parallel"],
     "tensor-parallel replicas are joined by a communicating step"),
    ([("parallel_mode", {"dims": [["tensor", 2], ["data", 2]]}), "tensor_parallel", "fsdp"], None),
    (["parallel_mode", "zero2", ("amp_native", "fp16")], None),
])
def test_each_method_says_whether_it_can_be_traced(items: list, reason: str | None) -> None:
    from atorch.strategy_search.costing.tracing import untraced_reason

    assert untraced_reason(Strategy.load(items), 4) == reason
