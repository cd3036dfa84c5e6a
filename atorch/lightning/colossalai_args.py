"""lightning-colossalai's ``ColossalAIStrategy`` arguments, each with what to give ``ATorchStrategy`` instead.

ATorchStrategy refuses them (they have no effect on atorch's engine); its error names the equivalent of each.
"""

from __future__ import annotations

_UNITS = ("FSDP2 shards by units, not chunks: load_strategy=[('fsdp', {'atorch_wrap_cls': (MyBlock,)})] "
          "or {'wrap_min_num_params': N}")
_SCALER = ("precision='16-mixed' uses torch's GradScaler with its defaults (init_scale 2**16, growth_factor 2, "
           "backoff_factor 0.5, growth_interval 2000); to set them use the Booster's plugins (initial_scale=...)")

EQUIVALENTS = {
    "use_chunk": _UNITS,
    "chunk_size": _UNITS,
    "min_chunk_size": _UNITS,
    "chunk_search_range": _UNITS,
    "chunk_search_n_grids": _UNITS,
    "enable_distributed_storage": "load_strategy=['fsdp'] shards parameters over the data-parallel ranks",
    "placement_policy": "'cpu': load_strategy=[('fsdp', {'cpu_offload': True})]; 'cuda': load_strategy=['fsdp']; "
                        "'auto' (adaptive placement) has none: pick one of the two",
    "gpu_margin_mem_ratio": "none (Gemini's adaptive placement); memory_limit=... bounds the automatic search",
    "force_outputs_fp32": "none: outputs keep the autocast dtype; cast them in your loss (output.float())",
    "initial_scale": _SCALER,
    "growth_factor": _SCALER,
    "backoff_factor": _SCALER,
    "growth_interval": _SCALER,
    "min_scale": "none: torch's GradScaler has no minimum scale",
    "max_scale": "none: torch's GradScaler has no maximum scale",
    "hysteresis": "none: torch's GradScaler lowers the scale at the first overflow",
}


def equivalents_of(names: list[str]) -> list[str]:
    """'name: what to write instead' for each Colossal-AI argument among ``names``."""
    return [f"{name} (ColossalAIStrategy): {EQUIVALENTS[name]}" for name in names if name in EQUIVALENTS]
