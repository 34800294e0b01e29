"""streampack next to the loaders people use today, one adapter module per library.

``PEERS`` maps a short name to a factory ``(capacity) -> adapter``; each adapter module
imports its library only when used, so this package imports with none of them installed
(the peers live in their own virtual environment: ``benchmarks/requirements-peers.txt``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .hf_trl_peer import HfTrlPeer
from .litdata_peer import LitdataPeer
from .mosaic_concat_peer import MosaicConcatPeer
from .mosaic_peer import MosaicPeer
from .streampack_peer import StreampackPeer
from .webdataset_peer import WebdatasetPeer

PEERS: dict[str, Callable[[int], Any]] = {
    "streampack": lambda capacity: StreampackPeer(capacity=capacity),
    "streampack-parquet": lambda capacity: StreampackPeer(capacity=capacity, fmt="parquet"),
    "streampack-tokens": lambda capacity: StreampackPeer(capacity=capacity, fmt="tokens"),
    "mosaic": lambda capacity: MosaicPeer(capacity=capacity),
    "mosaic-concat": lambda capacity: MosaicConcatPeer(capacity=capacity),
    "litdata": lambda capacity: LitdataPeer(capacity=capacity),
    "webdataset": lambda capacity: WebdatasetPeer(capacity=capacity),
    "hf-trl": lambda capacity: HfTrlPeer(capacity=capacity),
}
"""Every loader, streampack first (the others' ratios are taken against it)."""

# Python distributions whose versions the report records.
DISTRIBUTIONS = ("streampack", "torch", "torchdata", "numpy", "pyarrow", "webdataset", "datasets", "trl",
                 "mosaicml-streaming", "litdata")
