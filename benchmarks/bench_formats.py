"""Tokens per CPU-second of each pre-tokenized shard format on the same tokens (numbers quoted in docs/megatron.md,
docs/token_arrays.md and docs/hf_datasets.md).

    python benchmarks/bench_formats.py --docs 40000 --shards 4

The same long-tail documents (lognormal, mean ~600 tokens, ids < 50,000) are written as webdataset tar shards (an
``input_ids.npy`` int32 member a sample, pax headers, as ``webdataset.TarWriter`` writes them), as Megatron-core
indexed data sets of int32 and of uint16 ids (the ``.idx`` layout of ``streampack.io.megatron``, written here with
numpy so the benchmark needs no megatron-core), as parquet (an int32 list column, row groups of 1,024) and as flat
token arrays (``np.save`` uint16 with each document's last id replaced by the EOS id :data:`EOS`, so the same token
counts split at EOS; and ``np.memmap`` uint32 with an ``.offsets.npy`` file, the same ids) and as a Hugging Face
``datasets`` directory (``Dataset.save_to_disk`` with ``num_shards``: an int32 list column in record batches of
1,000 rows, ``datasets``' default), and the same table as an in-memory ``datasets.Dataset`` passed as the source
(read in place, ``streampack.io.hf_dataset``), and shuffled (``Dataset.shuffle``: read through its indices mapping).
Each is
read three ways, timed in CPU seconds of this process (``time.process_time``, so a busy box does not count):

- ``samples``: every document through the per-sample reader (``ShardReader``, one ``Sample`` each);
- ``blocks``: every document as token blocks (``io.blocks.read_blocks``: what the graph's reader hands the packer);
- ``packed``: ``PackedDataset`` end to end (one epoch, capacity 4,096, 2 packs a batch, window 256).

and, for the in-memory ``Dataset``, what a spawned DataLoader worker pays to get it: ``pickle`` the ``PackedDataset``
(the table pickled whole) and load it again, CPU seconds per GB of table.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


EOS = 65_535
"""The EOS id of the token-array set split at EOS (above every id of :func:`make_docs`)."""


def read_options(fmt: str) -> Any:
    """What a format's set is read with (a token array's layout; the defaults for the others)."""
    from streampack.options import ReadOptions

    if fmt.endswith("(EOS)"):
        return ReadOptions(eos_id=EOS)
    return ReadOptions(token_dtype="uint32") if fmt.endswith("(offsets)") else ReadOptions()


def write_token_arrays(root: str, s: int, part: list[np.ndarray], out: dict[str, list[str]]) -> None:
    eos = np.concatenate([np.append(d[:-1], EOS) for d in part]).astype(np.uint16)
    np.save(os.path.join(root, f"t16-{s:04d}.npy"), eos)
    out["token array uint16 (EOS)"].append(os.path.join(root, f"t16-{s:04d}.npy"))
    flat = np.concatenate(part).astype(np.uint32)
    path = os.path.join(root, f"t32-{s:04d}.bin")
    mm = np.memmap(path, dtype=np.uint32, mode="w+", shape=flat.shape)
    mm[:] = flat
    mm.flush()
    np.save(os.path.join(root, f"t32-{s:04d}.offsets.npy"), np.cumsum([0] + [len(d) for d in part]))
    out["token array uint32 (offsets)"].append(path)


def make_docs(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(6.0, 0.9, n), 8, 16_000).astype(np.int64)
    return [rng.integers(0, 50_000, int(k), dtype=np.int32) for k in lengths]


def write_megatron(prefix: str, docs: list[np.ndarray], dtype: np.dtype) -> str:
    """``prefix.bin`` + ``prefix.idx``, one sequence a document, in megatron-core's layout (version 1)."""
    from streampack.io.megatron import DTYPES, MAGIC

    code = next(c for c, d in DTYPES.items() if d == np.dtype(dtype))
    lengths = np.array([len(d) for d in docs], np.int32)
    pointers = np.zeros(len(docs), np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            f.write(d.astype(dtype).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(struct.pack("<9sQBQQ", MAGIC, 1, code, len(docs), len(docs) + 1))
        f.write(lengths.tobytes() + pointers.tobytes() + np.arange(len(docs) + 1, dtype=np.int64).tobytes())
    return prefix + ".idx"


def hf_in_memory(docs: list[np.ndarray]) -> Any:
    """The documents as an in-memory ``datasets.Dataset`` of one int32 list column."""
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    datasets.disable_progress_bars()
    lengths = np.array([len(d) for d in docs], np.int64)
    column = pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)),
                                      pa.array(np.concatenate(docs).astype(np.int32)))
    return datasets.Dataset(InMemoryTable(pa.table({"input_ids": column})))


def write_hf_dataset(root: str, docs: list[np.ndarray], shards: int) -> list[str]:
    """The documents as ``datasets`` saves them, in ``shards`` ``.arrow`` files (the directory expanded)."""
    from streampack.io.urls import expand_urls

    path = os.path.join(root, "hf")
    hf_in_memory(docs).save_to_disk(path, num_shards=shards)
    return expand_urls(path)


