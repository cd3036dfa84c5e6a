"""expert_parallel: the experts of each mixture-of-experts layer split over parallel_mode's 'expert' dimension.

As in torchtitan and DeepSpeed-MoE, expert ranks are data ranks too: the batch is split over data × expert
ranks (ParallelLayout.data_size), and DDP/FSDP of the non-expert parameters run over that group. Each rank of an
expert group keeps ``experts / expert`` whole experts of every MoE layer; the tokens routed to an expert travel
to its rank and back with two all-to-alls whose (uneven) split sizes are exchanged first: nothing is dropped, so
training matches one process. The router, attention and shared experts stay whole on every rank.

The split is transformers' own (``transformers.distributed.expert_parallel``: the ``grouped_gemm`` style makes the
experts' 3-D weights ``Shard(0)`` DTensors over the expert mesh and the ``ep_dispatch_experts`` style dispatches),
driven by the model's ``ep_plan`` where transformers ships one; for an experts module without one, atorch writes
the same plan itself (a module with ``num_experts`` and 3-D weights whose first dimension counts the experts, the
layout transformers' experts all share).

Gradients: an expert's gradient on its rank already sums the contributions of every token of its expert group
(the all-to-all's backward brings them). The global objective is the mean of the data × expert ranks' losses, so
the expert gradients are summed over the 'data' ranks that hold the same experts and divided by data × expert:
the same average the non-expert gradients get from DDP/FSDP (``ExpertGradientSync``). Beside context parallel the
context ranks of an expert position hold the same experts too, each backpropagating its share of the sequence: the
sum runs over data × context and the average over data × expert × context (``ParallelLayout.replica_size``).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from pydantic import Field, field_validator
from torch import nn

from atorch.grad_sync import PendingGradientSync
from atorch.layer_drop import layer_drop_problems, layer_drop_settings
from atorch.log import get_logger
from atorch.opt_lib.base import Method, MethodConfig, SearchRole, StrategyCheck
from atorch.opt_lib.cost_facts import Collective, CostFacts
from atorch.opt_lib.parallel_mode import ParallelMode
from atorch.opt_lib.registry import register
from atorch.parallel_layout import CONTEXT, DATA, EXPERT

if TYPE_CHECKING:
    from atorch.opt_lib.build_state import Build

logger = get_logger(__name__)

_EXPERT_MARK = "_atorch_expert"  # set on every expert parameter once split
# transformers' EP styles: an experts module's dispatch, and its 3-D weights split along the experts
DISPATCH, SPLIT = "ep_dispatch_experts", "grouped_gemm"


class ExpertParallelConfig(MethodConfig):
    """Needs an 'expert' dimension in parallel_mode, e.g. ``([("expert", 2), ("data", -1)], None)``."""

    plan: Literal["auto"] | dict[str, str] = Field(
        default="auto",
        description="'auto': the model's own ep_plan where transformers ships one (base_model_ep_plan), else "
        "transformers-style experts modules found by atorch; or a mapping of module / parameter name patterns "
        "('model.layers.*.mlp.experts') to 'ep_dispatch_experts' (the experts module) or 'grouped_gemm' (its "
        "3-D expert weights)",
    )

    @field_validator("plan")
    @classmethod
    def _styles_known(cls, plan: Any) -> Any:
        if isinstance(plan, dict):
            unknown = sorted({style for style in plan.values() if style not in (DISPATCH, SPLIT)})
            if unknown or DISPATCH not in plan.values():
                raise ValueError(f"a plan maps experts modules to '{DISPATCH}' and their weights to '{SPLIT}'"
                                 + (f"; unknown style(s) {unknown}" if unknown else f"; no '{DISPATCH}' entry"))
        return plan


def is_expert_param(param: torch.Tensor) -> bool:
    """Whether a parameter is an expert's, split over the expert dimension (kept out of DDP/FSDP)."""
    return bool(getattr(param, _EXPERT_MARK, False))


def expert_banks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's expert banks, (name, module): modules named ``experts``, transformers' convention for a MoE
    layer's bank (stacked weights or a ModuleList). Empty for a dense model."""
    return [(name, m) for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "experts"]


def expert_param_names(model: nn.Module) -> list[str]:
    return [name for name, param in model.named_parameters() if is_expert_param(param)]


