"""The shard index: compact, never beside the data, built once under a lock by racing processes,
position / range / part, damaged shards split across workers with every readable sample read
once and the damage counted once, and the ``streampack index`` command."""

from __future__ import annotations

import errno
import gzip
import io
import logging
import multiprocessing
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers_data import make_token_docs, write_jsonl_shards, write_tar, write_tar_shards
from helpers_faults import Fault, serve_faulty
from helpers_formats import jsonl_bytes, write_parquet_shards, write_zst_shards

from streampack import PackedDataset
from streampack.cli.main import main
from streampack.errors import ErrorCounter, ErrorPolicy
from streampack.io.decode import DecodeOptions
from streampack.io.index import cache_path, load_or_build_index
from streampack.io.index_cache import INDEX_SUFFIX
from streampack.io.limits import Limits
from streampack.io.storage import OpenOptions
from streampack.nodes.reader import ShardReader
from streampack.options import ReadOptions, TopologyOptions
from streampack.options.topology import Placement


def read_split(url, workers: int, cache_dir: str, limits: Limits = Limits()) -> tuple[list[list[int]], ErrorCounter]:
    errors = ErrorCounter()
    out = []
    for w in range(workers):
        reader = ShardReader(url, place=Placement(worker_id=w, num_workers=workers), epochs=1,
                             read=ReadOptions(cache_dir=cache_dir, limits=limits),
                             error_policy=ErrorPolicy("skip", errors))
        out += [s.tokens.tolist() for s in reader]
    return out, errors


def test_part_positions_and_numbers(tmp_path):
    docs = make_token_docs(10, seed=1)
    path = tmp_path / "blank.jsonl"
    raw = jsonl_bytes(docs)
    lines = raw.splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:3]) + b"\n\n" + b"".join(lines[3:]))  # two blank lines: numbers skip
    index = load_or_build_index(str(path), cache_dir=str(tmp_path / "c"))
    assert len(index) == 10 and index.numbers.tolist() == [0, 1, 2, 5, 6, 7, 8, 9, 10, 11]
    assert index.lengths.tolist() == [len(d) for d in docs]
    third = len(b"".join(lines[:3])) + 2  # sample 3 is line 5, after the blank lines
    assert index.part(3, 10) == (third, int(index.offsets[4]), 5)
    # a part past the last sample starts and ends at the end, numbered after the last sample
    assert index.part(19, 20) == (os.path.getsize(path), os.path.getsize(path), 12) and index.end == os.path.getsize(path)
    with pytest.raises(ValueError, match="part=3"):
        index.part(3, 3)
    assert index.part(2, 3) == (int(index.offsets[7]), index.end, 9)
    assert [index.key(i) for i in (0, 3)] == ["0", "5"]


def test_index_is_compact_and_never_beside_the_data(tmp_path):
    # bug: a 4M-line shard left a 123 MiB json sidecar next to the data (1 GiB RSS to build it)
    n = 50_000
    path = tmp_path / "data" / "big.jsonl"
    path.parent.mkdir()
    path.write_bytes(b"".join(b'{"text": "document %d"}\n' % i for i in range(n)))
    index = load_or_build_index(str(path), cache_dir=str(tmp_path / "cache"))
    assert len(index) == n and index.number_array is None and index.lengths.dtype == np.int32
    assert os.listdir(tmp_path / "data") == ["big.jsonl"]
    stored = os.path.getsize(cache_path(str(path), str(tmp_path / "cache")))
    assert stored < 3 * n, f"{stored / n:.1f} bytes per sample"
    assert cache_path(str(path), str(tmp_path / "cache")).endswith(INDEX_SUFFIX)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_truncated_tar_split_across_workers_keeps_every_readable_sample(tmp_path, workers):
    # bug: a truncated shard read by 2 or 3 workers delivered 0 of its 165 readable samples
    # and counted nothing (one worker delivered all 165)
    docs = make_token_docs(200, seed=2, min_len=30, max_len=30)
    (url,) = write_tar_shards(tmp_path, docs, 1)
    full = load_or_build_index(url, cache_dir=str(tmp_path / "full"))
    with open(url, "r+b") as f:
        f.truncate(int(full.offsets[165]) + 700)  # inside sample 165's data
    out, errors = read_split(url, workers, str(tmp_path / "c"))
    assert out == docs[:165]
    assert errors.counts == {"corrupt_shard": 1}
    index = load_or_build_index(url, cache_dir=str(tmp_path / "c"))
    assert len(index) == 165 and "truncated" in index.damage and index.end == int(full.offsets[165])


