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

