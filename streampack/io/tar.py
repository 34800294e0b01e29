"""webdataset tar shards: members grouped into samples, judged, decoded and indexed.

Consecutive members sharing the key (name up to the first dot of the basename) form one sample; members come from
``tar_stream``, and those the decoder never reads are skipped unread. Bad structure costs exactly the samples it
touches (``incomplete_sample``, ``repeated_key``: docs/reliability.md). A sample next to a corrupt region is judged only
by what follows it, so the verdict is the same when a read resumes mid-range; a repeated key looks back, so keys before
a resume point are not remembered (that would mean re-reading the range prefix at every resume).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from streampack.errors import DataError
from streampack.io.decode import BAD_LENGTH, DecodeOptions, Item, token_count
from streampack.io.keys import KeySet
from streampack.io.limits import Limits
from streampack.io.npy import npy_length
from streampack.io.tar_decode import decode_tar_sample, decoder_want
from streampack.io.tar_header import BLOCK, opens_region
from streampack.io.tar_stream import CorruptRegion, Cursor, TarMember, iter_tar_members

_KEY = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")
_LOOKAHEAD = 16
"""Units after a sample next to a corrupt region within which an intact sample must show its
fields (else the sample is dropped): bounds what waits for a verdict."""


def split_key(name: str) -> tuple[str, str] | None:
    """webdataset's ``(key, field)`` split of a member name; None when it has no field."""
    m = _KEY.match(name)
    return (m.group(1), m.group(2)) if m else None


@dataclass(slots=True)
class TarGroup:
    """The members of one sample (fields -> bytes) and what is wrong with it, if anything."""

    key: str
    offset: int
    fields: dict[str, bytes] = field(default_factory=dict)
    read_bytes: int = 0
    problem: DataError | None = None
    after_region: bool = False
    before_region: bool = False
    next_offset: int = -1
    last: bool = False
    seen: int = 0
    """Units read after this sample while its verdict is pending; -1 once decided."""

    def fail(self, err: DataError) -> None:
        if self.problem is None:
            self.problem = err
        self.fields = dict.fromkeys(self.fields, b"")  # nothing of a bad sample is held


@dataclass(slots=True)
class TarRegion:
    """A corrupt byte range, with the samples after it that it is judged to have broken."""

    region: CorruptRegion
    merged: list[TarGroup] = field(default_factory=list)

    @property
    def next_offset(self) -> int:
        return self.merged[-1].next_offset if self.merged else self.region.end


Unit = TarGroup | TarRegion


def _add_member(group: TarGroup, name: str, member: TarMember, *, limits: Limits, url: str) -> None:
    if name in group.fields:
        group.fail(DataError("duplicate_member", f"field {name!r} appears twice", url=url, key=group.key, value=name))
    group.fields[name] = member.data or b""
    if member.data is None:
        group.fail(DataError("member_too_large", f"member {name!r} declares {member.size} bytes, over "
                             f"max_member_bytes={limits.max_member_bytes}", url=url, key=group.key,
                             value=member.size, skipped_bytes=member.size))
    group.read_bytes += member.size if member.data is None else len(member.data)
    if group.read_bytes > limits.max_sample_bytes:
        group.fail(DataError("sample_too_large", f"members hold {group.read_bytes} bytes, over "
                             f"max_sample_bytes={limits.max_sample_bytes}", url=url, key=group.key,
                             value=group.read_bytes, skipped_bytes=group.read_bytes))


def _units(f: BinaryIO, *, url: str, start: int, end: int | None, want: Callable[[str], int], seekable: bool,
           limits: Limits, after_region: bool = False) -> Iterator[Unit]:
    """Members -> sample groups and corrupt regions, in stream order (one member read ahead)."""
    cursor, cur, after = Cursor(start), None, after_region

    def member_want(name: str) -> int:  # the rest of a sample already judged bad is not read
        if cur is None or cur.problem is None:
            return want(name)
        split = split_key(name)
        return 0 if split and split[0] == cur.key else want(name)

    members = iter_tar_members(f, url=url, start=start, end=end, want=member_want, seekable=seekable, cursor=cursor,
                               max_bytes=limits.max_member_bytes)
    while True:
        try:
            m = next(members)
        except StopIteration:
            break
        except DataError:
            broken = split_key(cursor.pending[0]) if cursor.pending else None
            if cur is not None and (broken is None or broken[0] != cur.key):  # else it dies with the tail
                cur.next_offset = cursor.pending[1] if cursor.pending else cursor.pos
                cur.before_region = cursor.pending is None  # a lost header may have been one of its members
                yield cur
            raise
        if isinstance(m, CorruptRegion):
            if cur is not None:
                cur.next_offset, cur.before_region = m.start, True
                yield cur
                cur = None
            yield TarRegion(m)
            after = True
            continue
        split = split_key(m.name)
        if split is None:
            continue
        if cur is not None and split[0] != cur.key:
            cur.next_offset = m.offset
            yield cur
            cur = None
        if cur is None:
            cur, after = TarGroup(split[0], m.offset, after_region=after), False
        _add_member(cur, split[1], m, limits=limits, url=url)
    if cur is not None:
        cur.next_offset, cur.last = cursor.pos, True
        yield cur


