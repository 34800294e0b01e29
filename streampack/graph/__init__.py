"""The graph builder: settings -> the node graph one reader runs (:mod:`.build`: :func:`build_graph` and the three
records it takes), and the checks a dataset runs once when it is built (:mod:`.preflight`)."""

from streampack.graph.build import build_graph
from streampack.settings import Placement, Sources, StreamConfig

__all__ = ["Placement", "Sources", "StreamConfig", "build_graph"]
