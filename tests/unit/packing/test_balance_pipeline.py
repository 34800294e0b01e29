"""Cost model and cost-balanced emission through PackedDataset (issue 14, items 1-2): the batch's
estimated cost and the readers' totals, exact resume under StatefulDataLoader, equal batch
counts over ranks, epochs continuing the schedule, and the settings' validation."""

from __future__ import annotations

import numpy as np
import pytest
from node_checks import canon, collect_documents, take, write_token_shards
from topology_sim import SimRank
from torchdata.stateful_dataloader import StatefulDataLoader

from streampack import check_invariants
from streampack.dataset import PackedDataset
from streampack.graph.build import build_graph
from streampack.integrations.metrics import StreamMetrics
from streampack.nodes.collate import is_filler
from streampack.options import CostOptions, PackOptions, TopologyOptions
from streampack.packing import CostModel
from streampack.packing.schedule import Balance
from streampack.plan.elastic import find_state
from streampack.settings import Placement
from tests.unit.plan.test_resume import _interrupted
from tests.unit.plan.test_topology_finite import _ranks

SHAPE = {"hidden": 64, "layers": 2, "heads": 4, "ffn": 128}
MODEL = CostModel.from_shape(**SHAPE)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_token_shards(tmp_path_factory.mktemp("balance"), 240, 6, mean=90, seed=5)


def test_every_batch_carries_its_estimated_cost(shards) -> None:
    """Finding: a PackedBatch said how many tokens it held but not how much work they are."""
    urls, _ = shards
    n = len(list(PackedDataset(urls, capacity=256, packs_per_batch=2, epochs=1, packing=PackOptions(window=24))))
    ds = PackedDataset(urls, capacity=256, packs_per_batch=2, epochs=1, packing=PackOptions(window=24),
                       topology=TopologyOptions(batches_per_epoch=n + 1), cost=CostOptions(model=SHAPE))
    batches = list(ds)
    metrics = StreamMetrics()
    for b in batches:
        check_invariants(b)
        real = [n for n, k in zip(b.doc_lengths.tolist(), b.doc_keys) if k != "<filler>"]
        assert b.est_cost == pytest.approx(MODEL.linear * sum(real) + MODEL.attention * sum(n * n for n in real))
        metrics.update(b)
    assert is_filler(batches[-1]) and batches[-1].est_cost == 0  # filler packs cost nothing
    total = sum(b.est_cost for b in batches)
    assert batches[-1].stats.cost == pytest.approx(total) == ds.metrics()["batches"]["cost"]
    assert metrics.scalars()["streampack/cost"] == pytest.approx(total)
    assert ds.filler().est_cost == 0.0  # what sync_batches feeds a rank that ran out
    assert PackedDataset(urls, capacity=256).filler().est_cost is None  # no cost model: not estimated
    assert list(PackedDataset(urls, capacity=256, epochs=1))[0].est_cost is None


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])  # 2: ~3 s, -m slow
def test_balanced_stream_resumes_exactly_after_three_interruptions(shards, num_workers: int) -> None:
    urls, _ = shards
    kw = {"cost": CostOptions(model=SHAPE, balance=Balance(reservoir=6))}
    total = 60  # an infinite stream over ~1.5 epochs of this tiny dataset: the stops cross one
    make = lambda **more: PackedDataset(urls, capacity=256, packs_per_batch=2, seed=7,
                                        packing=PackOptions(window=24, max_wait=3), **more)
    full = [canon(b) for b in take(iter(StatefulDataLoader(make(**kw), batch_size=None,
                                                            num_workers=num_workers)), total)]
    stops = sorted(np.random.default_rng(num_workers + 3).choice(np.arange(3, total - 3), 3, replace=False).tolist())
    assert _interrupted(urls, num_workers, stops, total, **kw) == full
    if num_workers == 0:  # balance changed the order: the comparison is not vacuous
        assert [canon(b) for b in take(iter(make(cost=CostOptions(model=SHAPE))), total)] != full