def _judged(units: Iterator[Unit], url: str, peek: _Peek | None = None) -> Iterator[Unit]:
    """Judge each sample next to a corrupt region by the first intact sample among the ``_LOOKAHEAD``
    units after it (forward only, so a resumed read judges alike; ``peek`` looks past a range's end),
    then check keys against the range's earlier ones."""
    judge, last = _Judge(url), None
    try:
        for last in units:
            if peek is not None and isinstance(last, TarGroup) and last.last:
                last.before_region = peek.region_next()
            yield from judge.push(last)
    except DataError:
        yield from judge.finish()
        raise
    if peek is not None and judge.undecided:
        judge.look_ahead(peek.units(after_region=isinstance(last, TarRegion)))
    yield from judge.finish()


class _Peek:
    """What follows a range that ends inside the shard: the header past its end (from the range's own
    stream, opened one block longer), and only when that is not a plain member, the units after it."""

    def __init__(self, f: BinaryIO, reopen: Callable[[int, int | None], BinaryIO], *, at: int, url: str,
                 want: Callable[[str], int], seekable: bool, limits: Limits) -> None:
        self.f, self.reopen, self.at, self.url = f, reopen, at, url
        self.want, self.seekable, self.limits = want, seekable, limits
        self._region: bool | None = None

    def region_next(self) -> bool:
        if self._region is None:
            self._region = opens_region(self.f.read(BLOCK))  # the range's stream stands at its end
        return self._region

    def units(self, *, after_region: bool) -> Iterator[Unit]:
        return _units(self.reopen(self.at, None), url=self.url, start=self.at, end=None, want=self.want,
                      seekable=self.seekable, limits=self.limits, after_region=after_region)


def _intact(unit: Unit) -> bool:
    """A sample group with no corrupt region next to it."""
    return isinstance(unit, TarGroup) and not (unit.after_region or unit.before_region)


class _Judge:
    """The units awaiting a verdict (at most ``_LOOKAHEAD`` + 2: a bound on memory)."""

    def __init__(self, url: str) -> None:
        self.url, self.pending, self.keys = url, [], KeySet()
        self.undecided: list[TarGroup] = []

    def push(self, unit: Unit) -> list[Unit]:
        if not self.pending and _intact(unit):
            if not self.keys.add(unit.key):  # the common case: nothing waits for a verdict
                unit.fail(self._repeated(unit))
            return [unit]
        intact = self._see(unit)
        if not intact:
            self.pending.append(unit)
            if isinstance(unit, TarGroup):
                self.undecided.append(unit)
            self._decide([g for g in self.undecided if g.seen >= _LOOKAHEAD], None)
        out = self._ready(final=False)
        return out + self._keyed([unit]) if intact else out

    def finish(self) -> list[Unit]:
        self._decide(self.undecided, None)
        return self._ready(final=True)

    def look_ahead(self, units: Iterator[Unit]) -> None:
        """Decide the waiting samples from units past the range (they are not this range's)."""
        try:
            for unit in units:
                self._see(unit)
                self._decide([g for g in self.undecided if g.seen >= _LOOKAHEAD], None)
                if not self.undecided:
                    return
        except DataError:  # unreadable past the range: no intact sample shows the fields
            return

    def _see(self, unit: Unit) -> bool:
        """Age the waiting samples by one unit, and decide them all when it is intact (returned)."""
        for group in self.undecided:
            group.seen += 1
        if _intact(unit):
            self._decide(self.undecided, frozenset(unit.fields))  # type: ignore[union-attr]
            return True
        return False

    def _decide(self, groups: list[TarGroup], intact: frozenset[str] | None) -> None:
        for group in groups:
            if frozenset(group.fields) != intact:
                shown = sorted(intact) if intact is not None else f"none in the next {_LOOKAHEAD} units"
                group.fail(DataError("incomplete_sample", f"next to a corrupt region, with fields "
                                     f"{sorted(group.fields)} where the next intact sample has {shown}",
                                     url=self.url, key=group.key, value=group.offset))
            group.seen = -1  # decided
        self.undecided = [g for g in self.undecided if g.seen >= 0]

    def _ready(self, *, final: bool) -> list[Unit]:
        """Decided units from the front; a region leaves with the samples after it that it
        broke (no resume point between a region and what it broke)."""
        out: list[Unit] = []
        while self.pending:
            head = self.pending[0]
            if isinstance(head, TarGroup):
                if head.seen >= 0:
                    break
                out.append(self.pending.pop(0))
                continue
            after = self.pending[1] if len(self.pending) > 1 else None
            if after is None and not final:
                break
            if isinstance(after, TarGroup) and after.after_region:
                if after.seen >= 0:
                    break
                if after.problem is not None and after.problem.reason == "incomplete_sample":
                    head.merged.append(self.pending.pop(1))
            out.append(self.pending.pop(0))
        return self._keyed(out)

    def _keyed(self, units: list[Unit]) -> list[Unit]:
        for unit in units:
            for group in unit.merged if isinstance(unit, TarRegion) else [unit]:
                if not self.keys.add(group.key):
                    group.fail(self._repeated(group))
        return units

    def _repeated(self, group: TarGroup) -> DataError:
        return DataError("repeated_key", "an earlier sample of this shard has the same key", url=self.url,
                         key=group.key, value=group.offset)


