"""The optimization methods: one module per method family, one registry (``registry.py``: it loads them)."""

from atorch.opt_lib.base import Categorical, IntRange, Method, MethodConfig
from atorch.opt_lib.compatibility import RULES, allowed_pairs, forbidden_pairs
from atorch.opt_lib.module_replace import register_replace_pair
from atorch.opt_lib.registry import APPLY_ORDER, get_method, method_names

__all__ = [
    "APPLY_ORDER", "RULES", "Categorical", "IntRange", "Method", "MethodConfig", "allowed_pairs",
    "forbidden_pairs", "get_method", "method_names", "register_replace_pair",
]
