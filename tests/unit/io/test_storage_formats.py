"""jsonl.zst beside jsonl.gz (round trip, multi-frame, resume by decompress-and-skip, truncation
detected), the accepted suffixes, and URL expansion through fsspec (no stat per explicit path,
http directory listings, memory:// globs, pipe: refusal)."""

from __future__ import annotations

import gzip
import io
import os

import fsspec
import pytest
import zstandard
from helpers_data import make_text_docs, make_token_docs, write_jsonl_shards
from helpers_faults import serve_faulty
from helpers_formats import jsonl_bytes, write_zst_shards
from node_checks import roundtrip

from streampack.errors import DataError, ErrorCounter, ErrorPolicy
from streampack.io import urls as urls_mod
from streampack.io.compression import CorruptStream, ZstdReader
from streampack.io.urls import ShardList, expand_urls, shard_format
from streampack.nodes.reader import OFFSET_KEY, ShardReader


def read_all(urls, **kw) -> list:
    return list(ShardReader(urls, shuffle=False, epochs=1, **kw))


@pytest.mark.parametrize("frames", [1, 3])
def test_zst_roundtrip_tokens_and_text(tmp_path, frames):
    docs = make_token_docs(40, seed=1)
    urls = write_zst_shards(tmp_path / "t", docs, 2, frames=frames)
    assert [s.tokens.tolist() for s in read_all(urls)] == docs
    texts = make_text_docs(20, seed=2)
    urls = write_zst_shards(tmp_path / "x", texts, 2, frames=frames)
    out = read_all(urls)
    assert [s.text for s in out] == texts and [s.key for s in out[:3]] == ["0", "1", "2"]


def test_zst_resume_is_exact_and_uses_uncompressed_offsets(tmp_path):
    docs = make_token_docs(60, seed=3)
    urls = write_zst_shards(tmp_path, docs, 2, frames=4)
    reader = ShardReader(urls, epochs=1, shuffle=False)
    head = [next(reader) for _ in range(45)]
    state = roundtrip(reader.state_dict())
    raw = jsonl_bytes(docs[30:])
    assert state[OFFSET_KEY] == len(jsonl_bytes(docs[30:45])) and state[OFFSET_KEY] < len(raw)
    resumed = ShardReader(urls, epochs=1, shuffle=False)
    resumed.reset(state)
    assert [s.tokens.tolist() for s in head + list(resumed)] == docs


