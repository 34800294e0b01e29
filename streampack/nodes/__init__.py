"""The pipeline's ``torchdata.nodes.BaseNode`` stages, one per file, in the order data flows.

Compose them by hand (with torchdata's own ``ParallelMapper``, ``Prefetcher``, ``PinMemory``,
``Loader`` in between) or let :func:`streampack.graph.build.build_graph` wire them as
``PackedDataset`` does; see ``docs/dataset.md``, "Build the graph yourself".
"""

from streampack.nodes.collate import ThdCollate
from streampack.nodes.mixture import Mixture
from streampack.nodes.overlong import OverlongNode, apply_overlong
from streampack.nodes.packed_reader import PackedShardReader
from streampack.nodes.reader import ShardReader
from streampack.nodes.stages import MapSamples, NodeStage
from streampack.nodes.tokenize import TextEncoder, Tokenize
from streampack.nodes.window_packer import WindowPacker

__all__ = ["MapSamples", "Mixture", "NodeStage", "OverlongNode", "PackedShardReader", "ShardReader",
           "TextEncoder", "ThdCollate", "Tokenize", "WindowPacker", "apply_overlong"]
