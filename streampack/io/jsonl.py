"""jsonl / jsonl.gz / jsonl.zst shards, and the record -> Sample decoding shared with tar json members.

A line is one json object. Pre-tokenized: a list of ids under ``tokens_key``; text: a string
under ``text_key`` (tokens win when both exist). Optional ``labels_key`` / ``loss_mask_key``
lists are carried into the Sample. The sample key is the 0-based line number; blank lines keep
their number but yield nothing.

Resume cost, honestly:

- ``.jsonl``: the byte offset of the next line is recorded while reading, so a resume is one
  ``seek`` — bytes before the offset are never read.
- ``.jsonl.gz`` / ``.jsonl.zst``: no random access, so the offset is in *uncompressed* bytes
  and a resume decompresses and discards everything before it (see
  :mod:`streampack.io.compression`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import BinaryIO

from streampack.errors import DataError
from streampack.io.compression import DECOMPRESS_ERRORS, text_stream
from streampack.io.decode import DecodeOptions, Item, decode_record, parse_json_object


def iter_lines(f: BinaryIO, *, start: int, first_index: int, end: int | None) -> Iterator[tuple[bytes, int, int, bool]]:
    """``(line, offset, line_number, is_last)`` from a stream positioned at ``start``.

    Reads one line ahead so the last line of a range is known when it is yielded.
    """
    off, idx = start, first_index
    line = f.readline() if end is None or off < end else b""
    while line:
        nxt_off = off + len(line)
        nxt = f.readline() if end is None or nxt_off < end else b""
        yield line, off, idx, not nxt
        line, off, idx = nxt, nxt_off, idx + 1


def iter_jsonl_items(
    f: BinaryIO, opts: DecodeOptions, *, url: str, start: int, first_index: int, end: int | None
) -> Iterator[Item]:
    """Decoded samples of one shard range; a bad line becomes an ``Item`` with ``error`` set.

    A damaged ``.gz`` raises ``DataError("corrupt_shard")`` naming the (uncompressed) offset
    and the number of the first line it loses.
    """
    reached, number = start, first_index
    try:
        for line, off, idx, last in iter_lines(f, start=start, first_index=first_index, end=end):
            reached, number = off + len(line), idx + 1  # the first line lost if the next read fails
            if not line.strip():
                if last:
                    yield Item(None, None, off + len(line), idx + 1, True)
                continue
            key = str(idx)
            try:
                sample = decode_record(parse_json_object(line, url=url, key=key), opts, url=url, key=key)
                yield Item(sample, None, off + len(line), idx + 1, last)
            except DataError as e:
                yield Item(None, e, off + len(line), idx + 1, last)
    except DECOMPRESS_ERRORS as e:
        raise DataError("corrupt_shard", f"cannot decompress after uncompressed byte {reached}: {e}",
                        url=url, key=str(number), value=reached) from None


def scan_jsonl(f: BinaryIO, opts: DecodeOptions, *, url: str) -> tuple[list[int], list[int], list[int], int]:
    """Index data for a whole shard: offsets and numbers of non-blank lines, their token
    lengths (-1 = text/unknown) and the end offset.

    Reads the whole shard once (it is built once per shard and cached).
    """
    offsets: list[int] = []
    numbers: list[int] = []
    lengths: list[int] = []
    end = 0
    try:
        for line, off, idx, _ in iter_lines(f, start=0, first_index=0, end=None):
            end = off + len(line)
            if not line.strip():
                continue
            offsets.append(off)
            numbers.append(idx)
            lengths.append(_cheap_length(line, opts))
    except (OSError, *DECOMPRESS_ERRORS) as e:
        raise DataError("corrupt_shard", f"cannot decompress/read: {e}", url=url, value=end) from None
    return offsets, numbers, lengths, end


def _cheap_length(line: bytes, opts: DecodeOptions) -> int:
    try:
        ids = json.loads(line).get(opts.tokens_key)
    except (ValueError, AttributeError):
        return -1
    return len(ids) if isinstance(ids, list) else -1


__all__ = ["DECOMPRESS_ERRORS", "iter_jsonl_items", "scan_jsonl", "text_stream"]
