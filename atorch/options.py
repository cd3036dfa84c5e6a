"""The options of ``auto_accelerate`` (its keyword arguments), typed once.

``ATorchStrategy`` (Lightning) and ``AutoPlugin`` (Booster) take the same options and check them with
the same models, so a new option is added here only. Every problem is reported at once, each naming
the option and the fix.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, ValidationError

from atorch.units import MemorySize


class SearchOptions(BaseModel):
    """``auto_accelerate(..., search={...})``: how the automatic search runs (every key optional)."""

    model_config = ConfigDict(extra="forbid")

    max_trials: int = Field(default=8, ge=1, description="most dry-runs")
    patience: int | None = Field(default=None, ge=1, description="stop after this many dry-runs without improvement")
    warmup_steps: int = Field(default=2, ge=0, description="untimed steps of a dry-run (memory is measured here)")
    measure_steps: int = Field(default=5, ge=1, description="timed steps of a dry-run (the median is kept)")
    min_measure_s: float = Field(default=1.0, ge=0, description=(
        "timed steps go on past measure_steps until they add up to this many seconds (at most max_measure_steps): "
        "steps of a few milliseconds are too noisy to rank candidates on a handful of them"))
    screen_measure_s: float = Field(default=0.5, ge=0, description=(
        "exploration's dry-runs time their steps until they add up to this many seconds (never past min_measure_s): "
        "enough to tell a clearly slower candidate apart; the confirmation re-measures the close contenders for "
        "min_measure_s each (bench/README.md, \"Run N\": picks within the machine's noise of full-length runs)"))
    max_measure_steps: int = Field(default=50, ge=1, description="the most timed steps of a dry-run")
    trial_timeout_s: float = Field(default=300.0, gt=0, description="one dry-run's limit; a rank past it is 'timeout'")
    rejoin_timeout_s: float | None = Field(default=None, gt=0, description=(
        "how long the other processes wait for one still inside a dry-run past trial_timeout_s (stuck in your "
        "model or loss) before they stop the search with an error naming it (default: twice trial_timeout_s, "
        "at least 60 s)"))
    confirm_within: float = Field(default=0.15, ge=0, lt=1, description=(
        "when the runner-up measured within this fraction of the best, both run once more and keep their faster "
        "run (two of max_trials; 0: off; with a strategy server too: the server records the second runs)"))
    confirm_rounds: int = Field(default=3, ge=1, le=10, description=(
        "interleaved re-measurement rounds of the best and the runner-up at most, while their step times stay "
        "within the machine's measured noise of each other (the first round is the two runs of max_trials kept for "
        "it, later ones only what exploration left of max_trials; a tie after the last round keeps the simpler "
        "strategy)"))
    sampler: Literal["tpe", "gp"] = Field(default="tpe", description="Optuna sampler")
    storage: str | None = Field(default=None, description="Optuna storage URL; default SQLite in the cache dir")
    force: bool = Field(default=False, description="search again even if a finished search has the same key")
    progress: bool = Field(default=True, description=(
        "rank 0 shows the search's progress (phase, each dry-run, one-time builds) on the console when the "
        "application has set up no logging; False: quiet"))
    dryrun: bool = Field(default=True, description="False: pick by the cost model alone, with no dry-run")
    top_k: int = Field(default=3, ge=0, description="cost-model favourites enqueued first")
    max_micro_batch_size: int | None = Field(default=None, ge=1, description="largest micro-batch per rank searched")
    context_parallel_from: int = Field(default=8192, ge=2, description=(
        "sequences at least this many tokens long get context-parallel candidates (a transformers decoder; "
        "8,192: the shortest sequence a published layout splits); included=['context_parallel'] offers them at "
        "any length"))
    hardware_profile: str | None = Field(
        default=None, description="a profile table (path, or a name in atorch's profiles/) instead of measuring"
    )
    seed: int = 0
    skip_slower_than: float | None = Field(default=4.0, gt=1, description=(
        "a candidate the cost model predicts this many times slower than the best measured one is not dry-run "
        "(recorded as skipped, with the factor); null: dry-run whatever the sampler proposes"))
    loop: Literal["user", "train_step"] = Field(default="user", description=(
        "'user': only strategies under which your own training loop (README Quick start: model(**data), "
        "loss.backward(), optim.step()) runs unchanged; 'train_step': you train with atorch.train_step, so "
        "methods that need it (pipeline parallel, DeepSpeed's 3D engine, loss_parallel) are searched too"))
    precision: Literal["exact", "mixed", "low"] = Field(default="mixed", description=(
        "how far the numerics may change: 'exact' keeps your dtypes (no autocast); 'mixed' adds 16-bit compute "
        "with fp32 master weights and optimizer state (amp_native); 'low' adds 16-bit weights and optimizer "
        "state with no fp32 master copy ('half'). A method in included= is used whatever this says"))
    server_fallback: bool = Field(
        default=False, description=("if the strategy server cannot be reached or fails (after the client's "
                                    "retries, $ATORCH_SERVER_RETRY_S): log it and search locally")
    )


def _flag(value: Any) -> bool:
    return bool(value)  # any truthy value, as ATorch's dict options were read


def _seconds(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"time_limit must be a positive number of seconds, got {value!r}")
    return value


def _search(value: Any) -> Any:
    if value is None:
        return {}
    if not isinstance(value, (dict, SearchOptions)):
        raise ValueError(f"search must be a dict of options, got {type(value).__name__}")
    return value


def _server_url(value: Any) -> str | None:
    if value is None:
        return None
    if not (isinstance(value, str) and value.startswith(("http://", "https://"))):
        raise ValueError(f"strategy_server must be an http(s) URL such as 'http://host:8765', got {value!r}")
    return value


def _method_names(label: str) -> BeforeValidator:
    def check(value: Any) -> Any:
        if value is None:
            return []
        if not isinstance(value, (list, tuple, set)):
            raise ValueError(f"{label} must be a list of method names, got {value!r}")
        return value

    return BeforeValidator(check)


Flag = Annotated[bool, BeforeValidator(_flag)]


class AccelerateOptions(BaseModel):
    """``auto_accelerate(..., **options)``: the keyword options beside ATorch's named arguments."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    verbose: Flag = Field(default=False, description="debug-level logs on rank 0")
    find_unused_parameters: Flag = Field(default=False, description="DDP's find_unused_parameters")
    ignore_dryrun_on_load_strategy: Flag = Field(default=False, description="accepted for ATorch; no effect")
    memory_limit: MemorySize | None = Field(
        default=None, description="bytes per process, or a size such as '6GiB' (default: the device's memory)")
    time_limit: Annotated[float | None, PlainValidator(_seconds)] = Field(
        default=None, description="seconds the automatic search may take")
    search: Annotated[SearchOptions, BeforeValidator(_search)] = Field(
        default_factory=SearchOptions, description="options of the automatic search")
    strategy_server: Annotated[str | None, BeforeValidator(_server_url)] = Field(
        default=None, description="URL of a strategy server holding the search (default: $ATORCH_STRATEGY_SERVER)")

    @classmethod
    def checked(cls, values: dict[str, Any], unknown_label: str = "keyword argument(s)",
                accepted: tuple[str, ...] = ()) -> tuple[AccelerateOptions, list[str]]:
        """The options, and every problem with them (an option with a problem takes its default).

        ``unknown_label`` names what an unknown key is to the caller; ``accepted`` lists the caller's own
        arguments beside these options, in the message that refuses an unknown key."""
        known = tuple(cls.model_fields)
        unknown = sorted(set(values) - set(known))
        problems = []
        if unknown:
            hints = [hint for name in unknown if (hint := _hint(name, (*accepted, *known)))]
            problems.append(f"unknown {unknown_label} {unknown}; accepted: {', '.join((*accepted, *known))}"
                            + (f"; did you mean {', '.join(hints)}?" if hints else ""))
        given = {k: v for k, v in values.items() if k in known}
        if not given.get("strategy_server"):  # None or "": the environment's, if any
            from atorch.settings import settings

            given["strategy_server"] = settings().strategy_server
        try:
            return cls.model_validate(given), problems
        except ValidationError as exc:
            errors = sorted(exc.errors(), key=lambda e: known.index(str(e["loc"][0])))
        problems += [_problem(e) for e in errors]
        bad = {str(e["loc"][0]) for e in errors}
        return cls.model_validate({k: v for k, v in given.items() if k not in bad}), problems


