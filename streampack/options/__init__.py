"""The option records ``PackedDataset`` takes, one per stage of the graph.

=================  ===========================  =============================================
``PackedDataset``  record                       the nodes that take its values
=================  ===========================  =============================================
``read=``          :class:`ReadOptions`         ShardReader (per source), Mixture, planner,
                                                manifest, replayer
``tokenize=``      :class:`TokenizeOptions`     Tokenize
``packing=``       :class:`PackOptions`         OverlongNode, WindowPacker, ThdCollate
``topology=``      :class:`TopologyOptions`     (rank resolution), WindowPacker / ThdCollate
                                                (``align``), planner and ThdCollate (counts)
``cost=``          :class:`CostOptions`         WindowPacker (balance), ThdCollate (est_cost)
=================  ===========================  =============================================

Each record checks its own values when made; ``StreamConfig`` (:mod:`streampack.settings`) checks
what spans two.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from streampack.options.cost import CostOptions
from streampack.options.packing import PackOptions
from streampack.options.read import ReadOptions
from streampack.options.tokenize import ChatOptions, TokenizeOptions
from streampack.options.topology import TopologyOptions

RECORDS: dict[str, type] = {"read": ReadOptions, "tokenize": TokenizeOptions, "packing": PackOptions,
                            "topology": TopologyOptions, "cost": CostOptions}
"""``PackedDataset`` parameter -> the record it takes."""


def checked_records(records: Mapping[str, Any]) -> dict[str, Any]:
    """Every record parameter -> its record (the default record where ``None`` was given);
    ``TypeError`` for a value of another type."""
    out = {}
    for param, kind in RECORDS.items():
        record = records.get(param)
        if record is not None and not isinstance(record, kind):
            raise TypeError(f"{param}= must be a streampack.options.{kind.__name__}, got {type(record).__name__}")
        out[param] = kind() if record is None else record
    return out


__all__ = ["ChatOptions", "CostOptions", "PackOptions", "RECORDS", "ReadOptions", "TokenizeOptions", "TopologyOptions",
           "checked_records"]
