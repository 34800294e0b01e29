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
what spans two. A flat keyword of earlier versions (``window=``) is a ``TypeError`` naming the
record field to set (:func:`refuse_flat_keywords`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from streampack.options.cost import CostOptions
from streampack.options.packing import PackOptions
from streampack.options.read import ReadOptions
from streampack.options.tokenize import TokenizeOptions
from streampack.options.topology import TopologyOptions

RECORDS: dict[str, type] = {"read": ReadOptions, "tokenize": TokenizeOptions, "packing": PackOptions,
                            "topology": TopologyOptions, "cost": CostOptions}
"""``PackedDataset`` parameter -> the record it takes."""


def field_for(name: str) -> tuple[str, type, str] | None:
    """``(parameter, record, field)`` that a flat keyword ``name`` of earlier versions meant, read off the records'
    fields: a field of that name (``window`` -> ``packing.window``), or ``<parameter>_<start of a field>``
    (``cost_model`` -> ``cost.model``, ``tokenize_block`` -> ``tokenize.block_size``); ``None`` for any other name."""
    param, _, rest = name.partition("_")
    found = None
    for p, kind in RECORDS.items():
        for f in dataclasses.fields(kind):
            if f.name == name or (p == param and rest and (f.name == rest or f.name.startswith(rest + "_"))):
                if found is not None:
                    return None  # two fields claim it: no guess
                found = (p, kind, f.name)
    return found


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


def hint_flat_keywords(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap a constructor so that a flat keyword of earlier versions gets the ``TypeError`` of
    :func:`refuse_flat_keywords`; its signature (``inspect.signature``) stays the constructor's."""
    params = set(inspect.signature(init).parameters)

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        if not params.issuperset(kwargs):
            refuse_flat_keywords(type(self).__name__, sorted(set(kwargs) - params))
        init(self, *args, **kwargs)  # any other unknown keyword: Python's own TypeError

    return checked


def refuse_flat_keywords(who: str, names: Iterable[str]) -> None:
    """``TypeError`` for the first keyword in ``names`` that is a record's field, naming the
    record to set it through (the other unknown names are left to Python's own ``TypeError``)."""
    for name in names:
        hit = field_for(name)
        if hit is not None:
            param, kind, field = hit
            raise TypeError(f"{who}() got an unexpected keyword argument {name!r}: it is a field of "
                            f"streampack.options.{kind.__name__}; pass {param}={kind.__name__}({field}=...)")


__all__ = ["CostOptions", "PackOptions", "RECORDS", "ReadOptions", "TokenizeOptions", "TopologyOptions",
           "checked_records", "field_for", "hint_flat_keywords", "refuse_flat_keywords"]
