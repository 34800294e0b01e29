"""A shard that changed since the checkpoint is refused by name (issue 13, finding 6).

Before: a shard rewritten with the same size resumed silently at the old byte offsets (reading
whatever now lies there), and one of another size failed with "unparsable tar header" without
saying the shard had changed. The state now records each shard's identity — size and mtime
for a local file, size and ETag / mtime for a remote object — and a restore compares it.
"""

from __future__ import annotations

import os
import shutil

import pytest
from helpers_data import make_token_docs, write_jsonl_shards, write_tar_shards

from streampack import PackedDataset
from streampack.io.storage import OpenOptions
from streampack.nodes.reader import ShardReader
from streampack.options import PackOptions, ReadOptions
from streampack.plan.state import record_of


def _touch_later(path: str) -> None:
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))


def _same_size_rewrite(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[-600] ^= 0x01  # flip one bit inside the data: same size, other contents
    open(path, "wb").write(bytes(data))
    _touch_later(path)


@pytest.mark.parametrize("change", ["same_size", "other_size"])
def test_reader_refuses_a_changed_shard_naming_it(tmp_path, change):
    urls = write_tar_shards(tmp_path, make_token_docs(40, seed=3), 1)
    reader = ShardReader(urls, seed=0, epochs=1)
    for _ in range(7):
        next(reader)
    state = reader.state_dict()
    if change == "same_size":
        _same_size_rewrite(urls[0])
        what = "tag"
    else:
        write_tar_shards(tmp_path, make_token_docs(400, seed=4), 1)  # tar pads to 10 KiB records: much more data
        what = "size"
    with pytest.raises(ValueError, match=rf"shard '.*shard-000000.tar' changed since the state was saved \({what} "):
        ShardReader(urls, seed=0, epochs=1).reset(state)


def test_unchanged_shard_resumes_and_a_finished_one_is_not_checked(tmp_path):
    urls = write_tar_shards(tmp_path, make_token_docs(40, seed=3), 2)
    reader = ShardReader(urls, seed=0, shuffle=False, epochs=1)
    head = [next(reader).key for _ in range(25)]  # into the second shard
    state = reader.state_dict()
    identity = record_of(state["identity"])
    assert identity["shards"] == [0, 1] and identity["sizes"][0] == os.path.getsize(urls[0])
    restored = ShardReader(urls, seed=0, shuffle=False, epochs=1)
    restored.reset(state)
    assert [s.key for s in restored][:3] == [s.key for s in ShardReader(urls, seed=0, shuffle=False, epochs=1)][25:28]
    _same_size_rewrite(urls[0])  # the finished shard changed: only the packer's replay asks about it
    ShardReader(urls, seed=0, shuffle=False, epochs=1).reset(state)
    assert head


def test_packed_dataset_refuses_a_carried_samples_shard_that_changed(tmp_path):
    """Samples in the packer's window are stored as references and re-read on restore: their
    shards are checked too, not only the one being read."""
    urls = write_jsonl_shards(tmp_path, make_token_docs(240, seed=5, max_len=60), 24)  # 10 docs per shard
    ds = PackedDataset(urls, capacity=256, seed=1, shuffle=False, packing=PackOptions(window=64))
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    current = state["graph"]["source"]["source"]["source"]["shard_pos"]  # collate -> packer -> overlong -> reader
    fresh = PackedDataset(urls, capacity=256, seed=1, shuffle=False, packing=PackOptions(window=64))
    fresh.load_state_dict(state)
    assert next(iter(fresh)).doc_keys == next(it).doc_keys  # unchanged: exact
    for shard, url in enumerate(urls):
        if shard != current:
            _touch_later(url)  # contents identical, mtime newer: the identity no longer matches
    fresh = PackedDataset(urls, capacity=256, seed=1, shuffle=False, packing=PackOptions(window=64))
    fresh.load_state_dict(state)
    with pytest.raises(ValueError, match=r"shard '.*shard-0000\d\d.jsonl' changed since the state was saved \(tag"):
        next(iter(fresh))


# ------------------------------------------------------------------ issue 18, item 4: the identity option


def _restage(path: str) -> None:
    """What `cp` without `-p` (or a re-download) does: the same bytes under a new mtime."""
    shutil.copyfile(path, path + ".new")
    os.replace(path + ".new", path)
    _touch_later(path)


def _state_after(urls, n: int, **kw):
    reader = ShardReader(urls, seed=0, epochs=1, shuffle=False, **kw)
    head = [next(reader).key for _ in range(n)]
    return reader.state_dict(), head, [s.key for s in reader]


@pytest.mark.parametrize("identity", ["size", "digest", "off"])
def test_a_re_staged_shard_resumes_when_the_identity_option_allows_it(tmp_path, identity):
    # bug: a re-staged shard (same bytes, new mtime) refused every resume, with no opt-out
    urls = write_tar_shards(tmp_path, make_token_docs(40, seed=3), 1)
    opts = OpenOptions(identity=identity)
    state, _, rest = _state_after(urls, 7, open_options=opts)
    strict, _, _ = _state_after(urls, 7)
    _restage(urls[0])
    with pytest.raises(ValueError, match=r"changed since the state was saved \(tag .*identity='size' or 'digest'"):
        ShardReader(urls, seed=0, epochs=1, shuffle=False).reset(strict)  # the default stays strict
    restored = ShardReader(urls, seed=0, epochs=1, shuffle=False, open_options=opts)
    restored.reset(state)
    assert [s.key for s in restored] == rest


def test_digest_refuses_a_same_size_edit_and_a_state_without_a_digest(tmp_path):
    urls = write_tar_shards(tmp_path, make_token_docs(40, seed=3), 1)
    digest = OpenOptions(identity="digest")
    state, _, _ = _state_after(urls, 7, open_options=digest)
    assert record_of(state["identity"])["tags"][0].startswith("digest=")
    tag_state, _, _ = _state_after(urls, 7)
    _same_size_rewrite(urls[0])  # a bit flipped 600 bytes before the end: inside the last 64 KiB
    with pytest.raises(ValueError, match=r"changed since the state was saved \(digest 'digest="):
        ShardReader(urls, seed=0, epochs=1, shuffle=False, open_options=digest).reset(state)
    with pytest.raises(ValueError, match=r"recorded with identity='tag' \(no digest\).*identity='size'"):
        ShardReader(urls, seed=0, epochs=1, shuffle=False, open_options=digest).reset(tag_state)
    with pytest.raises(ValueError, match="identity='bogus' must be one of"):
        OpenOptions(identity="bogus")


def test_packed_dataset_identity_size_resumes_re_staged_carried_shards(tmp_path):
    urls = write_jsonl_shards(tmp_path, make_token_docs(240, seed=5, max_len=60), 24)
    kw = dict(capacity=256, packing=PackOptions(window=64), seed=1, shuffle=False)
    ds = PackedDataset(urls, **kw)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    for url in urls:
        _restage(url)
    fresh = PackedDataset(urls, read=ReadOptions(identity="size"), **kw)
    fresh.load_state_dict(state)
    assert next(iter(fresh)).doc_keys == next(it).doc_keys
