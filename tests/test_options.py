"""The options typed once (atorch/options.py) and the ATORCH_* settings (atorch/settings.py):
auto_accelerate, ATorchStrategy and AutoPlugin refuse the same bad option with the same sentence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from toy_models import mlp, mlp_dataset, mlp_loss

import atorch
from atorch.booster.plugin import AutoPlugin
from atorch.errors import SetupError, StrategyError
from atorch.options import AccelerateOptions, StrategyOptions
from atorch.settings import cache_dir, settings

BAD = {"memory_limit": "6 parsecs", "time_limit": 0, "search": {"max_trail": 3}}


def accelerate_problems(**options) -> list[str]:
    with pytest.raises(StrategyError) as info:
        atorch.auto_accelerate(mlp(), torch.optim.SGD, dataset=mlp_dataset(), loss_func=mlp_loss,
                               model_input_format="unpack_sequence", dataloader_args={"batch_size": 8},
                               load_strategy=["parallel_mode"], **options)
    return info.value.problems


def test_every_front_end_refuses_a_bad_option_with_the_same_sentences() -> None:
    expected = accelerate_problems(**BAD)
    assert [p.split(" ")[0] for p in expected] == ["memory_limit", "time_limit", "search"], expected
    with pytest.raises(SetupError) as plugin:
        AutoPlugin(**BAD)
    for problem in expected:
        assert problem in str(plugin.value)
    pytest.importorskip("lightning")
    from atorch.lightning import ATorchStrategy

    with pytest.raises(SetupError) as lightning:
        ATorchStrategy(load_strategy=["parallel_mode"], **BAD)
    for problem in expected:
        assert problem in str(lightning.value)


def test_an_unknown_option_is_refused_with_the_closest_name() -> None:
    problem, = accelerate_problems(memory=1, max_trials=3)
    assert problem.startswith("unknown keyword argument(s) ['max_trials', 'memory']; accepted: verbose,")
    assert problem.endswith("did you mean search={'max_trials': ...}, memory_limit for 'memory'?")
    with pytest.raises(SetupError, match=r"unknown option\(s\) \['exclude'\]; accepted: .*did you mean excluded"):
        AutoPlugin(exclude=["fsdp"])


def test_a_new_option_is_accepted_everywhere_once_it_is_a_field() -> None:
    """ATorchStrategy and AutoPlugin take every keyword option of auto_accelerate (a subclass each)."""
    assert set(AccelerateOptions.model_fields) < set(StrategyOptions.model_fields)
    plugin = AutoPlugin(memory_limit="20MiB", strategy_server="http://127.0.0.1:1", verbose=False)
    assert plugin.accelerate_kwargs["strategy_server"] == "http://127.0.0.1:1"
    options, problems = StrategyOptions.checked({"memory_limit": "1GB", "excluded": None, "time_limit": 90})
    assert not problems and options.memory_limit == 10**9 and options.excluded == [] and options.time_limit == 90


def test_strategy_server_defaults_to_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("ATORCH_STRATEGY_SERVER", "host:8765")
    problem, = accelerate_problems()
    assert problem == "strategy_server must be an http(s) URL such as 'http://host:8765', got 'host:8765'"
    monkeypatch.setenv("ATORCH_STRATEGY_SERVER", "http://host:8765")
    assert AccelerateOptions.checked({})[0].strategy_server == "http://host:8765"
    assert AccelerateOptions.checked({"strategy_server": "https://other"})[0].strategy_server == "https://other"


def test_settings_are_read_from_the_environment_at_each_call(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ATORCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ATORCH_SERVER_BUSY_TIMEOUT_S", "0.5")
    assert cache_dir() == tmp_path and settings().server_busy_timeout_s == 0.5
    monkeypatch.setenv("ATORCH_CACHE_DIR", "")  # empty counts as unset
    monkeypatch.delenv("ATORCH_SERVER_BUSY_TIMEOUT_S")
    assert cache_dir() == Path.home() / ".cache" / "atorch" and settings().server_busy_timeout_s == 5.0
