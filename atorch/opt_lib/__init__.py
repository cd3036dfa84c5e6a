"""The optimization methods: one module per method family, one registry (``registry.py``: it loads them)."""

from atorch.opt_lib.base import Categorical, IntRange, Method, MethodConfig
from atorch.opt_lib.build_state import Build
from atorch.opt_lib.compatibility import RULES, Rule, allowed_pairs, forbidden_pairs
from atorch.opt_lib.module_replace import register_replace_pair
from atorch.opt_lib.registry import apply_order, get_method, method_names, register_method, scoped

__all__ = [
    "RULES", "Build", "Categorical", "IntRange", "Method", "MethodConfig", "Rule", "allowed_pairs", "apply_order",
    "forbidden_pairs", "get_method", "method_names", "register_method", "register_replace_pair", "scoped",
]
