"""Finite epochs over several ranks with no number to guess (issue 11, build item 1).

Ranks are simulated in-process (one PackedDataset per rank with explicit ``dp_rank`` /
``dp_size``) and read through real DataLoader workers.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers_data import make_text_docs, make_token_docs, write_jsonl_shards, write_tar_shards
from node_checks import (
    ListSource,
    collect_documents,
    lognormal_lengths,
    make_samples,
    write_token_shards,
)
from torch.utils.data import DataLoader

from streampack import check_invariants
from streampack.dataset import PackedDataset
from streampack.nodes.collate import BatchLayout, ThdCollate, is_filler
from streampack.nodes.overlong import OverlongNode
from streampack.nodes.window_packer import WindowPacker
from streampack.options import PackOptions, ReadOptions, TopologyOptions
from streampack.packing.window_rounds import PackerRules, count_packs

CAP = 512


@pytest.fixture(scope="module")
def few_shards(tmp_path_factory):
    # 6 shards of long-tail documents: whole-shard assignment left some of 4 x 2 readers a
    # whole shard and others half of one; the plan balances samples instead
    urls, docs = write_token_shards(tmp_path_factory.mktemp("few"), 360, 6, mean=140, seed=4, max_len=3 * CAP)
    list(PackedDataset(urls, capacity=CAP, epochs=1, packing=PackOptions(window=16)))  # compile the packer pre-fork
    return urls, docs


def _ranks(urls, dp_size: int, num_workers: int, *, batches_per_epoch: int | None = None, **kw) -> list[list]:
    out = []
    for rank in range(dp_size):
        ds = PackedDataset(urls, capacity=CAP, epochs=1, seed=5, packs_per_batch=2, packing=PackOptions(window=32),
                           topology=TopologyOptions(dp_rank=rank, dp_size=dp_size, batches_per_epoch=batches_per_epoch,
                                                    equal_batches="count"), **kw)
        out.append(list(DataLoader(ds, batch_size=None, num_workers=num_workers)))
    return out


@pytest.mark.parametrize("dp_size,num_workers", [(3, 0), (2, 2), pytest.param(3, 2, marks=pytest.mark.slow),
                                                 pytest.param(2, 3, marks=pytest.mark.slow),
                                                 pytest.param(4, 2, marks=pytest.mark.slow)])
def test_equal_batch_counts_and_every_sample_once_without_batches_per_epoch(few_shards, dp_size, num_workers):
    """Finding: finite mode with dp_size > 1 needed a guessed batches_per_epoch (too small: the
    run died at the end of the epoch; too large: ranks trained on fillers)."""
    urls, docs = few_shards
    ranks = _ranks(urls, dp_size, num_workers)
    assert len({len(r) for r in ranks}) == 1, [len(r) for r in ranks]
    batches = [b for r in ranks for b in r]
    for b in batches:
        check_invariants(b)
        assert b.total_tokens == 2 * CAP  # every batch, fillers and the last one included
    assert collect_documents(batches) == {f"{i:08d}": d for i, d in enumerate(docs)}
    fillers = [b for b in batches if is_filler(b)]
    assert all(b.num_targets == 0 for b in fillers)
    # as few fillers as the balanced split allows: a few per epoch, not a guessed margin
    assert len(fillers) <= 2 * dp_size, len(fillers)


def test_plan_is_reported_and_fillers_counted(few_shards):
    urls, _ = few_shards
    counts, fillers = [], 0
    for rank in range(3):
        ds = PackedDataset(urls, capacity=CAP, epochs=1, seed=5, packing=PackOptions(window=32),
                           topology=TopologyOptions(dp_rank=rank, dp_size=3, equal_batches="count"))
        counts.append(sum(1 for _ in ds))
        plan, got = ds.metrics()["plan"], ds.metrics()["batches"]
        assert plan["quota"] == counts[-1] and plan["batches"] == got["batches"] - got["fillers"]
        assert plan["fillers_all_ranks"] >= plan["min_fillers_all_ranks"] >= 0
        fillers += got["fillers"]
    assert len(set(counts)) == 1 and fillers == plan["fillers_all_ranks"]


def test_fillers_have_the_shape_of_every_batch():
    """Finding: a filler batch had ``capacity`` tokens instead of ``packs_per_batch * capacity``,
    so ranks saw different shapes in the same step."""
    samples = make_samples([CAP] * 7)  # 7 full packs: batches of 3, 3, then 1 + 2 filler packs
    source = WindowPacker(OverlongNode(ListSource(samples), CAP, "split"), rules=PackerRules(capacity=CAP, window=16))
    batches = list(ThdCollate(source, layout=BatchLayout(capacity=CAP, packs_per_batch=3), num_batches=10))
    assert len(batches) == 10 and sum(is_filler(b) for b in batches) >= 1
    assert {b.total_tokens for b in batches} == {3 * CAP} and {b.num_packs for b in batches} == {3}
    partial = [b for b in batches if not is_filler(b) and "<filler>" in b.doc_keys]
    assert partial and all(b.num_targets > 0 for b in partial)  # the last real batch, completed


def test_explicit_batches_per_epoch_still_overrides(few_shards):
    urls, _ = few_shards
    ranks = _ranks(urls, 2, 0, batches_per_epoch=40)
    assert [len(r) for r in ranks] == [40, 40]
    with pytest.raises(ValueError, match="more than num_batches=3"):
        _ranks(urls, 2, 0, batches_per_epoch=3)


@pytest.mark.parametrize("seed", range(6))
def test_plan_counts_exactly_the_packs_the_node_emits(seed):
    """The plan simulates the packer on lengths alone: it must agree with the node."""
    rng = np.random.default_rng(seed)
    cap = int(rng.choice([64, 100, 256]))
    align = int(rng.choice([1, 4])) if cap % 4 == 0 else 1
    lengths = lognormal_lengths(int(rng.integers(0, 400)), mean=cap / 4, seed=seed, max_len=cap)
    carry = lognormal_lengths(int(rng.integers(0, 40)), mean=cap / 3, seed=seed + 7, max_len=cap)
    rules = PackerRules(capacity=cap, window=int(rng.choice([1, 8, 32])), align=align, seed=seed,
                        max_wait=int(rng.integers(1, 5)), algorithm=str(rng.choice(["bfd", "ffd", "kk"])))
    from streampack.plan.state import samples_to_table

    node = WindowPacker(ListSource(make_samples(lengths)), rules=rules,  # the very rules the plan counts with
                        carry=samples_to_table(make_samples(carry)))
    assert count_packs(rules, lengths, carry) == sum(1 for _ in node)


@pytest.mark.parametrize("seed", range(6))
def test_plan_counts_the_warmup_rounds_exactly(seed):
    """The warm-up ramps the window (warmup, 2*warmup, ... up to window): the plan must count the
    node's packs through it, a carried window (elastic resume) included."""
    rng = np.random.default_rng(100 + seed)
    cap = int(rng.choice([64, 256]))
    lengths = lognormal_lengths(int(rng.integers(50, 1500)), mean=cap / 4, seed=seed, max_len=cap)
    carry = lognormal_lengths(int(rng.integers(0, 200)), mean=cap / 3, seed=seed + 7, max_len=cap)
    rules = PackerRules(capacity=cap, window=int(rng.choice([96, 256, 512])), seed=seed,
                        max_wait=int(rng.integers(1, 9)), warmup=int(rng.choice([1, 4, 16, 64])),
                        algorithm=str(rng.choice(["bfd", "ffd", "kk"])))
    from streampack.plan.state import samples_to_table

    node = WindowPacker(ListSource(make_samples(lengths)), rules=rules,
                        carry=samples_to_table(make_samples(carry)))
    assert count_packs(rules, lengths, carry) == sum(1 for _ in node)
    assert node.metrics["rounds"] >= 2  # the ramp ran (not one flush round)


