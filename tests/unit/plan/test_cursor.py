"""The cursor (``streampack.plan.cursor``): what a reader has not delivered, as named records.

Each stateful node hands out its part through one method over its own saved state, and the
state keeps every column of a table under its name: no module reads another's private keys or
a column by position (a dropped column in a positional unpack once re-trained a whole shard).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_data import write_tar_shards
from node_checks import read_as
from topology_sim import roundtrip

import streampack
from streampack import PackedDataset
from streampack.io.index import load_or_build_index
from streampack.nodes.overlong import OverlongNode
from streampack.nodes.reader import KIND as READER_KIND
from streampack.nodes.reader import ShardReader
from streampack.nodes.window_packer import WindowPacker
from streampack.options import PackOptions
from streampack.plan import rows as row_table
from streampack.plan.cursor import Pulled, Split, Undelivered
from streampack.plan.elastic import find_state
from streampack.plan.epoch_plan import ShardSamples
from streampack.plan.state import REF_COLUMNS, table_lengths, table_refs, table_size

CAP = 64
POSITIONAL = [
    re.compile(r"\[\s*:\s*,\s*(?!None\b)(?:[A-Z_][A-Z0-9_]*|-?\d+|\[)"),  # t[:, LENGTH], t[:, 0], t[:, [A, B]]
    re.compile(r"\[\s*[\w.-]+\s*,\s*_?[A-Z][A-Z0-9_]+\s*\]"),  # t[i, LENGTH], out[mine, CHUNK], rows[-1, _LAST]
]


def test_no_positional_column_reads_in_nodes_and_plan():
    """Every state table and row table in ``nodes/`` and ``plan/`` is read by field name."""
    root = Path(streampack.__file__).parent
    found = [f"{path.relative_to(root)}:{n}: {line.strip()}"
             for folder in ("nodes", "plan") for path in sorted((root / folder).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if any(p.search(line) for p in POSITIONAL)]
    assert found == [], "\n".join(found)


def test_row_table_operations_are_the_plain_matrix_operations():
    """``cat`` / ``take`` / ``put`` / ``repeat`` (through the int64 view) give numpy's own result
    on the structured array, field for field."""
    rng = np.random.default_rng(0)
    a, b = row_table.rows_of(5), row_table.rows_of(3)
    for name in row_table.COLUMNS:
        a[name], b[name] = rng.integers(-5, 100, 5), rng.integers(-5, 100, 3)
    assert np.array_equal(row_table.cat([a, b]), np.concatenate([a, b]))
    assert np.array_equal(row_table.take(a, np.array([4, 0, 4])), a[[4, 0, 4]])
    mask = a["length"] > 40
    assert np.array_equal(row_table.take(a, mask), a[mask])
    assert np.array_equal(row_table.repeat(a, np.array([0, 2, 1, 0, 3])), np.repeat(a, [0, 2, 1, 0, 3]))
    c = a.copy()
    row_table.put(c, np.array([1, 3]), b[:2])
    want = a.copy()
    want[[1, 3]] = b[:2]
    assert np.array_equal(c, want)
    assert np.array_equal(row_table.take(a[::2], np.array([1])), a[2:3])  # a strided slice too
    refs = row_table.ref_table(a)
    assert refs.dtype.names == REF_COLUMNS and all(np.array_equal(refs[n], a[n]) for n in REF_COLUMNS)


def _corpus(tmp_path) -> list[str]:
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 30_000, int(n)) for n in rng.integers(5, 50, 120)]
    for i in (7, 30, 55, 90):
        docs[i] = rng.integers(0, 30_000, 9 * CAP + 5)  # split into 10 chunks
    return write_tar_shards(tmp_path, docs, 3)


def _make(urls: list[str]) -> PackedDataset:
    return PackedDataset(urls, capacity=CAP, epochs=1, shuffle=False, packing=PackOptions(window=8))


def _mid_split(urls: list[str]):
    """A state with a split document's chunks pending, and the iterator it was taken from."""
    ds = _make(urls)
    it = iter(ds)
    for _ in range(200):
        next(it)
        state = ds.state_dict()
        if Split.from_state(find_state(state["graph"], OverlongNode.KIND)["pending"]) is not None:
            return state, it
    raise AssertionError("no save point inside a split document")


