"""streampack: ``PackedDataset`` under ``StatefulDataLoader``, as the README shows.

Reads the webdataset tar shards (``input_ids.npy`` members); with ``fmt="parquet"`` the
parquet shards instead, which :func:`reads_parquet` detects at run time (the parquet reader
lands separately). Packing: windowed best-fit decreasing (window 1024), 8 packs per batch.
"""

from __future__ import annotations

from typing import Any

from streampack.nodes.collate import FILLER_KEY

from .corpus import Corpus, write_parquet, write_tar
from .measure import Count

PACKS_PER_BATCH = 8


def reads_parquet() -> bool:
    from streampack.io.urls import SHARD_SUFFIXES

    return ".parquet" in SHARD_SUFFIXES


class StreampackPeer:
    packing = "windowed BFD (window 1024), whole documents, THD batch with cu_seqlens"

    def __init__(self, *, capacity: int, fmt: str = "tar", window: int = 1024) -> None:
        if fmt not in ("tar", "parquet"):
            raise ValueError(f"{fmt=} must be 'tar' or 'parquet'")
        self.capacity, self.fmt, self.window = capacity, fmt, window
        self.name = "streampack" if fmt == "tar" else "streampack (parquet)"
        self.notes = ["state holds where to re-read each sample waiting in the packer window (shard, offset), not its tokens"]
        self.urls: list[str] = []

    def missing(self) -> str | None:
        if self.fmt == "parquet" and not reads_parquet():
            return "this streampack does not read parquet yet"
        return None

    def prepare(self, corpus: Corpus) -> None:
        self.urls = write_tar(corpus) if self.fmt == "tar" else write_parquet(corpus)
        # import what the loader uses here, outside the timings, as the litdata adapter's prepare
        # imports litdata: a loader's cost is its reading and packing, not its import (which a
        # child run with PYTHONDONTWRITEBYTECODE=1 also compiles from source, ~0.1 s)
        import torchdata.stateful_dataloader  # noqa: F401

        import streampack.dataset  # noqa: F401
        import streampack.options  # noqa: F401
        if self.fmt == "parquet":
            import pyarrow.parquet  # noqa: F401

    def loader(self, num_workers: int, state: Any | None = None) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        from streampack import PackedDataset
        from streampack.options import PackOptions
        from streampack.plan.state import load_loader_state

        ds = PackedDataset(self.urls, capacity=self.capacity, epochs=1, seed=0, packs_per_batch=PACKS_PER_BATCH,
                           packing=PackOptions(window=self.window))
        loader = StatefulDataLoader(ds, batch_size=None, num_workers=num_workers,
                                    prefetch_factor=8 if num_workers else None)
        if state is not None:
            load_loader_state(loader, state)
        return loader

    def count(self, batch: Any) -> Count:
        # a finite stream's last batch is completed with filler packs: one pad-token document
        # each (in a span, so kernels write every row), no targets, not data
        fillers = batch.doc_keys.count(FILLER_KEY)
        return Count(tokens=batch.num_tokens - fillers * batch.capacity, slots=batch.input_ids.numel(),
                     ids=batch.input_ids, filler_slots=fillers * batch.capacity)

    def save(self, loader: Any, batches: int) -> Any:
        return loader.state_dict()
