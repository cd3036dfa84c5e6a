"""An Optuna view of a SearchSpace walked directly (define-by-run over its tree), for the space's tests: the
search itself asks through the candidate table (atorch.strategy_search.search.candidates.CandidateTable)."""

from __future__ import annotations

from typing import Any

from atorch.strategy_search.search.space import Candidate, Point, SearchSpace


def _param_name(space: SearchSpace, dim: Any, choices: tuple[Any, ...]) -> str:
    # Optuna needs one distribution per parameter name: a dimension narrowed by the rules
    # (e.g. precision under DeepSpeed) gets its own name.
    canonical = space.micro_batch_sizes if dim.name == "micro_batch_size" else dim.choices
    return dim.name if choices == canonical else f"{dim.name}|{','.join(map(str, choices))}"


def _walk(space: SearchSpace, choose: Any) -> Point:
    point: Point = {}
    while (dim := space.next_dim(point)) is not None:
        choices = space._valid_choices(point, dim)
        point[dim.name] = choose(_param_name(space, dim, choices), choices)
    return point


def suggest(space: SearchSpace, trial: Any) -> Candidate:
    """Ask an Optuna trial for a valid candidate."""
    space.enumerate()
    point = _walk(space, lambda name, choices: trial.suggest_categorical(name, list(choices)))
    return space.from_point(point)


def to_params(space: SearchSpace, point: Point) -> dict[str, Any]:
    """Optuna params of a point (for enqueue_trial)."""
    params: dict[str, Any] = {}

    def take(name: str, choices: tuple[Any, ...]) -> Any:
        dim_name = name.split("|", 1)[0]
        params[name] = point[dim_name]
        return point[dim_name]

    space.enumerate()
    _walk(space, take)
    return params


def point_from_params(params: dict[str, Any]) -> Point:
    return {name.split("|", 1)[0]: value for name, value in params.items()}


def optuna_distributions(space: SearchSpace) -> dict[str, Any]:
    """Every Optuna parameter the space can ask for, with its distribution."""
    from optuna.distributions import CategoricalDistribution

    out: dict[str, Any] = {}
    for point in space.valid_points():
        walked: Point = {}
        while (dim := space.next_dim(walked)) is not None:
            choices = space._valid_choices(walked, dim)
            out.setdefault(_param_name(space, dim, choices), CategoricalDistribution(choices))
            walked[dim.name] = point[dim.name]
    return out
