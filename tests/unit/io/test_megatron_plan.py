"""Megatron-core shards through ``PackedDataset`` like tar: the manifest (``streampack index``) plans a finite epoch
over several ranks with equal batch counts and every document once; a restore is exact, an elastic one trains every
document once; the token blocks give the batches the per-sample reader gives."""

from __future__ import annotations

import numpy as np
import pytest
from helpers_megatron import megatron_documents, write_megatron_shards
from node_checks import (
    canon,
    check_elastic_resume_every_document_once,
    check_exact_resume,
    check_ranks_deliver_every_document_once,
    documents_by_key,
    planned_dataset,
    roundtrip,
    take,
    worker_error,
)
from topology_sim import SimRank

from streampack.cli.main import main
from streampack.dataset import PackedDataset
from streampack.options import PackOptions, ReadOptions

CAP = 256


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """300 long-tail documents (up to 3 x capacity) in 4 shards of 1-3 sequences a document, and their manifest."""
    root = tmp_path_factory.mktemp("megatron")
    rng = np.random.default_rng(7)
    lengths = np.clip(rng.lognormal(4.5, 0.9, 300), 1, 3 * CAP).astype(int)
    docs = [rng.integers(0, 50_000, n).tolist() for n in lengths]
    urls = write_megatron_shards(root / "data", docs, 4, dtype=np.uint16)
    assert [d for u in urls for d in megatron_documents(u)] == docs
    assert main(["index", *urls, "--out", str(root / "manifest"), "--quiet", "--pool", "threads"]) == 0
    return urls, docs, str(root / "manifest")


def _expected(urls, docs) -> dict[str, list[int]]:
    out, i = {}, 0
    for url in urls:
        for d in range(len(megatron_documents(url))):
            out[f"{url}#{d}"] = docs[i]
            i += 1
    return out


def _ds(urls, manifest, rank: int, size: int, read: ReadOptions | None = None, **kw) -> PackedDataset:
    read = ReadOptions(manifest=manifest) if read is None else read
    return planned_dataset(urls, read, rank, size, capacity=CAP, **kw)


@pytest.mark.slow  # ~6 s; the token-array and save_to_disk plans run the same check in the fast loop
def test_finite_equal_steps_over_ranks_every_document_once(corpus, monkeypatch):
    urls, docs, manifest = corpus
    check_ranks_deliver_every_document_once(lambda r: _ds(urls, manifest, r, 3), _expected(urls, docs), monkeypatch)


def test_exact_resume(corpus):
    urls, _, manifest = corpus
    check_exact_resume(lambda: _ds(urls, manifest, 0, 2))


def test_elastic_resume_every_document_once(corpus):
    urls, docs, manifest = corpus
    make = lambda r, size: _ds(urls, manifest, r, size, packs_per_batch=1, packing=PackOptions(window=8))  # noqa: E731
    check_elastic_resume_every_document_once(make, _expected(urls, docs), old=(2, 2), new=(3, 0), taken=4)


def test_a_changed_shard_is_refused_on_resume(corpus, tmp_path):
    import shutil

    urls, docs, manifest = corpus
    copies = []
    for url in urls:
        for ext in (".idx", ".bin"):
            shutil.copy(url[:-4] + ext, tmp_path / (url.rsplit("/", 1)[1][:-4] + ext))
        copies.append(str(tmp_path / url.rsplit("/", 1)[1]))
    ds = PackedDataset(copies, capacity=CAP, epochs=1, seed=2)
    take(iter(ds), 2)
    state = roundtrip(ds.state_dict())
    write_megatron_shards(tmp_path / "other", docs[:10], 1)
    shutil.copy(tmp_path / "other" / "shard-000.idx", copies[0])
    restored = PackedDataset(copies, capacity=CAP, epochs=1, seed=2)
    restored.load_state_dict(state)
    with pytest.raises(ValueError, match="shard-000.idx"):
        list(restored)



