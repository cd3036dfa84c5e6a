"""ATorch's ``atorch.auto.opt_lib.module_replace_optimization``: ``register_replace_pair``."""

from atorch.opt_lib.module_replace import register_replace_pair

__all__ = ["register_replace_pair"]