# ----- the plan -----------------------------------------------------------------------------------
def _wildcard(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _own_plan(model: nn.Module) -> dict[str, str]:
    """transformers' experts layout without a shipped plan: a module with ``num_experts`` whose 3-D parameters all
    count the experts in their first dimension (called as ``experts(hidden, top_k_index, top_k_weights)``)."""
    plan = {}
    for name, module in model.named_modules():
        count = getattr(module, "num_experts", None)
        own = list(module.named_parameters(recurse=False))
        if not isinstance(count, int) or not own or any(p.dim() != 3 or p.shape[0] != count for _, p in own):
            continue
        plan.update({f"{name}.{p}": SPLIT for p, _ in own})
        plan[name] = DISPATCH  # after its parameters (see expert_plan)
    return plan


def expert_plan(model: nn.Module, plan: Literal["auto"] | dict[str, str] = "auto") -> dict[str, str]:
    """Concrete module and parameter names -> transformers' EP style: from ``plan`` (patterns, ``*`` for any name
    part), or with "auto" the model's ep_plan where transformers ships one, else atorch's own for transformers-style
    experts modules. Parameters come first: splitting them sets the experts module's local ``num_experts``, which
    its dispatch reads when it is installed."""
    patterns = dict(getattr(model, "ep_plan", None) or {}) if plan == "auto" else plan
    if not patterns:
        return _own_plan(model)
    # a weight takes the split style only, a module the dispatch only ('experts.*' names its weights, not act_fn)
    names = [(n, SPLIT) for n, _ in model.named_parameters()] + [(n, DISPATCH) for n, _ in model.named_modules()]
    found = {}
    for name, kind in names:
        style = patterns.get(_wildcard(name)) or next(
            (s for pattern, s in patterns.items() if s == kind and fnmatch.fnmatchcase(name, pattern)), None)
        if style == kind:
            found[name] = style
    return found


def experts_modules(model: nn.Module, plan: Literal["auto"] | dict[str, str] = "auto") -> dict[str, nn.Module]:
    modules = dict(model.named_modules())
    return {name: modules[name] for name, style in expert_plan(model, plan).items() if style == DISPATCH}


# ----- the transformation -------------------------------------------------------------------------
def split_experts(ctx: Any, config: ExpertParallelConfig, communicate: bool) -> None:
    """expert_parallel's apply step: every rank of an expert group keeps its experts, dispatching through
    transformers' all-to-all. [communication] The experts start from the first data × expert rank's weights."""
    if not communicate:  # a model of fake tensors for the cost model: experts stay whole
        return
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    from atorch.state_names import state_roots

    layout, device = ctx.layout, ctx.env.device.type
    batch = ctx.data_mesh  # data × expert
    source = int(batch.mesh.flatten()[0])
    split = 0
    for model in state_roots(ctx.model):  # the model, or each pipeline stage's (its own MoE layers)
        plan = expert_plan(model, config.plan)
        params = dict(model.named_parameters())
        experts = [params[name] for name, style in plan.items() if style == SPLIT]
        with torch.no_grad():
            for param in experts:  # whole, before the split: every expert rank then cuts the same tensor
                dist.broadcast(param.data, src=source, group=batch.get_group())
        apply_expert_parallelism(model, layout.mesh(device)[EXPERT], _own_rank_mesh(device), plan)
        for name, param in model.named_parameters():
            if plan.get(name) == SPLIT:
                setattr(param, _EXPERT_MARK, True)
        split += sum(s == DISPATCH for s in plan.values())
    logger.info("expert_parallel: %d experts modules split over %d ranks (data × expert %d)", split,
                layout.size(EXPERT), layout.data_size)


_OWN_RANK: dict[tuple[Any, str], Any] = {}


def _own_rank_mesh(device_type: str) -> Any:
    """A 1-rank mesh: transformers' dispatch takes the ranks that share one batch (its tensor group), here none."""
    from torch.distributed.device_mesh import DeviceMesh

    key = (dist.group.WORLD, device_type)
    if key not in _OWN_RANK:
        group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        _OWN_RANK.clear()
        _OWN_RANK[key] = DeviceMesh.from_group(group, device_type)
    return _OWN_RANK[key]


class ExpertGradientSync(PendingGradientSync):
    """Wraps the data-parallel gradient sync (DDP's or FSDP's): at the accumulation boundary, before the step, the
    expert gradients are summed over the ranks holding the same experts and divided by data × expert × context."""

    def __init__(self, model: nn.Module, inner: Callable[[bool], None] | None, replicas: Any, batch_size: int) -> None:
        super().__init__(model)
        self.inner = inner
        self.replicas, self.batch_size = replicas, batch_size  # the data × context group; data × expert × context

    def __call__(self, enabled: bool) -> None:
        super().__call__(enabled)
        if self.inner is not None:
            self.inner(enabled)

    def complete(self) -> None:
        complete = getattr(self.inner, "complete", None)
        if complete is not None:
            complete()
        model = self.due()
        if model is None:
            return
        average_expert_gradients(model, self.replicas, self.batch_size)
        self._pending = False


def average_expert_gradients(model: nn.Module, replicas: Any, batch_size: int) -> None:
    """[communication] The expert gradients summed over ``replicas`` (the ranks holding the same experts; None:
    none other) and divided by ``batch_size`` (data × expert × context)."""
    from torch.distributed.tensor import DTensor

    experts = [p for p in model.parameters() if is_expert_param(p) and p.requires_grad]
    for param in experts:  # every replica reduces the same list, also where a weight saw no token (no hang)
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in experts]
    with torch.no_grad():
        if grads and replicas is not None:
            flat = torch.cat([g.reshape(-1) for g in grads])  # one reduction (linear: sums of sums)
            dist.all_reduce(flat, group=replicas)
            for grad, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                grad.copy_(part.view_as(grad))
        for grad in grads:
            grad.div_(batch_size)


