"""The contiguous fast path: which graphs take it, and its nodes after the reader.

For pre-tokenized shards the graph builder (:mod:`streampack.graph.build`) wires
``BlockReader -> ChunkNode -> RowPacker -> RowCollate`` (:mod:`streampack.nodes.block_reader`,
``chunker``, ``row_packer``, ``row_collate``) instead of ``ShardReader -> OverlongNode ->
WindowPacker -> ThdCollate``: documents move as rows of arrays read in blocks
(:mod:`streampack.io.blocks`), never as one Sample each, and each document's ids are copied
once, into the batch. It is an optimisation, not a second semantics: the batches, states,
metrics and errors are the per-sample path's, batch for batch (``tests/test_contiguous.py``), and
a state saved on either path restores on the other.

One in-process epoch of the 4M-token corpus (capacity 4096, window 1024, 8 packs a batch)
costs 131 CPU-ms from tar shards, 5.0x less than the per-sample path (parquet 134 CPU-ms, 2.7x
less): ``benchmarks/bench_loaders.py``; where the time goes is in ``benchmarks/README.md``,
"The cost of a token".

``STREAMPACK_CONTIGUOUS=0`` turns it off (every stream then runs the per-sample path).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from torchdata.nodes import BaseNode

from streampack.io.blocks import block_format
from streampack.nodes.chunker import ChunkNode
from streampack.nodes.row_packer import RowPacker
from streampack.plan.replay import ReplaySpec
from streampack.plan.row_replay import RowReplay
from streampack.plan.rows import BlockStore
from streampack.settings import Sources, StreamConfig

CONTIGUOUS_ENV = "STREAMPACK_CONTIGUOUS"
"""Environment variable: ``0`` turns the contiguous fast path off (every stream then runs the
per-sample path; the batches and states are the same either way)."""


def contiguous_path(config: StreamConfig, sources: Sources, tokenizer: Any,
                    stages: Sequence[Any], around: Mapping[str, Any] | None) -> bool:
    """Whether a reader's graph runs the contiguous fast path (``BlockReader -> ChunkNode ->
    RowPacker -> RowCollate``, :mod:`streampack.plan.rows`) instead of the per-sample one: one
    source of pre-tokenized tar / parquet shards (no tokenizer, no mixture, no ``streampack pack``
    directory), no user stage, no media, no cost-balanced emission, no labels or loss-mask
    field, and no torchdata node wrapped around a stage before the collate. Every overlong
    policy is supported. It yields the per-sample path's batches and states, batch for batch
    (``tests/test_contiguous.py``); what it cannot read as blocks it reads per sample."""
    if os.environ.get(CONTIGUOUS_ENV, "1") == "0" or sources.shards is None or sources.mixture:
        return False
    return (sources.packed is None and tokenizer is None and not stages and config.media is None
            and config.cost.balance is None and config.read.labels_key is None
            and config.read.loss_mask_key is None
            and not set(around or {}) - {"collate"} and all(block_format(u) for u in sources.shards.urls))


def row_chain(reader: BaseNode[Any], nodes: dict[str, Any], config: StreamConfig, seed: int, spec: ReplaySpec,
              carry: Mapping[str, Any] | None) -> RowPacker:
    """``ChunkNode -> RowPacker`` after a BlockReader (named ``overlong`` and ``packer`` in
    ``nodes``, as their per-sample counterparts); ``carry``: an elastic share's window."""
    pack, store = config.packing, BlockStore()
    replay = RowReplay(spec, store)
    node = nodes["overlong"] = ChunkNode(reader, config.capacity, pack.overlong, replay=replay.chunks, store=store)
    packer = nodes["packer"] = RowPacker(node, rules=config.packer_rules(seed), shuffle=config.shuffle, replay=replay,
                                         store=store, carry=carry)
    return packer


__all__ = ["CONTIGUOUS_ENV", "contiguous_path", "row_chain"]
