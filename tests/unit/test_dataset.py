"""PackedDataset: DataLoader workers, collate, validation, fingerprints, stages, passes."""

from __future__ import annotations

import io

import pytest
import torch
from helpers_hostile import closing_workers
from node_checks import canon, collect_documents, write_token_shards
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streampack import PackedBatch, check_invariants
from streampack.dataset import PackedDataset
from streampack.nodes.stages import MapSamples, NodeStage
from streampack.options import PackOptions, ReadOptions, TopologyOptions
from streampack.plan.state import check_loader_state, dataset_states, load_loader_state

CAP = 512


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_token_shards(tmp_path_factory.mktemp("shards"), 400, 8, mean=120, seed=0)


def _expected(docs) -> dict[str, list[int]]:
    return {f"{i:08d}": d for i, d in enumerate(docs)}


@pytest.mark.parametrize("num_workers", [0, 1, 2, 4])
def test_dataloader_covers_epoch(shards, num_workers: int) -> None:
    urls, docs = shards
    ds = PackedDataset(urls, capacity=CAP, packs_per_batch=2, epochs=1, seed=3, packing=PackOptions(window=32))
    loader = DataLoader(ds, batch_size=None, num_workers=num_workers)
    batches = list(loader)
    assert batches and all(isinstance(b, PackedBatch) for b in batches)  # survives default_convert
    for b in batches:
        check_invariants(b)
        assert b.num_packs in (1, 2)
    assert collect_documents(batches) == _expected(docs)


def test_pin_memory_option_and_loader_pin(shards) -> None:
    urls, _ = shards
    ds = PackedDataset(urls, capacity=CAP, epochs=1, packing=PackOptions(window=8, pin_memory=True))
    assert isinstance(next(iter(ds)), PackedBatch)  # no-op without CUDA


def test_state_weights_only_roundtrip_and_size(shards) -> None:
    urls, _ = shards
    ds = PackedDataset(urls, capacity=CAP, packing=PackOptions(window=64))
    it = iter(ds)
    for _ in range(5):
        next(it)
    state = ds.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert buf.tell() < 4 << 20
    want = [canon(next(it)) for _ in range(5)]
    other = PackedDataset(urls, capacity=CAP, packing=PackOptions(window=64))
    other.load_state_dict(loaded)
    assert other.state_dict() is loaded
    it2 = iter(other)
    assert [canon(next(it2)) for _ in range(5)] == want


def test_fingerprint_mismatch_names_both_values(shards) -> None:
    urls, _ = shards
    ds = PackedDataset(urls, capacity=CAP, seed=1, packing=PackOptions(window=16))
    next(iter(ds))
    state = ds.state_dict()
    for kwargs, pattern in [({"capacity": 2 * CAP}, "capacity: saved 512, now 1024"),
                            ({"seed": 2}, "seed: saved 1, now 2"),
                            ({"topology": TopologyOptions(dp_rank=0, dp_size=2)}, "dp_size: saved 1, now 2"),
                            ({"packing": PackOptions(window=32)}, "window: saved 16, now 32")]:
        other = PackedDataset(urls, **{"capacity": CAP, "packing": PackOptions(window=16), "seed": 1, **kwargs})
        with pytest.raises(ValueError, match=pattern):
            other.load_state_dict(state)
    # num_workers: the dataset refuses in the worker, the loader helper refuses up front
    other = PackedDataset(urls, capacity=CAP, seed=1, packing=PackOptions(window=16))
    other.load_state_dict(state)
    loader = DataLoader(other, batch_size=None, num_workers=1)
    with pytest.raises(ValueError, match="num_workers: saved 0, now 1"), closing_workers(iter(loader)) as batches:
        list(batches)
    loader = StatefulDataLoader(PackedDataset(urls, capacity=CAP, packing=PackOptions(window=16)), batch_size=None,
                                num_workers=2)
    with closing_workers(iter(loader)) as it:
        next(it)
        loader_state = loader.state_dict()
    assert len(dataset_states(loader_state)) == 2
    with pytest.raises(ValueError, match="num_workers=2.*num_workers=1"):
        load_loader_state(StatefulDataLoader(ds, batch_size=None, num_workers=1), loader_state)
    check_loader_state(loader_state, 2)


@pytest.mark.parametrize("kwargs, pattern", [  # lambdas: a record checks its values when it is made
    (lambda: {"packing": PackOptions(algorithm="nope")}, "unknown packing algorithm"),
    (lambda: {"topology": TopologyOptions(cp_size=2), "capacity": 510}, "capacity=510 must be a multiple of align=4"),
    (lambda: {"packing": PackOptions(overlong="chop")}, "overlong='chop'"),
    (lambda: {"packing": PackOptions(window=0)}, "window=0"),
    (lambda: {"packs_per_batch": 0}, "packs_per_batch=0"),
    (lambda: {"read": ReadOptions(on_error="ignore")}, "on_error='ignore'"),
    (lambda: {"topology": TopologyOptions(batches_per_epoch=5)}, "needs a finite stream"),
    (lambda: {"epochs": 1, "topology": TopologyOptions(dp_rank=0, dp_size=2, equal_batches="guess")},
     "equal_batches='guess'"),
    (lambda: {"tokenizer": "/no/such/tokenizer.json"}, "does not exist"),
])
def test_validation(shards, kwargs, pattern) -> None:
    urls, _ = shards
    with pytest.raises(ValueError, match=pattern):
        PackedDataset(urls, **{"capacity": CAP, **kwargs()})


