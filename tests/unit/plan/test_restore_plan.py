"""A restored reader takes its epoch's spans from its state (their ends and the manifest) instead of cutting the
epoch again, which reads the index of every shard a boundary falls in."""

from __future__ import annotations

import pytest
import torch
from node_checks import write_token_shards

from streampack import PackedDataset
from streampack.graph.build import make_planner, manifest_of
from streampack.io.manifest import Manifest
from streampack.options import PackOptions, ReadOptions, TopologyOptions
from streampack.plan.sharding import WorkEnds, epoch_permutation, order_positions, spans_from_ends
from streampack.settings import Placement


def _make(urls: list[str], cache: str) -> PackedDataset:
    # two ranks: each reader's range ends inside a shard, so cutting it reads that shard's index
    return PackedDataset(urls, capacity=1024, epochs=1, seed=3, packs_per_batch=2,
                         packing=PackOptions(window=16, max_wait=3), read=ReadOptions(cache_dir=cache),
                         topology=TopologyOptions(dp_rank=1, dp_size=2, equal_batches="sync"))


def test_a_restored_planned_reader_reads_no_index_before_its_first_batch(tmp_path, monkeypatch):
    urls, _ = write_token_shards(tmp_path / "shards", 300, 5, mean=120)
    cache = str(tmp_path / "cache")
    ds = _make(urls, cache)
    it = iter(ds)
    for _ in range(4):
        next(it)
    state = ds.state_dict()
    want = [b.input_ids for b in it]
    assert want, "the state must be taken mid-epoch"

    loads: list[int] = []
    real = Manifest.load_index
    monkeypatch.setattr(Manifest, "load_index", lambda self, i, *a, **k: loads.append(i) or real(self, i, *a, **k))
    fresh = _make(urls, cache)
    fresh.load_state_dict(state)
    got = iter(fresh)
    batches = [next(got)]
    assert loads == []  # cutting the epoch again read the index of the shard its boundary falls in
    batches += list(got)
    assert len(batches) == len(want)
    for a, b in zip(batches, want):
        assert torch.equal(a.input_ids, b)


@pytest.mark.parametrize("seed", [0, 1, *(pytest.param(s, marks=pytest.mark.slow) for s in range(2, 6))])
def test_spans_from_ends_rebuild_every_readers_planned_spans(tmp_path, seed):
    urls, _ = write_token_shards(tmp_path, 200, 7, mean=60, seed=seed)
    ds = PackedDataset(urls, capacity=512, epochs=1, seed=seed, read=ReadOptions(cache_dir=str(tmp_path / "c")))
    manifest = manifest_of(ds.config, ds.sources)
    planner = make_planner(ds.config, ds.sources, Placement(dp_size=3, num_workers=2), count=False)
    checked = 0
    for epoch in range(2):
        for g in range(6):
            spans = planner.spans(epoch, g)
            if not spans:
                continue
            ends = WorkEnds(head=spans[0], tail=spans[-1], spans=len(spans))
            assert planner.spans_from_ends(epoch, ends) == spans
            checked += 1
            if len(spans) > 2:  # ends cut from another order do not add up: refused, not guessed
                other = epoch_permutation(len(urls), seed=seed, epoch=epoch, shuffle=True)[::-1].copy()
                assert spans_from_ends(ends, other, order_positions(other), manifest.samples) is None
    assert checked >= 6
