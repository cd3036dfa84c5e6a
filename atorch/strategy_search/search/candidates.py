"""The candidate table: the valid points of a search space in walk order, with the cost model's predictions.

It is everything a study needs to ask and tell, as plain JSON, so a server can run the same search as the
local planner without the model or the registry. The Optuna view (``suggest`` / ``to_params``) works from
the points alone: the dimension that follows a prefix is the next key of the points extending it, and the
choices there are the values those points take next (so an invalid combination is never proposed).

A parameter's Optuna name is the dimension's name when every value of the dimension is offered, else
``name|a,b`` (Optuna needs one distribution per parameter name), as ``SearchSpace`` names them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Point = dict[str, Any]


def point_key(point: Point) -> str:
    """A stable JSON text of a point (identifies a candidate in a study; equals ``Candidate.key``)."""
    return json.dumps(point, sort_keys=True)




def _dimensions() -> tuple[tuple[str, Any, str, bool], ...]:
    """The registry's search dimensions as (name, off value, kind, whether it changes the memory layout)."""
    from atorch.opt_lib import registry

    return _dimensions_of(tuple(registry.method_names()))  # a method registered later counts too


@functools.cache
def _dimensions_of(_names: tuple[str, ...]) -> tuple[tuple[str, Any, str, bool], ...]:
    from atorch.opt_lib.registry import search_dimensions

    return tuple((d.name, d.off, d.kind, any(d.role(m).in_family for m in d.methods)) for d in search_dimensions())


def _precision_dimension() -> tuple[str, Any] | None:
    """The choice dimension among the precision methods (its name and off value), if the registry has one."""
    from atorch.opt_lib import registry

    return _precision_dimension_of(tuple(registry.method_names()))  # a method registered later counts too


@functools.cache
def _precision_dimension_of(_names: tuple[str, ...]) -> tuple[str, Any] | None:
    from atorch.opt_lib.registry import search_dimensions

    return next(((d.name, d.off) for d in search_dimensions()
                 if d.kind == "choice" and all(m.group == "precision" for m in d.methods)), None)


def not_family_keys() -> frozenset[str]:
    """Point keys that do not change how memory is laid out (the micro-batch size, and the dimensions whose
    methods' search roles say so: precision, module_replace): a measurement corrects the predictions of the
    candidates that share every other key (the same layout, sharding and recompute: a "family")."""
    return frozenset({"micro_batch_size"} | {name for name, _, _, in_family in _dimensions() if not in_family})


def is_baseline(point: Point) -> bool:
    """Plain data parallel: every searched dimension at its "off" value (no tensor or pipeline split, no
    sharding, fp32, no checkpointing, no replacement). A choice dimension must be there (a fine-tuning space's
    points have none: no baseline); a switch or a layout size may be left out."""
    return all((point.get(name) if kind == "choice" else point.get(name, off)) == off
               for name, off, kind, _ in _dimensions())


@functools.cache
def _numerics_dimensions(_names: tuple[str, ...]) -> frozenset[str]:
    from atorch.opt_lib.registry import search_dimensions

    return frozenset(d.name for d in search_dimensions() if any(m.numerics != "exact" for m in d.methods))


def keeps_user_numbers(point: Point) -> bool:
    """On plain data parallel's layout (no tensor or pipeline split) and at the user's numbers (every dimension
    whose methods change the numerics at its "off" value: fp32); sharding, recompute or a module swap may be on."""
    from atorch.opt_lib import registry

    numerics = _numerics_dimensions(tuple(registry.method_names()))
    return all((point.get(name) if kind == "choice" else point.get(name, off)) == off
               for name, off, kind, _ in _dimensions() if kind == "layout" or name in numerics)


