"""The optimization methods. Importing this package registers every method once."""

from atorch.opt_lib import (  # noqa: F401  (imported to register)
    activation_checkpoint,
    ds_3d_parallel,
    fp8,
    mixed_parallel,
    module_replace,
    parallel_mode,
    pipeline_parallel,
    precision,
    sharding,
    tensor_parallel,
    zero1,
)
from atorch.opt_lib.base import Categorical, IntRange, Method, MethodConfig
from atorch.opt_lib.compatibility import RULES, allowed_pairs, forbidden_pairs
from atorch.opt_lib.module_replace import register_replace_pair
from atorch.opt_lib.registry import APPLY_ORDER, get_method, method_names

__all__ = [
    "APPLY_ORDER", "RULES", "Categorical", "IntRange", "Method", "MethodConfig", "allowed_pairs",
    "forbidden_pairs", "get_method", "method_names", "register_replace_pair",
]
