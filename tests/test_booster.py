"""The Booster (Colossal-AI API) on atorch's engine.

One launch of tests/workers/booster_worker.py (2 gloo processes): Colossal-AI's documented Booster loop under
every plugin against ``auto_accelerate`` with the strategy the plugin translated into; execute_pipeline at pp2
against one process; no_sync accumulation; parameter groups and a scheduler across boost; AutoPlugin. The
argument checks and the plugin=None path run here, in one process.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from launcher import HERE, run_json
from torch import nn
from toy_models import mlp, mlp_dataset

from atorch.booster import Booster
from atorch.booster.plugin import (
    AutoPlugin,
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from atorch.errors import SetupError, StrategyError

WORKER = HERE / "workers" / "booster_worker.py"

# The Booster and auto_accelerate run the same strategy through the same engine on the same inputs: the same
# operations in the same order, so the losses agree to the bit. The tolerance leaves 8 fp32 ulps (8 × 2^-23 ≈
# 1e-6 relative) for a collective that a backend might sum in another order in another launch.
SAME_PROGRAM = 1e-6
# A pipeline computes the operations of one process; only sums are ordered differently (micro-batch losses and
# gradients accumulate and are scaled by 1/m; the global norm adds per-stage norms): a few ulps per sum, near
# 1e-6 relative over 4 blocks and 3 SGD steps, so 1e-5 (as in test_pipeline_parallel.py).
PIPELINE_TOL = 1e-5


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_json(WORKER, "all", str(tmp_path_factory.mktemp("cache")), timeout=400)


@pytest.fixture(scope="module")
def plugins(report: dict[str, Any]) -> dict[str, Any]:
    return report


@pytest.fixture(scope="module")
def accumulate(report: dict[str, Any]) -> dict[str, Any]:
    return report


def ok(report: dict[str, Any], name: str) -> dict[str, Any]:
    entry = report[name]
    assert "error" not in entry, f"{name} failed: {entry['error']}"
    return entry


def methods(entry: dict[str, Any]) -> dict[str, Any]:
    return {m["name"]: m["config"] for m in json.loads(entry["strategy"])["methods"]}


EXPECTED = {  # scenario -> methods of the translated strategy, with the config keys that matter
    "TorchDDPPlugin": {"parallel_mode": {}},
    "TorchDDPPlugin+bf16": {"parallel_mode": {}, "amp_native": {"dtype": "bf16"}},
    "TorchFSDPPlugin": {"parallel_mode": {}, "fsdp": {"cpu_offload": False}},
    "LowLevelZeroPlugin[stage1,bf16]": {"parallel_mode": {}, "amp_native": {"dtype": "bf16"}, "zero1": {}},
    "LowLevelZeroPlugin[stage2]": {"parallel_mode": {}, "zero2": {"cpu_offload": False}},
    "GeminiPlugin[offload]": {"parallel_mode": {}, "amp_native": {"dtype": "bf16"}, "fsdp": {"cpu_offload": True}},
    "HybridParallelPlugin[tp2]": {"parallel_mode": {"dims": [["tensor", 2], ["data", 1]]}, "tensor_parallel": {}},
}


@pytest.mark.distributed
@pytest.mark.timeout(420)
@pytest.mark.parametrize("scenario", list(EXPECTED))
def test_documented_loop_under_each_plugin_matches_the_engine(plugins: dict[str, Any], scenario: str) -> None:
    entry = ok(plugins, scenario)
    assert entry["losses"] == pytest.approx(entry["engine"], rel=SAME_PROGRAM, abs=0)
    got = methods(entry)
    assert set(got) == set(EXPECTED[scenario]), got
    for name, config in EXPECTED[scenario].items():
        assert {k: got[name][k] for k in config} == config
    assert entry["lr"] == pytest.approx(0.1 * 0.5**3)  # the scheduler built before boost drove the real optimizer


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_plugins_that_mean_the_same_training_give_the_same_losses(plugins: dict[str, Any]) -> None:
    # DDP, FSDP and ZeRO-2 (fp32) are the same arithmetic on this model: same losses (see SAME_PROGRAM)
    ddp = ok(plugins, "TorchDDPPlugin")["losses"]
    for name in ("TorchFSDPPlugin", "LowLevelZeroPlugin[stage2]"):
        assert ok(plugins, name)["losses"] == pytest.approx(ddp, rel=SAME_PROGRAM, abs=0)


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_execute_pipeline_matches_one_process(plugins: dict[str, Any]) -> None:
    clipped, plain = ok(plugins, "pipeline[pp2,clip]"), ok(plugins, "pipeline[pp2]")
    for entry in (clipped, plain):
        assert entry["losses"] == pytest.approx(entry["reference"], rel=PIPELINE_TOL, abs=0)
        assert all(a == b for a, b in entry["on_ranks"]), "the loss is the same on every rank of the pipeline"
        assert entry["sampler"] == [1, 0]  # pipeline 2 at 2 processes: one data-parallel rank
        assert "booster.execute_pipeline" in entry["refusals"]["forward"]
        assert "instead of no_sync" in entry["refusals"]["no_sync"]
    # clipping engaged (over both stages' gradients, or it would not match torch's clip in one process)
    assert abs(clipped["losses"][1] - plain["losses"][1]) > 1e-4


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_prepare_dataloader_samples_over_the_data_parallel_ranks(plugins: dict[str, Any]) -> None:
    entry = ok(plugins, "tp_sampler")
    assert entry["tp"] == [1, 0]  # tensor 2: both processes read the same batches
    assert entry["ddp"] == [2, 0]


@pytest.mark.distributed
@pytest.mark.timeout(420)
@pytest.mark.parametrize("plugin", ["TorchDDPPlugin", "TorchFSDPPlugin", "LowLevelZeroPlugin[stage1]",
                                    "LowLevelZeroPlugin[stage2]"])
def test_no_sync_accumulation_equals_one_batch(accumulate: dict[str, Any], plugin: str) -> None:
    entry = ok(accumulate, f"no_sync/{plugin}")
    # d/dw mean over 8 samples = (mean over 4 + mean over 4) / 2: equal up to summation order (a few ulps)
    assert entry["weights"] == pytest.approx(entry["whole"], rel=SAME_PROGRAM, abs=1e-7)
    assert "inside booster.no_sync()" in entry["step_refused"]
    if plugin in ("TorchDDPPlugin", "LowLevelZeroPlugin[stage1]"):  # DDP: inside no_sync each rank's own gradient
        assert entry["unsynced"] > 1e-3


@pytest.mark.distributed
@pytest.mark.timeout(420)
@pytest.mark.parametrize("plugin", ["LowLevelZeroPlugin[stage1]", "TorchFSDPPlugin"])
def test_parameter_groups_and_scheduler_survive_boost(accumulate: dict[str, Any], plugin: str) -> None:
    entry = ok(accumulate, f"groups/{plugin}")
    # built with lr 0.01 / 0.05 and weight decay 0.1 / 0.0; one StepLR(gamma=0.5) step before boost
    assert entry["before"] == [[0.005, 0.1, 5], [0.025, 0.0, 5]]
    assert entry["after"] == [0.0025, 0.0125]  # the schedule continues on the rebuilt optimizer
    assert entry["last_epoch"] == 2 and entry["groups_on_boosted_model"]
    assert entry["scheduler_on"] == "AcceleratedOptimizer"


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_auto_plugin_trains_with_the_searched_strategy(accumulate: dict[str, Any]) -> None:
    entry = ok(accumulate, "AutoPlugin")
    assert entry["source"] == "search"
    assert entry["losses"] == pytest.approx(entry["engine"], rel=SAME_PROGRAM, abs=0)


# ----- one process ---------------------------------------------------------------------------------------
def test_without_plugin_objects_pass_through_and_backward_works() -> None:
    booster = Booster()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    boosted = booster.boost(model, optimizer, None, None, None)
    assert boosted[0] is model and boosted[1] is optimizer
    booster.backward(model(torch.randn(2, 16)).pow(2).mean(), optimizer)  # Colossal-AI: AttributeError
    assert all(p.grad is not None for p in model.parameters())
    with booster.no_sync(model, optimizer):  # nothing to synchronise without a plugin
        pass


@pytest.mark.parametrize(("make", "expected"), [
    (lambda: LowLevelZeroPlugin(stage=3, precision="fp64"), ["stage=3", "precision='fp64'"]),
    (lambda: HybridParallelPlugin(tp_size=1, pp_size=2), ["num_microbatches", "give one of them"]),
    (lambda: HybridParallelPlugin(tp_size=2, pp_size=1, custom_policy=object()), ["custom_policy", "tp_plan"]),
    (lambda: HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2, pp_style="interleaved"),
     ["num_model_chunks=1", "more than 1 with 'interleaved'"]),
    (lambda: GeminiPlugin(offload_param_frac=0.5), ["offload_param_frac=0.5", "use 0.0 or 1.0"]),
    (lambda: LowLevelZeroPlugin(stage=1, cpu_offload=True), ["cpu_offload=True", "stage=2"]),
    (lambda: TorchFSDPPlugin(param_init_fn=lambda m: m), ["param_init_fn"]),
    (lambda: HybridParallelPlugin(tp_size=2, pp_size=1, enable_sequence_parallelism=True,
                                  sequence_parallelism_mode="ring_attn"), ["mode 'split_gather' with tp_size > 1"]),
    (lambda: HybridParallelPlugin(tp_size=1, pp_size=1, enable_sequence_parallelism=True), ["tp_size > 1"]),
])
def test_bad_plugin_arguments_name_the_argument_and_the_fix(make: Any, expected: list[str]) -> None:
    with pytest.raises(StrategyError) as info:
        make()
    for text in expected:
        assert text in str(info.value)


def test_split_gather_sequence_parallelism_is_tensor_parallels() -> None:
    plugin = HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32", enable_sequence_parallelism=True)
    assert ("tensor_parallel", {"sequence_parallel": True}) in plugin.methods()
    assert ("tensor_parallel", {}) in HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32").methods()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for CPU-only machines")
def test_cpu_only_refusals() -> None:
    with pytest.raises(StrategyError, match="flash attention kernels need a CUDA GPU"):
        HybridParallelPlugin(tp_size=1, pp_size=1, enable_flash_attention=True)
    with pytest.raises(StrategyError, match="SyncBatchNorm needs CUDA"):
        TorchDDPPlugin(sync_bn=True)


def test_booster_arguments_are_checked() -> None:
    with pytest.raises(SetupError, match="accepted: 'fp16', 'bf16', 'fp8'"):
        Booster(mixed_precision="fp16_apex")
    with pytest.raises(SetupError, match="plugin must be one of atorch.booster.plugin"):
        Booster(plugin="ddp")  # type: ignore[arg-type]


def test_what_colossalai_ignores_is_ignored_with_a_warning() -> None:
    with pytest.warns(UserWarning, match=r"mixed_precision='bf16'\) is ignored: LowLevelZeroPlugin sets the precision"):
        booster = Booster(plugin=LowLevelZeroPlugin(), mixed_precision="bf16")
    assert booster.precision_methods == []
    other = "cpu" if torch.cuda.is_available() else "cuda"  # the device this process does not train on
    with pytest.warns(UserWarning, match=rf"device='{other}'\) is ignored: TorchDDPPlugin places the model itself"):
        Booster(plugin=TorchDDPPlugin(), device=other)


def test_checkpoint_keywords_are_colossalais_and_no_others(tmp_path) -> None:
    booster, model = Booster(), mlp()
    with pytest.raises(TypeError, match="unexpected keyword argument 'sharded'"):
        booster.save_model(model, str(tmp_path / "m.bin"), sharded=True)  # a typo of shard
    with pytest.warns(UserWarning, match=r"save_model\(use_async=True\): atorch writes the checkpoint before"):
        booster.save_model(model, str(tmp_path / "m"), use_async=True)  # implies safetensors, as in Colossal-AI
    from safetensors.torch import load_file

    assert set(load_file(str(tmp_path / "m"))) == set(model.state_dict())  # written as safetensors
    with pytest.warns(UserWarning, match=r"load_model\(low_cpu_mem_mode=False, num_threads=4\) has no effect"):
        booster.load_model(model, str(tmp_path / "m"), low_cpu_mem_mode=False, num_threads=4)


def test_arguments_without_effect_are_named_once_at_boost(atorch_log) -> None:
    for _ in range(2):
        plugin = TorchDDPPlugin(bucket_cap_mb=50, static_graph=True, check_reduction=False)  # the last: default
        model = mlp()
        Booster(plugin=plugin).boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    named = [r.getMessage() for r in atorch_log.records if "has no effect in atorch" in r.getMessage()]
    assert sorted(named) == ["TorchDDPPlugin(bucket_cap_mb=50) has no effect in atorch: a speed knob; atorch's DDP "
                             "keeps torch's defaults (the results are the same)",
                             "TorchDDPPlugin(static_graph=True) has no effect in atorch: a speed knob; atorch's "
                             "DDP keeps torch's defaults (the results are the same)"]
    assert GeminiPlugin(placement_policy="auto").no_effect["placement_policy"][0] == "auto"


def test_auto_plugin_needs_the_dataloader() -> None:
    model = mlp()
    with pytest.raises(SetupError, match="pass the dataloader"):
        Booster(plugin=AutoPlugin()).boost(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_pipeline_refuses_several_parameter_groups() -> None:
    model = mlp()
    groups = [{"params": list(model.blocks.parameters()), "lr": 0.2},
              {"params": [p for n, p in model.named_parameters() if not n.startswith("blocks")]}]
    booster = Booster(plugin=HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2, precision="fp32"))
    with pytest.raises(SetupError, match="cannot keep 2 parameter groups"):
        booster.boost(model, torch.optim.SGD(groups, lr=0.1))


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_batchnorm_stays_batchnorm_and_fp8_is_skipped_with_the_reason_on_cpu() -> None:
    booster = Booster(plugin=TorchDDPPlugin(), mixed_precision="fp8")
    model = BNNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    boosted, optimizer, *_ = booster.boost(model, optimizer)
    assert not any(isinstance(m, nn.SyncBatchNorm) for m in boosted.modules())
    assert any(isinstance(m, nn.BatchNorm1d) for m in boosted.modules())
    assert "fp8" in booster.skipped and booster.skipped["fp8"]
    booster.backward(boosted(torch.randn(4, 16)).pow(2).mean(), optimizer)
    norm = optimizer.clip_grad_by_norm(1e-3)
    assert float(norm) > 1e-3
    optimizer.step()
    with pytest.raises(SetupError, match="HybridParallelPlugin"):
        booster.execute_pipeline(iter([torch.randn(4, 16)]), boosted, lambda o, i: o.mean())
    boosted.result.close()


def test_plugin_defaults_translate_into_valid_strategies() -> None:
    for plugin in (TorchDDPPlugin(), TorchFSDPPlugin(), LowLevelZeroPlugin(), LowLevelZeroPlugin(stage=2),
                   GeminiPlugin(), HybridParallelPlugin(tp_size=1, pp_size=1)):
        assert plugin.strategy() is not None
    assert AutoPlugin().strategy() is None
    assert mlp_dataset() is not None


def test_mixed_precision_without_plugin_means_ddp_with_autocast() -> None:
    booster = Booster(mixed_precision="bf16")
    model = mlp()
    boosted, optimizer, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert booster.strategy.names() == ["parallel_mode", "amp_native"]
    assert booster.strategy.get("amp_native").dtype == "bf16"
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # also after boost
    booster.backward(boosted(torch.randn(2, 16)).pow(2).mean(), optimizer)
    optimizer.step()
    scheduler.step()
    assert optimizer.optim.param_groups[0]["lr"] == pytest.approx(0.05)
    boosted.result.close()


def test_translations_that_need_the_world_size_or_the_model() -> None:
    assert HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32").layout(4).data_size == 2  # tensor × DDP
    assert HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32", zero_stage=2).layout(4).data_size == 2
    with pytest.raises(StrategyError, match="does not divide the 4 processes"):
        HybridParallelPlugin(tp_size=3, pp_size=1).layout(4)
    model = mlp()
    plugin = TorchFSDPPlugin(ignored_modules=[model.head])  # torch FSDP's instances become atorch's names
    plugin.prepare_model(model)
    assert list(plugin.strategy().get("fsdp").ignored_modules) == ["head"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu_syncbatchnorm_fp16_scaling_and_fp8() -> None:
    booster = Booster(plugin=TorchDDPPlugin(), mixed_precision="fp16")
    model = BNNet()
    boosted, optimizer, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert any(isinstance(m, nn.SyncBatchNorm) for m in boosted.modules())  # Colossal-AI's conversion on CUDA
    assert optimizer.optim.grad_scaler is not None  # fp16: booster.backward scales the loss
    loss = boosted(torch.randn(4, 16)).float().pow(2).mean()
    booster.backward(loss, optimizer)
    assert torch.isfinite(optimizer.clip_grad_by_norm(1.0))
    optimizer.step()
    boosted.result.close()
    HybridParallelPlugin(tp_size=1, pp_size=1, enable_flash_attention=True)  # accepted where CUDA runs it
    booster = Booster(plugin=TorchDDPPlugin(), mixed_precision="fp8")
    model = mlp()
    boosted, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    names = {type(m).__module__ for m in boosted.modules()}
    assert booster.skipped.get("fp8") or any("transformer_engine" in n for n in names), (booster.skipped, names)
    boosted.result.close()


def test_low_level_zero_defaults_are_fp16_autocast_with_colossal_ai_loss_scale() -> None:
    booster = Booster(plugin=LowLevelZeroPlugin())  # stage 1, precision 'fp16', initial_scale 2**32
    model = mlp()
    boosted, optimizer, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert booster.strategy.names() == ["parallel_mode", "amp_native", "zero1"]
    assert booster.strategy.get("amp_native").dtype == "fp16"
    assert optimizer.optim.grad_scaler._init_scale == 2.0**32
    booster.backward(boosted(torch.randn(4, 16)).float().pow(2).mean(), optimizer)  # the loss is scaled
    assert float(optimizer.optim.grad_scaler.get_scale()) == 2.0**32
    boosted.result.close()