@pytest.mark.parametrize("fmt", ["gz", "zst"])
@pytest.mark.parametrize("workers", [1, 3])
def test_truncated_compressed_jsonl_split_across_workers(tmp_path, fmt, workers):
    docs = make_token_docs(2000, seed=3, min_len=40, max_len=40)  # several 128 KiB zstd blocks
    if fmt == "gz":
        (url,) = write_jsonl_shards(tmp_path, docs, 1, gz=True)
    else:
        (url,) = write_zst_shards(tmp_path, docs, 1)
    data = open(url, "rb").read()
    open(url, "wb").write(data[: len(data) * 2 // 3])
    single, single_errors = read_split(url, 1, str(tmp_path / "single"))
    assert single == docs[:len(single)] and 0 < len(single) < 2000 and single_errors.counts == {"corrupt_shard": 1}
    out, errors = read_split(url, workers, str(tmp_path / "c"))
    assert out == single and errors.counts == {"corrupt_shard": 1}


def test_damaged_shard_with_more_workers_than_samples(tmp_path):
    docs = make_token_docs(3, seed=4, min_len=30, max_len=30)
    (url,) = write_tar_shards(tmp_path, docs, 1)
    full = load_or_build_index(url, cache_dir=str(tmp_path / "full"))
    with open(url, "r+b") as f:
        f.truncate(int(full.offsets[2]) + 600)
    out, errors = read_split(url, 5, str(tmp_path / "c"))  # parts 2..4 are empty; only the last reads on
    assert out == docs[:2] and errors.counts == {"corrupt_shard": 1}


def _race(url: str, cache_dir: str, worker: int, workers: int, barrier, results) -> None:
    barrier.wait()
    reader = ShardReader(url, place=Placement(worker_id=worker, num_workers=workers), epochs=1,
                         read=ReadOptions(cache_dir=cache_dir))
    results.put((worker, [s.key for s in reader]))


def test_racing_processes_build_the_index_once(tmp_path):
    # bug: every worker of a split remote shard downloaded all of it to build the index (9x the
    # shard's bytes with 8 workers), and the unlocked cache let them race on the same file
    docs = make_token_docs(120, seed=5, min_len=50, max_len=50)
    (local,) = write_tar_shards(tmp_path / "d", docs, 1)
    size, workers = os.path.getsize(local), 4
    ctx = multiprocessing.get_context("fork")
    with serve_faulty(tmp_path / "d") as server:
        server.plan.add(Fault("delay", delay=0.5))  # the first builder holds the lock a while
        url = f"{server.url}/{os.path.basename(local)}"
        barrier, results = ctx.Barrier(workers), ctx.Queue()
        procs = [ctx.Process(target=_race, args=(url, str(tmp_path / "c"), w, workers, barrier, results))
                 for w in range(workers)]
        for p in procs:
            p.start()
        keys = dict(results.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(30)
        assert [p.exitcode for p in procs] == [0] * workers
        ranges = [r.range for r in server.gets()]
    assert [k for w in sorted(keys) for k in keys[w]] == [f"{i:08d}" for i in range(120)] and all(keys.values())
    whole = [r for r in ranges if r == f"bytes=0-{size - 1}"]
    assert len(whole) == 1, f"the index was built {len(whole)} times: {ranges}"
    fetched = sum(int(b) - int(a) + 1 for a, b in (r.split("=")[1].split("-") for r in ranges))
    assert fetched <= 2 * size, f"{fetched} bytes fetched for a {size}-byte shard"


def test_cli_index_builds_ahead_and_readers_reuse_it(tmp_path, capsys):
    docs = make_token_docs(60, seed=6)
    write_tar_shards(tmp_path / "d", docs, 2)
    damaged = tmp_path / "d" / "shard-000002.jsonl.gz"
    damaged.write_bytes(gzip.compress(jsonl_bytes(docs))[:400])
    with serve_faulty(tmp_path / "d") as server:
        cache = str(tmp_path / "idx")
        assert main(["index", server.url + "/", "--cache-dir", cache, "--no-progress"]) == 0
        out = capsys.readouterr().out
        assert "indexed 3 of 3 shard(s)" in out and "1 damaged" in out and "damaged: " + server.url in out
        server.requests.clear()
        urls = [f"{server.url}/shard-00000{i}.tar" for i in range(2)]
        parts = [[s.tokens.tolist() for s in ShardReader(urls, place=Placement(worker_id=w, num_workers=4), epochs=1,
                                                         shuffle=False, read=ReadOptions(cache_dir=cache))]
                 for w in range(4)]
        assert sorted(map(tuple, sum(parts, []))) == sorted(map(tuple, docs))
        assert all(r.range and r.range != "bytes=0-" for r in server.gets()), "no whole-shard read: index reused"
    assert main(["index", str(tmp_path / "nope.tar"), "--cache-dir", cache, "--no-progress"]) == 1
    assert "failed: missing_shard" in capsys.readouterr().out


@pytest.mark.slow
def test_index_of_a_4m_line_shard_is_built_in_bounded_memory(tmp_path):
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:
        for start in range(0, 4_000_000, 100_000):
            f.write(b"".join(b'{"text": "document number %d"}\n' % i for i in range(start, start + 100_000)))
    script = textwrap.dedent(f"""
        import resource, os
        from streampack.io.index import load_or_build_index, cache_path
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        index = load_or_build_index({str(path)!r}, cache_dir={str(tmp_path / "c")!r})
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(len(index), (peak - base) // 1024, os.path.getsize(cache_path({str(path)!r}, {str(tmp_path / "c")!r})))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).stdout.split()
    samples, grown_mib, stored = int(out[0]), int(out[1]), int(out[2])
    assert samples == 4_000_000
    assert grown_mib < 150, f"building the index grew RSS by {grown_mib} MiB (was ~1 GiB)"
    assert stored < 12 * 2**20, f"index file of {stored / 2**20:.1f} MiB (the json sidecar was 123 MiB)"


def test_cache_dir_may_be_a_url(tmp_path, monkeypatch):
    import fsspec

    import streampack.io.index as index_mod

    docs = make_token_docs(20, seed=7)
    (url,) = write_tar_shards(tmp_path, docs, 1)
    built = load_or_build_index(url, cache_dir="memory://index-cache-test")
    try:
        assert fsspec.filesystem("memory").ls("/index-cache-test", detail=False)
        monkeypatch.setattr(index_mod, "_memo", type(index_mod._memo)())  # another process
        monkeypatch.setattr(index_mod, "build_index", lambda *a, **k: pytest.fail("the shared index was rebuilt"))
        again = load_or_build_index(url, cache_dir="memory://index-cache-test")
        assert again.offsets.tolist() == built.offsets.tolist() and again.keys == built.keys
    finally:
        fsspec.filesystem("memory").rm("/index-cache-test", recursive=True)


# ------------------------------------------------------------------ issue 18, items 5 to 7


def _npy(n: int) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.arange(n, dtype=np.int64), allow_pickle=False)
    return buf.getvalue()


def test_tar_index_lengths_do_not_follow_pythonhashseed(tmp_path):
    # bug: a sample with both `npy` and `input_ids.npy` was indexed with the length of whichever
    # member a set iterated first (5 or 9 here, by PYTHONHASHSEED), and that length cut epochs
    path = write_tar(tmp_path / "s.tar", [("a", {"npy": _npy(3)}), ("b", {"npy": _npy(5), "input_ids.npy": _npy(9)}),
                                          ("c", {"input_ids.npy": _npy(7)})])
    # two interpreters whose sets iterate the two members in opposite orders (each prints its
    # order: the guard that both orders were tried), not six random seeds (~0.5 s each)
    script = (f"from streampack.io.index import build_index; "
              f"print(list({{'npy', 'input_ids.npy'}})[0], build_index({path!r}).lengths.tolist())")
    seen = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed),
                                "PYTHONPATH": os.pathsep.join(sys.path)}).stdout.split(maxsplit=1) for seed in (0, 1)]
    assert {first for first, _ in seen} == {"npy", "input_ids.npy"}, seen
    # b: the reader refuses it (conflicting_fields), so no length is right
    assert {lengths.strip() for _, lengths in seen} == {"[3, -1, 7]"}, seen
    errors = ErrorCounter()
    assert [s.key for s in ShardReader(path, epochs=1, error_policy=ErrorPolicy("skip", errors))] == ["a", "c"]
    assert errors.counts == {"conflicting_fields": 1}


def test_a_filesystem_without_flock_is_no_lock_not_a_data_error(tmp_path, monkeypatch, caplog):
    # bug: flock raising ENOLCK (some NFS / FUSE mounts) became corrupt_shard: the span was
    # dropped under on_error="skip"
    import fcntl

    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    docs = make_token_docs(40, seed=8)
    (url,) = write_tar_shards(tmp_path / "d", docs, 1)
    with caplog.at_level(logging.WARNING, logger="streampack"):
        out, errors = read_split(url, 3, str(tmp_path / "c"))
    assert sorted(map(tuple, out)) == sorted(map(tuple, docs)) and errors.counts == {}
    assert len([r for r in caplog.records if "cannot lock" in r.getMessage()]) == 1


def test_an_index_built_under_tight_limits_does_not_poison_a_later_run(tmp_path):
    # bug: the cache key ignored the limits: a run with max_line_bytes=1000 indexed the long line
    # as length -1, and a later 2-rank run with the default limits was refused ("text to tokenize?")
    docs = make_token_docs(39, seed=9) + [list(range(600))]  # the last line is ~3 KB
    urls = write_jsonl_shards(tmp_path / "d", docs, 1)
    cache = str(tmp_path / "c")
    out, errors = read_split(urls[0], 2, cache, limits=Limits(max_line_bytes=1000))
    assert len(out) == 39 and errors.counts == {"line_too_long": 1}
    ds = PackedDataset(urls, capacity=1024, epochs=1, read=ReadOptions(cache_dir=cache),
                       topology=TopologyOptions(dp_rank=0, dp_size=2, equal_batches="count"))
    assert sum(b.num_tokens for b in ds) > 0
    index = load_or_build_index(urls[0], cache_dir=cache)
    assert index.lengths.tolist() == [len(d) for d in docs]


def test_only_the_limits_an_index_depends_on_key_it(tmp_path):
    from streampack.io.index import fingerprint_of, index_decode
    from streampack.io.storage import identity

    (tar,) = write_tar_shards(tmp_path, make_token_docs(4), 1)
    (jsonl,) = write_jsonl_shards(tmp_path, make_token_docs(4), 1)
    base, lines = index_decode(), index_decode(DecodeOptions(limits=Limits(max_line_bytes=10)))
    tar_id, jsonl_id = identity(tar, OpenOptions()), identity(jsonl, OpenOptions())
    assert fingerprint_of(tar, base, tar_id) == fingerprint_of(tar, lines, tar_id)
    assert fingerprint_of(jsonl, base, jsonl_id) != fingerprint_of(jsonl, lines, jsonl_id)


def test_pre_tokenized_parquet_is_not_called_text_to_tokenize(tmp_path):
    # issue 17: its index records the token list lengths now, so it is planned, not refused
    urls = write_parquet_shards(tmp_path, make_token_docs(20), 2)
    PackedDataset(urls, capacity=256, epochs=1, read=ReadOptions(cache_dir=str(tmp_path / "c")),
                  topology=TopologyOptions(dp_rank=0, dp_size=2, equal_batches="count"))
