"""A shard changed between a checkpoint and the resume (issue 18, the last open class).

Before: only a reader that was *inside* the changed shard at the save checked it. Every other
reader resumed, on a plan cut from new sample counts (a local data set's manifest is rebuilt
when a shard changes) or over new bytes at the old manifest's offsets (a remote shard re-staged
with a new ETag): samples of *unchanged* shards were trained twice or never, old and new
contents were mixed in one epoch, and nothing was said. Now the reader state names the
manifest its plan was cut from (``ShardReader`` state ``"manifest"``: its fingerprints), every
reader compares it on restore and checks each shard it opens against the manifest, and a change
is a ``DataError("shard_changed")`` naming the shard with its old and new identity — under
``on_error="skip"`` too. With the original bytes back, the same states resume exactly once.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import pytest
import zstandard
from helpers_data import make_token_docs, write_jsonl_shards, write_tar_shards
from helpers_faults import serve_faulty
from topology_sim import SimRank

from streampack import PackedDataset
from streampack.errors import DataError
from streampack.io.decode import DecodeOptions
from streampack.io.index import index_decode
from streampack.io.manifest import HISTORY_DIR, HISTORY_KEEP, build_manifest, load_manifest, load_saved
from streampack.nodes.collate import FILLER_KEY
from streampack.nodes.reader import MANIFEST_KEY
from streampack.options import PackOptions, ReadOptions, TopologyOptions
from streampack.plan.elastic import find_state
from streampack.plan.state import record_of

DP = 2
OPTIONS = {"capacity": 48, "packing": PackOptions(window=2), "packs_per_batch": 1, "epochs": 1, "seed": 3}


@dataclass(frozen=True, slots=True, kw_only=True)
class Saved:
    """A shard's bytes and times before a change, to put it back."""

    path: str
    data: bytes
    times: tuple[int, int]

    @classmethod
    def of(cls, path: str) -> Saved:
        st = os.stat(path)
        return cls(path=path, data=open(path, "rb").read(), times=(st.st_atime_ns, st.st_mtime_ns))

    def put_back(self) -> None:
        with open(self.path, "wb") as f:
            f.write(self.data)
        os.utime(self.path, ns=self.times)


def _later(path: str, ns: int = 5_000_000_000) -> None:
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + ns))


def _truncate(path: str) -> None:
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    _later(path)


def _ranks(urls: list[str], states: list | None = None, **kw) -> list[SimRank]:
    load = (lambda r: None) if states is None else (lambda r: (lambda w: states[r]))
    return [SimRank(lambda r=r: _dataset(urls, r, kw), 0, load=load(r)) for r in range(DP)]


def _dataset(urls: list[str], rank: int, kw: dict) -> PackedDataset:
    topology = TopologyOptions(dp_rank=rank, dp_size=DP, equal_batches="count")
    return PackedDataset(urls, topology=topology, **{**OPTIONS, **kw})


def _take(ranks: list[SimRank], k: int | None = None) -> Counter:
    keys: Counter = Counter()
    for rank in ranks:
        for i, batch in enumerate(rank):
            keys.update(key for key in batch.doc_keys if key != FILLER_KEY)
            if k is not None and i + 1 == k:
                break
    return keys


def _refused(urls: list[str], states: list, **kw) -> list[DataError]:
    """Every rank's refusal (each loads its own state on the same topology)."""
    out = []
    for r in range(DP):
        with pytest.raises(DataError) as info:
            _take([SimRank(lambda: _dataset(urls, r, kw), 0, load=lambda w: states[r])])
        out.append(info.value)
    return out


def _resume_exactly_once(urls: list[str], before: Counter, states: list, want: Counter, **kw) -> None:
    after = _take(_ranks(urls, states, **kw))
    assert before + after == want and max(want.values()) == 1 and len(want) > 10


def _save_after_one_batch(urls: list[str], **kw) -> tuple[Counter, list]:
    ranks = _ranks(urls, **kw)
    before = _take(ranks, 1)
    return before, [st for rank in ranks for st in rank.states()]


