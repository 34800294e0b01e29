"""The manifest is input (issue 29 items 8, 9): every field is checked on load and a bad one is one
``ValueError`` naming the file and the field; held in memory it costs a measured ~135 B per shard,
not three Python strings; DataLoader workers get the one the main process read instead of
fetching it again."""

from __future__ import annotations

import gc
import hashlib
import io
import pickle
import tracemalloc
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_data import bucket_manifest, make_token_docs, serve_directory, write_tar_shards

import streampack.graph.build as graph_mod
from streampack import PackedDataset
from streampack.cli.main import main
from streampack.io.decode import DecodeOptions
from streampack.io.manifest import MANIFEST_FILE, Manifest, load_manifest, save_manifest
from streampack.io.storage import OpenOptions
from streampack.options import ReadOptions, TopologyOptions

Arrays = dict[str, np.ndarray]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[list[str], Path]:
    """Three tar shards (30 samples each) and the manifest ``streampack index --out`` wrote."""
    root = tmp_path_factory.mktemp("manifest-input")
    urls = write_tar_shards(root / "d", make_token_docs(90, seed=4), 3)
    assert main(["index", *urls, "--out", str(root / "m"), "--quiet", "--pool", "threads"]) == 0
    return urls, root / "m"


def _rewrite(src: Path, dst: Path, change: Callable[[Arrays], None]) -> Path:
    """A copy of the manifest in ``src`` whose arrays ``change`` edited, in ``dst``."""
    with np.load(src / MANIFEST_FILE) as data:
        arrays = {k: data[k] for k in data.files}
    change(arrays)
    dst.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(dst / MANIFEST_FILE, **arrays)
    return dst


def _set(name: str, value: Callable[[Arrays], np.ndarray]) -> Callable[[Arrays], None]:
    return lambda a: a.__setitem__(name, value(a))


def _negative_samples(a: Arrays) -> np.ndarray:
    samples = a["samples"].copy()
    samples[1] = -27
    return samples


BAD_FIELDS = {
    # field named in the error: how the file is made wrong
    "samples": _set("samples", _negative_samples),  # silently dropped the whole shard
    "sizes": _set("sizes", lambda a: a["sizes"].astype(np.float64)),
    "tokens": _set("tokens", lambda a: a["tokens"][:2]),  # one shard short: an IndexError later
    "byte_costs": _set("byte_costs", lambda a: np.zeros_like(a["byte_costs"])),
    "tokens_key": lambda a: a.pop("tokens_key"),
    "version": _set("version", lambda a: np.array("3")),
    "limits": _set("limits", lambda a: np.zeros_like(a["limits"])),  # Limits' own error named no manifest
    "url_ends": _set("url_ends", lambda a: a["url_ends"] - 1),
    "tag_ends": _set("tag_ends", lambda a: a["tag_ends"][::-1].copy()),
    "digest_ends": _set("digest_ends", lambda a: a["digest_ends"][:1]),
    "urls": _set("url_ends", lambda a: np.concatenate([[0], a["url_ends"][1:]])),  # an empty URL first
}


@pytest.mark.parametrize("name", list(BAD_FIELDS))
def test_a_bad_field_is_one_value_error_naming_the_manifest_and_the_field(built, tmp_path, name):
    location = _rewrite(built[1], tmp_path / name, BAD_FIELDS[name])
    with pytest.raises(ValueError, match=f"field '{name}'") as e:
        load_manifest(str(location))
    assert type(e.value) is ValueError and str(location / MANIFEST_FILE) in str(e.value)


def test_a_negative_sample_count_is_refused_before_any_reader_plans(built, tmp_path):
    """The shard with -27 samples was planned as empty: its 30 samples never trained, no word said."""
    urls, src = built
    location = _rewrite(src, tmp_path / "m", BAD_FIELDS["samples"])
    (tmp_path / "m" / "shards").mkdir()  # the index files beside it, as written
    for f in (src / "shards").iterdir():
        (tmp_path / "m" / "shards" / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match=r"field 'samples' holds -27 at entry 1"):
        PackedDataset(urls, capacity=256, epochs=1, seed=0, read=ReadOptions(manifest=str(location)),
                      topology=TopologyOptions(dp_rank=0, dp_size=2, equal_batches="count"))