@pytest.mark.parametrize("cut", ["frame_middle", "before_checksum", "header"])
def test_truncated_zst_is_corrupt_not_a_short_shard(tmp_path, cut):
    # zstandard's reader returns a truncated frame's partial data and a clean end: a cut
    # .jsonl.zst read as a shorter shard, silently
    docs = make_token_docs(200, seed=4, min_len=50, max_len=60)
    data = zstandard.ZstdCompressor(write_checksum=True).compress(jsonl_bytes(docs))
    keep = {"frame_middle": len(data) // 2, "before_checksum": len(data) - 2, "header": 3}[cut]
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(data[:keep])
    with pytest.raises(CorruptStream):
        io.BufferedReader(ZstdReader(io.BytesIO(data[:keep]))).read()
    with pytest.raises(DataError, match="corrupt_shard") as info:
        read_all(str(path))
    assert str(path) in str(info.value)
    errors = ErrorCounter()
    out = read_all(str(path), error_policy=ErrorPolicy("skip", errors))
    assert errors.counts == {"corrupt_shard": 1} and [s.tokens.tolist() for s in out] == docs[:len(out)]
    # every complete line before the cut is delivered (issue 18 item 9): with only the
    # checksum cut off, that is all of them, and the damage is still counted
    assert len(out) == 200 if cut == "before_checksum" else len(out) < 200


def test_suffixes(tmp_path):
    assert [shard_format(u) for u in ("a.tar", "a.jsonl", "a.ndjson", "a.jsonl.gz", "a.json.gz", "a.jsonl.zst",
                                      "a.json.zst", "a.parquet", "https://h/a.parquet?sig=x&b=.tar")] == [
        "tar", "jsonl", "jsonl", "jsonl.gz", "jsonl.gz", "jsonl.zst", "jsonl.zst", "parquet", "parquet"]
    with pytest.raises(ValueError, match="cannot tell the format"):
        shard_format("a.json")
    docs = make_text_docs(6, seed=5)  # Dolma's *.json.gz is JSON lines
    path = tmp_path / "dolma-0000.json.gz"
    path.write_bytes(gzip.compress(jsonl_bytes(docs)))
    assert [s.text for s in read_all(str(path))] == docs


def test_explicit_paths_cost_no_stat(tmp_path, monkeypatch):
    # bug: one isdir stat per URL (per worker, per pass): 20k URLs -> 20k stats
    calls: list[str] = []
    real_isdir, real_stat = os.path.isdir, os.stat
    monkeypatch.setattr(urls_mod.os.path, "isdir", lambda p: calls.append(p) or real_isdir(p))
    monkeypatch.setattr(urls_mod.os, "stat", lambda p, *a, **k: calls.append(p) or real_stat(p, *a, **k))
    names = [str(tmp_path / f"shard-{i:06d}.tar") for i in range(5000)]
    assert ShardList.of(names).urls == tuple(names)
    assert ShardList.of(str(tmp_path / "shard-{000000..004999}.tar")).urls == tuple(names)
    assert calls == []


def test_workers_never_expand_again(tmp_path, monkeypatch):
    import pickle

    from streampack.dataset import PackedDataset
    from streampack.options import PackOptions

    urls = write_jsonl_shards(tmp_path, make_token_docs(40, seed=6), 4)
    ds = PackedDataset(str(tmp_path / "shard-*.jsonl"), capacity=64, epochs=1, packing=PackOptions(window=4))

    def no_expansion(*a, **k):
        raise AssertionError("URL expansion ran again after the dataset was built")

    monkeypatch.setattr(urls_mod, "expand_urls", no_expansion)
    assert ds.urls == urls
    assert sum(b.num_tokens for b in ds) > 0
    worker_copy = pickle.loads(pickle.dumps(ds))  # what a DataLoader worker gets
    assert sum(b.num_tokens for b in worker_copy) > 0


def test_http_directory_listing_and_glob(tmp_path):
    urls = write_jsonl_shards(tmp_path / "d", make_token_docs(12, seed=7), 3)
    (tmp_path / "d" / "notes.txt").write_text("not a shard")
    with serve_faulty(tmp_path / "d") as server:
        listed = expand_urls(server.url + "/")
        assert listed == [f"{server.url}/{os.path.basename(u)}" for u in urls]
        assert expand_urls(server.url + "/shard-00000[02].jsonl") == [listed[0], listed[2]]
        assert expand_urls(server.url + "/shard-000001.jsonl?token=abc") == [server.url + "/shard-000001.jsonl?token=abc"]
        before = len(server.requests)
        expand_urls([f"{server.url}/shard-{i:06d}.jsonl" for i in range(3)])
        assert len(server.requests) == before, "explicit shard URLs are taken as given"


def test_memory_filesystem_glob_and_missing(tmp_path):
    fs = fsspec.filesystem("memory")
    docs = make_token_docs(9, seed=8)
    for i, u in enumerate(write_jsonl_shards(tmp_path, docs, 3)):
        fs.pipe(f"/glob-test/part-{i}.jsonl", open(u, "rb").read())
    try:
        found = expand_urls("memory://glob-test/part-*.jsonl")
        assert len(found) == 3 and [s.tokens.tolist() for s in read_all(found)] == docs
        with pytest.raises(ValueError, match="matches no shard files"):
            expand_urls("memory://glob-test/nothing-*.tar")
        errors = ErrorCounter()
        out = read_all(["memory://glob-test/gone.jsonl", *found], error_policy=ErrorPolicy("skip", errors))
        assert len(out) == 9 and errors.counts == {"missing_shard": 1}
    finally:
        fs.rm("/glob-test", recursive=True)


def test_unknown_protocol_and_pipe(tmp_path):
    with pytest.raises(ValueError, match="unknown URL protocol 'nosuchproto'"):
        read_all("nosuchproto://bucket/a.tar")
    with pytest.raises(ValueError, match="allow_pipe"):
        expand_urls(["pipe:cat x.tar"])


def test_optional_backends_build_or_say_which_extra(monkeypatch):
    import importlib.util

    from streampack.io import storage
    from streampack.io.storage import OpenOptions

    monkeypatch.setattr(storage, "_FILESYSTEMS", {})
    if importlib.util.find_spec("huggingface_hub") is not None:  # built without touching the network
        fs, path = storage.filesystem("hf://datasets/org/name/data/train-00000.parquet", OpenOptions())
        assert type(fs).__name__ == "HfFileSystem" and path == "datasets/org/name/data/train-00000.parquet"
    for url, extra, module in [("gs://bucket/a.parquet", "gcs", "gcsfs"), ("az://container/a.tar", "azure", "adlfs")]:
        if importlib.util.find_spec(module) is None:
            with pytest.raises(ImportError, match=rf"pip install 'streampack\[{extra}\]'"):
                storage.filesystem(url, OpenOptions())
