"""The option records ``PackedDataset`` takes, one per stage of the graph, and the old flat
keywords as shortcuts onto their fields.

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

Each record checks its own values when it is made, so a mistake names the record and the
field before any shard is opened. A new stage's record is one file here, one entry in
:data:`RECORDS` and one ``PackedDataset`` parameter (the signature has room for one more under
its limit of 15); new fields get no flat keyword.

**Shortcuts.** Every keyword ``PackedDataset`` took before the records (``window=``,
``retry_budget=``, ``dp_size=``, ...) still works: :data:`SHORTCUTS` maps each one to exactly one
record field (``PackedDataset(urls, capacity=c, window=256)`` is
``PackedDataset(urls, capacity=c, packing=PackOptions(window=256))``). Setting a field both ways
(a shortcut, and a record whose field is not at its default) is a ``TypeError``.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from streampack.options.cost import CostOptions
from streampack.options.packing import PackOptions
from streampack.options.read import ReadOptions
from streampack.options.tokenize import TokenizeOptions
from streampack.options.topology import TopologyOptions

RECORDS: dict[str, type] = {"read": ReadOptions, "tokenize": TokenizeOptions, "packing": PackOptions,
                            "topology": TopologyOptions, "cost": CostOptions}
"""``PackedDataset`` parameter -> the record it takes."""

_OLD_KEYWORDS = {  # per record parameter, the flat keywords that are its fields ("old=field" where renamed)
    "read": "text_key tokens_key labels_key loss_mask_key on_error vocab_size limits mixture_stop manifest "
            "cache_dir identity allow_pipe allow_pickle retries retry_budget connect_timeout read_timeout "
            "request_deadline allow_redirects storage_options",
    "tokenize": "bos_id eos_id num_threads tokenize_block=block_size",
    "packing": "window algorithm max_wait slack overlong pad_id ignore_index pin_memory",
    "topology": "dp_group dp_rank dp_size cp_size tp_size sequence_parallel align_multiple equal_batches "
                "batches_per_epoch",
    "cost": "cost_model=model balance",
}
SHORTCUTS: dict[str, tuple[str, str]] = {
    old: (param, field or old)
    for param, words in _OLD_KEYWORDS.items()
    for old, _, field in (word.partition("=") for word in words.split())
}
"""Flat keyword -> (record parameter, field): the only keywords ``PackedDataset`` accepts beyond
its own parameters."""


def with_shortcuts(records: Mapping[str, Any], shortcuts: Mapping[str, Any]) -> dict[str, Any]:
    """Every record parameter -> its record: the one given (or the default record) with the
    fields that ``shortcuts`` set. ``TypeError`` for an unknown keyword, a record of the wrong
    type, or a field set both by a shortcut and by the record."""
    unknown = sorted(set(shortcuts) - set(SHORTCUTS))
    if unknown:
        raise TypeError(f"PackedDataset() got unexpected keyword argument(s) {unknown}{_did_you_mean(unknown)}")
    out = {}
    for param, kind in RECORDS.items():
        record = records.get(param)
        if record is not None and not isinstance(record, kind):
            raise TypeError(f"{param}= must be a streampack.options.{kind.__name__}, got {type(record).__name__}")
        mine = {SHORTCUTS[k][1]: (k, v) for k, v in shortcuts.items() if SHORTCUTS[k][0] == param}
        if record is None:
            out[param] = kind(**{f: v for f, (_, v) in mine.items()})
            continue
        defaults = {f.name: f.default for f in dataclasses.fields(kind)}
        for f, (old, value) in mine.items():
            if getattr(record, f) != defaults[f]:
                raise TypeError(f"{old}={value!r} and {param}={kind.__name__}({f}={getattr(record, f)!r}) both set "
                                f"{param}.{f}: set it once (the flat keyword is a shortcut for the record field)")
        out[param] = dataclasses.replace(record, **{f: v for f, (_, v) in mine.items()}) if mine else record
    return out


def _did_you_mean(unknown: list[str]) -> str:
    hints = [f"{u!r} -> {m[0]!r}" for u in unknown if (m := difflib.get_close_matches(u, SHORTCUTS, n=1))]
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


__all__ = ["CostOptions", "PackOptions", "RECORDS", "ReadOptions", "SHORTCUTS", "TokenizeOptions",
           "TopologyOptions", "with_shortcuts"]