@pytest.mark.parametrize("fmt", ["tar", "zst"])
def test_every_reader_refuses_a_truncated_local_shard_and_resumes_once_it_is_put_back(tmp_path, fmt):
    """Old tree: no reader refused (the truncated shard's own reader included, for a .zst:
    its byte offsets were compressed-stream positions of another stream) and samples of the
    other shards were trained twice or never."""
    docs = make_token_docs(64, seed=1, max_len=40)
    if fmt == "tar":  # its first 8 samples, a whole archive (cut bytes give a sample of unknown length: unplannable)
        urls = write_tar_shards(tmp_path / "d", docs, 4)
        write_tar_shards(tmp_path / "cut", docs[48:56], 1)
    else:
        urls = write_jsonl_shards(tmp_path / "d", docs, 4)
        for i, u in enumerate(urls):
            with open(u + ".zst", "wb") as f:
                f.write(zstandard.ZstdCompressor().compress(open(u, "rb").read()))
            os.remove(u)
            urls[i] = u + ".zst"
    kw = {"read": ReadOptions(cache_dir=str(tmp_path / "cache"), on_error="skip")}
    want = _take(_ranks(urls, **kw))
    before, states = _save_after_one_batch(urls, **kw)
    shard = urls[3]
    kept = Saved.of(shard)
    if fmt == "tar":
        os.replace(tmp_path / "cut" / "shard-000000.tar", shard)
        _later(shard)
    else:
        _truncate(shard)
    size = os.path.getsize(shard)
    for err in _refused(urls, states, **kw):  # never a skip: a refusal
        assert err.reason == "shard_changed" and err.url == shard
        assert f"size {len(kept.data)} -> {size}" in str(err) and "samples 16 -> " in str(err)
        assert "put the original bytes back" in str(err)
    kept.put_back()
    _resume_exactly_once(urls, before, states, want, **kw)


def test_a_same_size_rewrite_of_a_shard_no_reader_had_opened_is_refused_by_every_reader(tmp_path):
    """The plan does not move (the same sample counts and sizes), but the bytes do: under the
    default identity ("tag": size + mtime) the refusal names the old and new mtime."""
    urls = write_tar_shards(tmp_path / "d", make_token_docs(64, seed=2, max_len=40), 4)
    kw = {"read": ReadOptions(cache_dir=str(tmp_path / "cache"))}
    want = _take(_ranks(urls, **kw))
    before, states = _save_after_one_batch(urls, **kw)
    kept = Saved.of(urls[1])
    data = bytearray(kept.data)
    data[-1100] ^= 1  # inside the last sample's payload: same size, same samples
    open(urls[1], "wb").write(bytes(data))
    os.utime(urls[1], ns=(kept.times[0], kept.times[1] + 5_000_000_000))
    for err in _refused(urls, states, **kw):
        assert err.url == urls[1] and f"tag 'mtime_ns={kept.times[1]}' -> 'mtime_ns={kept.times[1] + 5_000_000_000}'" \
            in str(err)
    kept.put_back()
    _resume_exactly_once(urls, before, states, want, **kw)


def test_a_restaged_local_shard_resumes_under_identity_digest(tmp_path):
    """Same bytes, new mtime (``cp`` without ``-p``): the manifest is rebuilt, but under
    ``identity="digest"`` its fingerprint is the same, so every reader resumes."""
    urls = write_tar_shards(tmp_path / "d", make_token_docs(64, seed=4, max_len=40), 4)
    kw = {"read": ReadOptions(cache_dir=str(tmp_path / "cache"), identity="digest")}
    want = _take(_ranks(urls, **kw))
    before, states = _save_after_one_batch(urls, **kw)
    for u in urls:
        _later(u)
    _resume_exactly_once(urls, before, states, want, **kw)


