"""A Megatron shard is its ``.idx`` and its ``.bin``: a ``.bin`` rewritten with the same size (other ids) beside an
unchanged ``.idx`` is refused at a restore and against a manifest, naming the ``.bin`` (io.shard_identity)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers_data import make_token_docs
from helpers_megatron import write_megatron_shards
from node_checks import planned_dataset

from streampack.cli.main import main
from streampack.io.manifest import load_manifest
from streampack.io.megatron import bin_url
from streampack.io.shard_identity import ShardChanged, current
from streampack.io.storage import OpenOptions
from streampack.nodes.reader import ShardReader
from streampack.options import ReadOptions


def _other_ids_same_size(idx_url: str) -> None:
    """Every id of the ``.bin`` beside ``idx_url`` replaced (same size, a later mtime), the ``.idx`` untouched."""
    path = bin_url(idx_url)
    ids = np.fromfile(path, dtype=np.int32)
    (ids + 1).tofile(path)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))


@pytest.fixture
def shards(tmp_path):
    return write_megatron_shards(tmp_path / "d", make_token_docs(60, seed=2, max_len=80), 2)


@pytest.mark.parametrize("mode", ["tag", "digest"])
def test_a_restore_refuses_a_rewritten_bin_naming_it(shards, mode):
    opts = ReadOptions(identity=mode)
    reader = ShardReader(shards, seed=0, shuffle=False, epochs=1, read=opts)
    for _ in range(5):
        next(reader)
    state = reader.state_dict()
    idx_before = os.stat(shards[0])
    _other_ids_same_size(shards[0])
    assert os.stat(shards[0]).st_mtime_ns == idx_before.st_mtime_ns, "the .idx is unchanged"
    with pytest.raises(ShardChanged, match=rf"cannot resume: shard '.*shard-000.idx' changed since the state was "
                                           rf"saved .*{'its .bin' if mode == 'tag' else 'the pair is'} "
                                           rf"'.*shard-000.bin'"):
        ShardReader(shards, seed=0, shuffle=False, epochs=1, read=opts).reset(state)


def test_a_manifest_refuses_a_rewritten_bin_naming_it(shards, tmp_path):
    out = str(tmp_path / "manifest")
    assert main(["index", *shards, "--out", out, "--quiet", "--pool", "threads"]) == 0
    m = load_manifest(out)
    assert m.sizes[1] == os.path.getsize(shards[1]) + os.path.getsize(bin_url(shards[1])), "the pair's bytes"
    for mode in ("tag", "digest"):
        m.check_identity(1, current(shards[1], OpenOptions(identity=mode)), mode)  # unchanged: silent
    _other_ids_same_size(shards[1])
    for mode in ("tag", "digest"):
        with pytest.raises(ShardChanged, match=r"stale manifest: shard '.*shard-001.idx' changed .*'.*shard-001.bin'"):
            m.check_identity(1, current(shards[1], OpenOptions(identity=mode)), mode)
    m.check_identity(0, current(shards[0], OpenOptions()), "tag")  # the other pair is fine
    ranks = [planned_dataset(shards, ReadOptions(manifest=out), r, 2, capacity=128) for r in range(2)]
    with pytest.raises(ShardChanged, match=r"stale manifest: .*its .bin '.*shard-001.bin' changed beside the same "
                                           r"\.idx"):
        for ds in ranks:  # whichever rank reads the pair meets it
            for _ in ds:
                pass