class AutoOptions(AccelerateOptions):
    """What ``AutoPlugin`` (Booster) takes: the keyword options, plus these arguments of ``auto_accelerate``."""

    excluded: Annotated[list[str], _method_names("excluded")] = Field(
        default_factory=list, description="methods the search leaves out")
    included: Annotated[list[str], _method_names("included")] = Field(
        default_factory=list, description="methods every searched strategy has")


class StrategyOptions(AutoOptions):
    """What ``ATorchStrategy`` (Lightning) takes beside ``load_strategy``: AutoPlugin's options, plus this
    argument of ``auto_accelerate``."""

    save_strategy_to_file: Path | None = Field(default=None, description="where rank 0 saves the strategy (JSON)")


def _hint(name: str, known: tuple[str, ...]) -> str | None:
    """The option an unknown keyword was probably meant to be (a search option goes inside ``search``)."""
    if name in SearchOptions.model_fields:
        return f"search={{'{name}': ...}}"
    close = difflib.get_close_matches(name, known, n=1)
    return f"{close[0]} for '{name}'" if close else None


def _problem(error: Any) -> str:
    """One pydantic error as a sentence naming the option (our validators' messages are whole sentences)."""
    loc = [str(part) for part in error["loc"]]
    if loc[0] == "search" and len(loc) > 1:
        known = "" if error["type"] != "extra_forbidden" else f"; known: {', '.join(SearchOptions.model_fields)}"
        return f"search option '{'.'.join(loc[1:])}': {error['msg']}{known}"
    if error["type"] == "value_error":
        return str(error["ctx"]["error"])
    return f"{'.'.join(loc)}: {error['msg']}, got {error['input']!r}"
