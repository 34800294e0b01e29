"""A ``save_to_disk`` directory through ``PackedDataset`` like tar: the manifest (``streampack index`` of the
directory) plans a finite epoch over three ranks with equal batch counts and every row once, as ``datasets`` reads
it, the token blocks giving the batches the per-sample reader gives; a restore is exact, an elastic one trains every row once; one file is split between readers by row; a truncated
file is skipped from the cut or named from a DataLoader worker."""

from __future__ import annotations

import os

import numpy as np
import pytest
from node_checks import (
    check_elastic_resume_every_document_once,
    check_exact_resume,
    check_ranks_deliver_every_document_once,
    documents_by_key,
    planned_dataset,
    worker_error,
)
from topology_sim import SimRank

from streampack.cli.main import main
from streampack.dataset import PackedDataset
from streampack.io.urls import expand_urls
from streampack.options import PackOptions, ReadOptions
from tests.unit.io.test_hf_datasets import BATCH, save

datasets = pytest.importorskip("datasets")
CAP = 256


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """300 long-tail rows (up to 3 x capacity) saved in 4 files, every row by ``url#row`` as ``datasets`` reads each
    file, and the manifest of the directory."""
    root = tmp_path_factory.mktemp("hfplan")
    rng = np.random.default_rng(11)
    ids = [rng.integers(0, 50_000, int(n)).tolist() for n in np.clip(rng.lognormal(4.5, 0.9, 300), 1, 3 * CAP)]
    directory = save(root / "ds", {"input_ids": ids}, 4)
    assert main(["index", directory, "--out", str(root / "manifest"), "--quiet", "--pool", "threads"]) == 0
    urls = expand_urls(directory)
    expected = {f"{u}#{r}": row for u in urls for r, row in enumerate(datasets.Dataset.from_file(u)["input_ids"])}
    assert sorted(expected.values()) == sorted(ids)
    return directory, expected, str(root / "manifest")


def _ds(source, manifest, rank: int, size: int, read: ReadOptions | None = None, **kw) -> PackedDataset:
    read = ReadOptions(manifest=manifest) if read is None else read
    return planned_dataset(source, read, rank, size, capacity=CAP, **kw)


def test_finite_equal_steps_over_ranks_every_row_once(corpus, monkeypatch):
    directory, expected, manifest = corpus
    check_ranks_deliver_every_document_once(lambda r: _ds(directory, manifest, r, 3), expected, monkeypatch)


def test_exact_resume(corpus):
    directory, _, manifest = corpus
    check_exact_resume(lambda: _ds(directory, manifest, 0, 2))


def test_elastic_resume_every_row_once(corpus):
    directory, expected, manifest = corpus
    make = lambda r, size: _ds(directory, manifest, r, size, packs_per_batch=1,  # noqa: E731
                               packing=PackOptions(window=8))
    check_elastic_resume_every_document_once(make, expected, old=(2, 2), new=(3, 0), taken=4)


def test_one_file_is_split_between_readers_by_row(corpus):
    """Fewer files than readers: 3 ranks x 2 workers share one file (indexed without a manifest), each row once."""
    directory, expected, _ = corpus
    url = expand_urls(directory)[0]
    runs = [list(SimRank(lambda r=r: _ds([url], None, r, 3), 2)) for r in range(3)]
    assert len({len(r) for r in runs}) == 1 and len(runs[0]) >= 1
    assert documents_by_key(b for r in runs for b in r) == {k: v for k, v in expected.items() if k.startswith(url + "#")}


def _truncated(tmp_path) -> tuple[str, dict[str, list[int]], int]:
    """Two files of 40 rows, the second cut inside its second record batch: the directory, every row the cut leaves
    readable, and the first row it breaks."""
    rows = [[r % 97 + 1] * (5 + r % 7) for r in range(80)]
    directory = save(tmp_path / "ds", {"input_ids": rows}, 2)
    urls = expand_urls(directory)
    want = {f"{u}#{r}": rows[40 * s + r] for s, u in enumerate(urls) for r in range(40)}
    with open(urls[1], "rb") as f:
        data = f.read()
    os.truncate(urls[1], len(data) // 2)
    cut = BATCH  # the file's first batch of 16 rows ends well before half of it
    for r in range(cut, 40):
        del want[f"{urls[1]}#{r}"]
    return directory, want, cut


def test_a_truncated_file_is_skipped_from_the_cut(tmp_path):
    """Under ``skip`` the rows from the cut are dropped and it is counted once; every other row is trained once."""
    directory, want, _ = _truncated(tmp_path)
    ds = PackedDataset(directory, capacity=64, epochs=1, seed=1, read=ReadOptions(on_error="skip"))
    assert documents_by_key(ds) == want
    assert ds.metrics()["errors"]["counts"] == {"corrupt_shard": 1}


def test_a_truncated_file_raises_from_a_worker_naming_the_row(tmp_path):
    from streampack.errors import DataError

    directory, _, cut = _truncated(tmp_path)
    ds = PackedDataset(directory, capacity=64, epochs=1, seed=1)
    err = worker_error(ds, DataError, f"row {cut}: cannot read the record batch")
    assert err.url == expand_urls(directory)[1] and err.key == str(cut)


def test_a_manifest_indexed_with_another_tokens_column_is_refused(corpus):
    """The plan divides the manifest's row counts: a run that reads another column is refused before a batch."""
    directory, _, manifest = corpus
    for size in (1, 3):
        with pytest.raises(ValueError, match="indexed its arrow shards with 'input_ids"):
            next(iter(_ds(directory, manifest, 0, size, read=ReadOptions(manifest=manifest, tokens_key="ids"))))
