"""Tar members from a byte stream: every header verified, every declared size bounded, and a
corrupt header skipped to the next readable one.

Not ``tarfile``: its stream mode treats a header cut short as a clean end (a truncated shard would silently lose its
tail) and reads whatever size a header declares; resuming also needs each header's exact offset. Damage:

- a header that is not one (bad checksum, non-octal fields) starts a :class:`CorruptRegion`,
  scanned forward to the next valid ``ustar`` header, as GNU tar does; a malformed pax record or
  an extension over :data:`MAX_EXTENSION_BYTES` extends the region over its member;
- a stream that ends inside a header or member, or with no readable header after a corrupt one,
  raises ``DataError("corrupt_shard")``.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from streampack.errors import DataError
from streampack.io import tar_header
from streampack.io.limits import MAX_EXTENSION_BYTES
from streampack.io.open import skip_bytes
from streampack.io.tar_header import BLOCK, Unreadable, is_header, padded, parse_header, parse_pax


@dataclass(slots=True)
class Cursor:
    pos: int
    pending: tuple[str, int] | None = None
    """``(name, offset)`` of the member whose data is being read."""


@dataclass(frozen=True, slots=True)
class TarMember:
    name: str
    offset: int
    """Byte offset of the member's first header (long-name / pax headers included)."""
    size: int
    """Declared data size."""
    data: bytes | None
    """The data, or only its first bytes when the caller asked for a prefix; None when the
    caller wanted it whole but it is over ``max_bytes`` (then it was skipped unread)."""


@dataclass(frozen=True, slots=True)
class CorruptRegion:
    start: int
    """Offset of the first unreadable header (or of the extension headers before it)."""
    end: int
    """Offset of the next readable header, or the end of the requested range."""
    detail: str


@dataclass(frozen=True, slots=True)
class _Header:
    name: str
    size: int
    kind: bytes
    first: int
    data_at: int

    @property
    def next(self) -> int:
        return self.data_at + padded(self.size)