def test_one_shard_is_split_between_readers_by_document(corpus):
    """Fewer shards than readers: 3 ranks x 2 workers share one shard (indexed without a manifest), each document
    read once."""
    urls, docs, _ = corpus
    make = lambda r: _ds(urls[:1], None, r, 3)  # noqa: E731
    runs = [list(SimRank(lambda r=r: make(r), 2)) for r in range(3)]
    assert len({len(r) for r in runs}) == 1 and len(runs[0]) >= 1
    expected = {k: v for k, v in _expected(urls, docs).items() if k.startswith(urls[0] + "#")}
    assert documents_by_key(b for r in runs for b in r) == expected



def _truncated(tmp_path) -> tuple[list[str], dict[str, list[int]]]:
    """Two shards, the second's .bin cut inside its document 18 (its documents 18 and 19 lose bytes); the URLs and
    every document the cut leaves whole."""
    import os

    docs = [[d + 1] * (5 + d % 7) for d in range(40)]
    urls = write_megatron_shards(tmp_path, docs, 2)
    want = {k: v for k, v in _expected(urls, docs).items() if k not in (f"{urls[1]}#18", f"{urls[1]}#19")}
    bin_path = urls[1][:-4] + ".bin"
    os.truncate(bin_path, os.path.getsize(bin_path) - 4 * len(docs[-1]) - 4)
    return urls, want


def test_a_truncated_bin_is_skipped_document_by_document(tmp_path):
    """Under ``skip`` exactly the documents past the cut are dropped and counted, every other one trained once."""
    urls, want = _truncated(tmp_path)
    ds = PackedDataset(urls, capacity=64, epochs=1, seed=1, read=ReadOptions(on_error="skip"))
    assert documents_by_key(ds) == want
    assert ds.metrics()["errors"]["counts"] == {"corrupt_shard": 2}


def test_a_truncated_bin_raises_from_a_worker_naming_the_document(tmp_path):
    """Under ``raise`` the ``DataError`` leaves a DataLoader worker as itself, naming the shard and the document."""
    from streampack.errors import DataError

    urls, _ = _truncated(tmp_path)
    ds = PackedDataset(urls, capacity=64, epochs=1, seed=1)
    err = worker_error(ds, DataError, "document 18: .*truncated .bin")
    assert err.url == urls[1] and err.key == "18"


@pytest.mark.slow  # ~5 s: a second manifest and three stop points
def test_a_sample_per_sequence_over_ranks_and_resumed(corpus, tmp_path):
    """``megatron_sample="sequence"`` through the same path: the manifest built per sequence plans equal steps over
    ranks with every sequence once; a restore is exact; a per-document state is refused."""
    from helpers_megatron import builder_and_dataset

    urls, _, per_document = corpus
    assert main(["index", *urls, "--out", str(tmp_path / "m"), "--quiet", "--pool", "threads",
                 "--megatron-sample", "sequence"]) == 0
    expected = {}
    for url in urls:
        ref = builder_and_dataset()[1](url[:-4])
        expected.update({f"{url}#{s}": ref[s].tolist() for s in range(len(ref))})
    read = ReadOptions(manifest=str(tmp_path / "m"), megatron_sample="sequence")
    runs = [list(_ds(urls, None, r, 2, read=read)) for r in range(2)]
    assert len({len(r) for r in runs}) == 1 and len(expected) > 300
    assert documents_by_key(b for r in runs for b in r) == expected
    whole = [canon(b) for b in runs[0]]
    ds = _ds(urls, None, 0, 2, read=read)
    head = [canon(b) for b in take(iter(ds), len(whole) // 2)]
    state = roundtrip(ds.state_dict())
    again = _ds(urls, None, 0, 2, read=read)
    again.load_state_dict(state)
    assert head + [canon(b) for b in again] == whole
    per_doc = _ds(urls, per_document, 0, 2)
    with pytest.raises(ValueError, match="megatron_sample=sequence"):
        per_doc.load_state_dict(state)
        list(per_doc)
