"""streampack: ``PackedDataset`` under ``PackedLoader``, as the README shows.

Reads the webdataset tar shards (``input_ids.npy`` members); with ``fmt="parquet"`` the
parquet shards instead, with ``fmt="tokens"`` flat token arrays with offsets files (the
pre-tokenized layout litdata's chunks also hold). Packing: windowed best-fit decreasing (window 1024), 8 packs per batch.
"""

from __future__ import annotations

from typing import Any

from streampack.nodes.collate import FILLER_KEY

from .corpus import Corpus, write_parquet, write_tar, write_token_arrays
from .measure import Count

PACKS_PER_BATCH = 8


class StreampackPeer:
    packing = "windowed BFD (window 1024), whole documents, THD batch with cu_seqlens"

    def __init__(self, *, capacity: int, fmt: str = "tar", window: int = 1024) -> None:
        if fmt not in ("tar", "parquet", "tokens"):
            raise ValueError(f"{fmt=} must be 'tar', 'parquet' or 'tokens'")
        self.capacity, self.fmt, self.window = capacity, fmt, window
        self.name = "streampack" if fmt == "tar" else f"streampack ({'token arrays' if fmt == 'tokens' else fmt})"
        self.notes = ["state holds where to re-read each sample waiting in the packer window (shard, offset), not its tokens"]
        self.urls: list[str] = []

    def missing(self) -> str | None:
        return None

    def prepare(self, corpus: Corpus) -> None:
        write = {"tar": write_tar, "parquet": write_parquet, "tokens": write_token_arrays}[self.fmt]
        self.urls = write(corpus)
        # import what the loader uses here, outside the timings, as the litdata adapter's prepare
        # imports litdata: a loader's cost is its reading and packing, not its import (which a
        # child run with PYTHONDONTWRITEBYTECODE=1 also compiles from source, ~0.1 s)
        import torchdata.stateful_dataloader  # noqa: F401

        import streampack.dataset  # noqa: F401
        import streampack.integrations.packed_loader  # noqa: F401
        import streampack.options  # noqa: F401
        if self.fmt == "parquet":
            import pyarrow.parquet  # noqa: F401

    def loader(self, num_workers: int, state: Any | None = None) -> Any:
        from streampack import PackedDataset, PackedLoader
        from streampack.options import PackOptions
        from streampack.plan.state import load_loader_state

        ds = PackedDataset(self.urls, capacity=self.capacity, epochs=1, seed=0, packs_per_batch=PACKS_PER_BATCH,
                           packing=PackOptions(window=self.window))
        loader = PackedLoader(ds, num_workers=num_workers, prefetch_factor=8 if num_workers else None)
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