def write_sets(root: str, docs: list[np.ndarray], shards: int) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import webdataset as wds

    parts = [docs[s * len(docs) // shards:(s + 1) * len(docs) // shards] for s in range(shards)]
    out: dict[str, list[str]] = {"tar": [], "megatron int32": [], "megatron uint16": [], "parquet": [],
                                 "token array uint16 (EOS)": [], "token array uint32 (offsets)": []}
    for s, part in enumerate(parts):
        path = os.path.join(root, f"shard-{s:04d}.tar")
        with wds.TarWriter(path) as sink:
            for i, d in enumerate(part):
                sink.write({"__key__": f"{s:04d}-{i:08d}", "input_ids.npy": d})
        out["tar"].append(path)
        out["megatron int32"].append(write_megatron(os.path.join(root, f"m32-{s:04d}"), part, np.dtype("<i4")))
        out["megatron uint16"].append(write_megatron(os.path.join(root, f"m16-{s:04d}"), part, np.dtype("<u2")))
        path = os.path.join(root, f"shard-{s:04d}.parquet")
        pq.write_table(pa.table({"input_ids": pa.array([d.tolist() for d in part], pa.list_(pa.int32()))}), path,
                       row_group_size=1024)
        out["parquet"].append(path)
        write_token_arrays(root, s, part, out)
    out["hf datasets (save_to_disk)"] = write_hf_dataset(root, docs, shards)
    out["hf datasets (in memory)"] = hf_in_memory(docs)
    out["hf datasets (in memory, shuffled)"] = hf_in_memory(docs).shuffle(seed=0)
    return out


def on_disk(source: Any) -> int:
    """Bytes a set takes on disk; an in-memory ``Dataset``: its table's bytes in memory."""
    if not isinstance(source, list):
        return int(source.data.nbytes)
    return sum(os.path.getsize(u) + (os.path.getsize(u[:-4] + ".bin") if u.endswith(".idx") else 0)
               + (os.path.getsize(u[:-4] + ".offsets.npy") if u.endswith(".bin") else 0) for u in source)


def _cpu(work: Any) -> tuple[float, int]:
    t = time.process_time()
    tokens = work()
    return time.process_time() - t, tokens


def read_samples(urls: list[str], read: Any) -> int:
    from streampack.nodes.reader import ShardReader

    return sum(len(s.tokens) for s in ShardReader(urls, shuffle=False, epochs=1, read=read))


def read_blocks(urls: Any, read: Any) -> int:
    from streampack.io.blocks import read_blocks as blocks_of
    from streampack.io.formats import ShardRange
    from streampack.io.storage import OpenOptions
    from streampack.io.urls import ShardList

    total = 0
    shards = ShardList.of(urls)  # held while read: an in-memory Dataset's URLs name it
    for url in shards.urls:
        streams: list = []
        for block in blocks_of(url, ShardRange(start=0, first=0), decode=read.decode(), opts=OpenOptions(),
                               streams=streams):
            total += int(block.lengths.sum())
        for f in streams:
            f.close()
    return total


def read_packed(urls: list[str], read: Any) -> int:
    from streampack.dataset import PackedDataset
    from streampack.options import PackOptions

    ds = PackedDataset(urls, capacity=4096, packs_per_batch=2, epochs=1, seed=0, packing=PackOptions(window=256),
                       read=read)
    return sum(b.num_tokens for b in ds)


def spawn_cost(ds: Any) -> dict[str, Any]:
    """CPU seconds to pickle a ``PackedDataset`` of ``ds`` and load it again (what each spawned worker is sent)."""
    import pickle

    from streampack.dataset import PackedDataset

    packed = PackedDataset(ds, capacity=4096, epochs=1)
    t = time.process_time()
    blob = pickle.dumps(packed)
    dumped = time.process_time()
    pickle.loads(blob)
    loaded = time.process_time()
    gb = ds.data.nbytes / 1e9
    return {"format": "hf datasets (in memory)", "read": "spawned worker (pickle + unpickle)",
            "MB_pickled": round(len(blob) / 1e6, 1), "dump_cpu_s_per_GB": round((dumped - t) / gb, 3),
            "load_cpu_s_per_GB": round((loaded - dumped) / gb, 3)}


def run(quick: bool = False, docs: int | None = None, shards: int = 4) -> list[dict[str, Any]]:
    """One row per format and way of reading: tokens per CPU-second, and the ratio to tar read the same way."""
    n = docs if docs is not None else (4_000 if quick else 40_000)
    corpus = make_docs(n)
    total = int(sum(len(d) for d in corpus))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as root:
        sets = write_sets(root, corpus, shards)
        read_packed(sets["tar"][:1], read_options("tar"))  # the packer's first compile is not a format's cost
        for way, work in (("samples", read_samples), ("blocks", read_blocks), ("packed", read_packed)):
            tar_rate = None
            for fmt, urls in sets.items():
                seconds, tokens = _cpu(lambda w=work, u=urls, r=read_options(fmt): w(u, r))
                assert tokens == total, (fmt, way, tokens, total)
                rate = tokens / max(seconds, 1e-9)
                tar_rate = rate if fmt == "tar" else tar_rate
                disk = on_disk(urls)
                rows.append({"format": fmt, "read": way, "docs": n, "tokens": tokens, "cpu_s": round(seconds, 3),
                             "Mtok_per_cpu_s": round(rate / 1e6, 2), "vs_tar": round(rate / tar_rate, 2),
                             "MB_on_disk": round(disk / 1e6, 1)})
                print(rows[-1], flush=True)
        rows.append(spawn_cost(sets["hf datasets (in memory)"]))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--docs", type=int, default=40_000)
    p.add_argument("--shards", type=int, default=4)
    a = p.parse_args()
    run(docs=a.docs, shards=a.shards)


if __name__ == "__main__":
    main()
