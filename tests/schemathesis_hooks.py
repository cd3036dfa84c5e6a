"""schemathesis hooks for tests/test_server.py: besides each generated body, the same body with one of its
numbers made NaN, Infinity or -Infinity (JSON's non-standard tokens, as Python's json writes them), so that
every float field of every route meets a non-finite value. Those bodies go as the bytes Python's json writes
(schemathesis's own JSON encoder refuses non-finite numbers)."""

from __future__ import annotations

import json
import math
from typing import Any

import schemathesis
from hypothesis import strategies as st

NON_FINITE = (math.nan, math.inf, -math.inf)
MAX_LEAVES = 12  # numbers per body to make non-finite (a table has thousands)


def _paths(body: Any, path: tuple = ()) -> list[tuple]:
    """The paths of the numbers in ``body``, depth first."""
    if isinstance(body, bool):
        return []
    if isinstance(body, (int, float)):
        return [path]
    items = body.items() if isinstance(body, dict) else enumerate(body) if isinstance(body, list) else ()
    return [p for k, v in items for p in _paths(v, (*path, k))]


def _with(body: Any, path: tuple, value: float) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(body, dict):
        return {**body, head: _with(body[head], rest, value)}
    return [_with(v, rest, value) if i == head else v for i, v in enumerate(body)]


@schemathesis.hook
def flatmap_body(context: Any, body: Any) -> Any:
    variants = [json.dumps(_with(body, path, value)).encode()
                for path in _paths(body)[:MAX_LEAVES] for value in NON_FINITE]
    return st.sampled_from([body, *variants])
