"""Bounded memory: RSS does not grow over a long infinite stream (the window bounds buffers)."""

from __future__ import annotations

import gc

import psutil
import pytest
from node_checks import write_token_shards

from streampack.dataset import PackedDataset


def _rss_growth(urls, samples: int) -> tuple[float, int]:
    ds = PackedDataset(urls, capacity=4096, window=1024, seed=1)
    proc = psutil.Process()
    seen, base = 0, None
    for batch in ds:
        seen += batch.num_docs
        if base is None and seen >= samples // 5:
            gc.collect()
            base = proc.memory_info().rss
        if seen >= samples:
            break
    gc.collect()
    return (proc.memory_info().rss - base) / 2**20, ds.metrics()["packing"]["docs"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    urls, _ = write_token_shards(tmp_path_factory.mktemp("mem"), 4000, 8, mean=600, seed=4)
    return urls


def test_rss_flat_short(shards) -> None:
    growth, docs = _rss_growth(shards, 40_000)
    assert docs >= 40_000
    assert growth < 32, f"RSS grew {growth:.1f} MiB"


@pytest.mark.slow
def test_rss_flat_long(shards) -> None:
    growth, docs = _rss_growth(shards, 400_000)
    assert docs >= 400_000
    assert growth < 32, f"RSS grew {growth:.1f} MiB"
