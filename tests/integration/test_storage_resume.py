"""Exact resume for every shard format (tar, jsonl, jsonl.gz, jsonl.zst, parquet), with 0 and 2
DataLoader workers and 3 consecutive interruptions, locally and over HTTP with faults injected
while it runs: k interrupted runs == one uninterrupted run, batch for batch, bit for bit.

The default set runs each format with 0 workers, all formats in one dataset with 2 workers, and
the remote run; each format with 2 workers, and the block reads' remote restores, are in the
slow set."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers_data import write_jsonl_shards, write_tar_shards
from helpers_faults import Fault, join_prefetch, serve_faulty
from helpers_formats import write_parquet_shards, write_zst_shards
from node_checks import canon, lognormal_lengths, roundtrip, take
from torchdata.stateful_dataloader import StatefulDataLoader

from streampack.dataset import PackedDataset
from streampack.options import PackOptions
from streampack.plan.state import load_loader_state

FORMATS = ["tar", "jsonl", "jsonl.gz", "jsonl.zst", "parquet"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two shards of every format holding the same 160 long-tail documents."""
    root = tmp_path_factory.mktemp("formats")
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 30_000, n).tolist() for n in lognormal_lengths(160, mean=80, seed=3).tolist()]
    writers = {
        "tar": lambda d: write_tar_shards(d, docs, 2),
        "jsonl": lambda d: write_jsonl_shards(d, docs, 2),
        "jsonl.gz": lambda d: write_jsonl_shards(d, docs, 2, gz=True),
        "jsonl.zst": lambda d: write_zst_shards(d, docs, 2, frames=2),
        "parquet": lambda d: write_parquet_shards(d, docs, 2, row_group_size=16),
    }
    return {fmt: write(root / fmt) for fmt, write in writers.items()}, root


def _ds(urls, **kw) -> PackedDataset:
    return PackedDataset(urls, **{"capacity": 256, "packs_per_batch": 2, "seed": 11,
                                  "packing": PackOptions(window=16, max_wait=3), **kw})


def take_canon(it, n: int) -> list:
    return [canon(b) for b in take(it, n)]


def _run(urls, num_workers: int, stops: list[int], total: int, **kw) -> list:
    """Batches of ``total`` steps, stopped and resumed (from a saved state, in a new loader) at each stop."""
    out, state, done = [], None, 0
    for stop in [*stops, total]:
        loader = StatefulDataLoader(_ds(urls, **kw), batch_size=None, num_workers=num_workers)
        if state is not None:
            load_loader_state(loader, roundtrip(state))
        it = iter(loader)
        out += take_canon(it, stop - done)
        done = stop
        state = loader.state_dict()
        del it
    return out


def _check(urls, num_workers: int, total: int = 50, **kw) -> None:
    full = _run(urls, num_workers, [], total, **kw)
    stops = sorted(np.random.default_rng(num_workers + total).choice(np.arange(2, total - 2), 3, replace=False).tolist())
    assert len(full) == total and _run(urls, num_workers, stops, total, **kw) == full


@pytest.mark.parametrize("fmt", FORMATS)
def test_three_interruptions_no_workers(corpus, fmt):
    _check(corpus[0][fmt], 0)


def test_three_interruptions_two_workers_every_format_in_one_dataset(corpus):
    _check([corpus[0][fmt][0] for fmt in FORMATS], 2, total=40)


def test_three_interruptions_over_http_with_faults(corpus, monkeypatch):
    from streampack.io import retry

    monkeypatch.setattr(retry._rng, "uniform", lambda lo, hi: min(hi, 0.01))  # short waits in a test
    urls = [corpus[0][fmt][1] for fmt in FORMATS]
    local = _run(urls, 0, [], 40)
    with serve_faulty(corpus[1]) as server:
        remote = [f"{server.url}/{os.path.relpath(u, corpus[1])}" for u in urls]
        for kind, fmt in [("short", "tar"), ("reset", "jsonl/"), ("status", "jsonl.gz"), ("short", "jsonl.zst"),
                          ("truncate", "parquet")]:
            server.plan.add(Fault(kind, fraction=0.5, status=503, path=fmt), times=2)
        got = _run(remote, 0, [7, 19, 31], 40)
        as_local = [(tuple(k.replace(server.url, str(corpus[1])) for k in b[0]), *b[1:]) for b in got]
        assert as_local == local
        assert sum(r.fault is not None for r in server.requests) >= 4  # the 40 steps reach most files
        join_prefetch()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["tar", "parquet"])
def test_block_restores_over_http_with_faults(corpus, monkeypatch, fmt):
    """Pre-tokenized tar or parquet shards are read as blocks, and restores pick the
    carried tar samples with one ranged request per cluster, or read each parquet row group
    once: over HTTP, with short reads and truncated bodies injected, three restores give the
    uninterrupted batches."""
    from streampack.io import retry

    monkeypatch.setattr(retry._rng, "uniform", lambda lo, hi: min(hi, 0.01))
    local = _run(corpus[0][fmt], 0, [], 40)
    with serve_faulty(corpus[1]) as server:
        remote = [f"{server.url}/{os.path.relpath(u, corpus[1])}" for u in corpus[0][fmt]]
        server.plan.add(Fault("short" if fmt == "tar" else "truncate", fraction=0.5, path=fmt), times=3)
        got = _run(remote, 0, [7, 19, 31], 40)
        assert [(tuple(k.replace(server.url, str(corpus[1])) for k in b[0]), *b[1:]) for b in got] == local
        assert sum(r.fault is not None for r in server.requests) >= 3
        join_prefetch()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_three_interruptions_two_workers(corpus, fmt):
    _check(corpus[0][fmt], 2)
