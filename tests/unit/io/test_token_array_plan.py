"""Flat token arrays through ``PackedDataset`` like tar: the manifest (``streampack index``) plans a finite epoch over
several ranks with equal batch counts and every document once; a restore is exact, an elastic one trains every
document once; the token blocks give the batches the per-sample reader gives; one array is split between readers by
document, and a truncated one is skipped or named document by document."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from node_checks import (
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
EOS = 50_000


def write_arrays(root, docs: list[list[int]], shards: int, *, offsets: bool) -> list[str]:
    """``docs`` in ``shards`` uint16 arrays written by ``np.save`` (every document ending in ``EOS``), or with
    ``offsets`` uint32 arrays written by ``np.memmap`` (no header, no EOS) with an ``np.save`` offsets file each."""
    os.makedirs(root, exist_ok=True)
    urls = []
    for s, part in enumerate(np.array_split(np.arange(len(docs)), shards)):
        chosen = [docs[i] for i in part]
        if offsets:
            flat = np.concatenate(chosen).astype(np.uint32)
            mm = np.memmap(os.path.join(root, f"shard-{s:03d}.bin"), dtype=np.uint32, mode="w+", shape=flat.shape)
            mm[:] = flat
            mm.flush()
            np.save(os.path.join(root, f"shard-{s:03d}.offsets.npy"),
                    np.concatenate([[0], np.cumsum([len(d) for d in chosen])]).astype(np.int64))
            urls.append(os.path.join(root, f"shard-{s:03d}.bin"))
        else:
            np.save(os.path.join(root, f"shard-{s:03d}.npy"), np.concatenate([d + [EOS] for d in chosen]).astype(
                np.uint16))
            urls.append(os.path.join(root, f"shard-{s:03d}.npy"))
    return urls


@pytest.fixture(scope="module", params=["eos", "offsets"])
def corpus(request, tmp_path_factory):
    """300 long-tail documents (up to 3 x capacity) in 4 arrays, their expected documents and their manifest."""
    root = tmp_path_factory.mktemp(request.param)
    rng = np.random.default_rng(7)
    lengths = np.clip(rng.lognormal(4.5, 0.9, 300), 1, 3 * CAP).astype(int)
    docs = [rng.integers(0, EOS, n).tolist() for n in lengths]
    offsets = request.param == "offsets"
    urls = write_arrays(root / "data", docs, 4, offsets=offsets)
    read = ReadOptions(token_dtype="uint32") if offsets else ReadOptions(eos_id=EOS)
    layout = ["--token-dtype", "uint32"] if offsets else ["--eos-id", str(EOS)]
    assert main(["index", *urls, "--out", str(root / "manifest"), "--quiet", "--pool", "threads", *layout]) == 0
    expected: dict[str, list[int]] = {}
    for url, part in zip(urls, np.array_split(np.arange(len(docs)), 4)):
        for d, j in enumerate(part):
            expected[f"{url}#{d}"] = docs[j] if offsets else docs[j] + [EOS]
    return urls, expected, str(root / "manifest"), read


def _ds(urls, manifest, read, rank: int, size: int, **kw) -> PackedDataset:
    return planned_dataset(urls, dataclasses.replace(read, manifest=manifest), rank, size, capacity=CAP, **kw)


def test_finite_equal_steps_over_ranks_every_document_once(corpus, monkeypatch):
    urls, expected, manifest, read = corpus
    check_ranks_deliver_every_document_once(lambda r: _ds(urls, manifest, read, r, 3), expected, monkeypatch)


def test_exact_resume(corpus):
    urls, _, manifest, read = corpus
    check_exact_resume(lambda: _ds(urls, manifest, read, 0, 2))


def test_elastic_resume_every_document_once(corpus):
    urls, expected, manifest, read = corpus
    make = lambda r, size: _ds(urls, manifest, read, r, size, packs_per_batch=1,  # noqa: E731
                               packing=PackOptions(window=8))
    check_elastic_resume_every_document_once(make, expected, old=(2, 2), new=(3, 0), taken=4)


def test_one_array_is_split_between_readers_by_document(corpus):
    """Fewer arrays than readers: 3 ranks x 2 workers share one array (indexed without a manifest), each document
    read once."""
    urls, expected, _, read = corpus
    runs = [list(SimRank(lambda r=r: _ds(urls[:1], None, read, r, 3), 2)) for r in range(3)]
    assert len({len(r) for r in runs}) == 1 and len(runs[0]) >= 1
    assert documents_by_key(b for r in runs for b in r) == {k: v for k, v in expected.items() if k.startswith(urls[0] + "#")}


def test_another_eos_id_is_refused_on_resume(tmp_path):
    """The EOS id decides the documents: a state saved under one is refused under another, naming both."""
    docs = [[d + 1] * (5 + d % 7) for d in range(60)]
    urls = write_arrays(tmp_path, docs, 2, offsets=False)
    ds = PackedDataset(urls, capacity=64, epochs=1, seed=1, read=ReadOptions(eos_id=EOS))
    take(iter(ds), 2)
    state = roundtrip(ds.state_dict())
    other = PackedDataset(urls, capacity=64, epochs=1, seed=1, read=ReadOptions(eos_id=7))
    with pytest.raises(ValueError, match="50000"):
        other.load_state_dict(state)
        list(other)


def _truncated(tmp_path) -> tuple[list[str], dict[str, list[int]]]:
    """Two arrays split at EOS, the second cut inside its last document (19): the URLs and every document the cut
    leaves whole."""
    docs = [[d + 1] * (5 + d % 7) for d in range(40)]
    urls = write_arrays(tmp_path, docs, 2, offsets=False)
    want = {f"{u}#{d}": docs[20 * s + d] + [EOS] for s, u in enumerate(urls) for d in range(20)}
    del want[f"{urls[1]}#19"]
    os.truncate(urls[1], os.path.getsize(urls[1]) - 6)
    return urls, want


def test_a_truncated_array_is_skipped_document_by_document(tmp_path):
    """Under ``skip`` exactly the document past the cut is dropped and counted, every other one trained once."""
    urls, want = _truncated(tmp_path)
    ds = PackedDataset(urls, capacity=64, epochs=1, seed=1, read=ReadOptions(on_error="skip", eos_id=EOS))
    assert documents_by_key(ds) == want
    assert ds.metrics()["errors"]["counts"] == {"corrupt_shard": 1}


def test_a_truncated_array_raises_from_a_worker_naming_the_document(tmp_path):
    """Under ``raise`` the ``DataError`` leaves a DataLoader worker as itself, naming the array and the document."""
    from streampack.errors import DataError

    urls, _ = _truncated(tmp_path)
    ds = PackedDataset(urls, capacity=64, epochs=1, seed=1, read=ReadOptions(eos_id=EOS))
    err = worker_error(ds, DataError, "document 19: .*truncated array")
    assert err.url == urls[1] and err.key == "19"


def test_a_manifest_indexed_with_another_layout_is_refused_before_a_batch(corpus):
    """The plan divides the manifest's document counts: a run that splits the arrays otherwise (another EOS id,
    another dtype) is refused up front, even one reader that would never load an index to notice."""
    urls, _, manifest, read = corpus
    other = (dataclasses.replace(read, eos_id=EOS - 1) if read.eos_id is not None
             else dataclasses.replace(read, token_dtype="uint16"))
    for size in (1, 3):
        with pytest.raises(ValueError, match=r"indexed its token_array shards with .* this run reads them with"):
            next(iter(_ds(urls, manifest, other, 0, size)))
