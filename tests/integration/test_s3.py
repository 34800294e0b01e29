"""``s3://`` shards through s3fs against a loopback moto server, behind a proxy that logs every
request and injects faults: same stream as local, ranged resume, index-based splitting, missing
keys, unreachable endpoints, prefix listing, and short bodies / resets / SlowDown bursts retried
at the exact offset."""

from __future__ import annotations

import io
import logging
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

import torch
from helpers_data import (
    closed_port,
    make_token_docs,
    write_jsonl_shards,
    write_tar_shards,
)
from helpers_faults import Fault, join_prefetch, proxy_faulty
from moto.server import ThreadedMotoServer

from streampack.cli.main import main
from streampack.dataset import PackedDataset
from streampack.errors import DataError, ErrorCounter, ErrorPolicy
from streampack.io import storage
from streampack.io.open import open_shard
from streampack.io.retry import IOStats, RetryPolicy
from streampack.io.storage import OpenOptions
from streampack.io.urls import ShardList, expand_urls
from streampack.nodes.reader import OFFSET_KEY, ShardReader
from streampack.options import PackOptions, ReadOptions
from streampack.options.topology import Placement

BUCKET = "streampack-test"
DOCS = make_token_docs(30, seed=7, min_len=20, max_len=60)
FAST = OpenOptions(retry=RetryPolicy(backoff=0.01, max_backoff=0.05, budget=10))