def test_equal_batch_counts_with_the_default_warmup(few_shards):
    """window=256 > the default warm-up (64): the plan counts the ramping rounds of every reader."""
    urls, docs = few_shards
    ranks = [list(PackedDataset(urls, capacity=CAP, epochs=1, seed=5, packs_per_batch=2,
                                packing=PackOptions(window=256),
                                topology=TopologyOptions(dp_rank=r, dp_size=3, equal_batches="count")))
             for r in range(3)]
    assert len({len(r) for r in ranks}) == 1, [len(r) for r in ranks]
    assert collect_documents([b for r in ranks for b in r]) == {f"{i:08d}": d for i, d in enumerate(docs)}


def test_text_shards_over_ranks_need_sync_or_a_count(tmp_path):
    """Text has no token lengths before tokenizing: the plan cannot count, so it says what to do."""
    urls = write_jsonl_shards(tmp_path, make_text_docs(20), 2)
    with pytest.raises(ValueError, match="equal_batches='sync'"):
        PackedDataset(urls, capacity=CAP, epochs=1, tokenizer=lambda t: [ord(c) for c in t],
                      topology=TopologyOptions(dp_rank=0, dp_size=2, equal_batches="count"))
    PackedDataset(urls, capacity=CAP, epochs=1, tokenizer=lambda t: [ord(c) for c in t],
                  topology=TopologyOptions(dp_rank=0, dp_size=2, equal_batches="sync"))
    PackedDataset(urls, capacity=CAP, epochs=1, tokenizer=lambda t: [ord(c) for c in t],
                  topology=TopologyOptions(dp_rank=0, dp_size=2, batches_per_epoch=4))


def _passes(ds, num_workers: int, passes: int = 2) -> list[list[tuple]]:
    loader = DataLoader(ds, batch_size=None, num_workers=num_workers)
    return [[b.doc_keys for b in loader] for _ in range(passes)]