def reduce_expert_gradients(ctx: Any) -> None:
    """expert_parallel's finish, after DDP/FSDP: the expert gradients' averaging joins the optimizer's gradient sync
    (under pipeline parallel: each schedule's, ``PipelinedModel.gradient_syncs``). The ranks holding the same experts
    are the data × context ranks of an expert position; the average is over every replica of the model's objective,
    data × expert × context (context ranks each backpropagate their share)."""
    from atorch.state_names import StagedModel

    layout, device = ctx.layout, ctx.env.device.type
    holders = (DATA, CONTEXT)
    replicas = layout.group_mesh(device, holders).get_group() if layout.size(DATA) * layout.size(CONTEXT) > 1 else None
    if isinstance(ctx.model, StagedModel):
        model = ctx.model
        model.gradient_syncs.append(lambda: average_expert_gradients(model, replicas, layout.replica_size))
        return
    ctx.gradient_sync = ExpertGradientSync(ctx.model, ctx.gradient_sync, replicas, layout.replica_size)


# ----- cost facts ---------------------------------------------------------------------------------
# Each MoE layer's dispatch and combine in forward, and their backward (the transposed all-to-alls), at every
# micro-batch: the routed tokens' hidden states in the compute dtype; a rank keeps 1/expert of them (the cost
# model's (n-1)/n all-to-all factor). The split sizes exchanged before each dispatch are a few integers: left out.
ROUTED_ALL_TO_ALL = Collective("all_to_all", of="routed_tokens", dtype="compute", per="micro_batch",
                               split="moe_layer", over=EXPERT)
# The dispatch's own operations per MoE layer and micro-batch, forward and backward (sorting and indexing the routed
# rows, the split sizes' exchange and their .tolist(), the combine's scatter): measured 906 -> 1004 aten operations
# per step on toy_models.moe (2 MoE layers) at expert 2 on 2 gloo ranks, the expert gradients' averaging included.
DISPATCH_OPS = 49
# The combine weights the returned rows on the sender (``token_outputs * top_k_weights``, saving them for backward)
# after the experts ran them with unit weights (saving their output): one copy of the routed rows more than the
# experts' own weighting keeps without expert parallel.
COMBINE_SAVED = 1.0
# ExpertGradientSync: the expert gradients summed over the ranks that hold the same experts, once per step.
EXPERT_GRADIENT_SYNC = Collective("all_reduce", of="experts", over="replicas")


def expert_cost_facts(layout: Any) -> CostFacts:
    """The experts split over the layout's 'expert' dimension (with their gradients and optimizer state), four
    all-to-alls and the dispatch's operations per MoE layer and micro-batch, and the expert gradients' all-reduce
    over their replicas."""
    size = layout.size(EXPERT)
    if size <= 1:
        return CostFacts()
    return CostFacts(expert_split=size, collectives=(ROUTED_ALL_TO_ALL,) * 4 + (EXPERT_GRADIENT_SYNC,),
                     moe_layer_ops=DISPATCH_OPS, routed_saved=COMBINE_SAVED)


