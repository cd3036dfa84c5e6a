"""auto_accelerate's argument checks (all problems in one error, before anything is built), the
default strategy, save_strategy_to_file, and that the user's own model is never modified."""

from __future__ import annotations

import copy
import json
import logging
import textwrap

import pytest
import torch
from launcher import run_json
from torch import nn
from toy_models import TokenDataset, gpt2_loss, mlp, mlp_dataset, mlp_loss, tiny_gpt2

import atorch
from atorch import Strategy, StrategyError
from atorch.log import console_while
from atorch.training import train_step

MLP_ARGS = dict(
    dataset=mlp_dataset(), loss_func=mlp_loss, model_input_format="unpack_sequence",
    optim_args={"lr": 0.1}, dataloader_args={"batch_size": 8},
)


@pytest.fixture
def atorch_log(caplog):
    """atorch's records propagate to the root logger, where caplog listens; at INFO for the test."""
    caplog.set_level(logging.INFO, logger="atorch")
    return caplog


def accelerate_problems(model=None, optim_func=torch.optim.SGD, **kwargs) -> list[str]:
    """The problems of one refused auto_accelerate call; the optimizer must never have been built."""
    built = []

    def recording_optim(params, **optim_args):
        built.append(True)
        return optim_func(params, **optim_args)

    args = dict(MLP_ARGS, **kwargs)
    with pytest.raises(StrategyError) as info:
        optim = recording_optim if callable(optim_func) else optim_func
        atorch.auto_accelerate(mlp() if model is None else model, optim, **args)
    assert not built, "the optimizer was built before the problems were reported"
    return info.value.problems


def only_problem(**kwargs) -> str:
    problems = accelerate_problems(**kwargs)
    assert len(problems) == 1, problems
    return problems[0]


# ----- arguments ---------------------------------------------------------------------------
def test_unknown_keyword_arguments():
    problem = only_problem(load_strategy=["parallel_mode"], verbos=True, memory=1)
    assert problem.startswith("unknown keyword argument(s) ['memory', 'verbos']; accepted: verbose,")


def test_memory_limit_is_parsed_to_bytes():
    _, result, _ = atorch.auto_accelerate(mlp(), torch.optim.SGD, load_strategy=["parallel_mode"], memory_limit="6GiB",
                                          **MLP_ARGS)
    assert result.args.memory_limit == 6 * 2**30
    _, result, _ = atorch.auto_accelerate(mlp(), torch.optim.SGD, load_strategy=["parallel_mode"], **MLP_ARGS)
    assert result.args.memory_limit is None


@pytest.mark.parametrize(
    "value, message",
    [("6 parsecs", "unknown unit 'parsecs'"), (-1, "must be positive"), ("lots", "is not a size")],
)
def test_bad_memory_limit(value, message):
    problem = only_problem(load_strategy=["parallel_mode"], memory_limit=value)
    assert "memory_limit" in problem and message in problem


@pytest.mark.parametrize("value", [-5, 0, "ten", True, [60]])
def test_bad_time_limit(value):
    problem = only_problem(load_strategy=["parallel_mode"], time_limit=value)
    assert problem == f"time_limit must be a positive number of seconds, got {value!r}"


def test_good_time_limit_is_returned():
    _, result, _ = atorch.auto_accelerate(mlp(), torch.optim.SGD, load_strategy=["parallel_mode"], time_limit=90,
                                          **MLP_ARGS)
    assert result.args.time_limit == 90


def test_model_input_format_typo():
    problem = only_problem(load_strategy=["parallel_mode"], model_input_format="unpack_dcit")
    assert problem == ("model_input_format 'unpack_dcit' is not one of None, 'unpack_sequence', 'unpack_dict', "
                       "'input_target'")


@pytest.mark.parametrize("name, value", [("optim_args", 5), ("dataloader_args", "batch_size=8"),
                                         ("lr_scheduler_args", [1])])
def test_argument_dicts_are_type_checked(name, value):
    problem = only_problem(load_strategy=["parallel_mode"], **{name: value})
    assert problem == f"{name} must be a dict, got {type(value).__name__}"


@pytest.mark.parametrize("batch", [0, -4, 2.5, "8"])
def test_batch_size_must_be_a_positive_int(batch):
    problem = only_problem(load_strategy=["parallel_mode"], dataloader_args={"batch_size": batch})
    assert problem == f"dataloader_args['batch_size'] must be a positive int (the global batch), got {batch!r}"


