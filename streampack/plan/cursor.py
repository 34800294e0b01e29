"""The cursor: named records of what a reader has not yet delivered to the trainer.

A reader's stream is cut, at any state, into three parts that never overlap: the frontier (:class:`Pulled`), a split
in progress (:class:`Split`) and the packer's carry (a table of ``state.REF`` references). Each stateful node hands
its part out through one ``undelivered`` method over its own saved state; :mod:`streampack.plan.elastic` composes them
into :class:`Undelivered` and never reads a node's private keys or a column by position.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from streampack.io.storage import ShardStat
from streampack.plan.sharding import Span, WorkEnds
from streampack.plan.state import (
    REF,
    concat_tables,
    make_table,
    record_of,
    record_text,
    require_fields,
)
from streampack.sample import SampleOrigin


@dataclass(frozen=True, slots=True, kw_only=True)
class Pulled:
    """The last sample an overlong stage pulled from one source (every field read by name)."""

    source: int
    shard: int
    epoch: int
    """The epoch the sample belongs to (after an elastic resume a reader's work may hold the same
    shard twice: an old reader's tail of the epoch before, and the shard's span in this one)."""
    offset: int
    number: int
    next_offset: int
    next_number: int

    @classmethod
    def of(cls, origin: SampleOrigin) -> Pulled:
        return cls(source=origin.source, shard=origin.shard, epoch=origin.epoch, offset=origin.offset,
                   number=origin.number, next_offset=origin.next_offset, next_number=origin.next_number)


PULLED_FIELDS = tuple(f.name for f in fields(Pulled))


def pulled_to_state(pulled: Iterable[Pulled]) -> str:
    """The last samples pulled (one per source) as one JSON text of named fields."""
    return record_text({"pulled": [asdict(p) for p in sorted(pulled, key=lambda p: p.source)]})


def pulled_from_state(text: str) -> list[Pulled]:
    """Inverse of :func:`pulled_to_state` (``ValueError`` naming a missing field)."""
    out = []
    for fields_ in record_of(text)["pulled"]:
        require_fields(fields_, PULLED_FIELDS, "a last sample pulled")
        out.append(Pulled(**{name: int(fields_[name]) for name in PULLED_FIELDS}))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Position:
    """Where to re-read one sample: its shard, the position in it, and its epoch."""

    source: int
    shard: int
    offset: int
    number: int
    epoch: int

    @classmethod
    def of(cls, origin: SampleOrigin) -> Position:
        return cls(source=origin.source, shard=origin.shard, offset=origin.offset, number=origin.number,
                   epoch=origin.epoch)


POSITION_FIELDS = tuple(f.name for f in fields(Position))
SPLIT_KEY = "split"


@dataclass(frozen=True, slots=True, kw_only=True)
class Split:
    """A document the overlong policy cut, whose chunks from ``next`` on are not emitted yet."""

    at: Position
    next: int
    """The first chunk not emitted."""
    count: int
    """How many chunks it was cut into."""
    tokens: int
    """Its tokens (checked when it is re-read)."""
    lengths: tuple[int, ...] | None = None
    """Each chunk's length when the chunks are not ``capacity``-token cuts (a media stream cuts
    around images); None for a text stream, whose cuts follow from ``tokens``."""

    def to_state(self) -> dict[str, str]:
        """``{"split": <one JSON text of named fields>}`` (a ``pending`` record of tokens has no
        ``split`` key)."""
        return {SPLIT_KEY: record_text({"at": asdict(self.at), "next": self.next, "count": self.count,
                                        "tokens": self.tokens, "lengths": self.lengths})}

    @classmethod
    def from_state(cls, pending: Mapping[str, Any]) -> Split | None:
        """The split a saved ``pending`` record holds, or None when it holds tokens instead (a
        graph that cannot re-read)."""
        if SPLIT_KEY not in pending:
            return None
        record = record_of(pending[SPLIT_KEY])
        require_fields(record, ("at", "next", "count", "tokens", "lengths"), "a split document")
        require_fields(record["at"], POSITION_FIELDS, "a split document's position")
        lengths = record["lengths"]
        return cls(at=Position(**{name: int(record["at"][name]) for name in POSITION_FIELDS}),
                   next=int(record["next"]), count=int(record["count"]), tokens=int(record["tokens"]),
                   lengths=None if lengths is None else tuple(int(n) for n in lengths))

    def carry(self, lengths: np.ndarray) -> dict[str, Any]:
        """The chunks not emitted as a table of references (``lengths``: every chunk's length)."""
        refs = np.zeros(max(self.count - self.next, 0), dtype=REF)
        for name in POSITION_FIELDS:  # every chunk is re-read from its document's position
            refs[name] = getattr(self.at, name)
        refs["chunk"] = np.arange(self.next, self.count)
        refs["length"] = np.asarray(lengths, dtype=np.int64)[self.next:self.count]
        return make_table(np.ones(len(refs), dtype=bool), refs, [])


@dataclass(frozen=True, slots=True, kw_only=True)
class Undelivered:
    """What one reader had not delivered, as its nodes hand it out: the frontier (None: nothing pulled yet) and the
    carried samples in delivery order (the packer's window, then a split document's chunks left)."""

    pulled: Pulled | None
    carry: Mapping[str, Any]

    @classmethod
    def compose(cls, pulled: Pulled | None, *carries: Mapping[str, Any]) -> Undelivered:
        return cls(pulled=pulled, carry=concat_tables(list(carries)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Planned:
    """A reader's plan as its state holds it (``ShardReader.undelivered``)."""

    start_epoch: int
    work: dict[int, list[Span]]
    """The spans of the epochs it was handed explicitly (an elastic share; a finite epoch's plan)."""
    ends: dict[int, WorkEnds]
    """The first and last span of each planned epoch (the rest follow from the manifest)."""
    identities: dict[int, ShardStat] = field(default_factory=dict)
    """The identities of the shards it read last (where its carried samples come from): a
    shard that changed since is refused, not re-read."""
    manifest: Mapping[str, str] | None = None
    """The fingerprints of the manifest its plan was cut from (None: no manifest)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PackedPlace:
    """Where an offline-packed reader stood (``PackedShardReader.undelivered``): every pack of
    ``epoch`` from ``position`` on, then its share of the later epochs, is undelivered."""

    epoch: int
    position: int
    work: dict[int, np.ndarray]
    """The packs of the epochs it was handed explicitly."""


__all__ = ["POSITION_FIELDS", "PULLED_FIELDS", "PackedPlace", "Planned", "Position", "Pulled", "Split", "Undelivered",
           "pulled_from_state", "pulled_to_state"]
