"""Mosaic ``streaming`` with concatenated samples, as llm-foundry pretrains (``--concat_tokens``).

llm-foundry's ``convert_dataset_hf --concat_tokens N`` writes the documents' token ids back to
back and cuts the stream into samples of exactly N tokens (the tail shorter than N is dropped),
one ``ndarray:int32`` column per sample in MDS. Training reads them with
``StreamingDataset(local=..., shuffle=True, shuffle_seed=0, batch_size=8)`` under
``StreamingDataLoader(batch_size=8)``, whose ``state_dict()`` is the resume. Every sample is full
(fill 100%), but documents are cut at sample edges and no boundaries reach the loop.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from .corpus import Corpus
from .measure import Count
from .mosaic_peer import import_streaming
from .streampack_peer import PACKS_PER_BATCH


class MosaicConcatPeer:
    name = "Mosaic streaming, concatenated"
    fmt = "MDS (concatenated)"
    packing = "llm-foundry concat_tokens: fixed samples cut from the concatenated token stream (no boundaries)"
    notes = ["documents cut at sample edges, no cu_seqlens; the tail shorter than capacity is dropped"]

    def __init__(self, *, capacity: int) -> None:
        self.capacity = capacity
        self.dir = ""

    def missing(self) -> str | None:
        try:
            import_streaming()
        except ImportError as e:
            return f"{e} (install: benchmarks/requirements-peers.txt)"
        return None

    def prepare(self, corpus: Corpus) -> None:
        streaming = import_streaming()
        name = "mds-concat"
        self.dir = corpus.format_dir(name)
        if corpus.is_written(name):
            return
        blocks = corpus.num_tokens // self.capacity
        stream = corpus.tokens[:blocks * self.capacity].reshape(blocks, self.capacity)
        shard_bytes = math.ceil(blocks * self.capacity * 4 / corpus.spec.num_shards) + (1 << 16)
        with streaming.MDSWriter(out=self.dir, columns={"tokens": "ndarray:int32"}, size_limit=shard_bytes,
                                 exist_ok=True, progress_bar=False) as out:
            for row in stream:
                out.write({"tokens": np.ascontiguousarray(row)})
        corpus.mark_written(name)

    def loader(self, num_workers: int, state: Any | None = None) -> Any:
        streaming = import_streaming()
        streaming.base.util.clean_stale_shared_memory()
        ds = streaming.StreamingDataset(local=self.dir, shuffle=True, shuffle_seed=0, batch_size=PACKS_PER_BATCH)
        context = "fork" if num_workers else None  # see mosaic_peer: a spawned worker lacks the vision stand-in
        loader = streaming.StreamingDataLoader(ds, batch_size=PACKS_PER_BATCH, num_workers=num_workers,
                                               prefetch_factor=8 if num_workers else None,
                                               multiprocessing_context=context)
        if state is not None:
            loader.load_state_dict(state)
        return loader

    def count(self, batch: dict[str, torch.Tensor]) -> Count:
        ids = batch["tokens"]
        return Count(tokens=ids.numel(), slots=ids.numel(), ids=ids)

    def save(self, loader: Any, batches: int) -> Any:
        return loader.state_dict()