def test_excluded_and_included_unknown_names():
    problems = accelerate_problems(load_strategy=["parallel_mode"], excluded=["fsdpp"], included=["no_such_method"])
    assert len(problems) == 2, problems
    assert problems[0].startswith("excluded names unknown method 'fsdpp'; known: parallel_mode,")
    assert problems[1].startswith("included names unknown method 'no_such_method'; known: parallel_mode,")


def test_method_in_load_strategy_and_excluded():
    problem = only_problem(load_strategy=["parallel_mode", "amp_native"], excluded=["amp_native"])
    assert problem == "'amp_native' is in load_strategy and in excluded; remove it from one"


def test_finetune_strategy_needs_a_strategy_to_search_around():
    problem = only_problem(finetune_strategy=True)
    assert "finetune_strategy=True searches around load_strategy: give load_strategy too" in problem


def test_search_options_are_checked_by_name():
    problems = accelerate_problems(search={"max_trail": 3, "trial_timeout_s": -1})
    assert any("search option 'max_trail'" in p and "known: max_trials" in p for p in problems), problems
    assert any("search option 'trial_timeout_s'" in p and "greater than 0" in p for p in problems), problems
    assert only_problem(search=[1]) == "search must be a dict of options, got list"


def test_strategy_problems_reach_the_caller():
    problem = only_problem(load_strategy=["parallel_mode", "amp_nativ"])
    assert problem == "unknown method 'amp_nativ'; did you mean 'amp_native'?"
    problem = only_problem(load_strategy=[("module_replace", {"pairs": ["no_such_pair"]})])
    assert problem.startswith("'module_replace': unknown replace pair(s) ['no_such_pair']; registered: [")


def test_several_problems_are_reported_together():
    problems = accelerate_problems(
        load_strategy=["parallel_mode", "amp_native", "half"],
        excluded=["amp_native", "zero3"],
        included=["tp"],
        model_input_format="unpack_dcit",
        dataloader_args={"batch_size": 0},
        finetune_strategy=True,
        memory_limit="6 parsecs",
        time_limit=-1,
        bogus=1,
    )
    expected = [
        "unknown keyword argument(s) ['bogus']",
        "memory_limit '6 parsecs' has unknown unit",
        "time_limit must be a positive number",
        "model_input_format 'unpack_dcit'",
        "dataloader_args['batch_size'] must be a positive int",
        "excluded names unknown method 'zero3'",
        "included names unknown method 'tp'",
        "'half' cannot be combined with 'amp_native'",
        "'amp_native' is in load_strategy and in excluded",
    ]
    assert len(problems) == len(expected), problems
    for fragment, problem in zip(expected, problems, strict=True):
        assert fragment in problem


def test_model_and_callables_are_checked():
    problems = accelerate_problems(model=nn.Linear(16, 8).state_dict(), optim_func=42, loss_func="mse",
                                   load_strategy=["parallel_mode"])
    assert problems == [
        "model must be a torch.nn.Module, got OrderedDict",
        "optim_func must be an optimizer class or a function (params, **optim_args) -> optimizer",
        "loss_func must be callable as loss_func(data, output)",
    ]


# ----- problems with the model, found before the build ---------------------------------------
def test_checkpoint_class_that_matches_nothing():
    problem = only_problem(load_strategy=[("checkpoint", ("NoSuchBlock",))])
    assert problem == (
        "'checkpoint': wrap_class ['NoSuchBlock'] matches no module of the model; use class objects or names"
    )
    # model_input_format=None: Sequential.forward binds the (x, y) batch as one argument, so only the fake-tensor
    # step finds that it cannot run; the model is still probed for the strategy's problems.
    problems = accelerate_problems(model=nn.Sequential(nn.Linear(16, 8)), model_input_format=None,
                                   load_strategy=["checkpoint"])
    assert len(problems) == 2, problems
    assert problems[0].startswith("the model's forward fails on a sample batch: model_input_format=None")
    assert problems[1].startswith("'checkpoint': no wrap_class given and no repeated blocks found in the model")


def test_fsdp_classes_that_match_nothing():
    problems = accelerate_problems(
        load_strategy=[("fsdp", {"atorch_wrap_cls": ["NoSuchBlock"], "ignored_modules": ["no_such_head"]})]
    )
    assert problems == [
        "'fsdp': atorch_wrap_cls ['NoSuchBlock'] matches no module of the model",
        "'fsdp': ignored_modules ['no_such_head'] match no module of the model; "
        "use classes, class names or module names such as 'lm_head'",
    ]


