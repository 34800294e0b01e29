"""The data-parallel group as the first source of rank and size (issue 11, build item 2).

Finding: the default topology was the global rank, so under TP/CP/PP every model-parallel
rank of a data-parallel replica read different data unless the user remembered to pass
``dp_rank`` / ``dp_size``; there was no ``dp_group``. Checked with a real gloo process group
(one process, so the fast suite stays fast; ``tests/integration/test_examples.py`` runs several ranks).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from helpers_data import make_token_docs, write_tar_shards

from streampack.dataset import PackedDataset
from streampack.options import TopologyOptions
from streampack.plan.topology import process_groups, resolve_topology


@pytest.fixture
def gloo(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_world_group_alone_gives_the_rank(gloo):
    assert process_groups() == 1
    assert resolve_topology() == (0, 1)


def test_model_parallel_groups_require_the_dp_group(gloo, tmp_path):
    urls = write_tar_shards(tmp_path / "d", make_token_docs(10), 2)
    tp = dist.new_group([0])  # e.g. a tensor-parallel group: the global rank is no longer the DP rank
    assert process_groups() == 2
    with pytest.raises(ValueError, match="dp_group"):
        PackedDataset(urls, capacity=64)
    dp = dist.new_group([0])
    ds = PackedDataset(urls, capacity=64, topology=TopologyOptions(dp_group=dp))
    assert (ds.dp_rank, ds.dp_size) == (0, 1)
    explicit = PackedDataset(urls, capacity=64, topology=TopologyOptions(dp_rank=0, dp_size=1))
    assert (explicit.dp_size, tp) == (1, tp)  # explicit wins
    with pytest.raises(ValueError, match="dp_size=2 contradicts dp_group"):
        PackedDataset(urls, capacity=64, topology=TopologyOptions(dp_group=dp, dp_size=2))
    assert PackedDataset(urls, capacity=64, topology=TopologyOptions(dp_group=dist.group.WORLD)).dp_size == 1


def test_dp_group_without_torch_distributed_is_an_error():
    with pytest.raises(ValueError, match="not initialized"):
        resolve_topology(process_group=object())