def complexity(point: Point) -> tuple[int, int]:
    """How much a point changes from plain data parallel: (searched dimensions away from their "off" value, the
    product of its model-parallel sizes). Between two candidates measured within noise of each other, the
    simpler one (the smaller tuple) is kept."""
    changed = sum(point.get(name, off) != off for name, off, _, _ in _dimensions())
    sizes = 1
    for name, off, kind, _ in _dimensions():
        if kind == "layout":
            sizes *= int(point.get(name, off) or 1)
    return changed, sizes


def layout_key(point: Point) -> str:
    """The parallel layout of a point (its tensor / pipeline sizes: the "layout" dimensions), the coarser group a
    family belongs to: time corrections fall back to it (``SearchState.time_correction``)."""
    return json.dumps({name: point.get(name, off) for name, off, kind, _ in _dimensions() if kind == "layout"},
                      sort_keys=True)


def splits_the_model(point: Point) -> bool:
    """Whether a point's layout splits the model (a tensor, pipeline, expert or context size above its off value)."""
    return any(point.get(name, off) != off for name, off, kind, _ in _dimensions() if kind == "layout")


@functools.cache
def _placement_keys(_names: tuple[str, ...]) -> tuple[frozenset[str], tuple[str, ...]]:
    """The choice dimensions that only place the model's state over the data ranks (every method of them a
    "parallel" one: the sharding choice) and their methods' option prefixes ("zero1.", "fsdp.")."""
    from atorch.opt_lib.registry import search_dimensions

    dims = [d for d in search_dimensions() if d.kind == "choice" and all(m.group == "parallel" for m in d.methods)]
    return frozenset(d.name for d in dims), tuple(f"{m.name}." for d in dims for m in d.methods)


def sibling_key(point: Point) -> str:
    """A point without its sharding (the choice, with its options): candidates sharing it compute the same step on
    the same activations, so the analytical memory model's error on the activations, measured on one of them by a
    trace, is its error on the others, DeepSpeed's engine among them (which the trace cannot build)."""
    from atorch.opt_lib import registry

    names, prefixes = _placement_keys(tuple(registry.method_names()))
    return json.dumps({k: v for k, v in point.items() if k not in names and not k.startswith(prefixes)},
                      sort_keys=True)


class SiblingErrors:
    """The analytical memory model's error on each sibling group (``sibling_key``), learnt from its traced members:
    the error they share, kept only where it is beyond ``band`` of its figure (a systematic error on the group's
    activations: checkpointing on the held-out Swin, 28-34% over-predicted, on every sharding alike); a smaller one is
    the model's noise, which differs from sharding to sharding (Swin's bf16 ZeRO-1 traced 4% under its figure, its
    FSDP2 sibling measured 2% over). The shared error is the traced members' error of least magnitude (none where two
    differ in sign): an error of one sharding's own terms shows on that member alone (on the held-out EfficientNet,
    checkpointed DDP traced 9% over its figure by its gradient buckets, torch ZeRO-1 5% over, FSDP2's ZeRO-2 10%
    under). A figure raised by the correction is never raised on one member's word: it drops untried siblings from
    the search (EfficientNet's DDP error put ZeRO-2, the best candidate under its budget, 27% over its measured peak,
    and no dry-run ever measured it), while one lowered wrongly costs an out-of-memory dry-run, stopped at its
    warm-up, whose family is then corrected by the measurement."""

    def __init__(self, band: float) -> None:
        self.band = band
        self._errors: dict[str, list[tuple[float, float]]] = {}  # group -> (traced - analytical, analytical) each

    def add(self, point: Point, traced_peak: float, analytical_peak: float) -> None:
        self._errors.setdefault(sibling_key(point), []).append((traced_peak - analytical_peak, analytical_peak))

    def _shared(self, point: Point) -> float | None:
        """The group's shared error in bytes, None where it is within the band of its member's figure."""
        errors = self._errors.get(sibling_key(point))
        if not errors or (min(e for e, _ in errors) < 0 < max(e for e, _ in errors)):
            return None
        error, analytical = min(errors, key=lambda pair: abs(pair[0]))
        if error > 0 and len(errors) < 2:  # raised only where two shardings agree
            return None
        return error if abs(error) > self.band * analytical else None

    def knows(self, point: Point) -> bool:
        return self._shared(point) is not None

    def corrected(self, point: Point, analytical_peak: float, activations: float) -> float | None:
        """An untraced member's peak: its analytical figure plus its group's shared error, never below its terms
        other than activations (what no activation error can take away); None where the group shares none."""
        error = self._shared(point)
        if error is None:
            return None
        return max(analytical_peak + error, analytical_peak - activations)