class _Reader:
    """Reads headers and data of one tar stream from a known offset."""

    def __init__(self, f: BinaryIO, *, url: str, seekable: bool, end: int | None) -> None:
        self.f, self.url, self.seekable, self.end = f, url, seekable, end
        self.size: int | None = None  # known for a local file: a size past it is a lie
        if seekable:
            here = f.tell()
            self.size = f.seek(0, io.SEEK_END)
            f.seek(here)

    def skip(self, n: int, *, at: int) -> None:
        if n <= 0:
            return
        if self.seekable:  # past the end is found by the next header read
            self.f.seek(n, io.SEEK_CUR)
            return
        skip_bytes(self.f, n, self.url, "truncated tar member data", at=at)

    def header(self, pos: int, block: bytes | None) -> _Header | None:
        """The member header at ``pos`` with its extension headers applied; None at the end."""
        first, long_name, pax = pos, None, {}
        while True:
            if block is None:
                if self.end is not None and pos >= self.end and first == pos:
                    return None
                block = self.f.read(BLOCK)
            if block == tar_header.ZERO_BLOCK and first == pos:
                return None
            if len(block) < BLOCK:
                raise DataError("corrupt_shard", self._short(block, pos), url=self.url, value=pos)
            name, size, kind = parse_header(block, first=first, at=pos)
            block = None
            if kind not in tar_header.EXTENSIONS:
                size = int(pax["size"]) if "size" in pax else size
                name = pax.get("path", long_name or name)
                if size >= tar_header.MAX_DECLARED or (self.size is not None and pos + BLOCK + size > self.size):
                    # a lie, or a file cut inside this member: resync tells them apart
                    raise Unreadable(f"member {name!r} declares {size} bytes, past the end of the file",
                                      first=first, at=pos, name=name)
                return _Header(name, size, kind, first, pos + BLOCK)
            if size > MAX_EXTENSION_BYTES:
                raise Unreadable(f"extension header declares {size} bytes (limit {MAX_EXTENSION_BYTES})",
                                  first=first, at=pos, poison=True)
            data = self.f.read(padded(size))
            if len(data) < padded(size):
                raise DataError("corrupt_shard", "truncated tar extension header", url=self.url, value=pos)
            if kind == b"L":
                long_name = data[:size].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            elif kind == tar_header.PAX:
                try:
                    pax = parse_pax(data[:size], first=first, at=pos)
                except Unreadable as bad:
                    bad.resume = pos + BLOCK + padded(size)  # its data is read already
                    raise
            pos += BLOCK + padded(size)
            if kind == b"g":  # a global header belongs to no member
                first = pos

    def _short(self, block: bytes, pos: int) -> str:
        if pos == 0 and not block:
            return "0-byte file is not a tar archive (an empty archive is 1024 zero bytes)"
        if block:
            return "truncated tar header"
        return "ended without an end-of-archive block (truncated, or a member declared more bytes than the file holds)"

    def resync(self, bad: Unreadable) -> tuple[CorruptRegion, bytes | None]:
        """Skip to the next readable header after ``bad``: the region lost and that header's
        block (None when the range ended first); raises when the stream ends first."""
        pos = bad.resume
        while self.end is None or pos < self.end:
            block = self.f.read(BLOCK)
            if len(block) < BLOCK:
                what = (f"truncated data of member {bad.name!r}" if bad.name
                        else f"{bad.detail}; no readable tar header after it")
                raise DataError("corrupt_shard", what, url=self.url, value=bad.first,
                                skipped_bytes=pos + len(block) - bad.first)
            if is_header(block):
                if not bad.poison:
                    return CorruptRegion(bad.first, pos, bad.detail), block
                # the member the broken extension described is not trustworthy: lose it too
                _, size, _ = parse_header(block, first=pos, at=pos)
                self.skip(padded(size), at=pos)
                return CorruptRegion(bad.first, pos + BLOCK + padded(size), bad.detail), None
            pos += BLOCK
        return CorruptRegion(bad.first, self.end, bad.detail), None

    def data(self, head: _Header, n: int, max_bytes: int | None) -> bytes | None:
        """``n`` data bytes of ``head`` (-1 all), the rest skipped; None if refused."""
        if n < 0 and max_bytes is not None and head.size > max_bytes:
            self.skip(padded(head.size), at=head.data_at)
            return None
        n = head.size if n < 0 else min(n, head.size)
        data = self.f.read(n)
        if len(data) < n:
            raise DataError("corrupt_shard", f"truncated data of member {head.name!r}", url=self.url,
                            value=head.data_at)
        self.skip(padded(head.size) - n, at=head.data_at)
        return data


def iter_tar_members(f: BinaryIO, *, url: str, start: int, end: int | None = None,
                     want: Callable[[str], int] = lambda name: -1, seekable: bool = False, cursor: Cursor | None = None,
                     max_bytes: int | None = None) -> Iterator[TarMember | CorruptRegion]:
    """Regular-file members (and corrupt regions) of a tar stream at header offset ``start``. ``want(name)``
    says how many data bytes to read (-1 all, 0 none); a member wanted whole over ``max_bytes`` is
    skipped unread (``data=None``). Stops at the end-of-archive block or ``end`` (``cursor.pos``)."""
    cursor = cursor if cursor is not None else Cursor(start)
    reader = _Reader(f, url=url, seekable=seekable, end=end)
    pos, block = start, None
    while True:
        cursor.pos = pos
        try:
            head = reader.header(pos, block)
        except Unreadable as bad:
            cursor.pending = (bad.name, bad.first) if bad.name is not None else None
            region, block = reader.resync(bad)
            cursor.pending = None
            pos = region.end
            yield region
            continue
        block = None
        if head is None:
            return
        regular = head.kind in tar_header.REGULAR
        cursor.pending = (head.name, head.first)
        data = reader.data(head, want(head.name) if regular else 0, max_bytes)
        cursor.pending = None
        pos = head.next
        if regular:
            yield TarMember(head.name, head.first, head.size, data)
