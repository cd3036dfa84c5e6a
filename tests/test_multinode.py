"""Beyond one machine: a two-node job simulated here (two torchrun launchers, ``--nnodes 2 --node-rank {0,1}
--rdzv-backend c10d``, 2 processes each) runs semi-automatic and automatic mode and a checkpoint round trip with
global ranks that are not local ranks; the measured hardware profile records 2 nodes × 2 processes, and the
search places tensor groups within a node. See tests/workers/multinode_worker.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from launcher import run_json_nodes

WORKER = Path(__file__).resolve().parent / "workers" / "multinode_worker.py"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    shared = tmp_path_factory.mktemp("multinode")
    nodes = [(str(shared), str(shared / f"cache{i}"), str(i)) for i in range(2)]  # each node its own cache
    return run_json_nodes(WORKER, nodes, nproc=2, timeout=240)


def _node_of(job: dict[str, Any]) -> dict[int, str]:
    return {r["rank"]: r["node"] for r in job["ranks"]}


@pytest.mark.distributed
def test_global_ranks_span_two_nodes_of_two(job: dict[str, Any]) -> None:
    ranks = sorted(job["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3] and {r["world"] for r in ranks} == {4}
    assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1] and {r["local_world"] for r in ranks} == {2}
    # torchrun numbers a node's processes consecutively: group rank g holds global ranks 2g and 2g + 1
    assert all(r["rank"] == 2 * r["group_rank"] + r["local_rank"] for r in ranks)
    assert sorted(_node_of(job).values()) == ["0", "0", "1", "1"]


@pytest.mark.distributed
def test_semi_automatic_tensor_groups_within_a_node_and_checkpoint_resumes(job: dict[str, Any]) -> None:
    semi, node = job["semi"], _node_of(job)
    assert semi["tensor_groups"] == [[0, 1], [2, 3]]
    assert all(len({node[r] for r in group}) == 1 for group in semi["tensor_groups"])
    assert all(0 < loss < 20 for loss in semi["first"])
    # saved on 4 processes of 2 nodes, loaded into a model built from another seed: the same next steps
    assert semi["losses_b"] == semi["losses_a"] and semi["info"]["step"] == 2


@pytest.mark.distributed
def test_automatic_search_measures_nodes_and_keeps_tensor_groups_in_a_node(job: dict[str, Any]) -> None:
    auto, node = job["auto"], _node_of(job)
    assert auto["profile"] == {"world_size": 4, "gpus_per_node": 2, "nodes": 2, "local_world_size": 2}
    assert auto["tensor_groups"], auto["strategy"]  # tensor parallelism was included
    assert all(len(group) == 2 and len({node[r] for r in group}) == 1 for group in auto["tensor_groups"])
    assert auto["search"]["dry_runs"] >= 1 and all(loss == loss for loss in auto["losses"])


def test_search_space_tensor_sizes_divide_the_ranks_per_node() -> None:
    from toy_models import tiny_gpt2

    from atorch.strategy_search.search.space import SearchSpace

    one_node = SearchSpace(tiny_gpt2(), 4, 8)
    two_nodes = SearchSpace(tiny_gpt2(), 4, 8, ranks_per_node=2)
    assert one_node.tensor_sizes == (1, 2, 4) and two_nodes.tensor_sizes == (1, 2)


def test_ranks_per_node_and_the_profile_cache_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from atorch.strategy_search.costing.hardware import cache_path, ranks_per_node

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ranks_per_node(4) == 2 and ranks_per_node(2) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert ranks_per_node(4) == 4  # uneven nodes: counted as one
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert ranks_per_node(4) == 4
    assert cache_path("cpu", 4, "gloo", 2) != cache_path("cpu", 4, "gloo")  # 2 nodes × 2 is not 1 × 4
