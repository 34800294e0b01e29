"""Learnable token shards for the examples: noisy counting sequences with long-tail lengths.

Each document is ``(start + stride * i) % vocab``: a model can learn "next = previous +
stride", so losses fall within a few steps, and nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import webdataset as wds


def write_shards(directory: Path, num_shards: int = 4, docs_per_shard: int = 200, seed: int = 0,
                 vocab: int = 64, median: float = 60, max_len: int = 600) -> list[str]:
    """``num_shards`` webdataset tar shards of ``npy`` token documents; returns their paths."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(num_shards):
        path = directory / f"train-{s:06d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for i in range(docs_per_shard):
                n = int(np.clip(rng.lognormal(np.log(median), 0.9), 2, max_len))
                start, stride = rng.integers(vocab), rng.integers(1, 4)
                ids = (start + stride * np.arange(n)) % vocab
                sink.write({"__key__": f"doc{s:02d}x{i:05d}", "npy": ids.astype(np.int64)})
        paths.append(str(path))
    return paths