def test_reiterating_reshuffles_identically_with_any_worker_count(tmp_path):
    """Finding: re-iterating a finite loader reshuffled with num_workers=0 but repeated the same
    order with workers (each pass's workers started from the main process's pass counter)."""
    urls = write_tar_shards(tmp_path, [[i] * (1 + i % 7) for i in range(60)], 6)
    make = lambda: PackedDataset(urls, capacity=32, epochs=1, seed=3, packing=PackOptions(window=8))  # noqa: E731
    main, one, two = _passes(make(), 0), _passes(make(), 1), _passes(make(), 2)
    for run in (main, one, two):
        assert run[0] != run[1], "the second pass must reshuffle"
    assert one == main  # one reader either way: the very same stream, pass after pass
    assert sorted(k for b in two[1] for k in b) == sorted(k for b in main[1] for k in b)
    ds = make()
    ds.set_epoch(1)  # choose the pass explicitly, as with DistributedSampler
    assert _passes(ds, 2, passes=1)[0] == two[1]


def test_one_reader_reads_a_finite_epoch_without_building_indexes(few_shards, monkeypatch) -> None:
    # before: a finite epoch on one rank with no workers indexed every shard (a full extra read,
    # 2.8 s of a 5.9 s epoch in benchmarks/bench_pipeline.py) to plan a split there is no one to share
    import streampack.graph.build as graph

    urls, docs = few_shards
    want = collect_documents(PackedDataset(urls, capacity=CAP, epochs=1, packing=PackOptions(window=16)))

    def refuse(*args, **kwargs):
        raise AssertionError("a single reader must not need the shard index")

    monkeypatch.setattr(graph, "obtain_manifest", refuse)
    monkeypatch.setattr(graph, "make_planner", refuse)
    assert collect_documents(PackedDataset(urls, capacity=CAP, epochs=1, packing=PackOptions(window=16))) == want
    reshuffled = collect_documents(PackedDataset(urls, capacity=CAP, epochs=1, seed=5, packing=PackOptions(window=16)))
    assert reshuffled == want and list(reshuffled) != list(want)  # every document once, in another order


def test_an_empty_record_is_skipped_and_counted_by_the_plan(tmp_path):
    """Finding (issue 17, 3c): one pre-tokenized record with 0 tokens crashed every rank of a
    planned finite run, on_error='skip' included (``lengths[8]=0 must be >= 1`` at the first
    ``next()``, naming no shard): the plan made it a 0-length chunk. It is skipped and counted
    (``empty_sample``) as one reader does, and the counts stay equal and exact."""
    docs = make_token_docs(40, seed=3, max_len=60)
    docs[8] = []
    urls = write_tar_shards(tmp_path, docs, 3)
    ranks, errors = [], 0
    for rank in range(2):
        ds = PackedDataset(urls, capacity=64, epochs=1, seed=1, read=ReadOptions(on_error="skip"),
                           packing=PackOptions(window=8),
                           topology=TopologyOptions(dp_rank=rank, dp_size=2, equal_batches="count"))
        ranks.append(list(ds))
        errors += ds.metrics()["errors"]["counts"].get("empty_sample", 0)
        assert ds.metrics()["plan"]["batches"] == ds.metrics()["batches"]["batches"] - ds.metrics()["batches"]["fillers"]
    assert errors == 1 and len({len(r) for r in ranks}) == 1
    want = {f"{i:08d}": d for i, d in enumerate(docs) if d}
    assert collect_documents([b for r in ranks for b in r]) == want


def test_remote_shards_without_a_manifest_are_refused_naming_the_command(tmp_path):
    """Planning over several readers needs the data set's manifest; building it in every job
    would read the whole data set (issue 17): remote shards without ``manifest=`` are refused
    at construction, naming ``streampack index``; with one the run plans from it."""
    from helpers_data import serve_directory

    from streampack.io.manifest import build_manifest

    docs = make_token_docs(30, seed=2, max_len=50)
    write_tar_shards(tmp_path / "d", docs, 3)
    with serve_directory(tmp_path / "d") as server:
        urls = [f"{server.url}/{p.name}" for p in sorted((tmp_path / "d").iterdir())]
        with pytest.raises(ValueError, match="streampack index"):
            PackedDataset(urls, capacity=64, epochs=1, topology=TopologyOptions(dp_rank=0, dp_size=2))
        build_manifest(urls, str(tmp_path / "m"))
        got = [list(PackedDataset(urls, capacity=64, epochs=1, read=ReadOptions(manifest=str(tmp_path / "m")),
                                  topology=TopologyOptions(dp_rank=r, dp_size=2, equal_batches="count")))
               for r in range(2)]
    assert len(got[0]) == len(got[1])
    assert collect_documents(got[0] + got[1]) == {f"{i:08d}": d for i, d in enumerate(docs)}
