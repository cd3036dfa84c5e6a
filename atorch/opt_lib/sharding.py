"""fsdp and zero2: parameter/gradient/optimizer-state sharding with FSDP2 ``fully_shard``."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from pydantic import Field, model_validator
from torch import nn

from atorch.class_ref import ClassRefs, matches
from atorch.layer_drop import layer_drop_problems, layer_drop_settings
from atorch.log import get_logger
from atorch.meta_init import ShardMaterialiser, is_meta
from atorch.opt_lib.base import Categorical, Dimension, Method, MethodConfig, SearchRole
from atorch.opt_lib.blocks import block_classes
from atorch.opt_lib.cost_facts import Collective, CostFacts, Gathering
from atorch.opt_lib.deepspeed_zero import UNTRACED_ENGINE, ZeroConfig, deepspeed_searchable, start_deepspeed
from atorch.opt_lib.expert_parallel import is_expert_param
from atorch.opt_lib.fsdp_keys import translate
from atorch.opt_lib.registry import register

if TYPE_CHECKING:
    from atorch.opt_lib.build_state import Build

logger = get_logger(__name__)


# what FSDP2's units do inside the model's layers (atorch.layer_drop)
SHARDED_LAYERS = "sharding gathers each layer's parameters and reduces its gradients inside it"


class ShardingConfig(MethodConfig):
    """Options shared by fsdp and zero2."""

    atorch_wrap_cls: ClassRefs = Field(
        default=None,
        description="module classes or names sharded as units; null: detected blocks "
        "(or size-based units if wrap_min_num_params is set)",
    )
    wrap_min_num_params: int | None = Field(
        default=None, gt=0,
        description="shard every module holding at least this many not-yet-sharded parameters, children first",
    )
    ignored_modules: ClassRefs = Field(
        default=None,
        description="classes, class names or module names kept whole on every rank (gradients still averaged)",
    )
    cpu_offload: bool = Field(
        default=False, description="keep sharded parameters, gradients and optimizer state in CPU memory"
    )
    sync_module_states: bool = Field(
        default=True, description="broadcast rank 0's weights before sharding so all ranks start identical"
    )
    wrap_trainable_outmost: bool = Field(
        default=False, description="units hold only frozen parameters; the trainable ones (LoRA adapters) are "
        "sharded together in the root unit (ATorch's key; also fsdp_wrap_params_outmost)",
    )

    @model_validator(mode="before")
    @classmethod
    def _atorch_keys(cls, value: Any) -> Any:
        # ATorch's names and torch FSDP1's arguments (atorch/opt_lib/fsdp_keys.py)
        return translate(value, "fsdp" if "reshard_after_forward" in cls.model_fields else "zero2")


class FSDPConfig(ShardingConfig):
    """fsdp's options: the shared ones, plus resharding and ATorch's FSDP1 keys (accepted, no-ops)."""

    reshard_after_forward: bool = Field(
        default=True, description="free gathered parameters after forward (ZeRO-3); False keeps them until backward"
    )
    use_orig_params: bool = Field(
        default=True, description="FSDP1 option accepted for compatibility; FSDP2 always keeps the original parameters"
    )
    limit_all_gathers: bool = Field(
        default=True, description="FSDP1 option accepted for compatibility; FSDP2 always bounds in-flight all-gathers"
    )
    forward_prefetch: bool = Field(
        default=False, description="FSDP1 option accepted for compatibility; FSDP2 prefetches the next unit itself"
    )


class Zero2Config(ZeroConfig, ShardingConfig):
    """zero2's options: the shared ones, plus the implementation (ATorch's ``use_ds_zero``)."""

    implementation: Literal["fsdp2", "deepspeed"] = Field(
        default="fsdp2",
        description="fsdp2: FSDP2 without resharding after forward; deepspeed: DeepSpeed's ZeRO stage 2 engine "
        "(the other keys then do not apply)",
    )


def _parameter_uses(module: nn.Module) -> Counter[int]:
    """How many times each parameter (by id) is registered under the module: >1 for tied weights."""
    return Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))


def _used_outside(module: nn.Module, model_uses: Counter[int]) -> bool:
    """True if a parameter of the module is also used elsewhere in the model (a weight tied across
    modules, such as BERT's word embeddings and masked-LM decoder). FSDP2 manages each parameter in
    one unit, so such a module cannot be a unit: its parameters fall to an enclosing unit or the root."""
    return any(model_uses[pid] > n for pid, n in _parameter_uses(module).items())


def _size_based_targets(model: nn.Module, min_params: int, assigned: set[int] | None = None) -> list[nn.Module]:
    """Modules (children first) that gather at least min_params parameters not yet assigned (to a
    chosen module, or to a module in ``assigned``: the class units)."""
    assigned = assigned or set()
    chosen: list[nn.Module] = []
    uses = _parameter_uses(model)

    def visit(module: nn.Module) -> int:
        count = sum(p.numel() for p in module.parameters(recurse=False))
        count += sum(visit(child) for child in module.children())
        # Containers without a forward (ModuleList/ModuleDict) cannot be units; their children can.
        is_container = isinstance(module, (nn.ModuleList, nn.ModuleDict))
        if module is not model and not is_container and count >= min_params and not _used_outside(module, uses):
            chosen.append(module)
            return 0
        return 0 if id(module) in assigned else count

    visit(model)
    return chosen


def _post_order(model: nn.Module) -> list[nn.Module]:
    """Every module below the root, children before their parent."""
    order: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        order.append(module)

    visit(model)
    return order[:-1]


def _frozen_parts(module: nn.Module) -> list[nn.Module]:
    """The largest modules under ``module`` (itself included) that hold parameters, none of them trainable
    (containers without a forward are looked into: they cannot be units)."""
    params = list(module.parameters())
    if not params:
        return []
    if not any(p.requires_grad for p in params) and not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return [module]
    return [part for child in module.children() for part in _frozen_parts(child)]


def choose_units(model: nn.Module, classes: tuple[str, ...] | None, min_params: int | None,
                 trainable_outmost: bool = False) -> list[nn.Module]:
    """The modules to shard as units, deepest first so that each is sharded after the units inside
    it (FSDP2 needs that when classes nest or overlap with size-based units). Modules that hold a
    parameter also used outside them (tied weights) are left out. ``trainable_outmost`` (ATorch's
    wrap_trainable_outmost): a unit holding trainable parameters is replaced by its frozen parts, so that
    every trainable parameter falls to the root unit (one gather and one reduce for a LoRA's adapters)."""
    wanted: set[int] = set()
    if classes:
        wanted |= {id(m) for m in model.modules() if m is not model and matches(m, classes)}
    if min_params:
        wanted |= {id(m) for m in _size_based_targets(model, min_params, assigned=set(wanted))}
    uses = _parameter_uses(model)
    if trainable_outmost:
        by_id = {id(m): m for m in model.modules()}
        wanted = {id(part) for unit in wanted for part in _frozen_parts(by_id[unit])}
    units, seen = [], set()
    for module in _post_order(model):
        if id(module) in wanted and id(module) not in seen and not _used_outside(module, uses):
            seen.add(id(module))  # a module reachable by two paths is sharded once
            units.append(module)
    return units


def sequential_units(model: nn.Module) -> list[nn.Module]:
    """Units of a plain nn.Sequential without repeated blocks (a CNN): by size, as torch's size-based policy,
    each gathering at least an eighth of the model, so that its larger layers are gathered one at a time
    rather than all at once with the root. None for any other model."""
    if type(model).forward is not nn.Sequential.forward:
        return []
    return choose_units(model, (), max(1, sum(p.numel() for p in model.parameters()) // 8))


def _ignored_modules(model: nn.Module, refs: tuple[str, ...] | None) -> list[nn.Module]:
    if not refs:
        return []
    return [m for name, m in model.named_modules() if name in refs or matches(m, refs)]


def sharding_problems(model: nn.Module, config: ShardingConfig) -> list[str]:
    problems = []
    if config.atorch_wrap_cls and not any(matches(m, config.atorch_wrap_cls) for m in model.modules()):
        problems.append(f"atorch_wrap_cls {list(config.atorch_wrap_cls)} matches no module of the model")
    if config.ignored_modules and not _ignored_modules(model, config.ignored_modules):
        problems.append(
            f"ignored_modules {list(config.ignored_modules)} match no module of the model; "
            "use classes, class names or module names such as 'lm_head'"
        )
    return problems


def _average_grads_of(params: set[nn.Parameter], group: Any, size: int, sync: dict[str, bool]) -> None:
    """FSDP leaves ignored parameters alone; keep them in step across ranks by averaging grads."""
    def hook(param: torch.Tensor) -> None:
        if sync["enabled"] and param.grad is not None:
            dist.all_reduce(param.grad, group=group)
            param.grad.div_(size)

    for param in params:
        param.register_post_accumulate_grad_hook(hook)


def broadcast_from_first(module: nn.Module, mesh: Any) -> None:
    """Make every rank of the mesh hold the first rank's parameters and buffers."""
    if mesh.size() == 1:
        return
    from torch.distributed.tensor import DTensor

    group, src = mesh.get_group(), int(mesh.mesh.flatten()[0])
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if is_expert_param(tensor):  # [expert_parallel] each rank's own experts (expert_parallel.py)
                continue
            # A tensor-parallel parameter: each data rank holds the same shard, broadcast that.
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor.data
            dist.broadcast(local, src=src, group=group)


def shard_model(ctx: Any, config: ShardingConfig, reshard_after_forward: bool, label: str) -> None:
    """Wrap ctx.model's units and root with FSDP2 over the data-parallel mesh (no communication:
    FSDP2 gathers on first forward; the initial weights are made equal beforehand by shard_over_data)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    model: nn.Module = ctx.model
    mesh = ctx.data_mesh
    # Units: the given classes; else size-based units if asked for; else the detected blocks.
    classes = config.atorch_wrap_cls or (() if config.wrap_min_num_params else block_classes(model))
    targets = choose_units(model, classes, config.wrap_min_num_params, config.wrap_trainable_outmost)
    if not targets and not classes and not config.wrap_min_num_params:
        targets = sequential_units(model)
        if targets:
            logger.info("%s: an nn.Sequential without repeated blocks: %d units by size", label, len(targets))
    if not targets:
        why = f"{list(classes)} give no module that can be a unit" if classes else "no repeated blocks detected"
        logger.warning(
            "%s: no units found (%s), so only the root is sharded: every rank gathers all parameters at once "
            "and saves little memory; give atorch_wrap_cls (your block classes) or wrap_min_num_params",
            label, why,
        )
    ignored_modules = _ignored_modules(model, config.ignored_modules)
    # A meta-device model is materialised one unit at a time, identically on every rank (no broadcast);
    # modules kept whole first, so that the parameters named as ignored are the real ones.
    materialiser = ShardMaterialiser(model, ctx.env.device) if is_meta(model) else None
    for module in ignored_modules if materialiser is not None else []:
        materialiser.before_shard(module)
    ignored = {p for m in ignored_modules for p in m.parameters()}
    experts = {p for p in model.parameters() if is_expert_param(p)}  # [expert_parallel] averaged over their replicas
    mp_policy = MixedPrecisionPolicy()
    if ctx.autocast_dtype is not None:
        mp_policy = MixedPrecisionPolicy(param_dtype=ctx.autocast_dtype, reduce_dtype=torch.float32)
    # Pinned memory needs an accelerator; on a CPU-only run the offload only keeps state on the CPU.
    offload = CPUOffloadPolicy(pin_memory=ctx.env.device.type == "cuda") if config.cpu_offload else OffloadPolicy()
    options = dict(
        mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
        offload_policy=offload, ignored_params=(ignored | experts) or None,
    )
    # Batch norm keeps fp32 parameters under mixed precision: its running statistics are fp32 buffers,
    # and CPU batch_norm refuses 16-bit weights with them (autocast runs it on 16-bit inputs as is).
    # Each norm is a small unit of its own, without the cast, sharded first (deepest first).
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
             and any(p.requires_grad for p in m.parameters(recurse=False))] if ctx.autocast_dtype is not None else []
    fp32 = {**options, "mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.float32)}
    for module in [*norms, *targets, model]:
        if materialiser is not None:
            materialiser.before_shard(module)
        fully_shard(module, **(fp32 if module in norms else options))
    if materialiser is not None:
        materialiser.finish()

    sync = {"enabled": True}
    if ignored:
        _average_grads_of(ignored, mesh.get_group(), mesh.size(), sync)

    def set_sync(enabled: bool) -> None:
        sync["enabled"] = enabled
        model.set_requires_gradient_sync(enabled)

    ctx.gradient_sync = set_sync
    ctx.sharded_gradients = True
    logger.info(
        "%s: FSDP2 over %d processes, %d units + root%s%s%s", label, mesh.size(), len(targets),
        f" (blocks: {list(classes)})" if classes else "", ", CPU offload" if config.cpu_offload else "",
        ", trainable parameters in the root unit" if config.wrap_trainable_outmost else "",
    )


def shard_over_data(build: Build, config: ShardingConfig, reshard_after_forward: bool, label: str) -> None:
    """The model sharded over the data dimension with FSDP2 (fsdp, and zero2 on FSDP2)."""
    ctx = build.ctx
    # [communication] Every data-parallel rank starts from rank 0's weights. DDP does this in its constructor and
    # DeepSpeed in its engine; FSDP2 does not, so it happens here. A model on the meta device is initialised
    # identically on every rank instead (meta_init.py).
    if build.communicate and config.sync_module_states and ctx.replica_size > 1 and not is_meta(ctx.model):
        broadcast_from_first(ctx.model, ctx.data_mesh)
    if build.per_stage is not None:  # [pipeline] each stage its own FSDP2 root
        build.per_stage(ctx, shard_model, config, reshard_after_forward=reshard_after_forward, label=label)
    else:
        shard_model(ctx, config, reshard_after_forward=reshard_after_forward, label=label)


def same_program(name: str, config: Any) -> tuple[str, Any]:
    """A strategy item as the program it runs, for telling duplicate candidates apart: zero2 over FSDP2 is
    FSDP2 keeping gathered parameters from forward to backward (zero2's apply step, and fsdp's with
    ``reshard_after_forward=False``, call the same ``shard_model``), so ("zero2", fsdp2) and ("fsdp",
    reshard_after_forward=False) with the same shared options are one program; the FSDP1 keys fsdp accepts are
    no-ops."""
    if name == "zero2" and getattr(config, "implementation", None) == "fsdp2" or name == "fsdp":
        shared = config.model_dump(mode="json", include=set(ShardingConfig.model_fields))
        return "fsdp", {**shared, "reshard_after_forward": getattr(config, "reshard_after_forward", False)}
    return name, config.model_dump(mode="json") if config is not None else None


def zero1_sharding() -> ShardingConfig:
    """What zero1 runs with next to a 'tensor' or 'expert' dimension (zero1.runs_on_fsdp2): FSDP2 with sharding's
    defaults (the detected blocks as units), without resharding after forward."""
    logger.info("zero1: tensor- or expert-parallel (DTensor) parameters: runs as FSDP2 over the data ranks without "
                "resharding after forward (as zero2), which shards the gradients as well as the optimizer state")
    return ShardingConfig()


@register
class FSDP(Method):
    name = "fsdp"
    group = "parallel"
    summary = "Fully sharded data parallel (FSDP2 fully_shard): parameters, gradients, optimizer state."
    search_role = SearchRole("choice", "sharding", position=20, rank=2, off="ddp")
    Config = FSDPConfig
    mesh_dims = ("data",)

    def search_space(self, ctx: Any) -> dict[str, Dimension]:
        return {"reshard_after_forward": Categorical((True, False)), "cpu_offload": Categorical((False, True))}

    def searchable(self, model: Any) -> bool:
        return not layer_drop_settings(model)  # a layer one rank skips holds collectives the others run

    def model_problems(self, ctx: Any, config: FSDPConfig) -> list[str]:  # type: ignore[override]
        return sharding_problems(ctx.model, config) + layer_drop_problems(ctx.model, SHARDED_LAYERS)

    # ----- behaviour (atorch.apply.apply_strategy) -----------------------------------------------------------
    def apply(self, build: Build, config: FSDPConfig) -> None:  # type: ignore[override]
        shard_over_data(build, config, config.reshard_after_forward, self.name)

    def shards_data(self, config: MethodConfig) -> bool:
        return True

    def replicate(self, build: Build, config: FSDPConfig) -> bool:  # type: ignore[override]
        return True  # FSDP2 keeps the shards in step (its apply step)

    # ----- cost facts -----
    def cost_facts(self, config: FSDPConfig, layout: Any) -> CostFacts:  # type: ignore[override]
        return fsdp2_cost_facts(config, "per_use" if config.reshard_after_forward else "forward_to_backward")


@register
class Zero2(Method):
    name = "zero2"
    group = "parallel"
    summary = "ZeRO-2: gradients and optimizer state sharded (FSDP2 without resharding after forward, or DeepSpeed)."
    search_role = SearchRole("choice", "sharding", position=20, rank=1, off="ddp")
    Config = Zero2Config
    mesh_dims = ("data",)

    def searchable(self, model: Any) -> bool:
        return not layer_drop_settings(model)  # a layer one rank skips holds collectives the others run

    def optimizer_need(self, config: MethodConfig) -> str | None:
        if getattr(config, "implementation", None) == "deepspeed":
            return "with implementation 'deepspeed' hands the optimizer to DeepSpeed"
        return None

    def keeps_replicas_without_ddp(self, config: MethodConfig) -> bool:
        return True  # FSDP2, or DeepSpeed's engine

    def search_space(self, ctx: Any) -> dict[str, Dimension]:
        implementations = ("fsdp2", "deepspeed") if deepspeed_searchable(ctx.model) else ("fsdp2",)
        return {"implementation": Categorical(implementations)}

    def model_problems(self, ctx: Any, config: Zero2Config) -> list[str]:  # type: ignore[override]
        from atorch.opt_lib.deepspeed_zero import deepspeed_problems

        if config.implementation == "deepspeed":
            return deepspeed_problems(ctx, config)
        return sharding_problems(ctx.model, config) + layer_drop_problems(ctx.model, SHARDED_LAYERS)

    # ----- behaviour (atorch.apply.apply_strategy) -----------------------------------------------------------
    def apply(self, build: Build, config: Zero2Config) -> None:  # type: ignore[override]
        if self.shards_data(config):  # DeepSpeed's engine shards, after the optimizer is built (replicate)
            shard_over_data(build, config, False, self.name)

    def shards_data(self, config: MethodConfig) -> bool:
        return getattr(config, "implementation", None) != "deepspeed"

    def replicate(self, build: Build, config: Zero2Config) -> bool:  # type: ignore[override]
        if not self.shards_data(config):  # [communication] model and optimizer handed to DeepSpeed
            start_deepspeed(build.ctx, 2)
        return True

    def trace_problem(self, config: MethodConfig, layout: Any) -> str | None:
        return None if self.shards_data(config) else UNTRACED_ENGINE

    # ----- cost facts -----
    def cost_facts(self, config: Zero2Config, layout: Any) -> CostFacts:  # type: ignore[override]
        if config.implementation == "fsdp2":
            return fsdp2_cost_facts(config, "forward_to_backward")
        # DeepSpeed's ZeRO-2: every parameter stays whole in its flat buffer; gradients and optimizer state are
        # partitioned (its own buffers: the cost model's DeepSpeed terms); the updated partitions are gathered
        return CostFacts(gradients="data", optimizer_state="data", engine="deepspeed", offload=config.cpu_offload,
                         collectives=_SHARDED_SYNC, syncs_gradients=True)


# FSDP2 gathers the parameters (in the compute dtype: its mixed-precision policy) for each use, one collective per
# unit, and reduce-scatters the gradients once per step (its sync is off for all micro-batches but the last).
_SHARDED_SYNC = (Collective("all_gather", of="parameters", dtype="compute", per="gather", split="unit"),
                 Collective("reduce_scatter", split="unit"))


def fsdp2_cost_facts(config: ShardingConfig, gathering: Gathering) -> CostFacts:
    """FSDP2 over the data dimension: parameters, gradients and optimizer state sharded, gathered as ``gathering``
    says (fsdp's reshard_after_forward; zero2 keeps them from forward to backward)."""
    return CostFacts(parameters="data", gradients="data", optimizer_state="data", gathering=gathering,
                     offload=config.cpu_offload, collectives=_SHARDED_SYNC, syncs_gradients=True)
