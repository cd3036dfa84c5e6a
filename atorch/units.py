"""Parsing of human-written sizes such as "6GiB"."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str | None) -> int | None:
    """Return a byte count from an int or a string like "6GiB" / "512MB"; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"memory_limit must be a byte count or a size like '6GiB', not {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str) and (match := _SIZE.match(value)):
        number, unit = float(match.group(1)), match.group(2).lower()
    else:
        raise ValueError(f"memory_limit {value!r} is not a size; write bytes (e.g. 6442450944) or '6GiB'")
    if unit not in _UNITS:
        raise ValueError(
            f"memory_limit {value!r} has unknown unit {unit!r}; use one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        )
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"memory_limit must be positive, got {value!r}")
    return size