@pytest.mark.parametrize("blocks", [True, False])
def test_what_the_nodes_hand_out_is_exactly_what_is_still_to_come(tmp_path, monkeypatch, blocks):
    """The packer's carry, the split document's chunks left and every sample after the frontier
    in the reader's plan hold, token for token, what the stream still delivers after the save."""
    read_as(monkeypatch, blocks)
    urls = _corpus(tmp_path)
    state, it = _mid_split(urls)
    graph = state["graph"]["chain"]
    packer, overlong = find_state(graph, WindowPacker.KIND), find_state(graph, OverlongNode.KIND)
    split = OverlongNode.undelivered(overlong, capacity=CAP, policy="split")
    assert isinstance(split, Undelivered) and isinstance(split.pulled, Pulled)
    refs = table_refs(split.carry)
    at = Split.from_state(overlong["pending"])
    assert refs["chunk"].tolist() == list(range(at.next, at.count)) and set(refs["offset"].tolist()) == {at.at.offset}
    left = Undelivered.compose(split.pulled, WindowPacker.undelivered(packer).carry, split.carry)
    assert table_size(left.carry) > table_size(split.carry) > 0
    plan = ShardReader.undelivered(find_state(graph, READER_KIND))
    assert plan.start_epoch == pulled_epoch(left) == 0
    options = _make(urls).config.read
    pulled, after = left.pulled, 0
    for shard, url in enumerate(urls):  # one reader, no shuffle: shards in order, each whole
        samples = ShardSamples.of(load_or_build_index(url, decode=options.decode(), opts=options.open_options(),
                                                      cache_dir=options.cache_dir))
        lengths = samples.costs(tokens=True)
        if shard > pulled.shard:
            after += int(lengths.sum())
        elif shard == pulled.shard:
            after += int(lengths[samples.offsets > pulled.offset].sum())
    still = int(table_lengths(left.carry).sum()) + after
    delivered = sum(b.num_tokens for b in it)
    assert still == delivered, (still, delivered)


@pytest.mark.parametrize("blocks", [True, False])
def test_a_state_of_another_layout_is_refused_by_name(tmp_path, monkeypatch, blocks):
    """The positional layout (version 4: references as an int64 ``[n, 7]`` matrix) is refused
    by its version; a reference table of this version without a column names the column."""
    read_as(monkeypatch, blocks)
    urls = _corpus(tmp_path)
    state, _ = _mid_split(urls)
    table = find_state(state["graph"], WindowPacker.KIND)["table"]
    assert set(table["refs"]) == set(REF_COLUMNS)
    old = roundtrip(state)
    old["version"] = 4
    packer = find_state(old["graph"], WindowPacker.KIND)
    packer["table"]["refs"] = torch.stack([packer["table"]["refs"][c] for c in REF_COLUMNS], 1)
    with pytest.raises(ValueError, match=r"state version=4 is not the supported version=5"):
        _make(urls).load_state_dict(old)
    dropped = roundtrip(state)
    _find_table(dropped["graph"])["refs"].pop("epoch")
    with pytest.raises(ValueError, match=r"reference table without the field\(s\) \['epoch'\]"):
        ds = _make(urls)
        ds.load_state_dict(dropped)
        next(iter(ds))


def pulled_epoch(left: Undelivered) -> int:
    assert left.pulled is not None
    return left.pulled.epoch


def _find_table(tree):
    if isinstance(tree, dict):
        if tree.get("kind") == WindowPacker.KIND:
            return tree["table"]
        for v in tree.values():
            found = _find_table(v)
            if found is not None:
                return found
    return None
