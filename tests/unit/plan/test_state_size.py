"""State bounded by the window, not by documents (issue 11, build item 5).

Carried samples are stored as references (48-56 bytes each) and re-read on restore; the
limits below are the issue's: < 1 MB per worker at capacity 131072 with window 1024, no
pending-chunk blow-up for one 4M-token document under ``overlong="split"`` (28.5 MB per
checkpoint before), and capacity 32k with window 256 (17.6 MB per worker before).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers_data import write_tar_shards
from node_checks import canon, read_as
from topology_sim import roundtrip

from streampack.dataset import PackedDataset
from streampack.nodes.stages import MapSamples, NodeStage
from streampack.options import PackOptions
from streampack.plan.state import dataset_states, record_of, state_nbytes


def _shards(tmp_path, lengths, num_shards: int = 2, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return write_tar_shards(tmp_path, [rng.integers(0, 30_000, int(n), dtype=np.uint16) for n in lengths], num_shards)


def _carried(state) -> int:
    from streampack.plan.elastic import find_state
    from streampack.plan.state import table_size

    return table_size(find_state(state["graph"], "WindowPacker")["table"])


def _state_after(ds: PackedDataset, steps: int):
    it = iter(ds)
    for _ in range(steps):
        next(it)
    return ds.state_dict(), it


def test_capacity_131072_window_1024_under_one_megabyte(tmp_path):
    # 1500 short documents never fill a 131072-token pack: the whole window stays carried, the
    # worst case for a state that stores one entry per carried sample
    lengths = np.random.default_rng(0).integers(20, 200, 3000)
    urls = _shards(tmp_path, lengths)
    # the warm-up rounds hold 64, 128, 256, 512 samples (one pack each here): the fifth pack is
    # the first of a full 1024-sample window
    state, _ = _state_after(PackedDataset(urls, capacity=131072, packing=PackOptions(window=1024)), 5)
    size = state_nbytes(state)
    assert _carried(state) >= 1000
    assert size < 1 << 20, size
    assert size / _carried(state) < 200  # bytes per carried sample, everything else included


def test_one_4m_token_document_split_does_not_blow_up_the_state(tmp_path):
    """Finding: pending chunks were stored as tokens: 28.5 MB in every checkpoint."""
    urls = _shards(tmp_path, [100, 4_000_000, 100], num_shards=1)
    make = lambda: PackedDataset(urls, capacity=4096, shuffle=False, packing=PackOptions(window=64))  # noqa: E731
    ds = make()
    state, it = _state_after(ds, 300)  # deep inside the document's 977 chunks
    assert state_nbytes(state) < 64 << 10, state_nbytes(state)
    want = [canon(next(it)) for _ in range(3)]
    resumed = make()
    resumed.load_state_dict(roundtrip(state))
    got = iter(resumed)
    assert [canon(next(got)) for _ in range(3)] == want  # the pending chunks were re-read exactly


@pytest.mark.parametrize("capacity,window", [(32768, 256), (4096, 1024)])
def test_state_does_not_grow_with_capacity_or_length(tmp_path, capacity, window):
    """Finding: capacity 32k with window 256 gave 17.6 MB per worker (tokens were stored)."""
    lengths = np.random.default_rng(1).lognormal(np.log(capacity / 8), 1.0, 2 * window).astype(int) + 1
    urls = _shards(tmp_path, lengths)
    packing = PackOptions(window=window)
    refs = max(state_nbytes(_state_after(PackedDataset(urls, capacity=capacity, packing=packing), k)[0])
               for k in (1, 4))
    node_stage = [NodeStage(lambda up: MapSamples(up, lambda s: s))]  # cannot be replayed: keeps tokens
    tokens = state_nbytes(_state_after(PackedDataset(urls, capacity=capacity, stages=node_stage,
                                                     packing=PackOptions(window=window)),
                                       1)[0])
    assert refs < 100 << 10 and tokens > 10 * refs, (refs, tokens)


def test_restore_rereads_carried_samples_over_http_with_ranged_requests(tmp_path):
    """References are re-read where they were read: over HTTP, one ranged GET per run of
    carried samples of a shard (plus the reader's own reopen), not one per sample."""
    from helpers_data import serve_directory

    local = _shards(tmp_path, np.random.default_rng(3).integers(5, 60, 120), num_shards=3)
    with serve_directory(tmp_path) as server:
        urls = server.urls_for(local)
        make = lambda: PackedDataset(urls, capacity=256, seed=1, packing=PackOptions(window=48))  # noqa: E731
        ds = make()
        state, it = _state_after(ds, 4)
        assert _carried(state) > 10
        want = [canon(next(it)) for _ in range(6)]
        del it
        server.requests.clear()
        resumed = make()
        resumed.load_state_dict(roundtrip(state))
        got = iter(resumed)
        first = canon(next(got))
        ranged = [r for _, r in server.requests if r is not None]
        assert [first] + [canon(next(got)) for _ in range(5)] == want
        assert 1 <= len(ranged) <= 2 * len(urls), server.requests


def _leaves(tree) -> int:
    """Leaves as StatefulDataLoader's incremental state counts them: dicts, lists and tuples are
    walked, everything else (a string, a tensor, a number) is one leaf."""
    if isinstance(tree, dict):
        return sum(_leaves(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_leaves(v) for v in tree)
    return 1


def test_settings_and_counters_are_one_leaf_each_in_the_per_step_state(tmp_path):
    """StatefulDataLoader flattens, diffs and rebuilds every worker's state after every batch,
    leaf by leaf: the fingerprint (36 settings) and the metrics (40 counters) were ~75 of ~155
    leaves (~5% of a 2-worker epoch's CPU: streampack.plan.state.record_text). Each is one JSON text
    now; decoded, they are the dicts they were, and the state resumes exactly."""
    urls = _shards(tmp_path, [300] * 40)

    def make() -> PackedDataset:
        return PackedDataset(urls, capacity=1024, epochs=1, packing=PackOptions(window=16))

    ds = make()
    state, it = _state_after(ds, 3)
    assert isinstance(state["fingerprint"], str) and isinstance(state["metrics"], str)
    assert _leaves({k: v for k, v in state.items() if k != "graph"}) <= 8
    assert record_of(state["fingerprint"]) == ds.fingerprint(0)
    assert record_of(state["metrics"])["batches"]["batches"] == 3
    assert dataset_states({"dataset_state": state})[0]["metrics"] == record_of(state["metrics"])
    after = [canon(next(it)) for _ in range(3)]
    restored = make()
    restored.load_state_dict(roundtrip(state))
    again = iter(restored)
    assert [canon(next(again)) for _ in range(3)] == after


NODE_RECORDS = ("config", "identity", "counters", "metrics")


def _node_records(tree, path=()):
    """Every node-level settings or counters record in a graph state, by path."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key in NODE_RECORDS and not isinstance(value, dict):
                yield path + (key,), value
            else:
                yield from _node_records(value, path + (key,))


def _as_dicts(tree):
    """The graph state with its node records as dicts (the layout before they were texts)."""
    if isinstance(tree, dict):
        return {k: (record_of(v) if k in NODE_RECORDS and isinstance(v, str) else _as_dicts(v)) for k, v in tree.items()}
    return tree


@pytest.mark.parametrize("blocks", [True, False])
def test_node_records_are_one_leaf_each_and_a_state_of_another_layout_is_refused(tmp_path, monkeypatch, blocks):
    """torchdata rebuilds every worker's state from its flat leaves in the training process after
    every batch (``_unflatten``: work per leaf and per level of its key): each reader's config and
    identity and each node's counters and metrics are one JSON text now, so a state is 44 leaves
    and 199 key levels, not 82 and 426 (streampack.plan.state.record_text). The packer's carried
    references are one tensor per named column (``state.make_table``: no column read by
    position), 6 leaves and 37 key levels more: 50 and 236. Decoded the records are the dicts
    they were. No release ever wrote another layout, so none is read: a state of the layout that
    kept them as dicts (version 3) is refused naming both versions, and so is one that claims this
    version but keeps a dict record."""
    from torchdata.stateful_dataloader.incremental_state import _flatten

    read_as(monkeypatch, blocks)
    urls = _shards(tmp_path, [300] * 40)

    def make() -> PackedDataset:
        return PackedDataset(urls, capacity=1024, epochs=1, packing=PackOptions(window=16))

    state, it = _state_after(make(), 3)
    records = dict(_node_records(state["graph"]))
    kinds = {path[-1] for path in records}
    assert kinds == set(NODE_RECORDS) and all(isinstance(v, str) for v in records.values()), records
    flat = _flatten(state)
    assert len(flat) <= 52 and sum(len(k) for k in flat) <= 242, (len(flat), sum(len(k) for k in flat))
    reader = next(v for p, v in records.items() if p[-1] == "identity")
    assert record_of(reader)["shards"] and len(record_of(reader)["sizes"]) == len(record_of(reader)["shards"])
    after = [canon(next(it)) for _ in range(3)]
    restored = make()
    restored.load_state_dict(roundtrip(state))
    again = iter(restored)
    assert [canon(next(again)) for _ in range(3)] == after
    old = {**state, "version": 3, "graph": _as_dicts(state["graph"])}
    with pytest.raises(ValueError, match=r"state version=3 is not the supported version=5; was it saved by another"):
        make().load_state_dict(roundtrip(old))
    mixed = {**state, "graph": _as_dicts(state["graph"])}
    with pytest.raises(ValueError, match=r"a state record is a dict, not the JSON text .* another streampack version"):
        restored = make()
        restored.load_state_dict(roundtrip(mixed))
        next(iter(restored))
