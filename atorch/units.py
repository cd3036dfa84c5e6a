"""Sizes written by people ("6GiB", "512MB", a byte count), read with pydantic's ``ByteSize``."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import BeforeValidator, ByteSize, TypeAdapter, ValidationError

_BYTE_SIZE = TypeAdapter(ByteSize)
# ByteSize reads a number and a unit from the start of a string; the whole string must be one.
_WHOLE_SIZE = re.compile(r"\s*\d*\.?\d+\s*[A-Za-z]*\s*")


def parse_bytes(value: int | float | str | None, name: str = "memory_limit") -> int | None:
    """A byte count from an int or a string like "6GiB" / "512MB"; None stays None. ``name`` is the
    option the value came from, for the error."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a byte count or a size like '6GiB', not {value!r}")
    if isinstance(value, float):  # a float counts bytes (rounded down), as an int does
        if not math.isfinite(value):
            raise ValueError(f"{name} {value!r} is not a size; write bytes (e.g. 6442450944) or '6GiB'")
        value = int(value)
    if isinstance(value, int) and value <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    if isinstance(value, str) and not _WHOLE_SIZE.fullmatch(value):
        raise ValueError(f"{name} {value!r} is not a size; write bytes (e.g. 6442450944) or '6GiB'")
    try:
        size = int(_BYTE_SIZE.validate_python(value))
    except ValidationError as exc:
        error = exc.errors()[0]
        if error["type"] == "byte_size_unit":
            raise ValueError(f"{name} {value!r} has unknown unit {error['ctx']['unit']!r}; use one of B, KB, MB, GB, "
                             "TB, KiB, MiB, GiB, TiB") from None
        raise ValueError(f"{name} {value!r} is not a size; write bytes (e.g. 6442450944) or '6GiB'") from None
    if size <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return size


def _memory_limit(value: Any) -> int | None:
    return parse_bytes(value, "memory_limit")


# A memory size option: bytes as a ByteSize, refused with the reason (named after memory_limit, its one use).
MemorySize = Annotated[ByteSize, BeforeValidator(_memory_limit)]
