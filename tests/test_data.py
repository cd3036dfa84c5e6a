"""The returned dataloader (shuffle default, a new order each epoch, set_epoch, iterable datasets
split over ranks and workers) and the up-front checks of dataset, loss, model and launch environment."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from launcher import HERE, run_json
from test_validation import MLP_ARGS, accelerate_problems, only_problem
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from toy_models import TokenDataset, gpt2_loss, mlp, mlp_dataset, mlp_loss, tiny_gpt2

import atorch
from atorch.data import build_dataloader, start_method, worker_fork_hazard

WORKER = HERE / "workers" / "data_worker.py"


def ids_of(loader) -> list[int]:
    """One pass: the first feature of each sample (mlp_dataset rows are distinct random vectors)."""
    return [round(float(v), 6) for x, _ in loader for v in x[:, 0]]


def accelerate(**kwargs):
    _, result, _ = atorch.auto_accelerate(mlp(), torch.optim.SGD, **dict(MLP_ARGS, load_strategy=["parallel_mode"],
                                                                         **kwargs))
    return result


# ----- the dataloader at one process ------------------------------------------------------------
def test_single_process_shuffle_reshuffles_each_epoch_and_set_epoch_replays():
    loader = accelerate(dataloader_args={"batch_size": 8, "shuffle": True}).dataloader
    assert isinstance(loader, DataLoader) and len(loader) == 8
    first, second = ids_of(loader), ids_of(loader)
    assert sorted(first) == sorted(second) and first != second  # a permutation of 64 repeating: 1/64!
    loader.set_epoch(0)  # explicit: the next pass is epoch 0 again
    assert ids_of(loader) == first
    assert ids_of(loader) == second  # ...and the counter goes on from there


def test_single_process_default_is_in_order():
    loader = accelerate().dataloader
    expected = [round(float(v), 6) for v in mlp_dataset().tensors[0][:, 0]]
    assert ids_of(loader) == expected == ids_of(loader)


def test_iterable_dataset_is_split_over_workers_without_duplicates():
    class Stream(IterableDataset):
        def __iter__(self):
            data = mlp_dataset(samples=24)
            return iter(zip(data.tensors[0], data.tensors[1], strict=True))

    loader = accelerate(dataset=Stream(), dataloader_args={"batch_size": 4, "num_workers": 2}).dataloader
    got = ids_of(loader)
    assert sorted(got) == sorted(round(float(v), 6) for v in mlp_dataset(samples=24).tensors[0][:, 0])


def test_iterable_dataset_with_length_reports_this_ranks_share():
    class SizedStream(IterableDataset):
        def __len__(self):
            return 10

        def __iter__(self):
            return iter(range(10))

    assert len(build_dataloader(SizedStream(), {"batch_size": 4}, dp_size=2, dp_rank=1)) == 3  # 5 samples, 2 a batch
    assert [b.tolist() for b in build_dataloader(SizedStream(), {"batch_size": 4}, dp_size=2, dp_rank=1)] == [
        [1, 3], [5, 7], [9]
    ]


def test_forked_workers_warn_where_this_python_can_hang_them():
    """CPython before 3.11.10 (gh-112275) can deadlock a worker forked while a torch.distributed thread enters Python
    (seen on this machine's 3.11.7, gloo, about 1 worker start in 2,000): the loader says so, with the ways out."""
    hazard = worker_fork_hazard((3, 11, 7), "fork", 2, True)
    assert hazard is not None and "gh-112275" in hazard and "Python 3.11.7" in hazard
    assert "'multiprocessing_context': 'forkserver'" in hazard
    for fixed in ((3, 11, 10), (3, 12, 0), (3, 13, 1)):
        assert worker_fork_hazard(fixed, "fork", 2, True) is None
    assert worker_fork_hazard((3, 11, 7), "forkserver", 2, True) is None  # the workers are not forked from here
    assert worker_fork_hazard((3, 11, 7), "fork", 0, True) is None  # no worker
    assert worker_fork_hazard((3, 11, 7), "fork", 2, False) is None  # no torch.distributed thread
    assert start_method("spawn") == "spawn" and start_method(multiprocessing.get_context("forkserver")) == "forkserver"


# ----- the dataloader at two processes ----------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks() -> dict:
    return run_json(WORKER, nproc=2, timeout=300)


def check_split(orders: list[list[list[int]]], epoch: int, samples: int = 32) -> None:
    """Each epoch the ranks' samples are disjoint and cover the dataset."""
    ranks = [orders[rank][epoch] for rank in range(2)]
    assert not set(ranks[0]) & set(ranks[1])
    assert sorted(ranks[0] + ranks[1]) == list(range(samples))


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", ["default", "workers"])
def test_two_ranks_shuffle_by_default_and_reshuffle_each_epoch(two_ranks, scenario):
    out = two_ranks[scenario]
    orders = out["orders"]
    assert out["is_dataloader"] and out["len"] == 4 and out["batches"] == 4  # 32 samples / 2 ranks / 4 per rank
    for epoch in (0, 1):
        check_split(orders, epoch)
    assert orders[0][0] != orders[0][1] and orders[1][0] != orders[1][1]
    assert orders[0][0] != list(range(0, 32, 2))  # shuffled, not DistributedSampler's in-order split


@pytest.mark.distributed
def test_two_ranks_user_sampler_without_set_epoch(two_ranks):
    """distributed_sampler_cls without set_epoch: used as given (its order cannot change by epoch)."""
    out = two_ranks["user_sampler"]
    assert out["is_dataloader"] and out["len"] == 4 and out["batches"] == 4
    check_split(out["orders"], 0)
    assert out["orders"][0][0] != list(range(0, 32, 2)) and out["orders"][0][0] == out["orders"][0][1]


@pytest.mark.distributed
def test_two_ranks_shuffle_false_keeps_the_order(two_ranks):
    orders = two_ranks["no_shuffle"]["orders"]
    assert orders[0] == [list(range(0, 32, 2))] * 2 and orders[1] == [list(range(1, 32, 2))] * 2


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", ["stream", "stream_workers"])
def test_two_ranks_split_an_iterable_dataset(two_ranks, scenario):
    check_split(two_ranks[scenario]["orders"], 0)
    assert two_ranks[scenario]["batches"] == 4  # the global batch of 8 split: 4 per rank, 16 samples each


# ----- up-front checks --------------------------------------------------------------------------
PS = ["parallel_mode"]


def test_unpack_dict_with_a_tuple_dataset():
    problem = only_problem(load_strategy=PS, model_input_format="unpack_dict")
    assert problem.startswith("model_input_format='unpack_dict' calls model(**batch), but a batch is a list of 2")
    assert "use model_input_format='unpack_sequence'" in problem


def test_unpack_sequence_with_a_dict_dataset():
    problem = only_problem(model=tiny_gpt2(), load_strategy=PS, dataset=TokenDataset(8), loss_func=gpt2_loss,
                           model_input_format="unpack_sequence")
    assert "calls model(*batch), but a batch is a dict with keys ['input_ids', 'labels']" in problem
    assert "use model_input_format='unpack_dict'" in problem


def test_collate_fn_from_dataloader_args_is_used():
    def as_dict(samples):
        return {"x": torch.stack([s[0] for s in samples]), "labelz": torch.stack([s[1] for s in samples])}

    problem = only_problem(load_strategy=PS, model_input_format="unpack_dict",
                           dataloader_args={"batch_size": 8, "collate_fn": as_dict})
    assert problem.startswith("model_input_format='unpack_dict' calls model(**batch) with a dict with keys "
                              "['labelz', 'x'], which MLP.forward(x, y=None) does not accept")
    assert "unexpected keyword argument 'labelz'" in problem
    assert "change the dataset / collate_fn or model_input_format" in problem


def test_too_many_positional_inputs_for_forward():
    problem = only_problem(model=nn.Linear(16, 8), load_strategy=PS)
    assert "calls model(*batch) with a list of 2 element(s), which Linear.forward(input) does not accept" in problem


def test_input_problems_are_reported_with_strategy_and_model_problems():
    problems = accelerate_problems(load_strategy=["amp_nativ"], model_input_format="unpack_dict",
                                   loss_func=lambda output: output)
    assert len(problems) == 3, problems
    assert problems[0].startswith("loss_func <lambda>(output) cannot be called as loss_func(data, output)")
    assert problems[1].startswith("model_input_format='unpack_dict' calls model(**batch)")
    assert problems[2] == "unknown method 'amp_nativ'; did you mean 'amp_native'?"
    problems = accelerate_problems(load_strategy=[("checkpoint", ("NoSuchBlock",))], model_input_format="unpack_dict")
    assert len(problems) == 2, problems  # the model is still probed: its problems come with the input's
    assert problems[1].startswith("'checkpoint': wrap_class ['NoSuchBlock'] matches no")


def test_forward_with_kwargs_accepts_any_key():
    class Open(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 8)

        def forward(self, **batch):
            return self.lin(batch["x"])

    def as_dict(samples):
        return {"x": torch.stack([s[0] for s in samples]), "anything": torch.stack([s[1] for s in samples])}

    _, result, _ = atorch.auto_accelerate(
        Open(), torch.optim.SGD, mlp_dataset(), lambda data, output: output.sum(), model_input_format="unpack_dict",
        dataloader_args={"batch_size": 8, "collate_fn": as_dict}, optim_args={"lr": 0.1}, load_strategy=PS,
    )
    assert set(next(iter(result.dataloader))) == {"x", "anything"}


def test_a_dataloader_passed_as_dataset():
    problem = only_problem(load_strategy=PS, dataset=DataLoader(mlp_dataset(), batch_size=8))
    assert problem.startswith("dataset is a torch DataLoader; pass its dataset instead (dataset=loader.dataset)")
    assert "batch_size (the global batch)" in problem and "in dataloader_args" in problem


def test_shuffle_or_sampler_with_an_iterable_dataset():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(zip(*mlp_dataset().tensors, strict=True))

    problems = accelerate_problems(load_strategy=PS, dataset=Stream(),
                                   dataloader_args={"batch_size": 8, "shuffle": True},
                                   distributed_sampler_cls=torch.utils.data.DistributedSampler)
    assert len(problems) == 2, problems
    assert problems[0].startswith("dataloader_args['shuffle']=True with an IterableDataset")
    assert problems[1].startswith("distributed_sampler_cls with an IterableDataset")


def test_sampler_in_dataloader_args():
    problem = only_problem(load_strategy=PS, dataloader_args={"batch_size": 8, "sampler": range(64)})
    assert problem.startswith("dataloader_args['sampler'] cannot be used")
    assert "distributed_sampler_cls" in problem


@pytest.mark.parametrize("loss", [lambda output: output.sum(), lambda data, output, extra: output.sum()])
def test_loss_func_with_the_wrong_signature(loss):
    problem = only_problem(load_strategy=PS, loss_func=loss)
    assert problem.startswith("loss_func <lambda>(")
    assert "cannot be called as loss_func(data, output)" in problem


def test_loss_funcs_that_fit_or_have_no_signature_are_accepted():
    # (a loss module, forward(input, target), binds two arguments too, but fails on the batch: test_step_checks.py)
    for loss in (mlp_loss, lambda *args: args[1].sum(), lambda data, output, scale=1.0: output.sum() * scale):
        accelerate(loss_func=loss)
    # A builtin without a signature passes the signature check; its step on the sample batch then fails (max
    # compares the batch, a list, with the output): named as the loss_func's.
    problem = only_problem(load_strategy=PS, loss_func=max)
    assert problem.startswith("loss_func (max) fails on a sample batch") and "TypeError" in problem


@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`")
def test_a_model_already_wrapped_in_ddp_or_fsdp():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    accelerate()  # makes sure the one-process group exists
    problem = only_problem(model=DDP(mlp()), load_strategy=PS)
    assert problem.startswith("the model is already wrapped in DistributedDataParallel; pass the plain nn.Module")
    problem = only_problem(model=FSDP(mlp(), device_id=torch.device("cpu")), load_strategy=PS)
    assert problem.startswith("the model is already wrapped in FSDP; pass the plain nn.Module")
    sharded = mlp()
    fully_shard(sharded.blocks[0])
    problem = only_problem(model=sharded, load_strategy=PS)
    assert problem.startswith("module 'blocks.0' of the model is already wrapped in fully_shard (FSDP2)")


def test_save_strategy_to_file_is_checked_before_training(tmp_path):
    problem = only_problem(load_strategy=PS, save_strategy_to_file=str(tmp_path / "no" / "such" / "s.json"))
    assert problem == (f"save_strategy_to_file '{tmp_path / 'no' / 'such' / 's.json'}': directory "
                       f"'{tmp_path / 'no' / 'such'}' does not exist; create it first")
    problem = only_problem(load_strategy=PS, save_strategy_to_file=tmp_path)
    assert problem.startswith(f"save_strategy_to_file '{tmp_path}' is a directory; give a file path")
    (tmp_path / "file").write_text("")
    problem = only_problem(load_strategy=PS, save_strategy_to_file=tmp_path / "file" / "s.json")
    assert problem.endswith(f"'{tmp_path / 'file'}' is not a directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_save_strategy_to_file_not_writable(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    problem = only_problem(load_strategy=PS, save_strategy_to_file=locked / "s.json")
    assert problem.endswith("is not writable; choose a path this process may write")


LAUNCH_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import atorch
    from toy_models import mlp, mlp_dataset, mlp_loss

    out = {}
    for name, env in json.loads(sys.argv[1]).items():
        for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)
        os.environ.update(env)
        try:
            atorch.auto_accelerate(mlp(), torch.optim.SGD, mlp_dataset(), mlp_loss,
                                   model_input_format="unpack_sequence", dataloader_args={"batch_size": 8},
                                   load_strategy=["parallel_mode"], bogus=1)
            out[name] = "accepted"
        except atorch.StrategyError as exc:
            out[name] = exc.problems
    print("RESULT " + json.dumps(out))
    """
)


def test_launch_environment_without_a_rendezvous_address(tmp_path: Path):
    """In a fresh process (no process group yet), as a script started with `python` would be."""
    script = tmp_path / "launch.py"
    script.write_text(LAUNCH_SCRIPT)
    cases = {
        "no_master": {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"},
        "no_port": {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1"},
        "inconsistent": {"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "x", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
    }
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), json.dumps(cases)], capture_output=True, text=True,
                          timeout=120, env=env, check=True)
    out = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])
    bogus = "unknown keyword argument(s) ['bogus']"  # reported together with the launch problems
    assert out["no_master"][0].startswith(bogus) and len(out["no_master"]) == 2, out
    assert out["no_master"][1].startswith("WORLD_SIZE=2 but MASTER_ADDR and MASTER_PORT are not set")
    assert "launch with torchrun (torchrun --nproc_per_node=N train.py)" in out["no_master"][1]
    assert out["no_port"][1].startswith("WORLD_SIZE=2 but MASTER_PORT is not set"), out
    assert out["inconsistent"][1:] == [
        "environment variable LOCAL_RANK='x' is not a non-negative integer; launch with torchrun, which sets it",
        "RANK=2 is not below WORLD_SIZE=2; launch with torchrun",
    ]