# ----- what a successful call returns ------------------------------------------------------
def test_default_strategy_is_applied_and_returned(atorch_log, tmp_path):
    """No load_strategy and no dataset to search with, at world size 1 on CPU: plain data parallel over
    the one process; one step equals a plain fp32 SGD step on a copy of the model."""
    model = mlp()
    reference = copy.deepcopy(model)
    path = tmp_path / "saved.json"
    status, result, strategy = atorch.auto_accelerate(model, torch.optim.SGD, save_strategy_to_file=str(path),
                                                      **{**MLP_ARGS, "dataset": None})
    assert status is True
    assert strategy == Strategy.load([("parallel_mode", ([("data", 1)], None))])
    assert any("no load_strategy and no dataset: automatic search needs batches to measure; using [parallel_mode"
               in r.getMessage() for r in atorch_log.records)
    assert Strategy.load(path) == strategy
    assert json.loads(path.read_text(encoding="utf-8"))["methods"][0]["name"] == "parallel_mode"
    assert result.args.data_parallel_size == 1 and result.dataloader is None
    assert result.args.use_optim_backward is False and result.args.skipped == {}

    batch = next(iter(torch.utils.data.DataLoader(MLP_ARGS["dataset"], batch_size=8)))
    loss = train_step(result, [batch])
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_loss = mlp_loss(batch, reference(*batch))
    ref_loss.backward()
    ref_optim.step()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=0, atol=1e-6)
    for got, want in zip(result.model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_an_applications_root_handler_receives_atorchs_lines(capsys):
    """atorch adds no handler of its own (a NullHandler) unless asked: the application's logging config
    gets its lines. With verbose, atorch's console prints them (rank first) and the root handler does not."""
    atorch_logger = logging.getLogger("atorch")
    assert [type(h) for h in atorch_logger.handlers] == [logging.NullHandler] and atorch_logger.propagate
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger().addHandler(handler)
    try:
        atorch.auto_accelerate(mlp(), torch.optim.SGD, load_strategy=["parallel_mode"], **MLP_ARGS)[1].close()
        assert any(r.name == "atorch.accelerate" and r.getMessage().startswith("accelerated with [parallel_mode")
                   for r in records), [r.getMessage() for r in records]
        assert "accelerated with" not in capsys.readouterr().out
        records.clear()
        with console_while():
            atorch.auto_accelerate(mlp(), torch.optim.SGD, load_strategy=["parallel_mode"], verbose=True,
                                   **MLP_ARGS)[1].close()
            assert atorch_logger.isEnabledFor(logging.DEBUG)
        assert "[rank0] accelerated with [parallel_mode" in capsys.readouterr().out and not records
    finally:
        logging.getLogger().removeHandler(handler)
    assert [type(h) for h in atorch_logger.handlers] == [logging.NullHandler] and atorch_logger.propagate
    assert not atorch_logger.isEnabledFor(logging.DEBUG)


def test_save_strategy_to_file_round_trips(tmp_path):
    path = tmp_path / "nested.json"
    load = [("parallel_mode", ([("data", 4)], None)), ("amp_native", {"dtype": torch.bfloat16}),
            ("checkpoint", {"wrap_class": [nn.Sequential], "no_reentrant": True})]
    _, _, strategy = atorch.auto_accelerate(mlp(), torch.optim.SGD, load_strategy=load,
                                            save_strategy_to_file=path, **MLP_ARGS)
    saved = Strategy.load(path)
    assert saved == strategy
    assert saved.get("parallel_mode").dims == (("data", 1),)  # the layout that actually ran
    assert saved.get("checkpoint").wrap_class == ("torch.nn.modules.container.Sequential",)


def test_users_model_is_never_modified():
    model = tiny_gpt2()
    params = dict(model.named_parameters())
    values = {name: p.detach().clone() for name, p in params.items()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    modules = {name: (m, type(m)) for name, m in model.named_modules()}
    forwards = {name: m.forward for name, m in model.named_modules()}  # bound methods, compared by __func__
    optim_args, loader_args = {"lr": 1e-3}, {"batch_size": 4}

    _, result, _ = atorch.auto_accelerate(
        model, torch.optim.AdamW, TokenDataset(samples=8), gpt2_loss, model_input_format="unpack_dict",
        optim_args=optim_args, dataloader_args=loader_args,
        load_strategy=[("amp_native", {"dtype": "bf16"}), "checkpoint", "module_replace"],
    )
    # The strategy did change the model it returned...
    assert result.model is not model
    assert type(result.model.transformer.h[0]).__name__ == "CheckpointWrapper"
    assert "forward" in result.model.__dict__
    assert type(result.model.transformer.h[0]._checkpoint_wrapped_module.attn.c_attn) is nn.Linear
    train_step(result, [next(iter(result.dataloader))])

    # ...and nothing of the user's: same objects, same values, no gradients, same classes, no patched forward.
    assert dict(model.named_parameters()) == params  # same Parameter objects under the same names
    for name, p in model.named_parameters():
        assert torch.equal(p, values[name]), name
        assert p.grad is None, name
    result_params = {id(p) for p in result.model.parameters()}
    assert not result_params & {id(p) for p in params.values()}
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name]), name
    assert {name: (m, type(m)) for name, m in model.named_modules()} == modules
    for name, m in model.named_modules():
        assert "forward" not in m.__dict__, name
        assert m.forward.__func__ is forwards[name].__func__, name
    assert model.transformer.h[0].attn.c_attn.__class__.__name__ == "Conv1D"
    assert optim_args == {"lr": 1e-3} and loader_args == {"batch_size": 4}