def iter_tar_units(f: BinaryIO, *, url: str, start: int, end: int | None, want: Callable[[str], int], seekable: bool,
                   limits: Limits, reopen: Callable[[int, int | None], BinaryIO] | None = None) -> Iterator[Unit]:
    """Judged sample groups and corrupt regions of ``[start, end)``. With ``reopen(a, b)`` a range that
    ends inside the shard looks past ``end``: ``f`` must then hold one more block after it."""
    peek = None if end is None or reopen is None else _Peek(f, reopen, at=end, url=url, want=want,
                                                            seekable=seekable, limits=limits)
    return _judged(_units(f, url=url, start=start, end=end, want=want, seekable=seekable, limits=limits), url, peek)


def iter_tar_items(f: BinaryIO, opts: DecodeOptions, *, url: str, start: int, first_index: int, end: int | None,
                   seekable: bool, reopen: Callable[[int, int | None], BinaryIO] | None = None) -> Iterator[Item]:
    """Decoded samples of one shard range; a bad sample or corrupt region becomes an ``Item`` with
    ``error`` set; a shard that cannot be read on raises ``DataError("corrupt_shard")``."""
    idx = first_index
    for unit in iter_tar_units(f, url=url, start=start, end=end, want=decoder_want(opts), seekable=seekable,
                               limits=opts.limits, reopen=reopen):
        if isinstance(unit, TarRegion):
            yield Item(None, _region_error(unit, url), unit.next_offset, idx, False)
            continue
        try:
            if unit.problem is not None:
                raise unit.problem
            sample, err = decode_tar_sample(unit.key, unit.fields, opts, url=url), None
        except DataError as e:
            sample, err = None, e
        idx += 1
        yield Item(sample, err, unit.next_offset, idx, unit.last)


def _region_error(unit: TarRegion, url: str) -> DataError:
    r = unit.region
    lost = f" and the incomplete sample(s) {[g.key for g in unit.merged]} after it" if unit.merged else ""
    return DataError("corrupt_shard", f"{r.detail}; skipped bytes [{r.start}, {r.end}){lost}", url=url,
                     value=r.start, skipped_bytes=unit.next_offset - r.start)


def group_length(group: TarGroup, opts: DecodeOptions, token_npy: tuple[str, ...]) -> int:
    """Token count of a group read for an index: the count of the one member the reader takes the
    tokens from; -1 when unknown or when several members give tokens (the reader refuses that sample)."""
    found = [name for name in dict.fromkeys(token_npy) if group.fields.get(name)]
    raw = group.fields.get("json")
    count = token_count(raw, opts) if raw else -1
    if not found and count == BAD_LENGTH:
        return BAD_LENGTH  # the reader refuses the json member
    if len(found) + (count >= 0) != 1:
        return -1
    if not found:
        return count
    length = npy_length(group.fields[found[0]])
    return length if length >= 0 else BAD_LENGTH  # an unreadable npy header: the reader refuses it (bad_npy)
