"""``s3://`` shards against a loopback moto server: same stream as local, ranged resume,
index-based splitting, missing keys, unreachable endpoints, prefix listing."""

from __future__ import annotations

import io
import logging
import os
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

import torch
from helpers_data import (
    closed_port,
    make_token_docs,
    write_jsonl_shards,
    write_tar_shards,
)
from moto.server import ThreadedMotoServer

from streampack.cli.main import main
from streampack.dataset import PackedDataset
from streampack.errors import DataError, ErrorCounter
from streampack.io import s3 as s3_mod
from streampack.io.open import open_shard
from streampack.io.urls import expand_urls
from streampack.nodes.reader import OFFSET_KEY, ShardReader

BUCKET = "streampack-test"
DOCS = make_token_docs(30, seed=7, min_len=20, max_len=60)


class S3Fixture:
    """The bucket's shards (``local[fmt]`` and ``remote[fmt]`` list the same files) and a log of
    every S3 request the code under test sent: ``(operation, Range header or None)``."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.local: dict[str, list[str]] = {}
        self.remote: dict[str, list[str]] = {}
        self.requests: list[tuple[str, str | None]] = []

    def gets(self) -> list[str | None]:
        return [r for op, r in self.requests if op == "GetObject"]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto logs every request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    fx = S3Fixture(f"http://{host}:{port}")
    real_new_client = s3_mod._new_client

    def hooked_client(endpoint, timeout):
        client = real_new_client(endpoint, timeout)

        def record(request, event_name, **_):
            rng = request.headers.get("Range")
            fx.requests.append((event_name.rsplit(".", 1)[-1], rng.decode() if isinstance(rng, bytes) else rng))

        client.meta.events.register("before-send.s3", record)
        return client

    with pytest.MonkeyPatch.context() as mp:
        for name, value in [("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                            ("AWS_DEFAULT_REGION", "us-east-1"), (s3_mod.ENDPOINT_ENV, fx.endpoint)]:
            mp.setenv(name, value)
        for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
            mp.delenv(name, raising=False)
        mp.setattr(s3_mod, "_new_client", hooked_client)
        mp.setattr(s3_mod, "_CLIENTS", {})
        import boto3

        admin = boto3.client("s3", endpoint_url=fx.endpoint)
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
    s3.requests.clear()
    return s3


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
                for b in PackedDataset(urls, capacity=128, window=8, epochs=1, seed=1)]

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
    log.requests.clear()
    resumed = ShardReader(remote, epochs=1, shuffle=False)
    resumed.reset(state)
    assert tokens_and_keys(head) + tokens_and_keys(resumed) == want
    assert log.gets()[0] == f"bytes={state[OFFSET_KEY]}-", log.requests
    assert log.gets()[1:] == [None], "later shards are read whole, the resumed one never from 0"


def test_fewer_shards_than_workers_splits_via_index(log, tmp_path):
    def read_split():
        return [
            tokens_and_keys(ShardReader(log.remote["one"], worker_id=w, num_workers=3, epochs=1, cache_dir=str(tmp_path)))
            for w in range(3)
        ]

    per_worker = read_split()
    assert [x for part in per_worker for x in part] == [(d, f"{i:08d}") for i, d in enumerate(DOCS)]
    assert [len(p) for p in per_worker] == [10, 10, 10]
    ranges = [r for r in log.gets() if r]
    assert len(ranges) == 3 and all(r.split("=")[1].split("-")[1] for r in ranges), ranges  # each "a-b"
    assert ("HeadObject", None) in log.requests  # the index cache key: ETag + size + LastModified

    log.requests.clear()
    assert read_split() == per_worker
    assert None not in log.gets(), "the cached index was rebuilt (a whole-object GET)"


def test_missing_key_is_missing_shard(log):
    url = f"s3://{BUCKET}/tar/nope.tar"
    with pytest.raises(DataError, match="missing_shard") as info:
        next(ShardReader(url, retries=0))
    assert url in str(info.value)
    log.requests.clear()
    errors = ErrorCounter()
    out = list(ShardReader([url, *log.remote["tar-npy"]], shuffle=False, epochs=1, on_error="skip", errors=errors))
    assert len(out) == 30 and errors.counts == {"missing_shard": 1}
    assert log.gets().count(None) == 4, "a missing key is not retried"


def test_unreachable_endpoint_bounded_retries(s3, monkeypatch):
    monkeypatch.setenv(s3_mod.ENDPOINT_ENV, f"http://127.0.0.1:{closed_port()}")
    url = s3.remote["tar-npy"][0]
    t0 = time.perf_counter()
    with pytest.raises(DataError, match="unreachable_url") as info:
        next(ShardReader(url, retries=1, retry_backoff=0.01, timeout=2))
    assert url in str(info.value) and "2 attempts" in str(info.value)
    assert time.perf_counter() - t0 < 5


def test_prefix_listing(log, monkeypatch):
    assert expand_urls(f"s3://{BUCKET}/tar/") == log.remote["tar-npy"]  # README.txt left out
    assert expand_urls(f"s3://{BUCKET}/") == sorted(log.remote["jsonl"] + log.remote["one"] + log.remote["tar-npy"])
    log.requests.clear()
    monkeypatch.setattr(s3_mod, "LIST_PAGE_SIZE", 2)
    assert expand_urls(f"s3://{BUCKET}/jsonl/") == log.remote["jsonl"]
    assert [op for op, _ in log.requests] == ["ListObjectsV2"] * 2, "paginated"
    with pytest.raises(ValueError, match="holds no shard objects"):
        expand_urls(f"s3://{BUCKET}/nothing/")


def test_cli_inspect_reads_s3(s3, capsys):
    prefix = f"s3://{BUCKET}/tar/"
    assert main(["inspect", prefix, "--capacity", "64", "--algorithms", "bfd", "--windows", "8", "--no-progress"]) == 0
    assert "samples: 30" in capsys.readouterr().out


def test_broken_read_is_an_oserror_and_offsets_are_exact(s3):
    from botocore.exceptions import ResponseStreamingError

    class Broken:
        def read(self, n):
            raise ResponseStreamingError(error="peer went away")

        def close(self):
            pass

    with pytest.raises(OSError, match="peer went away"):
        s3_mod._Body(Broken(), "s3://x/y.tar").readinto(bytearray(4))
    url, path = s3.remote["jsonl"][0], s3.local["jsonl"][0]
    data = Path(path).read_bytes()
    with open_shard(url, 7, 40) as f:
        assert f.read() == data[7:40]
    with open_shard(url, len(data)) as f:
        assert f.read() == b""


def test_missing_boto3_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)
    monkeypatch.setitem(sys.modules, "botocore", None)
    monkeypatch.setattr(s3_mod, "_CLIENTS", {})
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


def test_boto3_endpoint_env_is_honoured(s3, monkeypatch):
    monkeypatch.delenv(s3_mod.ENDPOINT_ENV)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint)
    monkeypatch.setattr(s3_mod, "_CLIENTS", {})
    assert len(list(ShardReader(s3.remote["one"], epochs=1))) == 30