def test_a_shard_restaged_over_http_with_a_new_etag_is_refused_and_resumes_once_put_back(tmp_path):
    """Remote shards with a manifest (``streampack index``): the manifest does not change, so
    the check is each shard's ETag against it when a reader opens it (the HEAD it makes anyway,
    no request of its own). Old tree: a reader that had not opened the re-staged shard before the
    save read it at the manifest's offsets, whatever it now held."""
    urls_local = write_jsonl_shards(tmp_path / "d", make_token_docs(64, seed=5, max_len=40), 4)
    with serve_faulty(tmp_path / "d") as server:
        urls = [f"{server.url}/{os.path.basename(u)}" for u in urls_local]
        location = str(tmp_path / "manifest")
        build_manifest(urls, location, decode=index_decode(DecodeOptions(limits=PackedDataset(urls, **OPTIONS).config.read.limits)))
        kw = {"read": ReadOptions(manifest=location, on_error="skip")}
        want = _take(_ranks(urls, **kw))
        before, states = _save_after_one_batch(urls, **kw)
        opened = {s for st in states for s in record_of(find_state(st["graph"], "ShardReader")["identity"])["shards"]}
        shard = min(set(range(len(urls))) - opened)  # no reader had opened it: only the manifest knows it
        kept = Saved.of(urls_local[shard])
        _later(urls_local[shard])  # a re-upload: the same bytes, a new ETag
        errors = []
        for r in range(DP):
            try:
                _take([SimRank(lambda: _dataset(urls, r, kw), 0, load=lambda w: states[r])])
            except DataError as e:
                errors.append(e)
        assert errors, "some reader reads the re-staged shard"
        for err in errors:
            assert err.reason == "shard_changed" and err.url == urls[shard]
            assert "changed since the manifest" in str(err) and "tag '\"" in str(err) and "' -> '\"" in str(err)
            assert "identity='size' or 'digest'" in str(err)
        kept.put_back()
        _resume_exactly_once(urls, before, states, want, **kw)


def test_the_state_names_the_manifest_and_the_manifest_keeps_the_copies_it_names(tmp_path):
    urls = write_tar_shards(tmp_path / "d", make_token_docs(32, seed=6), 2)
    location = str(tmp_path / "m")
    first = build_manifest(urls, location)
    ranks = _ranks(urls, read=ReadOptions(manifest=location))
    _take(ranks, 1)
    reader = find_state(ranks[0].states()[0]["graph"], "ShardReader")
    assert reader[MANIFEST_KEY] == {m: first.fingerprint(m) for m in ("all", "tag", "size", "digest")}
    assert load_saved(location, first.fingerprint("all")).fingerprint("all") == first.fingerprint("all")
    for _ in range(HISTORY_KEEP + 2):  # every rebuild keeps a copy; a local cache keeps the newest few
        _later(urls[0], 1_000_000)
        build_manifest(urls, location)
    assert len(os.listdir(os.path.join(location, HISTORY_DIR))) == HISTORY_KEEP
    assert load_saved(location, first.fingerprint("all")) is None and load_saved(location, "../x") is None
    assert load_manifest(location).fingerprint("size") == first.fingerprint("size")  # only mtimes moved


def test_without_the_saved_manifest_the_refusal_still_names_the_shards_the_reader_recorded(tmp_path):
    urls = write_jsonl_shards(tmp_path / "d", make_token_docs(64, seed=7, max_len=40), 4)
    kw = {"read": ReadOptions(cache_dir=str(tmp_path / "cache"))}
    _, states = _save_after_one_batch(urls, **kw)
    for u in urls:  # every shard loses its second half of lines
        lines = open(u, "rb").readlines()
        open(u, "wb").write(b"".join(lines[: len(lines) // 2]))
        _later(u)
    for root, dirs, _ in os.walk(tmp_path / "cache"):  # another machine: no copy of the old manifest
        if os.path.basename(root) == HISTORY_DIR:
            for name in os.listdir(root):
                os.remove(os.path.join(root, name))
    for err in _refused(urls, states, **kw):
        assert err.reason == "shard_changed" and err.url in urls and " -> " in str(err)
