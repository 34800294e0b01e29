"""A shard that changed since the checkpoint is refused by name (issue 13, finding 6).

Before: a shard rewritten with the same size resumed silently at the old byte offsets (reading
whatever now lies there), and one of another size failed with "unparsable tar header" without
saying the shard had changed. The state now records each shard's identity — size and mtime
for a local file, size and ETag / mtime for a remote object — and a restore compares it.
"""

from __future__ import annotations

import os

import pytest
from helpers_data import make_token_docs, write_jsonl_shards, write_tar_shards

from streampack import PackedDataset
from streampack.nodes.reader import ShardReader


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
    assert state["identity"]["shards"] == [0, 1] and state["identity"]["sizes"][0] == os.path.getsize(urls[0])
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
    ds = PackedDataset(urls, capacity=256, window=64, seed=1, shuffle=False)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    current = state["graph"]["source"]["source"]["source"]["shard_pos"]  # collate -> packer -> overlong -> reader
    fresh = PackedDataset(urls, capacity=256, window=64, seed=1, shuffle=False)
    fresh.load_state_dict(state)
    assert next(iter(fresh)).doc_keys == next(it).doc_keys  # unchanged: exact
    for shard, url in enumerate(urls):
        if shard != current:
            _touch_later(url)  # contents identical, mtime newer: the identity no longer matches
    fresh = PackedDataset(urls, capacity=256, window=64, seed=1, shuffle=False)
    fresh.load_state_dict(state)
    with pytest.raises(ValueError, match=r"shard '.*shard-0000\d\d.jsonl' changed since the state was saved \(tag"):
        next(iter(fresh))
