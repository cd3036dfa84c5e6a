"""A class from the import path a strategy config keeps (atorch.class_ref.class_path), to check the path."""

from __future__ import annotations

import importlib
from typing import Any


def resolve_class(path: str) -> type:
    """Import the class named by an import path; raises ValueError naming the path on failure."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{path!r} is not an import path; write it as 'package.module.ClassName'")
    try:
        obj: Any = importlib.import_module(module_name)
        obj = getattr(obj, attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import class {path!r}: {exc}") from exc
    if not isinstance(obj, type):
        raise ValueError(f"{path!r} names {type(obj).__name__}, not a class")
    return obj
