"""ATorch's ``atorch.auto.opt_lib.ds_3d_parallel_optimization``.

ATorch's ``DeepSpeed3DParallelConfig`` (a DeepSpeed config dict, ``tpinfo``, ``custom_patcher``, ``batch_fn``)
has no counterpart object: atorch's ``ds_3d_parallel`` takes a plain config. Importing it says what to write.
"""

from typing import Any

_EQUIVALENT = {
    "DeepSpeed3DParallelConfig": (
        "atorch's ds_3d_parallel takes a plain config instead of DeepSpeed3DParallelConfig: "
        "load_strategy=[('parallel_mode', ([('pipeline', 2), ('data', -1)], None)), ('ds_3d_parallel', "
        "{'micro_batches': 4, 'partition_method': 'cost', 'zero_stage': 1})] (see docs/methods.md, ds_3d_parallel)"
    ),
}


def __getattr__(name: str) -> Any:
    if name in _EQUIVALENT:
        raise ImportError(_EQUIVALENT[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
