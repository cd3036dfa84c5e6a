"""The one Strategy type: an ordered list of (method name, config), stored as JSON.

Every form ATorch's ``load_strategy`` takes is parsed here; all problems are collected and raised
together in one StrategyError. Nothing here unpickles: pickled bytes are refused with the reason.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, SerializeAsAny, ValidationError

from atorch.errors import StrategyError
from atorch.opt_lib import registry
from atorch.opt_lib.base import MethodConfig, StrategyCheck
from atorch.opt_lib.compatibility import conflicts_in
from atorch.opt_lib.parallel_mode import ParallelMode
from atorch.parallel_layout import ParallelLayout

FORMAT_VERSION = 1


class StrategyItem(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    config: SerializeAsAny[MethodConfig]
    tunable: bool = False


class Strategy(BaseModel):
    """An ordered list of optimization methods with their configs."""

    model_config = ConfigDict(frozen=True)

    methods: tuple[StrategyItem, ...] = ()

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def load(cls, source: Any, world_size: int | None = None) -> Strategy:
        """Parse any accepted form; with world_size, also check sizes and compatibility.

        Raises StrategyError listing every problem found.
        """
        strategy, problems = cls.parse(source)
        if world_size is not None:
            problems += strategy.problems(world_size)
        if problems:
            raise StrategyError(problems)
        return strategy

    @classmethod
    def parse(cls, source: Any) -> tuple[Strategy, list[str]]:
        """The methods that parsed, and the problems of those that did not (nothing raised for
        those, so later checks can still run on the rest and report everything together).

        Raises StrategyError only when the source as a whole cannot be read (bad JSON, pickle...).
        """
        if isinstance(source, Strategy):
            return source, []
        items, problems = _parse_items(_decode(source))
        return cls(methods=tuple(items)), problems

    @classmethod
    def from_json(cls, text: str | bytes) -> Strategy:
        return cls.load(text if isinstance(text, bytes) else text.encode())

    # ----- views --------------------------------------------------------------------------
    def names(self) -> list[str]:
        return [item.name for item in self.methods]

    def configs(self) -> dict[str, MethodConfig]:
        return {item.name: item.config for item in self.methods}

    def get(self, name: str) -> MethodConfig | None:
        return self.configs().get(name)

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def applied_configs(self) -> dict[str, MethodConfig]:
        """The configs the strategy is applied as, by method (``Method.stands_for``: mixed_parallel is applied as
        tensor_parallel and pipeline_parallel on the layout's dimensions)."""
        configs = self.configs()
        applied: dict[str, MethodConfig] = {}
        for name, config in configs.items():
            applied.update(registry.get_method(name).stands_for(config, configs))
        return applied

    def applied_names(self) -> set[str]:
        """The methods the strategy is applied as, with the names given."""
        return set(self.names()) | set(self.applied_configs())

    def in_apply_order(self) -> list[StrategyItem]:
        rank = {name: i for i, name in enumerate(registry.apply_order())}
        return sorted(self.methods, key=lambda item: rank[item.name])

    def compute_dtype(self) -> str:
        """The dtype the strategy's matmuls compute in, "fp32", "bf16" or "fp16": each method in apply order
        turns the dtype before it into the one after it (``Method.compute_dtype``), from "fp32"."""
        dtype = "fp32"
        for item in self.in_apply_order():
            dtype = registry.get_method(item.name).compute_dtype(item.config, dtype)
        return dtype

    def to_list(self) -> list[tuple[str, dict[str, Any]]]:
        """ATorch's list form, with JSON-safe configs."""
        return [(item.name, item.config.model_dump(mode="json")) for item in self.methods]

    def to_json(self, indent: int | None = 2) -> str:
        payload = {
            "format_version": FORMAT_VERSION,
            "methods": [
                {"name": i.name, "config": i.config.model_dump(mode="json"), "tunable": i.tunable}
                for i in self.methods
            ],
        }
        return json.dumps(payload, indent=indent)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")

    def __str__(self) -> str:
        parts = []
        for item in self.methods:
            cfg = item.config.model_dump(mode="json", exclude_defaults=True)
            parts.append(f"{item.name}{cfg}" if cfg else item.name)
        return "[" + ", ".join(parts) + "]"

    # ----- checks and adjustment ----------------------------------------------------------
    def problems(self, world_size: int) -> list[str]:
        """Every reason this strategy cannot run on world_size processes."""
        configs = self.configs()
        check = StrategyCheck(world_size=world_size, configs=configs)
        found: list[str] = []
        for item in self.methods:
            found += [f"'{item.name}': {p}" for p in registry.get_method(item.name).check(item.config, check)]
        # Rules see the configs as they run at this world size (parallel_mode's data size fitted).
        return found + conflicts_in(self.adjusted(world_size).configs())

    def adjusted(self, world_size: int) -> Strategy:
        """The strategy as it runs at world_size (ATorch fits parallel_mode's data size)."""
        items = [
            item.model_copy(update={"config": registry.get_method(item.name).adjust(item.config, world_size)})
            for item in self.methods
        ]
        return Strategy(methods=tuple(items))

    def layout(self, world_size: int) -> ParallelLayout:
        """The layout this strategy runs with at world_size (its parallel_mode, fitted; else all data)."""
        mode = self.get(ParallelMode.name)
        if mode is None:
            return ParallelLayout.data_parallel(world_size)
        fitted = registry.get_method(ParallelMode.name).adjust(mode, world_size)
        return ParallelLayout(tuple(fitted.dims), fitted.rank_order)

    def with_method(self, name: str, config: Any = None) -> Strategy:
        """A copy with one more method (validated), or with its config replaced."""
        config_model = registry.get_method(name).parse_config(config)
        items = [i for i in self.methods if i.name != name] + [StrategyItem(name=name, config=config_model)]
        return Strategy(methods=tuple(items))


# ----- decoding of load_strategy forms ------------------------------------------------------
def _decode(source: Any) -> Any:
    """Turn bytes, JSON text or a file path into plain Python values (never unpickles)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode_bytes(bytes(source), "load_strategy bytes")
    if isinstance(source, os.PathLike):
        return _decode_file(Path(source))
    if isinstance(source, str):
        text = source.strip()
        if text.startswith(("[", "{")):
            return _loads(text, "load_strategy JSON string")
        path = Path(text).expanduser()
        if path.exists():
            return _decode_file(path)
        raise StrategyError(
            [
                f"load_strategy string {source[:80]!r} is neither JSON nor a path to an existing file; "
                "pass a list such as ['parallel_mode', 'fsdp'], a JSON string, or the path of a .json file"
            ]
        )
    return source


def _decode_file(path: Path) -> Any:
    if not path.is_file():
        raise StrategyError([f"strategy file {str(path)!r} does not exist"])
    return _decode_bytes(path.read_bytes(), f"strategy file {str(path)!r}")


def _looks_pickled(data: bytes) -> bool:
    # Protocol 2+ pickles start with PROTO (0x80); every pickle ends with the STOP opcode ".".
    return data.startswith(b"\x80") or (data.rstrip().endswith(b".") and data.lstrip()[:1] not in b'[{"')


def _decode_bytes(data: bytes, what: str) -> Any:
    if _looks_pickled(data):
        raise StrategyError(
            [
                f"{what} looks pickled; pickled strategies are refused because unpickling can run "
                "arbitrary code. Save strategies as JSON (save_strategy_to_file=... or Strategy.save) "
                "and load that"
            ]
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StrategyError([f"{what} is not UTF-8 JSON ({exc}); strategies are stored as JSON text"]) from exc
    return _loads(text, what)


def _loads(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise StrategyError([f"{what} is not valid JSON: {exc}"]) from exc


def _split_item(index: int, raw: Any) -> tuple[str | None, Any, bool, str | None]:
    """(name, raw config, tunable, problem) for one list entry."""
    if isinstance(raw, str):
        return raw, None, False, None
    if isinstance(raw, dict) and "name" in raw:
        extra = set(raw) - {"name", "config", "tunable"}
        if extra:
            return None, None, False, f"entry {index}: unknown key(s) {sorted(extra)}; use name, config, tunable"
        return raw["name"], raw.get("config"), bool(raw.get("tunable", False)), None
    if isinstance(raw, (list, tuple)) and 1 <= len(raw) <= 3 and isinstance(raw[0], str):
        tunable = raw[2] if len(raw) == 3 else False
        if not isinstance(tunable, bool):
            return None, None, False, f"entry {index} ({raw[0]!r}): third element (tunable) must be True/False"
        return raw[0], raw[1] if len(raw) > 1 else None, tunable, None
    return None, None, False, (
        f"entry {index} ({raw!r}) is not a method; write a name like 'fsdp' or a pair like ('fsdp', {{...}})"
    )


def _parse_items(data: Any) -> tuple[list[StrategyItem], list[str]]:
    if isinstance(data, dict) and "methods" in data:
        version = data.get("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            return [], [f"strategy format_version {version!r} is not supported (this atorch reads {FORMAT_VERSION})"]
        data = data["methods"]
    if not isinstance(data, Iterable) or isinstance(data, (str, bytes, dict)):
        return [], [
            f"load_strategy must be a list of methods, JSON, a Strategy or a .json path, not {type(data).__name__}"
        ]
    items: list[StrategyItem] = []
    problems: list[str] = []
    seen: set[str] = set()
    for index, raw in enumerate(data):
        name, raw_config, tunable, problem = _split_item(index, raw)
        if problem:
            problems.append(problem)
            continue
        assert name is not None
        if not registry.is_registered(name):
            close = difflib.get_close_matches(name, registry.method_names(), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"known methods: {', '.join(registry.method_names())}"
            problems.append(f"unknown method '{name}'; {hint}")
            continue
        if name in seen:
            problems.append(f"method '{name}' appears more than once; keep one entry")
            continue
        seen.add(name)
        method = registry.get_method(name)
        try:
            config = method.parse_config(raw_config)
        except ValidationError as exc:
            problems += [f"'{name}': {msg}" for msg in _config_messages(method.Config, exc)]
            continue
        except (TypeError, ValueError) as exc:
            problems.append(f"'{name}': {exc}")
            continue
        items.append(StrategyItem(name=name, config=config, tunable=tunable))
    return items, problems


def _config_messages(config_cls: type[MethodConfig], exc: ValidationError) -> list[str]:
    allowed = ", ".join(config_cls.model_fields) or "none"
    messages = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "config"
        if err["type"] == "extra_forbidden":
            messages.append(f"unknown config key '{key}' (allowed keys: {allowed})")
        else:
            got = err.get("input")
            messages.append(f"config key '{key}': {err['msg']} (got {got!r})")
    return messages