def test_a_manifest_made_in_code_with_columns_of_different_lengths_is_refused():
    with pytest.raises(ValueError, match=r"lists 2 URLs but other column lengths \{'samples': 1\}"):
        Manifest(location="mem", tokens_key="input_ids", urls=["a.tar", "b.tar"], sizes=[1, 2], tags=["", ""],
                 samples=[3], tokens=[4, 5], byte_costs=[6, 7])


@pytest.mark.parametrize("cut", ["truncated", "not a zip", "a .npy"])
def test_a_damaged_manifest_file_is_a_value_error_naming_it(built, tmp_path, cut):
    data = (built[1] / MANIFEST_FILE).read_bytes()
    if cut == "a .npy":
        buf = io.BytesIO()
        np.save(buf, np.arange(3))
        data = buf.getvalue()
    location = tmp_path / "m"
    location.mkdir()
    (location / MANIFEST_FILE).write_bytes(data[: len(data) // 2] if cut == "truncated" else
                                           b"<html>not found</html>" if cut == "not a zip" else data)
    with pytest.raises(ValueError, match="cut short or not a manifest") as e:
        load_manifest(str(location))
    assert str(location / MANIFEST_FILE) in str(e.value) and "not found" not in str(e.value)
    assert not isinstance(e.value, zipfile.BadZipFile)


def test_a_truncated_shard_index_file_is_named_not_a_bad_zip_file(built, tmp_path):
    """A per-shard index file cut short escaped as ``zipfile.BadZipFile`` from the reader."""
    src = built[1]
    location = tmp_path / "m"
    (location / "shards").mkdir(parents=True)
    (location / MANIFEST_FILE).write_bytes((src / MANIFEST_FILE).read_bytes())
    for f in (src / "shards").iterdir():
        data = f.read_bytes()
        (location / "shards" / f.name).write_bytes(data[: len(data) // 2])
    m = load_manifest(str(location))
    with pytest.raises(ValueError, match="missing or damaged"):
        m.load_index(0, DecodeOptions(), OpenOptions())


@pytest.mark.parametrize("column", ["lengths", "key_ends"])
def test_a_shard_index_file_with_a_short_column_is_named_damaged(built, tmp_path, column):
    """A column one entry short loaded, and read past its end as an IndexError mid-epoch."""
    src = built[1]
    location = tmp_path / "m"
    (location / "shards").mkdir(parents=True)
    (location / MANIFEST_FILE).write_bytes((src / MANIFEST_FILE).read_bytes())
    for f in (src / "shards").iterdir():
        with np.load(f) as data:
            arrays = {k: data[k] for k in data.files}
        arrays[column] = arrays[column][:-1]
        np.savez_compressed(location / "shards" / f.name, **arrays)
    m = load_manifest(str(location))
    with pytest.raises(ValueError, match="missing or damaged"):
        m.load_index(0, DecodeOptions(), OpenOptions())


# ------------------------------------------------------------------ what holding one costs


def _held(make: Callable[[], object]) -> tuple[object, int]:
    """What ``make()`` returns and the bytes it holds once made (tracemalloc: Python objects and
    numpy buffers alike), the temporaries of making it freed."""
    gc.collect()
    tracemalloc.start()
    try:
        made = make()
        gc.collect()
        return made, tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


def test_a_held_manifest_costs_at_most_150_bytes_per_shard(tmp_path):
    """Measured, not assumed: three Python strings per shard held ~340 B (tracemalloc) and ~520 B
    of RSS per shard (``benchmarks/bench_manifest_memory.py``)."""
    n = 20_000
    bucket_manifest(tmp_path / "m", n)

    def load() -> Manifest:
        m = load_manifest(str(tmp_path / "m"))
        for mode in ("all", "tag", "size", "digest"):  # what a planned reader takes
            m.fingerprint(mode)
        return m

    m, held = _held(load)
    assert isinstance(m, Manifest) and len(m) == n
    assert held / n <= 150, f"{held / n:.0f} B per shard held"
    assert m.urls[12_345] == "s3://my-bucket/datasets/web-2026/train/shard-012345.tar"  # the strings are all there
    assert m.digests[-1] == f"digest={hashlib.sha1(str(n - 1).encode()).hexdigest()}"
    assert m.fingerprint("all") == _fingerprint_of_strings(m)  # hashed in chunks of strings, the same value
    raw = pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL)
    copy, copied = _held(lambda: pickle.loads(raw))  # what a spawned worker holds
    assert copied / n <= 150 and copy.fingerprint("all") == m.fingerprint("all") and copy.urls == m.urls


def _fingerprint_of_strings(m: Manifest) -> str:
    """``Manifest.fingerprint("all")`` computed over Python strings, as states saved before name it."""
    parts = (b"".join(np.ascontiguousarray(c, dtype=np.int64).tobytes() for c in (m.samples, m.tokens, m.byte_costs)),
             m.sizes.tobytes(), "\n".join(list(m.tags)).encode(), "\n".join(list(m.digests)).encode())
    text = "|".join(["all", str(len(m)), *(hashlib.sha1(b).hexdigest() for b in parts)])
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def test_the_column_layout_keeps_the_fingerprints_and_the_file(built, tmp_path):
    """The manifest's fingerprint names it in resume states: holding strings as bytes changes
    neither it nor the file written."""
    m = load_manifest(str(built[1]))
    assert m.fingerprint("all") == _fingerprint_of_strings(m)
    copy = Manifest(location=str(tmp_path), tokens_key=m.tokens_key, urls=list(m.urls), sizes=m.sizes,
                    tags=tuple(m.tags), samples=m.samples, tokens=m.tokens, byte_costs=m.byte_costs,
                    digests=list(m.digests), limits=m.limits)
    save_manifest(copy, OpenOptions())
    again = load_manifest(str(tmp_path))
    assert list(again.urls) == built[0] and again.fingerprint("all") == m.fingerprint("all")


# ------------------------------------------------------------------ one read per rank


def _manifest_gets(store) -> int:
    return sum(1 for path, _ in store.requests if path.endswith("/" + MANIFEST_FILE))


def _served(tmp_path: Path):
    urls = write_tar_shards(tmp_path / "d", make_token_docs(96, seed=2), 4)
    store = serve_directory(tmp_path)
    info = store.__enter__()
    remote = [f"{info.url}/d/{Path(u).name}" for u in urls]
    assert main(["index", *remote, "--out", str(tmp_path / "m"), "--quiet", "--pool", "threads"]) == 0
    info.requests.clear()
    return store, info, remote


@pytest.mark.parametrize("dp_size", [1, 2])
def test_a_worker_unpickling_the_dataset_does_not_fetch_the_manifest_again(tmp_path, dp_size):
    """What a spawned worker does, in this process: a fresh process holds no manifest, unpickles
    the dataset and iterates. The main process reads it once whatever the rank count (with one
    rank it read none, and every worker of the rank read its own)."""
    store, info, urls = _served(tmp_path)
    try:
        ds = PackedDataset(urls, capacity=256, epochs=1, seed=1,
                           read=ReadOptions(manifest=f"{info.url}/m", cache_dir=str(tmp_path / "cache")),
                           topology=TopologyOptions(dp_rank=0, dp_size=dp_size, equal_batches="count"))
        assert _manifest_gets(info) == 1
        raw = pickle.dumps(ds)
        graph_mod._GIVEN.clear()  # a spawned worker starts without it
        worker = pickle.loads(raw)
        assert sum(1 for _ in worker) > 0
        assert _manifest_gets(info) == 1, "the worker fetched the manifest again"
    finally:
        store.__exit__(None, None, None)


@pytest.mark.slow  # two forked workers reading over loopback: ~3 s on 2 busy cores
def test_forked_workers_of_one_rank_share_the_manifest_read_once(tmp_path):
    """One rank, two readers: the main process never read the manifest, so each worker did."""
    store, info, urls = _served(tmp_path)
    try:
        ds = PackedDataset(urls, capacity=256, epochs=1, seed=1,
                           read=ReadOptions(manifest=f"{info.url}/m", cache_dir=str(tmp_path / "cache")))
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
        assert sum(1 for _ in loader) > 0
        assert _manifest_gets(info) == 1
    finally:
        store.__exit__(None, None, None)


@pytest.mark.slow  # spawned workers import torch: several seconds each
def test_spawned_dataloader_workers_fetch_the_manifest_once_per_rank(tmp_path):
    store, info, urls = _served(tmp_path)
    try:
        ds = PackedDataset(urls, capacity=256, epochs=1, seed=1,
                           read=ReadOptions(manifest=f"{info.url}/m", cache_dir=str(tmp_path / "cache")),
                           topology=TopologyOptions(dp_rank=0, dp_size=2, equal_batches="count"))
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn")
        assert sum(1 for _ in loader) > 0
        assert _manifest_gets(info) == 1, "1 + W reads: each spawned worker fetched it again"
    finally:
        store.__exit__(None, None, None)


# ------------------------------------------------------------------ a local manifest, held


def _local(tmp_path: Path, counted: list[str], monkeypatch) -> tuple[PackedDataset, list[str]]:
    import streampack.io.manifest as manifest_mod

    urls = write_tar_shards(tmp_path / "d", make_token_docs(96, seed=2), 4)
    inner = manifest_mod.load_manifest

    def counting(location, *args, **kwargs):
        counted.append(location)
        return inner(location, *args, **kwargs)

    monkeypatch.setattr(manifest_mod, "load_manifest", counting)
    graph_mod._GIVEN.clear()
    ds = PackedDataset(urls, capacity=256, epochs=1, seed=1, read=ReadOptions(cache_dir=str(tmp_path / "cache")))
    return ds, urls


def test_a_held_local_manifest_is_checked_by_stat_not_read_again(tmp_path, monkeypatch):
    read: list[str] = []
    ds, urls = _local(tmp_path, read, monkeypatch)
    first = graph_mod.manifest_of(ds.config, ds.sources)
    reads = len(read)
    assert graph_mod.manifest_of(ds.config, ds.sources) is first and len(read) == reads
    Path(urls[1]).write_bytes(Path(urls[1]).read_bytes() + b"\0" * 1024)  # a rewritten shard is seen
    assert graph_mod.manifest_of(ds.config, ds.sources).sizes[1] == first.sizes[1] + 1024


def test_a_restored_loader_reads_the_manifest_once_for_its_workers(tmp_path, monkeypatch):
    """``load_loader_state`` on a loader with workers: the main process reads the manifest the
    workers' plans need, and a worker (here: a spawned one, unpickling the dataset) reads none."""
    from streampack.plan.state import load_loader_state

    read: list[str] = []
    ds, _ = _local(tmp_path, read, monkeypatch)

    class Loader:  # what load_loader_state uses of a StatefulDataLoader
        dataset, num_workers = ds, 2

        def load_state_dict(self, state):
            pass

    load_loader_state(Loader(), {"_snapshot": {"_main_snapshot": {"_num_workers": 2}}})
    assert ds._manifest is not None
    worker = pickle.loads(pickle.dumps(ds))
    graph_mod._GIVEN.clear()  # a spawned worker starts without it
    reads = len(read)
    graph_mod.hold_manifest(worker.config, worker.sources, worker._manifest)  # what __iter__ does first
    assert graph_mod.manifest_of(worker.config, worker.sources) is worker._manifest and len(read) == reads
    Loader.dataset, Loader.num_workers = PackedDataset(ds.urls, capacity=256, epochs=1, seed=1), 0
    load_loader_state(Loader(), {})  # no workers, one rank: no plan, so no manifest to read
    assert Loader.dataset._manifest is None
