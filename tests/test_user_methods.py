"""A method defined outside atorch: registered at a stated place in the apply order, applied by a semi-automatic
strategy (one process, and two real gloo processes), checked by the same compatibility rules, and gone again when
registered inside ``registry.scoped()``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from launcher import HERE, run_json
from toy_models import mlp, mlp_dataset, mlp_loss
from user_method_example import ScaleOutput

import atorch
from atorch import Strategy, StrategyError
from atorch.opt_lib import Rule, registry
from atorch.opt_lib.compatibility import added_rules
from atorch.training import train_step

MLP_ARGS = dict(dataset=mlp_dataset(), loss_func=mlp_loss, model_input_format="unpack_sequence",
                optim_args={"lr": 0.1}, dataloader_args={"batch_size": 8, "shuffle": False})


def test_a_user_method_is_placed_applied_and_gone_after_its_scope() -> None:
    order, rules = registry.apply_order(), added_rules()
    with registry.scoped():
        atorch.register_method(ScaleOutput, after="checkpoint", before="fsdp", reason="after recompute wraps blocks")
        new = registry.apply_order()
        assert new[new.index("checkpoint") + 1] == "scale_output" and registry.placement("scale_output")
        strategy = Strategy.load(["parallel_mode", ("scale_output", {"factor": 0.5})])
        assert Strategy.load(strategy.to_json()) == strategy
        _, result, _ = atorch.auto_accelerate(mlp(), torch.optim.SGD, load_strategy=strategy.to_list(), **MLP_ARGS)
        x = torch.randn(4, 16)
        torch.testing.assert_close(result.model(x), 0.5 * mlp()(x), rtol=0, atol=0)
        assert train_step(result, [next(iter(result.dataloader))]).isfinite()
    assert registry.apply_order() == order and added_rules() == rules
    assert not registry.is_registered("scale_output")


def test_an_unregistered_name_still_gives_the_clear_error() -> None:
    with registry.scoped():
        atorch.register_method(ScaleOutput)
    with pytest.raises(StrategyError) as info:
        Strategy.load([("scale_output", {"factor": 2.0})])
    assert "unknown method 'scale_output'" in str(info.value)


def test_the_scope_is_restored_when_the_block_raises() -> None:
    order = registry.apply_order()
    with pytest.raises(RuntimeError, match="inside"), registry.scoped():
        atorch.register_method(ScaleOutput)
        raise RuntimeError("inside")
    assert registry.apply_order() == order


def test_rules_a_user_method_declares_refuse_and_no_rule_means_compatible() -> None:
    with registry.scoped():
        atorch.register_method(ScaleOutput)
        assert Strategy.load(["scale_output", ("half", "bf16")]).problems(1) == []
    with registry.scoped():
        rule = Rule(("scale_output", "half"), "scaling a 16-bit output overflows", "drop 'half'")
        atorch.register_method(ScaleOutput, rules=[rule])
        problems = Strategy.load(["scale_output", ("half", "bf16")]).problems(1)
        assert any("'scale_output' cannot be combined with 'half'" in p for p in problems), problems
    assert Strategy.load([("half", "bf16")]).problems(1) == []


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"after": "nothing"}, "no registered method 'nothing'"),
    ({"after": "fsdp", "before": "checkpoint"}, "nothing lies between them"),
    ({"after": "fsdp", "rules": [Rule(("half", "fsdp"), "r", "f")]}, "a rule must name 'scale_output'"),
])
def test_a_wrong_registration_is_refused(kwargs: dict[str, Any], message: str) -> None:
    order = registry.apply_order()
    with registry.scoped(), pytest.raises(ValueError, match=message):
        atorch.register_method(ScaleOutput, **kwargs)
    assert registry.apply_order() == order


def test_a_name_is_registered_once_and_only_a_method_class_is_taken() -> None:
    class NotAMethod:
        name = "x"

    with registry.scoped():
        atorch.register_method(ScaleOutput)
        with pytest.raises(ValueError, match="already registered"):
            atorch.register_method(ScaleOutput)
        with pytest.raises(TypeError, match="subclass of atorch.opt_lib.Method"):
            atorch.register_method(NotAMethod)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="already registered"):
            atorch.register_method(type("Fsdp", (ScaleOutput,), {"name": "fsdp"}))


@pytest.mark.distributed
def test_a_user_method_trains_on_two_gloo_processes() -> None:
    """Registered in each process, applied under DDP: both ranks compute the scaled model and agree on the loss."""
    out = run_json(HERE / "workers" / "user_method_worker.py")
    assert out["scaled"] and out["ddp"], out
    assert out["losses"][0] == out["losses"][1], out