# ----- batch division over data-parallel ranks (needs two real processes) -------------------
BATCH_SCRIPT = textwrap.dedent(
    """
    import json

    import torch
    import torch.distributed as dist
    from toy_models import mlp, mlp_dataset, mlp_loss

    import atorch


    def run(batch, strategy):
        try:
            _, result, _ = atorch.auto_accelerate(
                mlp(), torch.optim.SGD, mlp_dataset(), mlp_loss, model_input_format="unpack_sequence",
                optim_args={"lr": 0.1}, dataloader_args={"batch_size": batch}, load_strategy=strategy,
            )
        except atorch.StrategyError as exc:
            return {"problems": exc.problems}
        return {"dp": result.args.data_parallel_size, "local": result.args.local_batch_size,
                "rank": result.args.data_parallel_rank, "len": len(next(iter(result.dataloader))[0])}


    out = {
        "odd": run(3, ["parallel_mode"]),
        "odd_default": run(5, None),
        "even": run(6, [("parallel_mode", ([("data", 2)], [1, 0]))]),
        "bad_rank_order": run(4, [("parallel_mode", ([("data", 2)], [0, 1, 2]))]),
    }
    # Rank 0 reports; from the others only the numbers that differ by rank (tensors, no pickling).
    mine = torch.tensor([out["even"]["rank"], sum(len(v.get("problems", ())) for v in out.values())])
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    out["dp_ranks"] = [int(t[0]) for t in gathered]
    out["problem_counts"] = [int(t[1]) for t in gathered]
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    """
)


@pytest.mark.distributed
def test_batch_size_must_divide_over_data_parallel_ranks(tmp_path):
    script = tmp_path / "batch_division.py"
    script.write_text(BATCH_SCRIPT)
    out = run_json(script, nproc=2, timeout=240)
    assert out["odd"] == {"problems": [
        "global batch_size 3 does not divide over 2 data-parallel processes; use a multiple of 2"
    ]}
    assert out["odd_default"] == {"problems": [
        "global batch_size 5 does not divide over 2 data-parallel processes; use a multiple of 2"
    ]}
    assert out["bad_rank_order"] == {"problems": [
        "'parallel_mode': rank_order must be a permutation of 0..1, got [0, 1, 2]"
    ]}
    assert out["even"]["dp"] == 2 and out["even"]["local"] == 3 and out["even"]["len"] == 3
    assert out["problem_counts"] == [3, 3]  # the other rank refused the same calls
    # rank_order [1, 0]: process 1 sits at data-parallel position 0.
    assert out["dp_ranks"] == [1, 0]


def test_unparsable_methods_and_conflicts_among_the_rest_are_reported_together():
    problems = accelerate_problems(
        load_strategy=["fsdpp", ("amp_native", {"dtype": "int8"}), "zero1", "fsdp"]
    )
    assert problems[0] == "unknown method 'fsdpp'; did you mean 'fsdp'?"
    assert problems[1].startswith("'amp_native': config key 'dtype'")
    assert problems[2].startswith("'zero1' cannot be combined with 'fsdp'")
    assert len(problems) == 3, problems