def expert_sizes(model: nn.Module, world_size: int) -> tuple[int, ...]:
    """The 'expert' sizes above 1 the automatic search offers for ``model`` at ``world_size`` ranks: those dividing
    the world and every experts module's count (none for a model without experts modules atorch can split)."""
    counts = {int(module.num_experts) for module in experts_modules(model).values()}
    if not counts:
        return ()
    return tuple(e for e in range(2, world_size + 1) if world_size % e == 0 and all(c % e == 0 for c in counts))


# ----- the method ---------------------------------------------------------------------------------
@register
class ExpertParallel(Method):
    name = "expert_parallel"
    group = "parallel"
    summary = ("Expert parallel: each MoE layer's experts split over the 'expert' dimension, tokens dispatched and "
               "combined with all-to-all (dropless); expert ranks are data ranks too.")
    mesh_dims = (EXPERT,)
    Config = ExpertParallelConfig
    # the search offers an 'expert' size (expert_sizes) on an all-data-parallel layout: the rules refuse it next to
    # tensor or pipeline stages
    search_role = SearchRole("layout", EXPERT, off=1)

    def searchable(self, model: Any) -> bool:
        return bool(experts_modules(model)) and not layer_drop_settings(model)

    def trace_problem(self, config: MethodConfig, layout: Any) -> str | None:
        # the dispatch reads its all-to-alls' split sizes off the routing (.tolist()), which fake tensors lack
        return "expert parallel's token dispatch sizes its all-to-alls by the routing (data, not shapes)"

    def cost_facts(self, config: ExpertParallelConfig, layout: Any) -> CostFacts:  # type: ignore[override]
        return expert_cost_facts(layout)

    def check(self, config: Any, check: StrategyCheck) -> list[str]:
        if ParallelMode.name not in check.configs:  # with one: the compatibility table's rule
            return ["expert_parallel splits the experts over parallel_mode's 'expert' dimension; add one, e.g. "
                    "('parallel_mode', {'dims': [['expert', 2], ['data', -1]]})"]
        return []

    def applicable(self, ctx: Any) -> str | None:
        items = [i for i in getattr(ctx.strategy, "methods", ()) if i.name == self.name]
        if items and items[0].config.plan != "auto":  # an explicit plan: model_problems checks what it finds
            return None
        if not experts_modules(ctx.model):
            return ("the model has no mixture-of-experts layer atorch can split (a transformers MoE model: its "
                    "config's base_model_ep_plan, or experts modules with num_experts and 3-D expert weights)")
        return None

    def model_problems(self, ctx: Any, config: ExpertParallelConfig) -> list[str]:  # type: ignore[override]
        from atorch.meta_init import is_meta

        if is_meta(ctx.model):  # the experts are cut from whole tensors made equal by a broadcast
            return ["a model on the meta device is not supported with expert_parallel yet; build it on CPU"]
        if dropped := layer_drop_problems(ctx.model, "expert parallel exchanges each MoE layer's tokens inside it"):
            return dropped
        size = ctx.layout.size(EXPERT)
        plan = expert_plan(ctx.model, config.plan)
        modules = experts_modules(ctx.model, config.plan)
        if not modules:
            return [f"plan {config.plan} names no experts module of the model (module names such as "
                    f"{[n for n, _ in ctx.model.named_modules()][1:4]})"]
        problems = []
        for name in modules:
            if not any(key.startswith(f"{name}.") and style == SPLIT for key, style in plan.items()):
                problems.append(f"plan gives experts module {name} no '{SPLIT}' weights; map its 3-D expert "
                                f"weights ('{name}.*') to '{SPLIT}'")
        for name, module in modules.items():
            count = int(module.num_experts)
            if count % size:
                divisors = [d for d in range(2, count + 1) if count % d == 0]
                problems.append(f"'expert' size {size} does not divide the {count} experts of {name}; give "
                                f"parallel_mode an 'expert' size that divides {count} (one of {divisors})")
                break
        return problems

    # ----- behaviour (atorch.apply.apply_strategy) -----------------------------------------------------------
    def apply(self, build: Build, config: ExpertParallelConfig) -> None:  # type: ignore[override]
        split_experts(build.ctx, config, build.communicate)

    def finish(self, build: Build, config: ExpertParallelConfig) -> None:  # type: ignore[override]
        if build.communicate:  # expert gradients: averaged over their replicas only
            reduce_expert_gradients(build.ctx)
