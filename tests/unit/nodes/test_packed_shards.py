"""Offline packing (`streampack pack`) and PackedShardReader: conservation, refusal, state."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
from helpers_data import make_token_docs, write_jsonl_shards, write_tar_shards
from node_checks import check_save_load

from streampack.cli.main import main
from streampack.io.packed_format import is_packed_dataset, read_manifest
from streampack.layout.batch import check_invariants, pack_batch
from streampack.nodes.collate import BatchLayout
from streampack.nodes.packed_reader import PackedShardReader
from streampack.options import PackOptions, ReadOptions, TokenizeOptions, TopologyOptions
from streampack.options.topology import Placement


def _pack(tmp_path: Path, docs, *, capacity: int, extra: list[str] = (), num_shards: int = 3, **kw) -> Path:
    paths = write_tar_shards(tmp_path / "in", docs, num_shards, **kw)
    out = tmp_path / "packed"
    rc = main(["pack", *paths, "--out", str(out), "--capacity", str(capacity),
               "--packs-per-shard", "7", "--no-progress", *extra])
    assert rc == 0
    return out


def _by_key(packs) -> dict[str, np.ndarray]:
    docs = {}
    for pack in packs:
        for s in pack:
            assert s.doc_key not in docs, f"document {s.doc_key} read twice"
            docs[s.doc_key] = s
    return docs


@pytest.mark.parametrize("algorithm", ["bfd", "ffs", "greedy"])
def test_pack_conserves_every_document(tmp_path, algorithm):
    docs = make_token_docs(200, seed=1, max_len=120)
    out = _pack(tmp_path, docs, capacity=256, extra=["--algorithm", algorithm])
    m = read_manifest(out)
    assert (m.capacity, m.align, m.algorithm) == (256, 1, algorithm)
    assert sum(m.pack_docs) == 200 and sum(m.pack_lengths) == sum(map(len, docs))
    assert 0 < m.metrics["fill"] <= 1 and "docs_per_bin" in m.metrics
    got = _by_key(PackedShardReader(out, layout=BatchLayout(capacity=256)))
    assert len(got) == 200
    for key, s in got.items():
        index = int(key.rsplit("#", 1)[1])
        assert s.tokens.dtype == np.int64
        assert s.tokens.tolist() == docs[index], key


def test_labels_loss_mask_and_cp_alignment(tmp_path):
    docs = make_token_docs(60, seed=2, max_len=50)
    labels = [[t + 1 for t in d] for d in docs]
    mask = [[i % 2 for i in range(len(d))] for d in docs]
    out = _pack(tmp_path, docs, capacity=128, extra=["--cp-size", "2", "--tp-size", "2"],
                labels=labels, loss_mask=mask)
    m = read_manifest(out)
    assert (m.align, m.cp_size, m.tp_size) == (8, 2, 2)
    assert "labels.npy" in m.fields and "loss_mask.npy" in m.fields
    packs = list(PackedShardReader(out, layout=BatchLayout(capacity=128, align=8)))
    for pack in packs:
        assert sum(-(-len(s) // 8) * 8 for s in pack) <= 128
        batch = pack_batch([pack], capacity=128, align=8)
        check_invariants(batch, [s.tokens for s in pack])
    got = _by_key(packs)
    assert len(got) == 60
    for key, s in got.items():
        i = int(key.rsplit("#", 1)[1])
        assert s.labels.tolist() == labels[i] and s.loss_mask.astype(int).tolist() == mask[i]


def test_overlong_documents_are_split_and_rejoin(tmp_path):
    docs = make_token_docs(30, seed=3, min_len=10, max_len=300)
    out = _pack(tmp_path, docs, capacity=64)
    chunks: dict[int, list[tuple[int, list[int]]]] = {}
    for key, s in _by_key(PackedShardReader(out, layout=BatchLayout(capacity=64))).items():
        assert len(s) <= 64
        tail = key.rsplit("#", 1)[1]
        doc, _, part = tail.partition("/")
        chunks.setdefault(int(doc), []).append((int(part or 0), s.tokens.tolist()))
    assert sorted(chunks) == list(range(30))
    for i, parts in chunks.items():
        assert sum((t for _, t in sorted(parts)), []) == docs[i]
    assert read_manifest(out).extra["overlong_counters"]["samples_split"] > 0


def test_mismatched_capacity_or_alignment_is_refused(tmp_path):
    out = _pack(tmp_path, make_token_docs(40, seed=4), capacity=64, extra=["--cp-size", "2"])
    with pytest.raises(ValueError, match="capacity=64, align=4"):
        PackedShardReader(out, layout=BatchLayout(capacity=128, align=4))
    with pytest.raises(ValueError, match="align=1"):
        PackedShardReader(out, layout=BatchLayout(capacity=64, align=1))
    PackedShardReader(out, layout=BatchLayout(capacity=64, align=4))


def test_output_is_deterministic_and_detected(tmp_path):
    paths = write_tar_shards(tmp_path / "a" / "in", make_token_docs(50, seed=5), 3)
    a, b = tmp_path / "a" / "packed", tmp_path / "b"
    for out in (a, b):
        assert main(["pack", *paths, "--out", str(out), "--capacity", "64", "--packs-per-shard", "7",
                     "--no-progress"]) == 0
    digest = lambda d: {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("*.tar"))}  # noqa: E731
    assert digest(a) == digest(b) and digest(a)
    assert is_packed_dataset(a) and is_packed_dataset(a / "manifest.json")
    assert is_packed_dataset(sorted(str(p) for p in a.glob("*.tar")))
    assert not is_packed_dataset(tmp_path / "a" / "in")
    assert not is_packed_dataset([])
    with pytest.raises(ValueError, match="no packed-dataset manifest"):
        read_manifest(tmp_path / "a" / "in")


def test_text_shards_need_a_tokenizer(tmp_path, capsys):
    paths = write_jsonl_shards(tmp_path / "in", ["hello world"] * 5, 1)
    assert main(["pack", *paths, "--out", str(tmp_path / "o"), "--capacity", "64", "--no-progress"]) == 2
    assert "--tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("dp_size,num_workers,packs_per_batch", [(1, 1, 1), (2, 1, 1), (2, 3, 1), (3, 2, 2), (2, 2, 3)])
def test_ranks_and_workers_read_every_pack_once(tmp_path, dp_size, num_workers, packs_per_batch):
    """Every pack exactly once per epoch whatever the worker count (it used to deal N // G packs
    per worker and drop the rest), and quotas that give every rank the same batch count."""
    out = _pack(tmp_path, make_token_docs(150, seed=6, max_len=60), capacity=128)
    n = read_manifest(out).num_packs
    seen: list[str] = []
    for epoch in range(2):
        per_rank = []
        for rank in range(dp_size):
            batches = 0
            for worker in range(num_workers):
                reader = PackedShardReader(out, layout=BatchLayout(capacity=128, packs_per_batch=packs_per_batch),
                                           place=Placement(dp_rank=rank, dp_size=dp_size, worker_id=worker,
                                                           num_workers=num_workers),
                                           shuffle=True, seed=3, epochs=epoch + 1, start_epoch=epoch)
                packs = list(reader)
                assert len(packs) == len(reader.dealt(epoch, reader.global_worker))
                quota = reader.quotas(epoch)[reader.global_worker]
                assert quota >= -(-len(packs) // packs_per_batch)
                batches += quota
                seen.extend(f"{epoch}:{s.doc_key}" for p in packs for s in p)
            per_rank.append(batches)
        assert len(set(per_rank)) == 1, per_rank
        # fillers: at most dp_size - 1 per epoch (the fewest any split of the batches needs)
        assert per_rank[0] * dp_size - -(-n // packs_per_batch) < dp_size
    assert len(seen) == len(set(seen)) == 2 * sum(read_manifest(out).pack_docs)


@pytest.mark.parametrize("shuffle,epochs", [(False, 1), (True, 2)])
def test_state_is_exact(tmp_path, shuffle, epochs):
    out = _pack(tmp_path, make_token_docs(120, seed=7, max_len=60), capacity=128)
    n = check_save_load(lambda: PackedShardReader(out, layout=BatchLayout(capacity=128), shuffle=shuffle, epochs=epochs,
                                                  seed=1, place=Placement(dp_rank=1, dp_size=2)))
    assert n == epochs * (read_manifest(out).num_packs // 2)


def test_state_refuses_other_settings(tmp_path):
    out = _pack(tmp_path, make_token_docs(80, seed=8), capacity=128)
    reader = PackedShardReader(out, layout=BatchLayout(capacity=128), place=Placement(dp_size=2))
    next(iter(reader))
    state = json.loads(json.dumps(reader.state_dict()))
    assert state["next_pack"] == [0, 2]  # shard index, pack index of this rank's next pack
    with pytest.raises(ValueError, match="PackedShardReader state was saved with different settings: "
                                         "dp_size: state=2 reader=1"):
        PackedShardReader(out, layout=BatchLayout(capacity=128)).reset(state)


def test_explicit_shard_files_read_only_their_packs(tmp_path):
    out = _pack(tmp_path, make_token_docs(100, seed=9), capacity=64)
    m = read_manifest(out)
    assert len(m.shards) >= 2
    first = out / m.shards[0].name
    packs = list(PackedShardReader([str(first)], layout=BatchLayout(capacity=64)))
    assert len(packs) == len(m.shards[0].offsets)
    assert len(list(PackedShardReader(sorted(out.glob("*.tar")), layout=BatchLayout(capacity=64)))) == m.num_packs
    with pytest.raises(ValueError, match="not listed"):
        PackedShardReader([str(out / "other.tar")], layout=BatchLayout(capacity=64))


def test_packed_dataset_reads_offline_packs_and_resumes(tmp_path):
    """`streampack pack` output goes straight into PackedDataset (no repacking), resumable."""
    from streampack import PackedDataset

    docs = make_token_docs(150, seed=5, max_len=100)
    out = _pack(tmp_path, docs, capacity=256)
    m = read_manifest(out)
    ds = PackedDataset(out, capacity=256, packs_per_batch=2, epochs=1, shuffle=False)
    batches = list(ds)
    # every batch has the full shape: the last one is completed with a filler pack
    assert all(b.num_packs == 2 for b in batches)
    assert sum(b.num_packs - b.doc_keys.count("<filler>") for b in batches) == len(m.pack_lengths)
    seen = {}
    for b in batches:
        check_invariants(b)
        for k, (s, n) in zip(b.doc_keys, zip(b.cu_seqlens_padded[:-1].tolist(), b.doc_lengths.tolist())):
            if k != "<filler>":
                seen[k] = b.input_ids[s:s + n].tolist()
    assert sorted(seen.values()) == sorted(docs)

    ds2 = PackedDataset(out, capacity=256, packs_per_batch=2, epochs=1, shuffle=False)
    it = iter(ds2)
    head = [next(it) for _ in range(3)]
    state = ds2.state_dict()
    ds3 = PackedDataset(out, capacity=256, packs_per_batch=2, epochs=1, shuffle=False)
    ds3.load_state_dict(state)
    rest = list(ds3)
    import torch

    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(head + rest, batches))
    assert len(head + rest) == len(batches)
    with pytest.raises(ValueError, match="capacity=256"):
        PackedDataset(out, capacity=512, epochs=1)  # refused at construction, not in a worker
    with pytest.raises(ValueError, match="align=4"):
        PackedDataset(out, capacity=256, epochs=1, topology=TopologyOptions(cp_size=2))


def test_repacking_a_folder_removes_stale_shards(tmp_path):
    docs = make_token_docs(120, seed=6, max_len=100)
    out = _pack(tmp_path, docs, capacity=256)
    before = sorted(p.name for p in out.glob("packed-*.tar"))
    assert len(before) > 1
    paths = write_tar_shards(tmp_path / "small", docs[:10], 1)
    assert main(["pack", *paths, "--out", str(out), "--capacity", "256", "--no-progress"]) == 0
    after = sorted(p.name for p in out.glob("packed-*.tar"))
    assert after == [s.name for s in read_manifest(out).shards] == ["packed-000000.tar"]


def _targets_by_doc(ds) -> dict[str, tuple[list[int], list[int]]]:
    """doc key -> (tokens, next-token labels) over every batch of a finite dataset."""
    out = {}
    for batch in ds:
        cu, cup = batch.cu_seqlens.tolist(), batch.cu_seqlens_padded.tolist()
        for i, key in enumerate(batch.doc_keys):
            start, n = cup[i], cu[i + 1] - cu[i]
            assert key not in out, f"{key} read twice"
            out[key] = (batch.input_ids[start:start + n].tolist(), batch.labels[start:start + n].tolist())
    return out


def test_offline_pack_and_online_stream_give_the_same_targets(tmp_path):
    """`streampack pack` reads through the pipeline's own graph: loss masks, labels, BOS/EOS and
    the skip policy come out exactly as PackedDataset streams them (they were dropped before)."""
    from streampack import PackedDataset
    from streampack.cli.corpus import train_demo_tokenizer, write_demo_corpus

    docs = make_token_docs(60, seed=5, min_len=2, max_len=90)
    docs[7] = [5, -3, 9]  # a bad sample: skipped and counted
    mask = [[int(j % 3 != 0) for j in range(len(d))] for d in docs]
    jsonl = write_jsonl_shards(tmp_path / "tok", docs, 2, loss_mask=mask)
    corpus = write_demo_corpus(tmp_path / "text", num_shards=1, docs_per_shard=30, vocab_size=300)
    tok = train_demo_tokenizer(corpus, tmp_path / "tokenizer.json", vocab_size=300)
    cases = [(jsonl, ["--loss-mask-key", "loss_mask", "--on-error", "skip"],
              {"read": ReadOptions(loss_mask_key="loss_mask", on_error="skip")}),
             (corpus, ["--tokenizer", tok, "--bos-id", "1", "--eos-id", "2"],
              {"tokenizer": tok, "tokenize": TokenizeOptions(bos_id=1, eos_id=2)})]
    for n, (urls, flags, kwargs) in enumerate(cases):
        out = tmp_path / f"packed{n}"
        assert main(["pack", *urls, "--out", str(out), "--capacity", "256", "--no-progress", *flags]) == 0
        offline = _targets_by_doc(PackedDataset(str(out), capacity=256, epochs=1, shuffle=False))
        online = _targets_by_doc(PackedDataset(urls, capacity=256, epochs=1, shuffle=False,
                                               packing=PackOptions(window=16), **kwargs))
        assert offline == online
        assert len({re.sub(r"/\d+$", "", k) for k in online}) == (59 if n == 0 else 30)  # chunks of one doc
        if n == 0:
            assert read_manifest(out).extra["errors"]["counts"] == {"negative_id": 1}
            assert any(-100 in labels and labels[:-1] != tokens[1:] for tokens, labels in online.values())
        else:
            # BOS opens every document (its first chunk when split), EOS closes every unsplit one
            assert all(t[0] == 1 for k, (t, _) in online.items() if "/" not in k.split("#")[1] or k.endswith("/0"))
            assert all(t[-1] == 2 for k, (t, _) in online.items() if "/" not in k.split("#")[1])


@pytest.mark.parametrize("dp_size,num_workers", [pytest.param(1, 2, marks=pytest.mark.slow),
                                                 pytest.param(1, 3, marks=pytest.mark.slow), (2, 3)])
def test_packed_directory_complete_under_dataloader_workers(tmp_path, dp_size, num_workers):
    """Finding: the README's evaluation recipe (``epochs=1, shuffle=False``) over a `streampack
    pack` directory silently dropped the last 1-2 packs per epoch with 2 or 3 workers."""
    from torch.utils.data import DataLoader

    from streampack import PackedDataset

    docs = make_token_docs(150, seed=11, max_len=90)
    out = _pack(tmp_path, docs, capacity=256)
    assert read_manifest(out).num_packs == 29  # divides between no number of readers
    counts, seen = [], []
    for rank in range(dp_size):
        ds = PackedDataset(out, capacity=256, packs_per_batch=2, epochs=1, shuffle=False,
                           topology=TopologyOptions(dp_rank=rank, dp_size=dp_size))
        batches = list(DataLoader(ds, batch_size=None, num_workers=num_workers))
        counts.append(len(batches))
        seen += [k for b in batches for k in b.doc_keys if k != "<filler>"]
        assert all(b.total_tokens == 512 for b in batches)
    assert len(set(counts)) == 1, counts
    everything = PackedShardReader(out, layout=BatchLayout(capacity=256))
    assert sorted(seen) == sorted(k for p in everything for k in (s.doc_key for s in p))
    assert len(seen) == len(docs)