def test_balanced_finite_resume_across_epochs_and_changed_settings_refused(shards) -> None:
    urls, _ = shards
    kw = {"epochs": 2, "cost": CostOptions(model=SHAPE, balance="cost")}
    first = PackedDataset(urls, capacity=256, packs_per_batch=2, seed=7, packing=PackOptions(window=24, max_wait=3),
                          **kw)
    full = [canon(b) for b in StatefulDataLoader(first, batch_size=None)]
    n = len(full)
    assert _interrupted(urls, 0, [5, n // 2, n // 2 + 3], n + 5, **kw) == full
    ds = PackedDataset(urls, capacity=256, packs_per_batch=2, packing=PackOptions(window=24), **kw)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    for other in (CostOptions(model=SHAPE), CostOptions(model=SHAPE, balance=Balance(reservoir=9)),
                  CostOptions(model={**SHAPE, "layers": 3}, balance="cost")):
        with pytest.raises(ValueError, match="cannot resume"):
            PackedDataset(urls, capacity=256, packs_per_batch=2, packing=PackOptions(window=24),
                          **{**kw, "cost": other}).load_state_dict(state)


@pytest.mark.parametrize("dp_size,num_workers", [(3, 0), (2, 2)])
def test_equal_batch_counts_over_ranks_with_balance(dp_size: int, num_workers: int, tmp_path) -> None:
    """The plan counts the packer's batches from the index; balance reorders and regroups packs
    but never adds or drops one, so every rank still yields the same count, each sample once."""
    urls, docs = write_token_shards(tmp_path, 360, 6, mean=140, seed=4, max_len=1536)
    ranks = _ranks(urls, dp_size, num_workers, cost=CostOptions(model=SHAPE, balance=Balance(reservoir=6)))
    assert len({len(r) for r in ranks}) == 1, [len(r) for r in ranks]
    batches = [b for r in ranks for b in r]
    assert collect_documents(batches) == {f"{i:08d}": d for i, d in enumerate(docs)}
    assert all(b.total_tokens == 1024 for b in batches) and sum(is_filler(b) for b in batches) <= 2 * dp_size


def test_a_new_epoch_continues_the_schedule_and_the_histogram(shards) -> None:
    """Each epoch has its own packer; with balance it starts where the previous epoch's left
    off (batches yielded, fillers included, and the cost histogram), so a rank's steps stay
    aligned with the other ranks' and the targets stay informed."""
    urls, _ = shards
    ds = PackedDataset(urls, capacity=256, packs_per_batch=2, epochs=2, packing=PackOptions(window=24),
                       cost=CostOptions(model=SHAPE, balance="cost"))
    graph = build_graph(ds.config, ds.sources, Placement(dp_size=1))
    graph.root.reset(None)
    first = 0
    while graph.loop.epoch == 0:
        before = graph.nodes["packer"].reservoir
        next(graph.root)
        first += 1
    res = graph.nodes["packer"].reservoir
    assert res is not before and res.first_batch == first - 1  # the batch just taken is the new epoch's first
    assert (res.counts >= before.counts).all() and res.counts.sum() > before.counts.sum() > 0


def test_settings_are_validated(shards, tmp_path) -> None:
    urls, _ = shards
    with pytest.raises(ValueError, match=r"CostOptions\(balance='cost'\) needs model="):
        PackedDataset(urls, capacity=256, cost=CostOptions(balance="cost"))
    with pytest.raises(ValueError, match="balance="):
        PackedDataset(urls, capacity=256, cost=CostOptions(balance="tokens", model=SHAPE))
    with pytest.raises(ValueError, match="model shape"):
        PackedDataset(urls, capacity=256, cost=CostOptions(model={"hidden": 64}))
    with pytest.raises(TypeError, match=r"CostOptions\(model=...\): must be a CostModel"):
        PackedDataset(urls, capacity=256, cost=CostOptions(model=3))
    from streampack.cli.main import main

    out = tmp_path / "packed"
    assert main(["pack", *urls, "--out", str(out), "--capacity", "256", "--no-progress"]) == 0
    with pytest.raises(ValueError, match="streampack pack"):
        PackedDataset(str(out), capacity=256, cost=CostOptions(model=SHAPE, balance="cost"))
    ds = PackedDataset(urls, capacity=256, cost=CostOptions(model=MODEL, balance="cost"))
    assert ds.fingerprint(0)["balance"] == {"reservoir": 64, "max_hold": None, "tail": 0.1, "over": 0.2,
                                            "tolerance": 0.02}


@pytest.mark.parametrize("a,b,c,d,steps", [(2, 2, 3, 1, 3), (3, 0, 1, 2, 4)])
def test_elastic_resume_hands_the_reservoirs_on(a: int, b: int, c: int, d: int, steps: int, tmp_path) -> None:
    """The packs waiting in every old reader's reservoir are unemitted data: an elastic resume
    hands them to the new readers like the window's carry, so every chunk is trained once."""
    from tests.unit.plan.test_elastic import _chunks, _new_run, _old_run

    urls, _ = write_token_shards(tmp_path, 300, 5, mean=110, seed=3, max_len=768)
    make = lambda r, size: PackedDataset(urls, capacity=256, epochs=1, seed=2,
                                         packing=PackOptions(window=8, max_wait=3),
                                         topology=TopologyOptions(dp_rank=r, dp_size=size, equal_batches="count"),
                                         cost=CostOptions(model=SHAPE, balance=Balance(reservoir=5)))
    consumed, states = _old_run(make, a, b, steps)
    held = [find_state(s["graph"], "WindowPacker") for s in states if s["graph"] is not None]
    assert sum(int(p["pack_sizes"].numel()) for p in held) > 0, "reservoirs must hold packs at the save point"
    got, counts = _new_run(make, c, d, states)
    assert len(set(counts)) == 1
    full = [x for r in range(a) for x in SimRank(lambda r=r: make(r, a), b)]
    assert _chunks(consumed + got) == _chunks(full) and max(_chunks(full).values()) == 1
