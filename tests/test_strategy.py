"""Strategy parsing: every accepted load_strategy form round-trips through JSON; every malformed
one is refused with a message naming the problem, all problems together in one StrategyError."""

from __future__ import annotations

import json
import pathlib
import pickle

import pytest
import torch
from class_paths import resolve_class
from torch import nn
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from atorch import Strategy, StrategyError
from atorch.class_ref import class_path
from atorch.opt_lib.registry import method_names

GPT2_BLOCK_PATH = "transformers.models.gpt2.modeling_gpt2.GPT2Block"


class SomeBlock(nn.Module):
    """A user-defined block class, referenced from strategies by its import path."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)


def assert_round_trips(strategy: Strategy, tmp_path: pathlib.Path) -> None:
    """JSON text, JSON bytes, the dict form and a saved file all give back an equal Strategy."""
    text = strategy.to_json()
    assert Strategy.load(text) == strategy
    assert Strategy.load(text.encode("utf-8")) == strategy
    assert Strategy.load(json.loads(text)) == strategy
    assert Strategy.from_json(text) == strategy
    path = tmp_path / "strategy.json"
    strategy.save(path)
    assert json.loads(path.read_text(encoding="utf-8"))["format_version"] == 1
    assert Strategy.load(path) == strategy
    assert Strategy.load(str(path)) == strategy
    assert Strategy.load(strategy) is strategy
    # The JSON form is stable: dumping the reloaded strategy gives the same text.
    assert Strategy.load(text).to_json() == text


ATORCH_FORMS = {
    "names": ["parallel_mode", "amp_native", "checkpoint"],
    "all_names": method_names(),
    "tuple_pairs": [("amp_native", {"dtype": "bf16"}), ("zero1", {"use_ds_zero": False})],
    "list_pairs": [["amp_native", {"dtype": "bf16"}], ["zero2", {"use_ds_zero": True}]],
    "tuple_of_pairs": (("half", "fp16"), ("checkpoint", None)),
    "triples": [("fsdp", {"cpu_offload": True}, True), ["amp_native", {"dtype": "fp16"}, False]],
    "parallel_mode": [("parallel_mode", ([("data", 2)], None))],
    "parallel_mode_rank_order": [("parallel_mode", ([("data", 2)], [1, 0]))],
    "amp_torch_dtype": [("amp_native", {"dtype": torch.bfloat16})],
    "half_bare_dtype": [("half", "bf16")],
    "half_torch_dtype": [("half", torch.float16)],
    "checkpoint_classes": [("checkpoint", (GPT2Block, SomeBlock))],
    "checkpoint_single_class": [("checkpoint", GPT2Block)],
    "fsdp_wrap_cls": [("fsdp", {"atorch_wrap_cls": (GPT2Block,)})],
    "fp8": [("fp8", {"include": ["attn"], "exclude": ["lm_head"], "margin": 1, "fp8_format": "E4M3"})],
    "module_replace": [("module_replace", {"pairs": ["hf_conv1d_to_linear"]})],
    "mixed": ["parallel_mode", ("amp_native", {"dtype": torch.bfloat16}), ("checkpoint", (GPT2Block,)),
              ("fsdp", {"atorch_wrap_cls": (GPT2Block,)}, True)],
}


@pytest.mark.parametrize("form", list(ATORCH_FORMS.values()), ids=list(ATORCH_FORMS))
def test_atorch_forms_round_trip(form, tmp_path):
    strategy = Strategy.load(form)
    assert len(strategy.methods) == len(form)
    assert strategy.names() == [entry if isinstance(entry, str) else entry[0] for entry in form]
    assert_round_trips(strategy, tmp_path)


def test_forms_parse_to_the_stated_configs():
    strategy = Strategy.load(ATORCH_FORMS["mixed"])
    assert strategy.get("parallel_mode").dims == (("data", -1),)
    assert strategy.get("amp_native").dtype == "bf16"
    assert strategy.get("checkpoint").wrap_class == (GPT2_BLOCK_PATH,)
    assert strategy.get("fsdp").atorch_wrap_cls == (GPT2_BLOCK_PATH,)
    assert [item.tunable for item in strategy.methods] == [False, False, False, True]

    mode = Strategy.load(ATORCH_FORMS["parallel_mode_rank_order"]).get("parallel_mode")
    assert mode.dims == (("data", 2),) and mode.rank_order == (1, 0)
    assert Strategy.load(ATORCH_FORMS["half_bare_dtype"]).get("half").dtype == "bf16"
    assert Strategy.load(ATORCH_FORMS["half_torch_dtype"]).get("half").dtype == "fp16"
    assert Strategy.load(["half"]).get("half").dtype == "fp16"  # the documented default


def test_pair_and_triple_forms_are_equivalent():
    as_tuples = Strategy.load([("amp_native", {"dtype": "bf16"}), ("fsdp", {"cpu_offload": True})])
    as_lists = Strategy.load([["amp_native", {"dtype": "bf16"}], ["fsdp", {"cpu_offload": True}]])
    as_triples = Strategy.load(
        [("amp_native", {"dtype": torch.bfloat16}, False), ("fsdp", {"cpu_offload": True}, False)]
    )
    as_dicts = Strategy.load(
        [{"name": "amp_native", "config": {"dtype": "bfloat16"}}, {"name": "fsdp", "config": {"cpu_offload": True}}]
    )
    assert as_tuples == as_lists == as_triples == as_dicts


def test_classes_serialise_as_import_paths_and_resolve_back(tmp_path):
    from_class = Strategy.load([("checkpoint", (GPT2Block, SomeBlock)), ("fsdp", {"atorch_wrap_cls": SomeBlock})])
    some_block = class_path(SomeBlock)
    from_path = Strategy.load(
        [("checkpoint", (GPT2_BLOCK_PATH, some_block)), ("fsdp", {"atorch_wrap_cls": [some_block]})]
    )
    assert from_class == from_path
    payload = json.loads(from_class.to_json())
    assert payload["methods"][0]["config"]["wrap_class"] == [GPT2_BLOCK_PATH, class_path(SomeBlock)]
    reloaded = Strategy.load(from_class.to_json())
    assert [resolve_class(p) for p in reloaded.get("checkpoint").wrap_class] == [GPT2Block, SomeBlock]
    assert resolve_class(reloaded.get("fsdp").atorch_wrap_cls[0]) is SomeBlock


def test_resolve_class_names_the_bad_path():
    with pytest.raises(ValueError, match="not an import path"):
        resolve_class("GPT2Block")
    with pytest.raises(ValueError, match="cannot import class 'no_such_pkg.Block'"):
        resolve_class("no_such_pkg.Block")
    with pytest.raises(ValueError, match="not a class"):
        resolve_class("torch.float32")


def test_strategy_views():
    strategy = Strategy.load([("fsdp", {}), ("parallel_mode", None), ("amp_native", {"dtype": "bf16"})])
    assert "fsdp" in strategy and "zero1" not in strategy
    assert [i.name for i in strategy.in_apply_order()] == ["parallel_mode", "amp_native", "fsdp"]
    assert strategy.to_list()[2] == ("amp_native", {"dtype": "bf16", "skip_if_nonfinite": False})
    assert str(strategy) == "[fsdp, parallel_mode, amp_native{'dtype': 'bf16'}]"
    grown = strategy.with_method("half", "bf16")
    assert grown.names()[-1] == "half" and "half" not in strategy  # frozen: the original is unchanged
    with pytest.raises(Exception):  # noqa: B017 (pydantic's frozen-instance error type)
        strategy.methods = ()


# ----- malformed input -------------------------------------------------------------------
def problems_of(source, world_size=None) -> list[str]:
    with pytest.raises(StrategyError) as info:
        Strategy.load(source, world_size=world_size)
    error = info.value
    # The message lists every problem, and the problems stay available one by one.
    assert f"({len(error.problems)} problem(s))" in str(error)
    for problem in error.problems:
        assert problem in str(error)
    return error.problems


def test_unknown_name_suggests_the_closest():
    [problem] = problems_of(["fsdpp"])
    assert problem == "unknown method 'fsdpp'; did you mean 'fsdp'?"
    [problem] = problems_of(["completely_unrelated"])
    assert "unknown method 'completely_unrelated'" in problem and "known methods: parallel_mode" in problem


def test_unknown_config_key_lists_allowed_keys():
    [problem] = problems_of([("amp_native", {"dtype": "bf16", "loss_scale": 128})])
    assert problem == "'amp_native': unknown config key 'loss_scale' (allowed keys: dtype, skip_if_nonfinite)"


@pytest.mark.parametrize(
    "entry, expected",
    [
        (("amp_native", {"dtype": "fp32"}), "'amp_native': config key 'dtype'"),
        (("half", 3), "'half': config key 'dtype'"),
        (("checkpoint", {"no_reentrant": "maybe"}), "'checkpoint': config key 'no_reentrant'"),
        (("fsdp", {"wrap_min_num_params": 0}), "'fsdp': config key 'wrap_min_num_params'"),
        (("parallel_mode", ([("data", 0)], None)), "size of 'data' must be positive"),
        (("parallel_mode", ([("data", 2), ("data", 2)], None)), "dimension names must be unique"),
        (("fsdp", {}, "yes"), "third element (tunable) must be True/False"),
        (42, "entry 0 (42) is not a method"),
        ({"name": "fsdp", "cfg": {}}, "entry 0: unknown key(s) ['cfg']"),
    ],
)
def test_bad_types_are_named(entry, expected):
    [problem] = problems_of([entry])
    assert expected in problem


def test_not_a_list():
    [problem] = problems_of(42)
    assert "load_strategy must be a list of methods" in problem and "not int" in problem
    [problem] = problems_of("no_such_strategy_file.json")
    assert "neither JSON nor a path to an existing file" in problem
    [problem] = problems_of(pathlib.Path("no_such_dir/strategy.json"))
    assert "does not exist" in problem


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickled_bytes_are_refused_with_the_reason(protocol):
    data = pickle.dumps(["parallel_mode", ("amp_native", {"dtype": "bf16"})], protocol=protocol)
    [problem] = problems_of(data)
    assert "looks pickled" in problem and "unpickling can run arbitrary code" in problem
    assert "JSON" in problem  # names the fix


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("payload", [("fsdp",), {"methods": ["fsdp"]}, "fsdp"], ids=["tuple", "dict", "str"])
def test_any_pickle_is_refused(protocol, payload):
    """Whatever was pickled, loading never unpickles: the bytes are refused (as pickle or as bad JSON)."""
    problems_of(pickle.dumps(payload, protocol=protocol))


def test_pickle_file_is_refused(tmp_path):
    path = tmp_path / "strategy.pkl"
    path.write_bytes(pickle.dumps(["fsdp"]))
    for source in (path, str(path)):
        [problem] = problems_of(source)
        assert str(path) in problem and "looks pickled" in problem


def test_non_utf8_and_invalid_json(tmp_path):
    [problem] = problems_of(b"\xff\xfe[\"fsdp\"]")
    assert "not UTF-8 JSON" in problem
    path = tmp_path / "latin1.json"
    path.write_bytes('["fsdp", "é"]'.encode("latin-1"))
    [problem] = problems_of(path)
    assert "not UTF-8 JSON" in problem and str(path) in problem
    [problem] = problems_of('["fsdp", ')
    assert problem.startswith("load_strategy JSON string is not valid JSON")
    [problem] = problems_of(b'{"methods": [')
    assert problem.startswith("load_strategy bytes is not valid JSON")


def test_duplicate_method():
    [problem] = problems_of(["fsdp", ("fsdp", {"cpu_offload": True})])
    assert problem == "method 'fsdp' appears more than once; keep one entry"


def test_unsupported_format_version():
    good = json.loads(Strategy.load(["fsdp"]).to_json())
    [problem] = problems_of(dict(good, format_version=2))
    assert problem == "strategy format_version 2 is not supported (this atorch reads 1)"
    [problem] = problems_of(json.dumps(dict(good, format_version="1")).encode())
    assert "format_version '1' is not supported" in problem


def test_sizes_are_checked_against_the_world_size():
    fits_two = [("parallel_mode", ([("data", 2)], [1, 0]))]
    assert Strategy.load(fits_two, world_size=2).get("parallel_mode").rank_order == (1, 0)
    [problem] = problems_of(fits_two, world_size=4)
    assert problem == "'parallel_mode': rank_order must be a permutation of 0..3, got [1, 0]"
    [problem] = problems_of([("parallel_mode", ([("data", 2)], [0, 0]))], world_size=2)
    assert "rank_order must be a permutation of 0..1, got [0, 0]" in problem

    odd_dim = [("parallel_mode", ([("data", -1), ("tensor", 3)], None))]
    for world in (2, 4):
        problems = problems_of(odd_dim, world_size=world)
        assert f"'parallel_mode': size 3 of 'tensor' does not divide the world size {world}" in problems
        assert any("dimension 'tensor' is not used by any method" in p for p in problems)
    problems = problems_of([("parallel_mode", ([("data", 2), ("tensor", -1)], None))], world_size=4)
    assert "'parallel_mode': only 'data' may have size -1; give 'tensor' a size" in problems


def test_data_size_is_fitted_to_the_world_size():
    strategy = Strategy.load([("parallel_mode", ([("data", 2)], None))], world_size=4)
    assert strategy.adjusted(4).get("parallel_mode").dims == (("data", 4),)
    assert strategy.adjusted(1).get("parallel_mode").dims == (("data", 1),)
    assert Strategy.load(["parallel_mode"]).adjusted(2).get("parallel_mode").dims == (("data", 2),)


def test_all_problems_are_reported_together():
    source = [
        "fsdpp",
        ("amp_native", {"dtype": "bf16", "scale": 1}),
        ("checkpoint", {"no_reentrant": "maybe"}),
        ("parallel_mode", ([("data", 2)], [0, 0])),
        "half",
        ("half", "bf16"),
    ]
    problems = problems_of(source, world_size=2)
    assert len(problems) == 5, problems
    joined = "\n".join(problems)
    for expected in (
        "did you mean 'fsdp'",
        "unknown config key 'scale'",
        "config key 'no_reentrant'",
        "method 'half' appears more than once",
        "rank_order must be a permutation of 0..1",
    ):
        assert expected in joined


def test_conflicts_are_reported_with_world_size():
    problems = problems_of(["amp_native", "half", "zero1", ("zero2", {"use_ds_zero": True})], world_size=2)
    joined = "\n".join(problems)
    assert "'half' cannot be combined with 'amp_native'" in joined
    assert "'zero1' cannot be combined with 'zero2'" in joined
    assert "'zero2' cannot be combined with 'amp_native' (zero2 implementation='deepspeed')" in joined
    # Without a world size only the form is checked.
    assert Strategy.load(["amp_native", "half"]).names() == ["amp_native", "half"]
