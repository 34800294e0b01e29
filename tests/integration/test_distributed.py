"""Sharding across data-parallel ranks and workers: disjoint, complete, equal batch counts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import Counter

import pytest
from node_checks import collect_documents, write_token_shards
from torch.utils.data import DataLoader

from streampack import check_invariants
from streampack.dataset import PackedDataset
from streampack.nodes.collate import is_filler
from streampack.options import PackOptions, TopologyOptions


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_token_shards(tmp_path_factory.mktemp("dist"), 400, 8, mean=120, seed=2)


def test_dp4_workers2_disjoint_cover_equal_counts(shards) -> None:
    urls, docs = shards
    per_worker: dict[tuple[int, int], list] = {}
    counts = []
    for rank in range(4):
        ds = PackedDataset(urls, capacity=512, epochs=1, seed=9, packing=PackOptions(window=32),
                           topology=TopologyOptions(dp_rank=rank, dp_size=4, batches_per_epoch=40))
        batches = list(DataLoader(ds, batch_size=None, num_workers=2))
        counts.append(len(batches))
        for i, b in enumerate(batches):  # the DataLoader takes workers round-robin
            per_worker.setdefault((rank, i % 2), []).append(b)
    assert counts == [40] * 4
    sets = {}
    for worker, batches in per_worker.items():
        real = [b for b in batches if not is_filler(b)]
        assert real, f"worker {worker} got no data"
        for b in batches:
            check_invariants(b)
        sets[worker] = collect_documents(real)
    union: dict = {}
    for worker, got in sets.items():
        assert not set(got) & set(union), f"worker {worker} overlaps another"
        union.update(got)
    assert union == {f"{i:08d}": d for i, d in enumerate(docs)}  # complete, tokens intact


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two torchrun processes: integration
@pytest.mark.distributed
def test_torchrun_two_ranks(shards, tmp_path) -> None:
    urls, docs = shards
    out = tmp_path / "result.json"
    here = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(here)), here]),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           os.path.join(here, "dist_worker.py"), json.dumps(urls), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads(out.read_text())
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["size"] == 2 for r in ranks)
    assert ranks[0]["batches"] == ranks[1]["batches"] > 0
    bases = [Counter(k.partition("/")[0] for k in r["keys"]) for r in ranks]
    assert not set(bases[0]) & set(bases[1])
    assert set(bases[0]) | set(bases[1]) == {f"{i:08d}" for i in range(len(docs))}
