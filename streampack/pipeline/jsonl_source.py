"""jsonl / jsonl.gz shards, and the record -> Sample decoding shared with tar json members.

A line is one json object. Pre-tokenized: a list of ids under ``tokens_key``; text: a string
under ``text_key`` (tokens win when both exist). Optional ``labels_key`` / ``loss_mask_key``
lists are carried into the Sample. The sample key is the 0-based line number; blank lines keep
their number but yield nothing.

Resume cost, honestly:

- ``.jsonl``: the byte offset of the next line is recorded while reading, so a resume is one
  ``seek`` — bytes before the offset are never read.
- ``.jsonl.gz``: gzip has no random access, so the offset is in *uncompressed* bytes and a
  resume decompresses and discards everything before it (O(offset); zlib inflates roughly
  0.3-1 GB/s on one core). Use plain jsonl or tar shards when mid-shard resume must be O(1).
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from streampack.pipeline.errors import DataError, validate_per_token, validate_text, validate_tokens
from streampack.sample import Sample


DECOMPRESS_ERRORS: tuple[type[BaseException], ...] = (gzip.BadGzipFile, EOFError, zlib.error)
"""What a damaged ``.gz`` raises while inflating (``zlib.error`` for bad deflate data, which is
neither an ``OSError`` nor an ``EOFError``). Other ``OSError``s are I/O failures (a dropped
connection): they propagate so the reader reopens the shard at the recorded offset and retries."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeOptions:
    """Which fields of a record hold what; one value passed from the reader to the sources."""

    tokens_key: str = "input_ids"
    """json field (or ``<tokens_key>.npy`` tar member) holding pre-tokenized ids."""
    text_key: str = "text"
    """json field holding raw text."""
    labels_key: str | None = None
    """json field holding per-token labels (a ``labels.npy`` tar member is always read)."""
    loss_mask_key: str | None = None
    """json field holding a per-token 0/1 loss mask (``loss_mask.npy`` is always read)."""
    allow_pickle: bool = False
    """Unpickle ``.pyd``/``.pickle``/``.pkl`` tar members (arbitrary code execution)."""


@dataclass(frozen=True, slots=True)
class Item:
    """One decoded sample (or the error it raised) with where the *next* one starts."""

    sample: Sample | None
    error: DataError | None
    next_offset: int
    next_index: int
    at_end: bool


def make_sample(
    *, url: str, key: str, tokens: Any = None, text: Any = None, labels: Any = None, loss_mask: Any = None
) -> Sample:
    """Validate raw fields into a :class:`Sample`; raises :class:`DataError`."""
    tok = txt = None
    if tokens is not None:
        tok = validate_tokens(tokens, url=url, key=key)
    elif text is not None:
        txt = validate_text(text, url=url, key=key)
    else:
        raise DataError("missing_field", "sample has neither tokens nor text", url=url, key=key, value=None)
    length = None if tok is None else tok.shape[0]
    lab = None if labels is None else validate_per_token(labels, length, what="labels", url=url, key=key)
    mask = None if loss_mask is None else validate_per_token(loss_mask, length, what="loss_mask", url=url, key=key)
    return Sample(key=key, url=url, tokens=tok, text=txt, labels=lab, loss_mask=mask)


def parse_json_object(raw: bytes, *, url: str, key: str) -> dict[str, Any]:
    text = validate_text(raw, url=url, key=key) if raw.strip() else ""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError("bad_json", str(e), url=url, key=key, value=text) from None
    if not isinstance(obj, dict):
        raise DataError("bad_json", f"want a json object, got {type(obj).__name__}", url=url, key=key, value=obj)
    return obj


def decode_record(record: Mapping[str, Any], opts: DecodeOptions, *, url: str, key: str) -> Sample:
    return make_sample(
        url=url,
        key=key,
        tokens=record.get(opts.tokens_key),
        text=record.get(opts.text_key),
        labels=record.get(opts.labels_key) if opts.labels_key else None,
        loss_mask=record.get(opts.loss_mask_key) if opts.loss_mask_key else None,
    )


def text_stream(raw: BinaryIO, url: str) -> BinaryIO:
    """The uncompressed byte stream of a jsonl / jsonl.gz shard opened at byte 0."""
    return gzip.GzipFile(fileobj=raw, mode="rb") if url.split("?", 1)[0].endswith(".gz") else raw


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


__all__ = ["DecodeOptions", "Item", "decode_record", "iter_jsonl_items", "make_sample", "scan_jsonl", "text_stream"]