def test_stages_function_drop_and_node(shards) -> None:
    urls, docs = shards
    keep_even = lambda s: s if int(s.key) % 2 == 0 else None  # noqa: E731
    double = NodeStage(lambda up: MapSamples(up, lambda s: s))
    ds = PackedDataset(urls, capacity=CAP, epochs=1, stages=[keep_even, double], packing=PackOptions(window=32))
    got = collect_documents(ds)
    assert got == {k: v for k, v in _expected(docs).items() if int(k) % 2 == 0}
    assert ds.metrics()["stages"][0]["dropped"] == len(docs) // 2
    with pytest.raises(TypeError, match="node instance"):
        PackedDataset(urls, capacity=CAP, stages=[MapSamples(None, keep_even)])


def test_fresh_iter_starts_new_pass_and_stale_iterator_refuses(shards) -> None:
    urls, docs = shards
    ds = PackedDataset(urls, capacity=CAP, epochs=1, packing=PackOptions(window=32))
    first = list(ds)
    second = list(ds)  # not empty: a new pass with a new shard order
    assert collect_documents(second) == _expected(docs)
    assert [b.doc_keys for b in first] != [b.doc_keys for b in second]
    it = iter(ds)
    next(it)
    ds.load_state_dict(ds.state_dict())
    with pytest.raises(RuntimeError, match="superseded"):
        next(it)


def test_metrics_exposed(shards) -> None:
    urls, _ = shards
    ds = PackedDataset(urls, capacity=CAP, epochs=1, packing=PackOptions(window=32),
                       topology=TopologyOptions(batches_per_epoch=400))
    n = sum(1 for _ in ds)
    m = ds.metrics()
    assert n == 400 and m["batches"]["fillers"] == 400 - (m["batches"]["batches"] - m["batches"]["fillers"])
    assert 0.9 < m["packing"]["fill"] <= 1 and m["overlong"]["samples_split"] >= 0
    assert m["errors"]["total"] == 0


def test_fingerprint_knows_which_tokenizer(tmp_path) -> None:
    """A state made with one vocabulary must not resume under another (ids would change)."""
    from helpers_data import make_text_docs, write_tar_shards

    urls = write_tar_shards(tmp_path / "text", make_text_docs(20, seed=0), 2, fmt="txt")
    from tokenizers import Tokenizer, models, pre_tokenizers

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path, vocab in ((a, {"[UNK]": 0, "w": 1}), (b, {"[UNK]": 0, "w": 2, "x": 1})):
        tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(path))

    def ds(tok, pad_id=0):
        return PackedDataset(urls, capacity=CAP, tokenizer=tok, packing=PackOptions(window=8, pad_id=pad_id))

    saved = ds(str(a)).fingerprint(0)
    from streampack.plan.state import check_fingerprint

    check_fingerprint(saved, ds(str(a)).fingerprint(0))
    with pytest.raises(ValueError, match="tokenizer: saved 'sha1:"):
        check_fingerprint(saved, ds(str(b)).fingerprint(0))
    with pytest.raises(ValueError, match="pad_id: saved 0, now 3"):
        check_fingerprint(saved, ds(str(a), pad_id=3).fingerprint(0))
    assert ds(len).fingerprint(0)["tokenizer"] == "builtins.len"


def test_main_process_state_dict_refuses_while_workers_read(shards) -> None:
    """Finding: with a plain DataLoader and workers, ``ds.state_dict()`` in the main process
    silently returned the start position; the checkpoint failed only at resume, with a
    misleading ``num_workers: saved 0, now 2``."""
    urls, _ = shards
    ds = PackedDataset(urls, capacity=CAP, packing=PackOptions(window=16))
    start = ds.state_dict()  # before anything ran, the start position is the truth
    assert start["graph"] is None and start["passes"] == 0
    it = iter(DataLoader(ds, batch_size=None, num_workers=2))
    next(it)
    with pytest.raises(RuntimeError, match="StatefulDataLoader"):
        ds.state_dict()
    del it
    main_only = PackedDataset(urls, capacity=CAP, packing=PackOptions(window=16))
    first = next(iter(DataLoader(main_only, batch_size=None, num_workers=0)))
    assert main_only.state_dict()["graph"] is not None and first.num_docs > 0


@pytest.mark.slow  # three loaders with worker processes
def test_a_loaded_state_is_used_once_per_reader(shards) -> None:
    """A state loaded into the dataset before a loader with workers resumes that iteration
    only; iterating the loader again starts the next pass instead of the checkpoint again.
    (A plain DataLoader restarts its round-robin at worker 0, so the workers' exact streams
    interleave differently from StatefulDataLoader's; compare them as multisets.)"""
    urls, _ = shards
    ds16 = PackedDataset(urls, capacity=CAP, epochs=1, packing=PackOptions(window=16))
    loader = StatefulDataLoader(ds16, batch_size=None, num_workers=2)
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    states = dataset_states(loader.state_dict())
    del it
    ds = PackedDataset(urls, capacity=CAP, epochs=1, packing=PackOptions(window=16))
    ds.load_state_dict(states)  # every worker's state: picks its own on the same topology
    plain = DataLoader(ds, batch_size=None, num_workers=2)
    resumed = list(plain)
    full = list(StatefulDataLoader(PackedDataset(urls, capacity=CAP, epochs=1, packing=PackOptions(window=16)),
                                   batch_size=None, num_workers=2))
    assert sorted(canon(b) for b in head + resumed) == sorted(canon(b) for b in full)
    again = list(plain)  # the next pass, not the checkpoint's rest once more
    assert collect_documents(again) == collect_documents(full)
    assert [canon(b) for b in again] != [canon(b) for b in full]
