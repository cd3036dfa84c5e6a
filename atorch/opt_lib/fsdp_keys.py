"""ATorch's and torch FSDP1's config keys for fsdp / zero2, read as their FSDP2 equivalents or refused with them.

ATorch documents that its fsdp config takes "all FSDP arguments plus some ATorch-defined arguments". Each is
mapped here onto atorch's keys where FSDP2 has the same meaning, accepted as a documented no-op where FSDP2 does
it by itself, or refused with the exact key or method to write instead.
"""

from __future__ import annotations

import functools
from typing import Any

# ATorch's names -> atorch's
RENAMED = {
    "atorch_size_based_min_num_params": "wrap_min_num_params",
    "atorch_ignored_cls": "ignored_modules",
    "fsdp_wrap_params_outmost": "wrap_trainable_outmost",
}

_NO_OPS = ("backward_prefetch",)  # FSDP2 prefetches the next unit's all-gather in backward by itself

_HYBRID = ("hybrid sharding (shard inside a node, replicate across nodes) is not available: fsdp/zero2 shard over "
           "the whole 'data' dimension; use 'fsdp' (or 'zero2') without sharding_strategy")
_MIXED_PRECISION = ("FSDP's mixed_precision: add ('amp_native', {'dtype': 'bf16'}) (or 'fp16') next to the sharding "
                    "method instead: FSDP2 then gathers 16-bit parameters and reduces gradients in fp32 "
                    "(MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)) over fp32 master weights")


def _name(value: Any) -> Any:
    """An enum member (ShardingStrategy.FULL_SHARD) or its name as a string: the upper-case name."""
    value = getattr(value, "name", value)
    return value.upper() if isinstance(value, str) else value


def _sharding_strategy(value: Any, method: str) -> dict[str, Any]:
    name = _name(value)
    if name == "FULL_SHARD":
        if method == "zero2":
            raise ValueError("sharding_strategy FULL_SHARD also shards parameters (ZeRO-3): use 'fsdp' instead of "
                             "'zero2'")
        return {"reshard_after_forward": True}
    if name == "SHARD_GRAD_OP":
        return {"reshard_after_forward": False} if method == "fsdp" else {}
    if name == "NO_SHARD":
        raise ValueError("sharding_strategy NO_SHARD is plain data parallel: drop the sharding method and keep "
                         "'parallel_mode' (DDP)")
    if name in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        raise ValueError(_HYBRID)
    raise ValueError(f"sharding_strategy {value!r} is not one of FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD")


def _auto_wrap_policy(policy: Any) -> dict[str, Any]:
    """torch's wrap policies as units: transformer_auto_wrap_policy / ModuleWrapPolicy -> atorch_wrap_cls,
    size_based_auto_wrap_policy -> wrap_min_num_params."""
    if policy is None:
        return {}
    classes = getattr(policy, "_module_classes", None)  # ModuleWrapPolicy
    if classes:
        return {"atorch_wrap_cls": tuple(classes)}
    if isinstance(policy, functools.partial):
        func = getattr(policy.func, "__name__", "")
        if func == "transformer_auto_wrap_policy" and policy.keywords.get("transformer_layer_cls"):
            return {"atorch_wrap_cls": tuple(policy.keywords["transformer_layer_cls"])}
        if func == "size_based_auto_wrap_policy":
            return {"wrap_min_num_params": int(policy.keywords.get("min_num_params", 100_000_000))}
    raise ValueError(f"auto_wrap_policy {policy!r} has no FSDP2 equivalent here: give the unit classes as "
                     "atorch_wrap_cls=(MyBlock,) or a size as wrap_min_num_params=N")


def translate(value: Any, method: str) -> Any:
    """A raw fsdp / zero2 config with ATorch's and FSDP1's keys replaced by atorch's (pydantic 'before')."""
    if not isinstance(value, dict):
        return value
    value, found = dict(value), {}
    for old, new in RENAMED.items():
        if old in value:
            if new in value:
                raise ValueError(f"{old} is ATorch's name for {new}: give one of them")
            found[new] = value.pop(old)
    for key in _NO_OPS:
        value.pop(key, None)
    if "not_use_fsdp" in value:
        if method != "zero2":
            raise ValueError("not_use_fsdp is a zero2 key (ATorch: fairscale's ZeRO-2)")
        if value.pop("not_use_fsdp"):
            raise ValueError("not_use_fsdp=True asks for fairscale's ZeRO-2, which atorch does not have: its "
                             "equivalent (parameters replicated, gradients and optimizer state sharded) is zero2 "
                             "{'implementation': 'deepspeed'}; the default zero2 is FSDP2 without resharding")
    if value.get("mixed_precision") is not None:
        raise ValueError(_MIXED_PRECISION)
    value.pop("mixed_precision", None)
    mapped: dict[str, Any] = {}
    if "sharding_strategy" in value:
        mapped.update(_sharding_strategy(value.pop("sharding_strategy"), method))
    if "auto_wrap_policy" in value:
        mapped.update(_auto_wrap_policy(value.pop("auto_wrap_policy")))
    for key, new in {**found, **mapped}.items():
        if key in value and value[key] != new:
            raise ValueError(f"{key}={value[key]!r} contradicts the FSDP1/ATorch key that means {key}={new!r}")
        value[key] = new
    return value
