"""The graph builder: settings -> the node graph one reader runs (:mod:`.build`), and the checks a
dataset runs once when it is built (:mod:`.preflight`).

To build a graph by hand: :func:`build_graph` and the three records it takes (what the stream is,
where it reads from, which reader this is).
"""

from streampack.graph.build import build_graph
from streampack.settings import Placement, Sources, StreamConfig

__all__ = ["Placement", "Sources", "StreamConfig", "build_graph"]