class S3Fixture:
    """The bucket's shards (``local[fmt]`` and ``remote[fmt]`` list the same files) and the
    proxy in front of moto (``proxy.requests``: every request the code under test sent)."""

    def __init__(self, proxy) -> None:
        self.proxy = proxy
        self.local: dict[str, list[str]] = {}
        self.remote: dict[str, list[str]] = {}
        self.admin: Any = None
        """A boto3 client of the moto server itself (no proxy)."""

    @property
    def endpoint(self) -> str:
        return self.proxy.url

    def gets(self, key: str = "") -> list[str | None]:
        """Range headers of the GetObject requests (listings excluded)."""
        return [r.range for r in self.proxy.gets(f"/{BUCKET}/{key}") if "list-type" not in r.path]

    def heads(self) -> list[str]:
        return [r.path for r in self.proxy.requests if r.method == "HEAD"]

    def listings(self) -> int:
        return sum("list-type" in r.path for r in self.proxy.requests)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto logs every request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    with proxy_faulty(f"http://{host}:{port}") as proxy, pytest.MonkeyPatch.context() as mp:
        fx = S3Fixture(proxy)
        for name, value in [("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                            ("AWS_DEFAULT_REGION", "us-east-1"), (storage.ENDPOINT_ENV, fx.endpoint)]:
            mp.setenv(name, value)
        for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
            mp.delenv(name, raising=False)
        mp.setattr(storage, "_FILESYSTEMS", {})
        import boto3

        admin = fx.admin = boto3.client("s3", endpoint_url=f"http://{host}:{port}")  # straight to moto
        admin.create_bucket(Bucket=BUCKET)
        root = tmp_path_factory.mktemp("s3src")
        fx.local = {
            "tar-npy": write_tar_shards(root / "tar", DOCS, 3),
            "jsonl": write_jsonl_shards(root / "jsonl", DOCS, 3),
            "one": write_tar_shards(root / "one", DOCS, 1),
        }
        for folder, paths in fx.local.items():
            fx.remote[folder] = []
            for path in paths:
                key = os.path.relpath(path, root)  # tar/..., jsonl/..., one/...
                admin.upload_file(path, BUCKET, key)
                fx.remote[folder].append(f"s3://{BUCKET}/{key}")
        admin.put_object(Bucket=BUCKET, Key="tar/README.txt", Body=b"not a shard")
        yield fx
    server.stop()


@pytest.fixture
def log(s3):
    join_prefetch()
    s3.proxy.requests.clear()
    s3.proxy.plan.clear()
    yield s3
    join_prefetch()
    s3.proxy.plan.clear()


def tokens_and_keys(samples) -> list[tuple[list[int], str]]:
    return [(s.tokens.tolist(), s.key) for s in samples]


@pytest.mark.parametrize("fmt", ["tar-npy", "jsonl"])
def test_s3_stream_equals_local(s3, fmt):
    want = tokens_and_keys(ShardReader(s3.local[fmt], epochs=2, seed=3))
    ext = "tar" if fmt == "tar-npy" else "jsonl"
    pattern = f"s3://{BUCKET}/{ext}/shard-{{000000..000002}}.{ext}"
    assert expand_urls(pattern) == s3.remote[fmt]
    got = list(ShardReader(pattern, epochs=2, seed=3))
    assert tokens_and_keys(got) == want and len(want) == 60
    assert all(s.url.startswith(f"s3://{BUCKET}/{ext}/") for s in got)


def test_packed_dataset_from_s3_equals_local(s3):
    def batches(urls):
        return [(b.input_ids.tolist(), b.cu_seqlens.tolist(), [k.rsplit("/", 1)[-1] for k in b.doc_keys])
                for b in PackedDataset(urls, capacity=128, epochs=1, seed=1, packing=PackOptions(window=8))]

    want = batches(s3.local["tar-npy"])
    assert want and batches(s3.remote["tar-npy"]) == want


@pytest.mark.parametrize("fmt", ["tar-npy", "jsonl"])
def test_resume_inside_shard_uses_ranged_get(log, fmt):
    remote = log.remote[fmt]
    want = tokens_and_keys(ShardReader(remote, epochs=1, shuffle=False))
    reader = ShardReader(remote, epochs=1, shuffle=False)
    head = [next(reader) for _ in range(15)]  # inside the second shard (10 docs per shard)
    state = reader.state_dict()
    assert state[OFFSET_KEY] > 0
    log.proxy.requests.clear()
    resumed = ShardReader(remote, epochs=1, shuffle=False)
    resumed.reset(state)
    assert tokens_and_keys(head) + tokens_and_keys(resumed) == want
    second = remote[1].split(f"{BUCKET}/", 1)[1]
    ranges = log.gets(second)
    assert ranges and ranges[0].startswith(f"bytes={state[OFFSET_KEY]}-"), log.proxy.requests
    assert all(int(r.split("=")[1].split("-")[0]) >= state[OFFSET_KEY] for r in ranges), "read before the offset"
    assert not log.gets(remote[0].split(f"{BUCKET}/", 1)[1]), "the finished shard was read again"


def test_fewer_shards_than_workers_splits_via_index(log, tmp_path):
    def read_split():
        return [
            tokens_and_keys(ShardReader(log.remote["one"], place=Placement(worker_id=w, num_workers=3), epochs=1,
                                        read=ReadOptions(cache_dir=str(tmp_path))))
            for w in range(3)
        ]

    per_worker = read_split()
    assert [x for part in per_worker for x in part] == [(d, f"{i:08d}") for i, d in enumerate(DOCS)]
    assert [len(p) for p in per_worker] == [10, 10, 10]
    size = os.path.getsize(log.local["one"][0])
    ranges = log.gets("one/")
    assert ranges[0] == f"bytes=0-{size - 1}", "one read of the whole object builds the index, once"
    assert len(ranges) == 4 and all(r.split("=")[1].split("-")[1] for r in ranges[1:]), ranges  # "a-b"
    assert log.heads(), "the index cache key: size + ETag"

    log.proxy.requests.clear()
    assert read_split() == per_worker
    assert f"bytes=0-{size - 1}" not in log.gets("one/"), "the cached index was rebuilt"


def test_missing_key_is_missing_shard(log):
    url = f"s3://{BUCKET}/tar/nope.tar"
    with pytest.raises(DataError, match="missing_shard") as info:
        next(ShardReader(url))
    assert url in str(info.value)
    log.proxy.requests.clear()
    errors = ErrorCounter()
    out = list(ShardReader([url, *log.remote["tar-npy"]], shuffle=False, epochs=1, error_policy=ErrorPolicy("skip",
                                                                                                            errors)))
    assert len(out) == 30 and errors.counts == {"missing_shard": 1}
    assert sum(r.path.endswith("/nope.tar") for r in log.proxy.requests) == 1, "a missing key is not retried"


def test_unreachable_endpoint_gives_up_within_the_budget(s3, monkeypatch):
    monkeypatch.setenv(storage.ENDPOINT_ENV, f"http://127.0.0.1:{closed_port()}")
    url = s3.remote["tar-npy"][0]
    t0 = time.perf_counter()
    opts = OpenOptions(retry=RetryPolicy(retries=1, backoff=0.01), connect_timeout=2)
    with pytest.raises(DataError, match="unreachable_url") as info:
        next(ShardReader(url, open_options=opts))
    assert url in str(info.value) and "2 attempt(s)" in str(info.value)
    assert time.perf_counter() - t0 < 5


def test_prefix_listing_once_per_dataset(log):
    assert expand_urls(f"s3://{BUCKET}/tar/") == log.remote["tar-npy"]  # README.txt left out
    assert expand_urls(f"s3://{BUCKET}/") == sorted(log.remote["jsonl"] + log.remote["one"] + log.remote["tar-npy"])
    with pytest.raises(ValueError, match="matches no shard files"):
        expand_urls(f"s3://{BUCKET}/nothing/")
    storage._FILESYSTEMS.clear()  # no listing cache left from the calls above
    log.proxy.requests.clear()
    ds = PackedDataset(f"s3://{BUCKET}/jsonl/", capacity=64, epochs=2, seed=0, packing=PackOptions(window=4))
    worker_copy = pickle.loads(pickle.dumps(ds))  # what each DataLoader worker gets
    assert len(list(worker_copy)) > 0 and len(list(ds)) > 0
    assert log.listings() == 1, "the prefix is listed once, by the process that built the dataset"


def test_cli_inspect_reads_s3(s3, capsys):
    prefix = f"s3://{BUCKET}/tar/"
    assert main(["inspect", prefix, "--capacity", "64", "--algorithms", "bfd", "--windows", "8", "--no-progress"]) == 0
    assert "samples: 30" in capsys.readouterr().out


def test_ranged_reads_are_exact(s3):
    url, path = s3.remote["jsonl"][0], s3.local["jsonl"][0]
    data = Path(path).read_bytes()
    with open_shard(url, 7, 40) as f:
        assert f.read() == data[7:40]
    with open_shard(url, len(data)) as f:
        assert f.read() == b""
    with open_shard(url, 0, opts=OpenOptions(block_size=4096)) as f:  # many blocks, prefetched
        assert f.read() == data


@pytest.mark.parametrize(("kind", "block_size"), [
    ("status", 8 << 20), ("short", 4096), ("reset", 4096),
    *(pytest.param(k, b, marks=pytest.mark.slow) for k, b in [("status", 4096), ("short", 8 << 20), ("reset", 8 << 20)]),
])
def test_faults_are_retried_at_the_exact_offset(log, kind, block_size):
    # a GetObject body cut short, a reset connection, a burst of 503 SlowDown: the stream
    # resumes where it was, so the samples are bit-identical to reading the files locally
    want = tokens_and_keys(ShardReader(log.local["tar-npy"], epochs=1, shuffle=False))
    log.proxy.plan.add(Fault(kind, fraction=0.4, path="/tar/"), times=4)
    stats = IOStats()
    opts = OpenOptions(retry=FAST.retry, block_size=block_size)
    got = tokens_and_keys(ShardReader(log.remote["tar-npy"], epochs=1, shuffle=False, open_options=opts,
                                      io_stats=stats))
    assert got == want
    assert sum(r.fault is not None for r in log.proxy.requests) == 4
    assert 1 <= stats.retries <= sum(stats.faults.values()) <= 4, stats
    if kind == "status" and block_size > 4096:
        # exact: botocore's and s3fs's own retries are off, and every faulted block is needed
        # (with small blocks a prefetched block past the end-of-archive marker is not, and
        # aiohttp itself may reopen a connection reset before the response once)
        assert stats.retries == 4 == stats.faults["HTTP 503"], stats


def test_missing_s3fs_message(monkeypatch):
    import fsspec  # noqa: F401

    registry = sys.modules["fsspec.registry"]._registry  # (fsspec.registry is the read-only view)
    monkeypatch.setitem(sys.modules, "s3fs", None)
    monkeypatch.delitem(registry, "s3", raising=False)  # forget the imported class
    monkeypatch.setattr(storage, "_FILESYSTEMS", {})
    with pytest.raises(ImportError, match=r"pip install 'streampack\[s3\]'"):
        open_shard(f"s3://{BUCKET}/tar/shard-000000.tar")


def test_state_roundtrips_weights_only(s3):
    reader = ShardReader(s3.remote["tar-npy"], epochs=1)
    next(reader)
    buf = io.BytesIO()
    torch.save(reader.state_dict(), buf)
    buf.seek(0)
    resumed = ShardReader(s3.remote["tar-npy"], epochs=1)
    resumed.reset(torch.load(buf, weights_only=True))
    assert len(list(resumed)) == 29


def test_botocore_endpoint_env_is_honoured(s3, monkeypatch):
    monkeypatch.delenv(storage.ENDPOINT_ENV)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint)
    assert len(list(ShardReader(ShardList.of(s3.remote["one"]), epochs=1))) == 30


def test_object_overwritten_mid_read_is_refused_not_spliced(s3, tmp_path):
    # issue 18, item 14: each ranged GetObject is pinned (IfMatch + ETag + ContentRange total)
    docs = make_token_docs(150, seed=9, min_len=100, max_len=200)
    (path,) = write_jsonl_shards(tmp_path, docs, 1)
    key = "changing/shard-000000.jsonl"
    url = f"s3://{BUCKET}/{key}"
    data = open(path, "rb").read()
    s3.admin.put_object(Bucket=BUCKET, Key=key, Body=data)
    opts = OpenOptions(retry=RetryPolicy(backoff=0.01, max_backoff=0.05, budget=5), block_size=16 << 10)
    errors = ErrorCounter()
    reader = ShardReader([url], shuffle=False, epochs=1, open_options=opts, error_policy=ErrorPolicy("skip", errors))
    head = [next(reader).tokens.tolist() for _ in range(5)]
    s3.admin.put_object(Bucket=BUCKET, Key=key, Body=b"".join(reversed(data.splitlines(keepends=True))))
    rest = [s.tokens.tolist() for s in reader]
    assert head + rest == docs[:len(head) + len(rest)] and len(rest) < len(docs) - 5
    assert errors.counts == {"shard_changed": 1}, errors.recent