def family_key(point: Point) -> str:
    """The memory family of a point: its layout, sharding (with its options) and recompute."""
    excluded = not_family_keys()
    return json.dumps({k: v for k, v in point.items() if k not in excluded}, sort_keys=True)


@dataclass
class CandidateTable:
    points: list[Point]  # valid points, in the space's walk order
    predictions: list[dict[str, Any]]  # one per point: Predicted.to_json() (atorch.strategy_search.search.outcome)
    global_batch: int
    # optional, per point: what a person reads (the strategy, micro-batching and their one-line description)
    details: list[dict[str, Any]] | None = None
    _prefixes: dict[str, list[str]] | None = field(default=None, repr=False, compare=False)
    _values: dict[str, list[str]] | None = field(default=None, repr=False, compare=False)
    _names: dict[str, str] | None = field(default=None, repr=False, compare=False)
    _groups: dict[tuple[str, str], str] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.points) != len(self.predictions):
            raise ValueError(f"{len(self.points)} points but {len(self.predictions)} predictions")
        if not self.points:
            raise ValueError("a candidate table needs at least one point")
        self.keys = [point_key(p) for p in self.points]
        self.by_key = {k: i for i, k in enumerate(self.keys)}
        if self.details is not None and len(self.details) != len(self.points):
            raise ValueError(f"{len(self.points)} points but {len(self.details)} details")

    # ----- JSON ------------------------------------------------------------------------------
    @classmethod
    def from_space(cls, space: Any, predict: Callable[[Any], dict[str, Any]]) -> CandidateTable:
        """The table of a SearchSpace: ``predict(candidate)`` gives a ``Predicted``'s JSON."""
        from atorch.strategy_search.search.describe import describe_candidate

        cands, points = space.enumerate(), space.valid_points()  # the same order
        details = [{**{k: v for k, v in c.to_json().items() if k != "point"},
                    "description": describe_candidate(c.strategy, c.micro_batch_size, c.micro_batches,
                                                      space.world_size)} for c in cands]
        return cls(points, [predict(c) for c in cands], space.global_batch, details)

    def to_json(self) -> dict[str, Any]:
        out = {"points": self.points, "predictions": self.predictions, "global_batch": self.global_batch}
        return {**out, "details": self.details} if self.details is not None else out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CandidateTable:
        details = data.get("details")
        return cls([dict(p) for p in data["points"]], [dict(p) for p in data["predictions"]],
                   int(data["global_batch"]), [dict(d) for d in details] if details is not None else None)

    def describe(self, key: str) -> dict[str, Any]:
        """The point, and its details when the table has them (stored with each trial: the strategy, the
        micro-batching and ``description``, the line every view shows)."""
        i = self.by_key[key]
        return {"point": self.points[i], **(self.details[i] if self.details is not None else {})}

    # ----- the cost model's view -------------------------------------------------------------
    def prediction(self, key: str) -> dict[str, Any]:
        return self.predictions[self.by_key[key]] if key in self.by_key else {"error": "not in the table"}

    @staticmethod
    def fits(pred: dict[str, Any], budget: float, correction: float | None = None, banded: bool = True) -> bool:
        """Whether the candidate may fit: the low end of its predicted peak's error band (``memory_band``) is within
        the budget (a dry-run then settles it). A family's measured correction (a float: that family was measured,
        whatever the ratio) replaces the band: the peak is then measured, not estimated; None: not measured.
        ``banded=False``: the figure itself (a pick that no dry-run will check)."""
        band = pred.get("memory_band", 0.0) if correction is None and banded else 0.0
        return "error" not in pred and pred["peak_memory_bytes"] * (correction or 1.0) * (1.0 - band) <= budget

    @staticmethod
    def fit_chance(pred: dict[str, Any], budget: float, correction: float | None = None) -> float:
        """The chance that the candidate fits the budget. 0 or 1 where its figure is decisive (a family's measured
        correction, or no error band); else the memory model's error taken as spread evenly over its band, as
        ``fits`` reads it: 1/2 with the figure at the budget, falling to 0 a band over it (where ``fits`` turns
        False) and rising to 1 a band under it. Measured by bench/memory_replay.py --close-calls over the six sweep
        files (2026-12-01): of the candidates predicted over the budget by under the band (8%), 0.23 fit on the tuned
        models and 0.29 on the held-out ones (this rule: 0.25); of those under it by under the band, 0.89 and 0.82
        (this rule: 0.75, on the safe side)."""
        if "error" in pred:
            return 0.0
        band = float(pred.get("memory_band", 0.0)) if correction is None else 0.0
        figure = float(pred["peak_memory_bytes"]) * (correction or 1.0)
        if band <= 0.0 or figure <= 0.0:
            return 1.0 if figure <= budget else 0.0
        short = 1.0 - budget / figure  # how much too high the figure must be for the candidate to fit
        return min(1.0, max(0.0, 0.5 - short / (2.0 * band)))

    def _memo(self, what: str, key: str, compute: Callable[[Point], str]) -> str:
        # a point's groups never change; the search reads them for every candidate at every ask (hundreds a search)
        found = self._groups.get((what, key))
        if found is None:
            found = self._groups[what, key] = compute(self.points[self.by_key[key]])
        return found

    def family(self, key: str) -> str:
        return self._memo("family", key, family_key)

    def layout(self, key: str) -> str:
        return self._memo("layout", key, layout_key)

    def precision(self, key: str) -> str:
        """The point's compute precision: its value of the choice among the precision methods (``amp_bf16``,
        ...), the choice's off value where the point leaves it out, "" in a space without one."""
        found = _precision_dimension()
        return "" if found is None else self._memo("precision", key, lambda p: str(p.get(found[0], found[1])))

    @staticmethod
    def reduced(precision: str) -> bool:
        """Whether a precision value computes in fewer bits than the precision choice's off value (fp32)."""
        found = _precision_dimension()
        return found is not None and precision != str(found[1])

    def time_family(self, key: str) -> str:
        """The family whose measured step-time error stands for a point's (``SearchState.time_correction``): its
        memory family and its compute precision."""
        return self._memo("time_family", key, lambda _: json.dumps([self.family(key), self.precision(key)]))

    def ranked(self, budget: float, correction: Callable[[str], float | None] | None = None,
               banded: bool = True) -> list[str]:
        """Keys of predicted-feasible points (``fits``), highest predicted samples/s first (walk order breaks ties).
        ``correction(key)`` scales a point's predicted peak (its family's measured / predicted; None: unmeasured)."""
        scale = correction or (lambda key: None)
        fitting = [i for i, pred in enumerate(self.predictions)
                   if self.fits(pred, budget, scale(self.keys[i]), banded)]
        return [self.keys[i] for i in sorted(fitting, key=lambda i: -self.predictions[i]["samples_per_s"])]

    def baseline(self, budget: float, correction: Callable[[str], float | None] | None = None) -> str | None:
        """Plain data parallel (no tensor or pipeline split, no sharding, fp32, no checkpointing, no replacement)
        at the micro-batch the cost model likes best. Where none fits the budget: the fastest predicted to fit at
        the user's numbers on that layout (``keeps_user_numbers``: sharding or recompute added, still fp32), so
        a search under a budget measures at least one fp32 candidate: the cost model's 16-bit speed-ups are its
        least certain figures (on the held-out bench's budgets, 16-bit picks ran at 0.64-0.87 of the fp32 best
        that no dry-run had measured). The fastest by expected samples/s (``fit_chance``), as the seeds. None fits:
        plain DDP, which costs no dry-run (predicted out of memory)."""
        ddp = [i for i, p in enumerate(self.points) if is_baseline(p)]
        if not ddp:
            return None
        scale = correction or (lambda key: None)

        def fastest_fitting(indices: list[int]) -> str | None:  # by expected samples/s, as the seeds
            fitting = [i for i in indices if self.fits(self.predictions[i], budget, scale(self.keys[i]))]
            return self.keys[max(fitting, key=lambda i: self.predictions[i]["samples_per_s"] * self.fit_chance(
                self.predictions[i], budget, scale(self.keys[i])))] if fitting else None

        exact = [i for i, p in enumerate(self.points) if keeps_user_numbers(p)]
        return fastest_fitting(ddp) or fastest_fitting(exact) or \
            self.keys[min(ddp, key=lambda i: self.points[i].get("micro_batch_size", 0))]

    # ----- the Optuna view -------------------------------------------------------------------
    def _index(self) -> None:
        # prefix (walk-ordered items) -> the JSON values taken next; dimension -> all its values, in a
        # global order (first appearance) so every prefix lists its choices consistently.
        self._prefixes, self._values, self._names = {}, {}, {}
        for point in self.points:
            items = list(point.items())
            for i, (name, value) in enumerate(items):
                text = json.dumps(value)
                prefix = json.dumps(items[:i])
                self._names.setdefault(prefix, name)  # the tree: one next dimension per prefix
                seen = self._prefixes.setdefault(prefix, [])
                if text not in seen:
                    seen.append(text)
                values = self._values.setdefault(name, [])
                if text not in values:
                    values.append(text)

    def _next(self, partial: Point) -> tuple[str, tuple[Any, ...]] | None:
        """The next dimension after ``partial`` and its choices (None once the point is complete)."""
        if self._prefixes is None:
            self._index()
            self._steps: dict[str, tuple[str, tuple[Any, ...]] | None] = {}
        prefix = json.dumps(list(partial.items()))
        if prefix not in self._steps:  # memoised: a server walks the same prefixes on every ask
            taken = self._prefixes.get(prefix)  # type: ignore[union-attr]
            if taken is None:
                self._steps[prefix] = None
            else:
                name = self._names[prefix]  # type: ignore[index]
                order = self._values[name]  # type: ignore[index]
                self._steps[prefix] = (name, tuple(json.loads(v) for v in order if v in taken))
        return self._steps[prefix]

    def _param_name(self, name: str, choices: tuple[Any, ...]) -> str:
        full = self._values[name]  # type: ignore[index]
        return name if len(choices) == len(full) else f"{name}|{','.join(map(str, choices))}"

    def _walk(self, choose: Callable[[str, tuple[Any, ...]], Any]) -> Point:
        point: Point = {}
        while (nxt := self._next(point)) is not None:
            name, choices = nxt
            point[name] = choose(self._param_name(name, choices), choices)
        return point

    def suggest(self, trial: Any) -> Point:
        """Ask an Optuna trial for a valid point (define-by-run over the tree)."""
        return self._walk(lambda name, choices: trial.suggest_categorical(name, list(choices)))

    def to_params(self, point: Point) -> dict[str, Any]:
        """Optuna params of a point (for enqueue_trial)."""
        params: dict[str, Any] = {}

        def take(name: str, choices: tuple[Any, ...]) -> Any:
            params[name] = point[name.split("|", 1)[0]]
            return params[name]

        self._walk(take)
        return params
