"""Megatron-core shards over HTTP (issue 33): the ``.idx`` and ``.bin`` are read by ranged requests (never the
``.bin`` whole), with short reads and truncated bodies injected; three interrupted runs give the uninterrupted local
batches, bit for bit."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers_faults import Fault, join_prefetch, serve_faulty
from helpers_megatron import write_megatron_shards
from node_checks import canon, lognormal_lengths, roundtrip, take

from streampack.dataset import PackedDataset
from streampack.io.decode import DecodeOptions
from streampack.io.formats import ShardRange, open_range
from streampack.io.storage import OpenOptions
from streampack.options import PackOptions


def _ds(urls, **kw) -> PackedDataset:
    return PackedDataset(urls, **{"capacity": 256, "packs_per_batch": 2, "seed": 11,
                                  "packing": PackOptions(window=16, max_wait=3), **kw})


def _run(urls, stops: list[int], total: int) -> list:
    out, state, done = [], None, 0
    for stop in [*stops, total]:
        ds = _ds(urls)
        if state is not None:
            ds.load_state_dict(roundtrip(state))
        it = iter(ds)
        out += [canon(b) for b in take(it, stop - done)]
        done = stop
        state = ds.state_dict()
        del it
    return out


@pytest.mark.slow  # ~8 s: megatron-core's import, three restores over HTTP
def test_three_interruptions_over_http_with_faults(tmp_path, monkeypatch):
    from streampack.io import retry

    monkeypatch.setattr(retry._rng, "uniform", lambda lo, hi: min(hi, 0.01))  # short waits in a test
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 30_000, n).tolist() for n in lognormal_lengths(200, mean=80, seed=3).tolist()]
    urls = write_megatron_shards(tmp_path, docs, 2)
    local = _run(urls, [], 40)
    with serve_faulty(tmp_path) as server:
        remote = [f"{server.url}/{os.path.basename(u)}" for u in urls]
        server.plan.add(Fault("short", fraction=0.5, path=".bin"), times=2)
        server.plan.add(Fault("truncate", fraction=0.5, path=".idx"), times=2)
        got = _run(remote, [7, 19, 31], 40)
        assert [(tuple(k.replace(server.url, str(tmp_path)) for k in b[0]), *b[1:]) for b in got] == local
        assert sum(r.fault is not None for r in server.requests) >= 3
        join_prefetch()


def test_a_range_reads_only_its_bytes_remotely(tmp_path):
    rng = np.random.default_rng(4)
    docs = [rng.integers(0, 30_000, int(n)).tolist() for n in rng.integers(100, 400, 2000)]
    (url,) = write_megatron_shards(tmp_path, docs, 1)
    bin_size = os.path.getsize(url[:-4] + ".bin")
    with serve_faulty(tmp_path) as server:
        remote = f"{server.url}/{os.path.basename(url)}"
        opts = OpenOptions(block_size=64 << 10)
        got = list(open_range(remote, ShardRange(start=1000, first=1000, end=1010), decode=DecodeOptions(),
                              opts=opts, streams=[]))
        assert [it.sample.tokens.tolist() for it in got] == docs[1000:1010]
        gets = [r for r in server.requests if r.method == "GET"]
        assert gets and all(r.range for r in gets), "every read is a ranged request"
        spans = [r.range.removeprefix("bytes=").split("-") for r in gets if r.path.endswith(".bin")]
        asked = sum(int(b) + 1 - int(a) if b else bin_size - int(a) for a, b in spans)
        assert asked < bin_size // 10, (asked, bin_size)
        join_prefetch()
