"""Mosaic ``streaming`` (MDS) with llm-foundry's bin packing.

``MDSWriter(columns={"input_ids": "ndarray:int32"})`` writes the documents;
``StreamingDataset(local=..., shuffle=True, shuffle_seed=0, batch_size=raw)`` under a torch
``DataLoader(batch_size=raw, collate_fn=BinPackCollator)``, which is how llm-foundry feeds a
packed MDS dataset: each raw batch of ``packing_ratio * 8`` documents becomes 8 packs, the
ratio chosen by llm-foundry's ``auto_packing_ratio``. The collator is a re-statement of
llm-foundry's (see :mod:`.packers` for why). State: ``StreamingDataset.state_dict(num_samples,
from_beginning=False)`` with the raw samples consumed (``StreamingDataLoader`` would count the
8 packs of a batch as its samples and resume too early); the collator's leftover bins are in
no state, so they are lost on resume, and those still open at the end of the epoch are dropped.

Importing ``streaming`` imports its vision datasets, which need ``torchvision``; PyPI has no
CPU build of it for torch 2.13 and the CUDA build fails to load next to the CPU torch
(``operator torchvision::nms does not exist``). Without torchvision, :func:`import_streaming`
registers an empty ``streaming.vision`` module first: nothing here uses it.
"""

from __future__ import annotations

import math
import sys
import types
from typing import Any

import numpy as np

from .corpus import Corpus
from .measure import Count
from .packers import BinPackCollator, PaddedBatch, auto_packing_ratio, pad_packs
from .streampack_peer import PACKS_PER_BATCH


def import_streaming() -> types.ModuleType:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    import streaming

    return streaming


class Collate:
    """DataLoader collate_fn: one raw batch -> 8 packs (one packer per worker process)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.packer = BinPackCollator(target_batch_size=PACKS_PER_BATCH, max_seq_len=capacity)

    def __call__(self, examples: list[dict[str, np.ndarray]]) -> PaddedBatch:
        return pad_packs(self.packer.pack([e["input_ids"] for e in examples]), self.capacity)


class MosaicPeer:
    name = "Mosaic streaming + llm-foundry packing"
    fmt = "MDS"
    packing = "llm-foundry BinPackCollator (first-fit decreasing per raw batch, leftover bins kept)"

    def __init__(self, *, capacity: int) -> None:
        self.capacity = capacity
        self.dir = ""
        self.ratio = 1.0
        self.notes: list[str] = []
        self._dataset: Any = None

    @property
    def raw_batch(self) -> int:
        return int(self.ratio * PACKS_PER_BATCH)

    def missing(self) -> str | None:
        try:
            import_streaming()
        except ImportError as e:
            return f"{e} (install: benchmarks/requirements-peers.txt)"
        return None

    def prepare(self, corpus: Corpus) -> None:
        streaming = import_streaming()
        name = "mds"
        self.dir = corpus.format_dir(name)
        self.ratio = auto_packing_ratio(corpus.lengths, target_batch_size=PACKS_PER_BATCH,
                                        max_seq_len=self.capacity)
        self.notes = [f"packing_ratio {self.ratio:g} (llm-foundry's auto_packing_ratio): raw batch {self.raw_batch}",
                      "collator re-stated: llm-foundry pins torch<2.7.1",
                      "the collator's leftover bins are in no state"]
        if corpus.is_written(name):
            return
        shard_bytes = math.ceil(corpus.num_tokens * 4 / corpus.spec.num_shards) + (1 << 16)
        with streaming.MDSWriter(out=self.dir, columns={"input_ids": "ndarray:int32"}, size_limit=shard_bytes,
                                 exist_ok=True, progress_bar=False) as out:
            for s in range(corpus.spec.num_shards):
                for _, doc in corpus.docs(s):
                    out.write({"input_ids": doc})
        corpus.mark_written(name)

    def loader(self, num_workers: int, state: Any | None = None) -> Any:
        from torch.utils.data import DataLoader

        streaming = import_streaming()
        self._dataset = None  # one StreamingDataset per local dir at a time: it owns shared memory
        streaming.base.util.clean_stale_shared_memory()
        ds = streaming.StreamingDataset(local=self.dir, shuffle=True, shuffle_seed=0, batch_size=self.raw_batch)
        if state is not None:
            ds.load_state_dict(state)
        self._dataset = ds
        # fork, whatever start method another peer set process-wide (litdata's writer forces one): a spawned
        # worker imports `streaming` afresh, without the `streaming.vision` stand-in, and dies
        context = "fork" if num_workers else None
        return DataLoader(ds, batch_size=self.raw_batch, collate_fn=Collate(self.capacity), num_workers=num_workers,
                          prefetch_factor=8 if num_workers else None, multiprocessing_context=context)

    def count(self, batch: PaddedBatch) -> Count:
        return Count(tokens=batch.num_tokens, slots=batch.input_ids.numel(), ids=batch.input_ids)

    def save(self, loader: Any, batches: int) -> Any:
        return self._dataset.state_dict(num_samples=batches * self.raw_batch, from_beginning=False)
