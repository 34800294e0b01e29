"""The replayer re-reads carried documents by reference: as token blocks when a stream's documents are the shards'
own ids, per sample otherwise; both give the chunk each reference names, and both refuse one that changed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from streampack.io.urls import ShardList
from streampack.options import ReadOptions
from streampack.plan.replay import Replayer, ReplaySpec
from streampack.plan.rows import BlockStore, PackRows
from streampack.plan.state import REF

LENGTHS = [3, 10, 5]


@pytest.fixture
def shard(tmp_path) -> tuple[str, list[int]]:
    path, offsets, at = tmp_path / "s.jsonl", [], 0
    with open(path, "w") as f:
        for i, n in enumerate(LENGTHS):
            line = json.dumps({"input_ids": list(range(100 * i, 100 * i + n))}) + "\n"
            offsets.append(at)
            at += len(line)
            f.write(line)
    return str(path), offsets


def _replayer(url: str, policy: str, *, blocks: bool) -> Replayer:
    read = ReadOptions()
    stages = [] if blocks else [lambda s: s]  # a stage makes every document a Sample again
    replayer = Replayer(ReplaySpec(sources=[ShardList.of([url])], decode=read.decode(), opts=read.open_options(),
                                   encoder=None, stages=stages, max_len=4, policy=policy))
    assert replayer.blocks is blocks
    return replayer


def _refs(offsets: list[int], wanted: list[tuple[int, int, int]]) -> np.ndarray:
    """``(document, chunk, length)`` -> references into the one shard."""
    refs = np.zeros(len(wanted), dtype=REF)
    for r, (doc, chunk, length) in zip(refs, wanted):
        r["offset"], r["number"], r["chunk"], r["length"] = offsets[doc], doc, chunk, length
    return refs


def _tokens(replayer: Replayer, refs: np.ndarray) -> list[list[int]]:
    store = BlockStore()
    rows = replayer(refs, store)
    return [s.tokens.tolist() for s in PackRows(rows=rows, blocks=store.subset(rows)).samples()]


@pytest.mark.parametrize("blocks", [True, False])
@pytest.mark.parametrize(("policy", "wanted", "want"), [
    ("split", [(1, 2, 2), (0, -1, 3), (1, 0, 4)], [[108, 109], [0, 1, 2], [100, 101, 102, 103]]),
    ("truncate", [(2, 0, 4), (0, -1, 3)], [[200, 201, 202, 203], [0, 1, 2]]),
])
def test_each_reference_comes_back_as_the_chunk_it_names(shard, blocks, policy, wanted, want):
    url, offsets = shard
    assert _tokens(_replayer(url, policy, blocks=blocks), _refs(offsets, wanted)) == want


@pytest.mark.parametrize("blocks", [True, False])
@pytest.mark.parametrize(("policy", "wanted", "message"), [
    ("split", [(0, -1, 3), (1, 1, 3)], r"@\d+ chunk 1 re-read with 4 tokens, 3 when the state was saved"),
    ("split", [(1, 3, 2)], r"chunk 3 re-read with None tokens, 2 when"),
    ("drop", [(2, 0, 4)], r"chunk 0 re-read with None tokens, 4 when"),
])
def test_a_reference_that_no_longer_matches_is_refused(shard, blocks, policy, wanted, message):
    url, offsets = shard
    with pytest.raises(ValueError, match=message + ".*shard changed since, or a stage is not a pure function"):
        _replayer(url, policy, blocks=blocks)(_refs(offsets, wanted), BlockStore())
