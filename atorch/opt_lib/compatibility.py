"""Which methods cannot be combined, and why: a table of rules, not code paths.

A rule names two or more methods and, optionally, a condition on their configs (e.g. DeepSpeed's
implementation of a ZeRO stage, or parallel_mode's rank order). Each rule carries an ``example``:
a strategy it refuses, which the tests use to show that every rule really refuses before building.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations
from typing import Any

from atorch.opt_lib.base import MethodConfig
from atorch.opt_lib.deepspeed_zero import runs_on_fsdp2

Configs = dict[str, MethodConfig]


@dataclass(frozen=True)
class Rule:
    methods: tuple[str, ...]
    reason: str
    fix: str
    # Only a conflict when this holds for the configs of ``methods``; None means always.
    when: Callable[[Configs], bool] | None = None
    condition: str = ""  # human-readable form of ``when``
    example: tuple[Any, ...] = ()  # a strategy this rule refuses (default: the bare method names)

    def message(self) -> str:
        quoted = [f"'{m}'" for m in self.methods]
        cond = f" ({self.condition})" if self.condition else ""
        if len(quoted) == 2:
            return f"{quoted[0]} cannot be combined with {quoted[1]}{cond}: {self.reason}; {self.fix}"
        return f"{', '.join(quoted[:-1])} and {quoted[-1]} cannot be combined{cond}: {self.reason}; {self.fix}"

    def applies(self, configs: Configs) -> bool:
        return all(m in configs for m in self.methods) and (self.when is None or self.when(configs))

    def refused_example(self) -> list[Any]:
        return list(self.example) if self.example else list(self.methods)


def _deepspeed(name: str) -> Callable[[Configs], bool]:
    return lambda configs: getattr(configs[name], "implementation", None) == "deepspeed"


def _permuted_groups(configs: Configs, dim: str = "data") -> bool:
    """parallel_mode's rank_order puts a data group's (or a ``dim`` group's) ranks out of ascending order."""
    from atorch.parallel_layout import ParallelLayout

    mode = configs["parallel_mode"]
    if mode.rank_order is None:
        return False
    dims = tuple(mode.dims)
    if any(size < 1 for _, size in dims):  # not fitted to a world size yet: judge the fitted form
        return False
    try:
        layout = ParallelLayout(dims, tuple(mode.rank_order))
    except ValueError:  # sizes and order disagree: parallel_mode's own check reports that
        return False
    return not layout.groups_follow_coordinates(dim)


def _ddp_data_parallel(configs: Configs) -> bool:
    """The data dimension (size > 1) would be replicated by DDP: no fsdp, no zero2 over FSDP2, and no zero1 run as
    FSDP2 (zero1.runs_on_fsdp2)."""
    mode = configs.get("parallel_mode")
    data = dict(mode.dims).get("data", 1) if mode is not None else 1
    return data > 1 and not _fsdp2_sharded(configs)


def _fsdp2_sharded(configs: Configs) -> bool:
    """FSDP2 shards the parameters: fsdp, zero2 on FSDP2, or zero1 run as FSDP2 (zero1.runs_on_fsdp2: beside a
    tensor or expert dimension)."""
    zero2 = configs.get("zero2")
    return ("fsdp" in configs or (zero2 is not None and getattr(zero2, "implementation", None) == "fsdp2")
            or runs_on_fsdp2(configs))


_TP_DIMS = {"dims": [["data", 1], ["tensor", 1]]}
_PP_DIMS = {"dims": [["pipeline", 1], ["data", 1]]}


def _has_dim(name: str) -> Callable[[Configs], bool]:
    return lambda configs: configs.get("parallel_mode") is not None and name in dict(configs["parallel_mode"].dims)


_3D_DIMS = {"dims": [["tensor", 1], ["pipeline", 1], ["data", 1]]}

RULES: tuple[Rule, ...] = (
    Rule(("zero1", "zero2"), "both shard optimizer state", "keep one ZeRO stage"),
    Rule(("zero1", "fsdp"), "fsdp already shards optimizer state", "drop 'zero1'"),
    Rule(("zero2", "fsdp"), "fsdp already shards gradients and optimizer state", "drop 'zero2'"),
    Rule(
        ("half", "amp_native"), "'half' casts the whole model while 'amp_native' autocasts fp32 weights",
        "keep one of them",
    ),
    *(
        Rule(
            (zero, precision), "DeepSpeed manages precision inside its engine",
            f"use implementation 'fsdp2'/'torch' for '{zero}', or drop '{precision}'",
            when=_deepspeed(zero), condition=f"{zero} implementation='deepspeed'",
            example=((zero, {"implementation": "deepspeed"}), precision),
        )
        for zero in ("zero1", "zero2")
        for precision in ("amp_native", "half")
    ),
    *(
        Rule(
            ("parallel_mode", sharding),
            "torch numbers a process group's ranks in ascending order, so with this rank_order FSDP2 would "
            "place each shard by group rank while its checkpoint metadata follows the mesh position "
            "(a saved checkpoint would reload the wrong weights)",
            "give each data-parallel group's ranks in ascending order (or drop rank_order)",
            when=_permuted_groups, condition="rank_order permutes a data-parallel group",
            example=(("parallel_mode", {"dims": [["data", 2]], "rank_order": [1, 0]}), sharding),
        )
        for sharding in ("fsdp", "zero2")
    ),
    # Tensor-parallel parameters are DTensors: torch's DDP and ZeroRedundancyOptimizer broadcast them with
    # plain c10d collectives, which DTensor refuses ("c10d.broadcast_ does not have a sharding strategy"); zero1
    # then runs as FSDP2 over the data dimension (zero1.py), so it is not refused.
    # (tensor_parallel with data size > 1 and no fsdp replicates the shards itself: tensor_data_parallel.py;
    # with a pipeline dimension too, the replicated stages' averaging is not proven on tensor-parallel shards.)
    Rule(
        ("tensor_parallel", "pipeline_parallel"),
        "replicating tensor-parallel pipeline stages over the data dimension is not supported",
        "add 'fsdp' (or 'zero2' / 'zero1', FSDP2 there too) to shard over the data dimension (FSDP2 per stage, "
        "tensor parallel inside)",
        when=_ddp_data_parallel, condition="data size > 1 without fsdp, zero2 or zero1",
        example=("tensor_parallel", "pipeline_parallel",
                 ("parallel_mode", {"dims": [["pipeline", 1], ["data", 2], ["tensor", 1]]})),
    ),
    Rule(
        ("tensor_parallel", "zero2"), "DeepSpeed's engine takes plain tensors, not tensor-parallel DTensors",
        "use implementation 'fsdp2' for 'zero2', or 'fsdp'",
        when=_deepspeed("zero2"), condition="zero2 implementation='deepspeed'",
        example=("tensor_parallel", ("parallel_mode", _TP_DIMS), ("zero2", {"implementation": "deepspeed"})),
    ),
    # Pipeline parallel: the schedule runs forward and backward of every micro-batch itself (fp16's loss
    # scaling runs inside it: pipeline_parallel.PipelineRunner).
    *(
        Rule(
            ("pipeline_parallel", zero), "DeepSpeed's engine owns forward, backward and step, which the pipeline "
            "schedule runs", f"use implementation 'fsdp2'/'torch' for '{zero}', or 'fsdp'",
            when=_deepspeed(zero), condition=f"{zero} implementation='deepspeed'",
            example=(("parallel_mode", _PP_DIMS), "pipeline_parallel", (zero, {"implementation": "deepspeed"})),
        )
        for zero in ("zero1", "zero2")
    ),
    # compile compiles the model's forward, which a pipeline schedule never calls (it calls each stage).
    Rule(("compile", "pipeline_parallel"), "the pipeline schedule calls each stage, never the compiled model",
         "drop 'compile'", example=(("parallel_mode", _PP_DIMS), "pipeline_parallel", "compile")),
    Rule(("compile", "mixed_parallel"), "the pipeline schedule calls each stage, never the compiled model",
         "drop 'compile'", when=_has_dim("pipeline"), condition="a pipeline dimension",
         example=(("parallel_mode", _3D_DIMS), "mixed_parallel", "compile")),
    # mixed_parallel stands for tensor_parallel and pipeline_parallel on the dimensions the layout has: their
    # limits hold for it too.
    *(
        Rule(("mixed_parallel", single), f"mixed_parallel already applies '{single}' on its dimension",
             f"drop '{single}' (configure it inside mixed_parallel)",
             example=(("parallel_mode", _3D_DIMS), "mixed_parallel", single))
        for single in ("tensor_parallel", "pipeline_parallel")
    ),
    Rule(
        ("mixed_parallel", "parallel_mode"),
        "DDP cannot replicate tensor-parallel (DTensor) parameters over the data dimension",
        "add 'fsdp' (or 'zero2' / 'zero1', FSDP2 there too) to shard over the data dimension",
        when=lambda c: _has_dim("tensor")(c) and _ddp_data_parallel(c),
        condition="a tensor dimension, data size > 1 without fsdp, zero2 or zero1",
        example=("mixed_parallel", ("parallel_mode", {"dims": [["tensor", 1], ["pipeline", 1], ["data", 2]]})),
    ),
    *(
        Rule(
            ("mixed_parallel", zero), "DeepSpeed's engine takes neither tensor-parallel DTensors nor a pipeline "
            "schedule", f"use implementation 'fsdp2'/'torch' for '{zero}', or 'fsdp'",
            when=_deepspeed(zero), condition=f"{zero} implementation='deepspeed'",
            example=(("parallel_mode", _3D_DIMS), "mixed_parallel", (zero, {"implementation": "deepspeed"})),
        )
        for zero in ("zero1", "zero2")
    ),
)


# ds_3d_parallel: DeepSpeed's pipeline engine owns the split, the schedule, precision, recompute and ZeRO-1.
_DS3D_ALONE: tuple[tuple[str, str, str], ...] = (
    ("pipeline_parallel", "both split the model into pipeline stages",
     "keep one: ds_3d_parallel (DeepSpeed's engine) or pipeline_parallel (torch.distributed.pipelining)"),
    ("mixed_parallel", "both split the model into pipeline stages", "keep one of them"),
    ("tensor_parallel", "DeepSpeed's pipeline engine takes plain tensors, not tensor-parallel DTensors",
     "use mixed_parallel for tensor × pipeline"),
    ("fsdp", "DeepSpeed's pipeline engine supports ZeRO stage 1 at most (it accumulates whole gradients over "
     "micro-batches)", "drop 'fsdp' (ds_3d_parallel shards optimizer state over the data dimension)"),
    ("zero2", "DeepSpeed's pipeline engine supports ZeRO stage 1 at most (it accumulates whole gradients over "
     "micro-batches)", "drop 'zero2' (ds_3d_parallel shards optimizer state over the data dimension)"),
    ("zero1", "ds_3d_parallel already runs ZeRO-1 on the data dimension", "drop 'zero1' (see ds_3d_parallel's "
     "zero_stage)"),
    ("half", "DeepSpeed manages precision inside its engine, which ds_3d_parallel runs in fp32", "drop 'half'"),
    ("amp_native", "DeepSpeed manages precision inside its engine, which ds_3d_parallel runs in fp32",
     "drop 'amp_native'"),
    ("fp8", "the fp8 layers are not carried into DeepSpeed's pipeline layers", "drop 'fp8'"),
    ("checkpoint", "DeepSpeed's pipeline engine recomputes activations itself",
     "drop 'checkpoint' and set ds_3d_parallel's activation_checkpoint_interval"),
    ("compile", "DeepSpeed's pipeline engine takes the model before compile would apply", "drop 'compile'"),
)


def _tensor_size_above_one(configs: Configs) -> bool:
    mode = configs.get("parallel_mode")
    return mode is not None and dict(mode.dims).get("tensor", 1) > 1


RULES += (
    *(
        Rule(("ds_3d_parallel", other), reason, fix, example=(("parallel_mode", _PP_DIMS), "ds_3d_parallel", other))
        for other, reason, fix in _DS3D_ALONE
    ),
    Rule(
        ("ds_3d_parallel", "parallel_mode"),
        "DeepSpeed's pipeline engine does not split layers over a tensor dimension (its 'model' axis expects layers "
        "written for Megatron's tensor parallelism)",
        "use mixed_parallel for tensor × pipeline, or give the 'tensor' dimension size 1",
        when=_tensor_size_above_one, condition="tensor size > 1",
        example=(("parallel_mode", {"dims": [["pipeline", 1], ["data", 1], ["tensor", 2]]}), "ds_3d_parallel"),
    ),
    Rule(
        ("ds_3d_parallel", "parallel_mode"),
        "DeepSpeed's topology numbers ranks in its own (row-major) order",
        "drop rank_order", when=lambda c: c["parallel_mode"].rank_order is not None, condition="rank_order given",
        example=(("parallel_mode", {"dims": [["pipeline", 2], ["data", 1]], "rank_order": [1, 0]}), "ds_3d_parallel"),
    ),
)


# expert_parallel: the experts split over parallel_mode's 'expert' dimension (expert_parallel.py).
_EP_DIMS = {"dims": [["expert", 2], ["data", 1]]}
_EP_ALONE: tuple[tuple[str, str, str], ...] = (
    ("ds_3d_parallel", "DeepSpeed's pipeline engine takes plain tensors, not expert-parallel DTensors",
     "drop 'ds_3d_parallel'"),
)


RULES += (
    # (expert_parallel without any parallel_mode: ExpertParallel.check says the same)
    Rule(("expert_parallel", "parallel_mode"), "expert_parallel splits the experts over parallel_mode's 'expert' "
         "dimension", "add one, e.g. ('parallel_mode', {'dims': [['expert', 2], ['data', -1]]})",
         when=lambda c: not _has_dim("expert")(c), condition="no 'expert' dimension in parallel_mode",
         example=("expert_parallel", ("parallel_mode", {"dims": [["data", 2]]}))),
    *(
        Rule(("expert_parallel", other), reason, fix, example=(("parallel_mode", _EP_DIMS), "expert_parallel", other))
        for other, reason, fix in _EP_ALONE
    ),
    Rule(
        ("expert_parallel", "parallel_mode"),
        "torch numbers a process group's ranks in ascending order, so with this rank_order the experts would be "
        "dispatched by group rank to ranks whose DTensor shard (placed by mesh position) holds other experts",
        "give each expert group's ranks in ascending order (or drop rank_order)",
        when=lambda c: _permuted_groups(c, "expert"), condition="rank_order permutes an expert group",
        example=(("parallel_mode", {"dims": [["expert", 2], ["data", 1]], "rank_order": [1, 0]}), "expert_parallel"),
    ),
    # zero1 (torch) next to experts runs as FSDP2 over the data × expert ranks (zero1.runs_on_fsdp2)
    *(
        Rule(
            ("expert_parallel", zero), "DeepSpeed's engine takes plain tensors, not expert-parallel DTensors",
            f"use implementation '{fix}' for '{zero}', or 'fsdp'",
            when=_deepspeed(zero), condition=f"{zero} implementation='deepspeed'",
            example=(("parallel_mode", _EP_DIMS), "expert_parallel", (zero, {"implementation": "deepspeed"})),
        )
        for zero, fix in (("zero1", "torch"), ("zero2", "fsdp2"))
    ),
)


# context_parallel: each sequence split over parallel_mode's 'context' dimension (context_parallel.py).
_CP_DIMS = {"dims": [["context", 2], ["data", 1]]}
_CP_ALONE: tuple[tuple[str, str, str], ...] = (
    ("ds_3d_parallel", "DeepSpeed's pipeline engine splits no sequence", "drop 'ds_3d_parallel'"),
)

def _sharded_over_data_and_context(configs: Configs) -> bool:
    """FSDP2 shards the parameters (fsdp, zero2 on FSDP2, zero1 beside a tensor dimension) over data × context with
    both sizes above 1 (as fitted to the world size)."""
    mode = configs.get("parallel_mode")
    dims = dict(mode.dims) if mode is not None else {}
    return _fsdp2_sharded(configs) and dims.get("data", 1) > 1 and dims.get("context", 1) > 1


RULES += (
    # (context_parallel without any parallel_mode: ContextParallel.check says the same)
    Rule(("context_parallel", "parallel_mode"), "context_parallel splits each sequence over parallel_mode's "
         "'context' dimension", "add one, e.g. ('parallel_mode', {'dims': [['context', 2], ['data', -1]]})",
         when=lambda c: not _has_dim("context")(c), condition="no 'context' dimension in parallel_mode",
         example=("context_parallel", ("parallel_mode", {"dims": [["data", 2]]}))),
    *(
        Rule(("context_parallel", other), reason, fix,
             example=(("parallel_mode", _CP_DIMS), "context_parallel", other))
        for other, reason, fix in _CP_ALONE
    ),
    Rule(
        ("context_parallel", "tensor_parallel"), "FSDP2 would shard the tensor-parallel DTensors over a data × "
        "context mesh, which torch's DeviceMesh flattens in another order than the process group numbers its ranks "
        "(each rank would hold another rank's shard)", "keep the data ranks unsharded (drop the sharding method: the "
        "tensor-parallel replicas average their gradients over data × context), or set data to 1 (tensor × context)",
        when=_sharded_over_data_and_context,
        condition="sharded by FSDP2 over data and context sizes both above 1",
        example=(("parallel_mode", {"dims": [["tensor", 1], ["context", 2], ["data", 2]]}), "context_parallel",
                 "tensor_parallel", "fsdp"),
    ),
    Rule(
        ("context_parallel", "zero2"), "DeepSpeed's engine averages gradients over its own data-parallel group, "
        "not over data × context", "use implementation 'fsdp2' for 'zero2', or 'fsdp'",
        when=_deepspeed("zero2"), condition="zero2 implementation='deepspeed'",
        example=(("parallel_mode", _CP_DIMS), "context_parallel", ("zero2", {"implementation": "deepspeed"})),
    ),
    Rule(
        ("context_parallel", "zero1"), "DeepSpeed's engine averages gradients over its own data-parallel group, "
        "not over data × context", "use implementation 'torch' for 'zero1'",
        when=_deepspeed("zero1"), condition="zero1 implementation='deepspeed'",
        example=(("parallel_mode", _CP_DIMS), "context_parallel", ("zero1", {"implementation": "deepspeed"})),
    ),
)


# Rules that came with methods registered outside atorch (registry.register_method), after the table above.
_added: tuple[Rule, ...] = ()


def add_rules(rules: tuple[Rule, ...]) -> None:
    global _added
    _added = (*_added, *rules)


def added_rules() -> tuple[Rule, ...]:
    return _added


def set_added_rules(rules: tuple[Rule, ...]) -> None:
    """Put back what ``added_rules`` returned (registry.scoped)."""
    global _added
    _added = rules


def all_rules() -> tuple[Rule, ...]:
    """The table and the rules registered methods added."""
    return (*RULES, *_added)


def conflicts_in(configs: Configs) -> list[str]:
    """Messages for every rule the given methods and configs break."""
    return [rule.message() for rule in all_rules() if rule.applies(configs)]


def forbidden_pairs() -> set[frozenset[str]]:
    """Pairs that conflict whatever their configs."""
    return {frozenset(r.methods) for r in all_rules() if r.when is None and len(r.methods) == 2}


def allowed_pairs(names: list[str]) -> list[tuple[str, str]]:
    """Every pair of the given methods that the table allows with default configs."""
    forbidden = forbidden_pairs()
    return [(a, b) for a, b in combinations(names, 2) if frozenset((a, b)) not in forbidden]
