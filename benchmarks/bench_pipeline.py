"""End-to-end pipeline benchmark: pre-tokenized local shards -> PackedBatch.

Reports tokens/s and samples/s with 1 and 2 DataLoader workers, packing fill at several
windows next to offline ``bfd`` over the same (split) samples, peak RSS, the state size
(``len(torch.save(state))``) and the time to resume from a checkpoint taken deep inside a
shard. Stream: lognormal lengths with mean ~600 (sigma 1), capacity 4096, overlong="split".

    python benchmarks/bench_pipeline.py --docs 60000 --out reports/bench_pipeline.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streampack import packing
from streampack.dataset import PackedDataset
from streampack.options import PackOptions
from streampack.plan.state import state_nbytes

CAP = 4096


def write_shards(directory: str, n_docs: int, num_shards: int, seed: int = 0) -> tuple[list[str], np.ndarray]:
    """Pre-tokenized npy tar shards with lognormal(mean ~600) lengths."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from helpers_data import write_tar_shards

    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(np.log(600) - 0.5, 1.0, n_docs).round()).astype(np.int64)
    docs = [rng.integers(0, 50_000, n).tolist() for n in lengths.tolist()]
    return write_tar_shards(directory, docs, num_shards), lengths


def offline_fill(lengths: np.ndarray) -> float:
    split = np.concatenate([[CAP] * (n // CAP) + ([n % CAP] if n % CAP else []) for n in lengths.tolist()])
    return float(split.sum() / (len(packing.pack(split, CAP, "bfd")) * CAP))


def throughput(urls: list[str], num_workers: int, window: int = 1024,
               packs_per_batch: int = 8) -> dict[str, Any]:
    ds = PackedDataset(urls, capacity=CAP, epochs=1, seed=0, packs_per_batch=packs_per_batch,
                       packing=PackOptions(window=window))
    loader = DataLoader(ds, batch_size=None, num_workers=num_workers,
                        prefetch_factor=8 if num_workers else None)
    start = time.perf_counter()
    tokens = docs = batches = 0
    for batch in loader:
        tokens += batch.num_tokens
        docs += batch.num_docs
        batches += 1
    dt = time.perf_counter() - start
    return {"case": f"end-to-end, {num_workers} worker(s), {packs_per_batch} packs/batch",
            "tokens_per_s": tokens / dt,
            "samples_per_s": docs / dt, "batches": batches, "seconds": dt}


def fills(urls: list[str], lengths: np.ndarray, windows: list[int]) -> list[dict[str, Any]]:
    offline = offline_fill(lengths)
    rows = []
    for window in windows:
        ds = PackedDataset(urls, capacity=CAP, epochs=1, seed=0, packing=PackOptions(window=window))
        for _ in ds:
            pass
        m = ds.metrics()["packing"]
        rows.append({"case": f"fill, window {window}", "fill": m["fill"], "offline_bfd_fill": offline,
                     "gap_points": 100 * (offline - m["fill"]), "packs": m["packs"],
                     "forced_by_age": m["forced_by_age"], "forced_by_carry": m["forced_by_carry"]})
    return rows


def state_and_resume(urls: list[str], window: int = 1024, steps: int = 300) -> dict[str, Any]:
    """Checkpoint deep inside a shard under StatefulDataLoader(num_workers=1), then resume."""
    loader = StatefulDataLoader(PackedDataset(urls, capacity=CAP, seed=0, packing=PackOptions(window=window)),
                                batch_size=None, num_workers=1)
    it = iter(loader)
    for _ in range(steps):
        next(it)
    state = loader.state_dict()
    want = next(it)
    del it
    ds_state = PackedDataset(urls, capacity=CAP, seed=0, packing=PackOptions(window=window))
    inner = iter(ds_state)
    for _ in range(steps):
        next(inner)
    size_ds = state_nbytes(ds_state.state_dict())
    buf = io.BytesIO()
    torch.save(state, buf)
    start = time.perf_counter()
    buf.seek(0)
    fresh = StatefulDataLoader(PackedDataset(urls, capacity=CAP, seed=0, packing=PackOptions(window=window)),
                               batch_size=None, num_workers=1)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    got = next(iter(fresh))
    resume_s = time.perf_counter() - start
    assert torch.equal(got.input_ids, want.input_ids), "resume is not exact"
    reader = ds_state.state_dict()
    return {"case": f"state + resume after {steps} batches, window {window}",
            "state_bytes": size_ds, "loader_state_bytes": buf.getbuffer().nbytes,
            "resume_seconds": resume_s, "checkpoint_in_shard_sample": _reader_sample(reader)}


def _reader_sample(state: Any) -> int:
    state = state["graph"]
    while isinstance(state, dict) and "source" in state:
        state = state["source"]
    return int(state.get("sample", -1)) if isinstance(state, dict) else -1


def run(docs: int = 60_000, shards: int = 8, windows: tuple[int, ...] = (64, 256, 1024, 4096),
        directory: str | None = None) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        urls, lengths = write_shards(directory or tmp, docs, shards)
        rows = [throughput(urls, 0), throughput(urls, 1), throughput(urls, 2),
                throughput(urls, 2, packs_per_batch=1)]
        rows += fills(urls, lengths, list(windows))
        rows.append(state_and_resume(urls))
    rows.append({"case": "peak RSS (this process)",
                 "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
    return rows


def to_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| case | metrics |", "|---|---|"]
    for row in rows:
        cells = ", ".join(f"{k}={v:,.4f}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in row.items() if k != "case")
        lines.append(f"| {row['case']} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=60_000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--out", default=None, help="write the rows as json here")
    args = parser.parse_args()
    rows = run(args.docs, args.shards)
    print(to_markdown(rows))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
