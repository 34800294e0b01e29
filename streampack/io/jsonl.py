"""jsonl / jsonl.gz / jsonl.zst shards, and the record -> Sample decoding shared with tar json members.

A line is one json object: ids under ``tokens_key`` or text under ``text_key`` (tokens win),
optional ``labels_key`` / ``loss_mask_key`` lists. The sample key is the 0-based line number;
blank lines keep their number but yield nothing. A ``.jsonl`` resume is one ``seek`` to the
recorded offset; ``.gz`` / ``.zst`` decompress and discard everything before it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from streampack.errors import DataError
from streampack.io.compression import DECOMPRESS_ERRORS, text_stream
from streampack.io.decode import DecodeOptions, Item, chat_fields, decode_record, parse_json_object
from streampack.io.limits import Limits

_DISCARD_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class Line:
    """One line of a jsonl stream, or a run of blank lines."""

    data: bytes | None
    """The line with its newline; None when it is over the limit (it was skipped unread);
    ``b"\\n"`` for a run of ``count`` > 1 blank lines."""
    offset: int
    number: int
    size: int
    """Bytes the line (the run) takes in the (uncompressed) stream, newline(s) included."""
    last: bool
    count: int = 1
    """Lines it stands for: more than 1 only for a run of blank lines, skipped in bulk."""


_BLANK = b" \t\r\n\x0b\x0c"  # what bytes.isspace() accepts
_BLANK_PEEK = 1 << 16


def _read_line(f: BinaryIO, limit: int) -> tuple[bytes | None, int]:
    """The next line and its size; None for a line over ``limit`` bytes, whose rest is dropped in
    1 MiB chunks (a 400 MiB line inflated from a 0.4 MiB ``.gz`` never sits in memory)."""
    line = f.readline(limit + 1)
    if len(line) <= limit or line.endswith(b"\n"):
        return line, len(line)
    size = len(line)
    del line
    while True:
        chunk = f.readline(_DISCARD_CHUNK)
        size += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return None, size


def _skip_blank_lines(f: BinaryIO, room: int | None) -> tuple[int, int]:
    """Consume the whole blank lines that follow (at most ``room`` bytes) in bulk from the buffer:
    ``(bytes, lines)`` (one Python iteration per line took 239 s on 16 MiB of newlines)."""
    peek = getattr(f, "peek", None)
    nbytes = lines = 0
    while peek is not None and (room is None or nbytes < room):
        buf = peek(1)[:_BLANK_PEEK]
        if room is not None:
            buf = buf[:room - nbytes]
        blank = len(buf) - len(buf.lstrip(_BLANK))
        cut = buf.rfind(b"\n", 0, blank) + 1  # whole lines only: a line may start with spaces
        if not cut:
            break
        f.read(cut)
        nbytes, lines = nbytes + cut, lines + buf.count(b"\n", 0, cut)
        if cut < len(buf):
            break
    return nbytes, lines


def _next_line(f: BinaryIO, off: int, idx: int, end: int | None, limit: int) -> Line | None:
    if end is not None and off >= end:
        return None
    data, size = _read_line(f, limit)
    if not size:
        return None
    if data is not None and data.endswith(b"\n") and data.isspace():
        more, lines = _skip_blank_lines(f, None if end is None else end - off - size)
        if lines:
            return Line(b"\n", off, idx, size + more, False, 1 + lines)
    return Line(data, off, idx, size, False)


def iter_lines(f: BinaryIO, *, start: int, first_index: int, end: int | None,
               max_bytes: int = Limits().max_line_bytes) -> Iterator[Line]:
    """The lines of a stream at ``start``, each at most ``max_bytes`` (a run of blank lines is one
    :class:`Line`), read one ahead; when that read fails the line already read is yielded first."""
    line = _next_line(f, start, first_index, end, max_bytes)
    while line is not None:
        try:
            nxt = _next_line(f, line.offset + line.size, line.number + line.count, end, max_bytes)
        except BaseException:
            if line.data is None or line.data.endswith(b"\n"):  # complete: it is good data
                yield line
            raise
        yield Line(line.data, line.offset, line.number, line.size, nxt is None, line.count)
        line = nxt


def _require_ids_or_text(record: dict[str, Any], opts: DecodeOptions, *, url: str, key: str) -> None:
    """A line with neither field is ``missing_field`` naming the keys looked for and the fields
    it has (a ``tokens_key`` / ``text_key`` typo is the usual cause), as parquet's error does."""
    if record.get(opts.tokens_key) is None and record.get(opts.text_key) is None and chat_fields(record) is None:
        fields = list(record)[:20]
        raise DataError("missing_field", f"no {opts.tokens_key!r} (token ids) or {opts.text_key!r} (text) field "
                        f"(fields: {fields}); set tokens_key= / text_key=", url=url, key=key)


def iter_jsonl_items(f: BinaryIO, opts: DecodeOptions, *, url: str, start: int, first_index: int,
                     end: int | None) -> Iterator[Item]:
    """Decoded samples of one shard range; a bad line becomes an ``Item`` with ``error`` set."""
    reached, number = start, first_index
    limit = opts.limits.max_line_bytes
    try:
        for line in iter_lines(f, start=start, first_index=first_index, end=end, max_bytes=limit):
            reached = nxt = line.offset + line.size  # where the first lost line starts if a read fails
            number = line.number + line.count
            key = str(line.number)
            if line.data is None:
                yield Item(None, DataError("line_too_long", f"line of {line.size} bytes, over max_line_bytes={limit}",
                                           url=url, key=key, value=line.size, skipped_bytes=line.size),
                           nxt, number, line.last)
                continue
            if line.data.isspace():
                if line.last:
                    yield Item(None, None, nxt, number, True)
                continue
            try:
                record = parse_json_object(line.data, url=url, key=key, max_depth=opts.limits.max_json_depth)
                _require_ids_or_text(record, opts, url=url, key=key)
                yield Item(decode_record(record, opts, url=url, key=key), None, nxt, number, line.last)
            except DataError as e:
                yield Item(None, e, nxt, number, line.last)
    except DECOMPRESS_ERRORS as e:
        raise DataError("corrupt_shard", f"cannot decompress after uncompressed byte {reached}: {e}",
                        url=url, key=str(number), value=reached) from None


__all__ = ["DECOMPRESS_ERRORS", "Line", "iter_jsonl_items", "iter_lines", "text_stream"]
