"""Bounded memory: RSS does not grow over a long infinite stream (the window bounds buffers), and
a hostile shard (a decompression bomb, a huge line, a huge member) costs at most its limits."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import psutil
import pytest
from node_checks import write_token_shards

from streampack.dataset import PackedDataset
from streampack.options import PackOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from rss_child import read_in_child  # noqa: E402


def _rss_growth(urls, samples: int) -> tuple[float, int]:
    ds = PackedDataset(urls, capacity=4096, seed=1, packing=PackOptions(window=1024))
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


@pytest.mark.slow  # 40,000 samples, ~4 s: the integration set (with the 400,000-sample run)
def test_rss_flat_short(shards) -> None:
    growth, docs = _rss_growth(shards, 40_000)
    assert docs >= 40_000
    assert growth < 32, f"RSS grew {growth:.1f} MiB"


@pytest.mark.slow
def test_rss_flat_long(shards) -> None:
    growth, docs = _rss_growth(shards, 400_000)
    assert docs >= 400_000
    assert growth < 32, f"RSS grew {growth:.1f} MiB"


# ------------------------------------------------------------------ hostile input (issue 13)
# Peak RSS of a child process while it reads one hostile shard, minus its RSS right before.
# Before the limits existed, reading the 0.39 MiB .jsonl.gz below grew RSS by ~1.25 GiB (the
# whole 400 MiB line, its decoded str and the parse; measured with benchmarks/bench_hostile.py);
# with the default 32 MiB line limit a reader holds at most a line prefix and its one-line
# lookahead (~64 MiB measured): the bound is 4 x the limit + 64 MiB.
_LINE_LIMIT_MIB = 32
_BOUND_MIB = 4 * _LINE_LIMIT_MIB + 64


def _child_rss_growth(url: str) -> tuple[list[str], dict, int]:
    read = read_in_child(url, cwd=os.path.dirname(url.removeprefix("pipe:cat ")), timeout=300)
    return read.keys, read.errors, read.growth_mib


def _bomb_lines(f, line_mib: int) -> None:
    f.write(b'{"input_ids": [1, 2]}\n{"text": "')
    chunk = b"a" * (1 << 20)
    for _ in range(line_mib):
        f.write(chunk)
    f.write(b'"}\n{"input_ids": [3, 4]}\n')


@pytest.mark.slow
def test_gzip_bomb_line_stays_within_the_line_limit(tmp_path) -> None:
    import gzip
    import os

    url = str(tmp_path / "bomb.jsonl.gz")
    with gzip.open(url, "wb", compresslevel=9) as f:
        _bomb_lines(f, 400)
    assert os.path.getsize(url) < 1 << 20  # ~0.39 MiB on disk, 400 MiB inflated
    kept, counts, growth = _child_rss_growth(url)
    assert kept == ["0", "2"] and counts == {"line_too_long": 1}
    assert growth < _BOUND_MIB, f"peak RSS grew {growth} MiB reading a 400 MiB line (bound {_BOUND_MIB})"


@pytest.mark.slow
def test_huge_line_shard_stays_within_the_line_limit(tmp_path) -> None:
    url = str(tmp_path / "huge.jsonl")
    with open(url, "wb") as f:
        _bomb_lines(f, 256)
    kept, counts, growth = _child_rss_growth(url)
    assert kept == ["0", "2"] and counts == {"line_too_long": 1}
    assert growth < _BOUND_MIB, f"peak RSS grew {growth} MiB reading a 256 MiB line (bound {_BOUND_MIB})"


@pytest.mark.slow
def test_huge_tar_member_through_a_pipe_is_skipped_in_bounded_chunks(tmp_path) -> None:
    # a real 256 MiB member (over the 32 MiB member limit) on a stream that cannot seek
    from helpers_hostile import archive, header, samples

    url = str(tmp_path / "big.tar")
    with open(url, "wb") as f:
        f.write(b"".join(samples(2)))
        f.write(header("00000002.npy", 256 << 20))
        f.seek(256 << 20, 1)  # sparse: zeros
        f.write(archive(*samples(1, start=3)))
    kept, counts, growth = _child_rss_growth(f"pipe:cat {url}")
    assert kept == ["00000000", "00000001", "00000003"] and counts == {"member_too_large": 1}
    assert growth < 64, f"peak RSS grew {growth} MiB skipping a 256 MiB member"
