"""Raw fields -> a validated :class:`~streampack.sample.Sample`, shared by every shard format.

Every value of a record (ids, text, labels, loss mask) is checked here, once; a problem becomes
a :class:`~streampack.errors.DataError` naming shard, key and value. Token ids (and labels) must
be below ``vocab_size`` (below 2**31 when it is not given).

JSON nesting (``max_json_depth``) is bounded without slowing normal lines: a line with no more opening brackets than the
limit cannot nest deeper; any other is parsed (CPython's json raises ``RecursionError`` long before the C stack is at
risk) and the parsed object measured. Only a process that raised the recursion limit past :data:`SAFE_RECURSION_LIMIT`
gets the exact byte scan (:func:`json_depth`, ~1.5x ``json.loads``, ``benchmarks/bench_hostile.py``) before parsing.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from streampack.errors import DataError
from streampack.io.limits import Limits, check_vocab_size, id_bound
from streampack.sample import Sample


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
    vocab_size: int | None = None
    """Token ids (and labels) must be below it; None = below 2**31."""
    limits: Limits = Limits()
    """Bounds on line / member / sample bytes and json depth."""
    eos_id: int | None = None
    """Flat token arrays (:mod:`streampack.io.token_array`): documents end at this id; None: at the offsets file."""
    megatron_sample: str = "document"
    """Megatron-core indexed data sets: a sample per ``document`` or per ``sequence``."""
    token_dtype: str | None = None
    """Flat token arrays without a numpy header (a raw ``.bin`` or a memmap named ``.npy``): the ids' dtype."""
    media: Any = None
    """A :class:`streampack.media.MediaOptions` (where a sample's images are; its methods read
    them, so this layer imports nothing of ``streampack.media``); None = text only."""

    def __post_init__(self) -> None:
        check_vocab_size(self.vocab_size)
        if not isinstance(self.limits, Limits):
            raise TypeError(f"limits must be a streampack.io.limits.Limits, got {type(self.limits).__name__}")


@dataclass(frozen=True, slots=True)
class Item:
    """One decoded sample (or the error it raised) with where the *next* one starts."""

    sample: Sample | None
    error: DataError | None
    next_offset: int
    next_index: int
    at_end: bool


CHAT_FIELDS = ("messages", "conversations", "prompt", "completion", "system", "tools")
"""The fields of a chat record, kept as ``Sample.chat`` when a record has no ids or text (the chat stage,
:mod:`streampack.chat`, renders them)."""


def chat_fields(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """A record's chat fields, None when it holds no conversation."""
    chat = {k: record[k] for k in CHAT_FIELDS if record.get(k) is not None}
    return chat if {"messages", "conversations", "prompt"} & chat.keys() else None


def make_sample(*, url: str, key: str, tokens: Any = None, text: Any = None, labels: Any = None, loss_mask: Any = None,
                vocab_size: int | None = None, images: tuple[Any, ...] = (), chat: Any = None) -> Sample:
    """Validate raw fields into a :class:`Sample` (ids win over text, text over a chat record); raises
    :class:`DataError`."""
    tok = txt = None
    if tokens is not None:
        tok = validate_tokens(tokens, url=url, key=key, vocab_size=vocab_size)
    elif text is not None:
        txt = validate_text(text, url=url, key=key)
    elif chat is not None:
        return Sample(key=key, url=url, chat=chat, images=images)
    else:
        raise DataError("missing_field", "sample has neither tokens nor text", url=url, key=key, value=None)
    length = None if tok is None else tok.shape[0]
    lab = None if labels is None else validate_per_token(labels, length, what="labels", url=url, key=key,
                                                         vocab_size=vocab_size)
    mask = None if loss_mask is None else validate_per_token(loss_mask, length, what="loss_mask", url=url, key=key)
    return Sample(key=key, url=url, tokens=tok, text=txt, labels=lab, loss_mask=mask, images=images)


def parse_json_object(raw: bytes, *, url: str, key: str, max_depth: int = Limits().max_json_depth) -> dict[str, Any]:
    """One json object from ``raw`` (strict UTF-8, nesting at most ``max_depth``)."""
    text = "" if not raw or raw.isspace() else validate_text(raw, url=url, key=key)
    try:
        obj = loads_bounded(raw, text, max_depth)
    except JsonTooDeep as e:
        raise DataError("json_too_deep", str(e), url=url, key=key, value=max_depth) from None
    except json.JSONDecodeError as e:
        raise DataError("bad_json", str(e), url=url, key=key, value=e.pos) from None
    if not isinstance(obj, dict):
        raise DataError("bad_json", f"want a json object, got {type(obj).__name__}", url=url, key=key,
                        value=type(obj).__name__)
    return obj


SAFE_RECURSION_LIMIT = 4000
"""Up to this recursion limit CPython's json raises ``RecursionError`` before the C stack
overflows (a json level takes well under 1 KB of an >= 8 MB stack)."""


class JsonTooDeep(ValueError):
    pass


def loads_bounded(raw: bytes, text: str | bytes, max_depth: int) -> Any:
    """``json.loads(text)`` (``raw`` = its bytes), refusing nesting deeper than ``max_depth``."""
    many = raw.count(b"[") + raw.count(b"{") > max_depth
    if many and sys.getrecursionlimit() > SAFE_RECURSION_LIMIT and json_depth(raw, max_depth) > max_depth:
        raise JsonTooDeep(f"json nests deeper than max_json_depth={max_depth}")
    try:
        obj = json.loads(text)
    except RecursionError:
        raise JsonTooDeep("json nests deeper than the interpreter's recursion limit") from None
    if many and _nesting_exceeds(obj, max_depth):
        raise JsonTooDeep(f"json nests deeper than max_json_depth={max_depth}")
    return obj


def _nesting_exceeds(obj: Any, limit: int) -> bool:
    stack = [(obj, 1)] if isinstance(obj, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


_KEEP = b'"[]{}'
_DELETE = bytes(c for c in range(256) if c not in _KEEP)
_STEP = np.zeros(256, np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


def json_depth(raw: bytes, limit: int) -> int:
    """Nesting depth of the json ``raw`` from its bytes, without parsing (any value <= ``limit`` when it
    cannot exceed it): escapes, then all but quotes and brackets, then string contents are removed."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return 0
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    structural = b"".join(raw.translate(None, _DELETE).split(b'"')[::2])
    steps = _STEP[np.frombuffer(structural, dtype=np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


BAD_LENGTH = -2
"""An index length meaning "the reader refuses this record" (unparsable json, an id field that is
not a list, a line or member over its limit): it never reaches the packer, so a plan counts it
as nothing (the reader skips and counts it, or raises), where -1 means "length unknown" (text)."""


def token_count(raw: bytes, opts: DecodeOptions) -> int:
    """Length of the id list under ``tokens_key`` in the json ``raw``: -1 without that field,
    :data:`BAD_LENGTH` when unreadable or not a list (a hint: the reader validates every sample)."""
    try:
        record = loads_bounded(raw, raw, opts.limits.max_json_depth)
        ids = record.get(opts.tokens_key, None) if isinstance(record, dict) else None
    except ValueError:
        return BAD_LENGTH
    if ids is None:
        return -1 if isinstance(record, dict) else BAD_LENGTH
    return len(ids) if isinstance(ids, list) else BAD_LENGTH


def decode_record(record: Mapping[str, Any], opts: DecodeOptions, *, url: str, key: str) -> Sample:
    images: tuple[Any, ...] = ()
    if opts.media is not None:
        images = opts.media.record_media(record, opts.limits, url=url, key=key)
    return make_sample(images=images, url=url, key=key, tokens=record.get(opts.tokens_key),
                       text=record.get(opts.text_key), labels=record.get(opts.labels_key) if opts.labels_key else None,
                       loss_mask=record.get(opts.loss_mask_key) if opts.loss_mask_key else None,
                       vocab_size=opts.vocab_size, chat=chat_fields(record))


def validate_tokens(value: Any, *, url: str, key: str, vocab_size: int | None = None) -> np.ndarray:
    """A json list or numpy array of token ids -> int64 ``[L]``, ``L >= 1``, ids in ``[0, vocab_size)``;
    strings, nested lists, booleans and integral floats are ``bad_dtype``, fractions ``non_integer_id``."""
    if isinstance(value, np.ndarray):
        arr = value
        if arr.dtype.kind not in "iu":
            raise DataError("bad_dtype", f"token array has dtype {arr.dtype}", url=url, key=key, value=arr[:8].tolist())
        if arr.ndim != 1:
            raise DataError("bad_dtype", f"token array has shape {arr.shape}, want [L]", url=url, key=key,
                            value=arr.shape)
        if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            raise DataError("bad_dtype", "token id overflows int64", url=url, key=key, value=int(arr.max()))
        arr = arr.astype(np.int64, copy=False)
    elif isinstance(value, list):
        arr = _json_ids(value, url=url, key=key)
    else:
        raise DataError("bad_dtype", f"tokens field is {type(value).__name__}, want a list of ints", url=url, key=key,
                        value=type(value).__name__)
    if arr.shape[0] == 0:
        raise DataError("empty_sample", "sample has 0 tokens", url=url, key=key, value=[])
    # one reduction checks both ends: viewed as uint64 a negative id is >= 2**63, past any bound
    # (min + max took 2 of the 3 reductions per sample, ~3 us each on a 600-token sample)
    if int(arr.view(np.uint64).max()) >= id_bound(vocab_size):
        if arr.min() < 0:
            bad = int(arr[np.argmax(arr < 0)])
            raise DataError("negative_id", "negative token id", url=url, key=key, value=bad)
        check_id_bound(arr, vocab_size, what="token id", url=url, key=key)
    return arr


def check_id_bound(ids: np.ndarray, vocab_size: int | None, *, what: str, url: str, key: str) -> None:
    """``out_of_vocab_id`` if any of ``ids`` is ``>= vocab_size`` (``>= 2**31`` without one)."""
    bound = id_bound(vocab_size)
    if ids.size and int(ids.max()) >= bound:
        bad = int(ids[np.argmax(ids >= bound)])
        limit = (f"vocab_size={vocab_size}" if vocab_size is not None
                 else "2**31 (set vocab_size to check the real bound)")
        raise DataError("out_of_vocab_id", f"{what} {bad} is not below {limit}", url=url, key=key, value=bad)


def _json_ids(values: list[Any], *, url: str, key: str) -> np.ndarray:
    for v in values:
        if type(v) is int:
            continue
        if type(v) is float and not v.is_integer():
            raise DataError("non_integer_id", "token id is not an integer", url=url, key=key, value=v)
        raise DataError("bad_dtype", f"token id of type {type(v).__name__}", url=url, key=key, value=type(v).__name__)
    try:
        return np.asarray(values, dtype=np.int64).reshape(-1)
    except OverflowError:
        raise DataError("bad_dtype", "token id overflows int64", url=url, key=key, value=max(values)) from None


def validate_text(value: Any, *, url: str, key: str) -> str:
    """Raw bytes (strict UTF-8) or str -> non-empty str."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError("bad_utf8", str(e), url=url, key=key, value=e.start) from None
    if not isinstance(value, str):
        raise DataError("bad_dtype", f"text field is {type(value).__name__}, want str", url=url, key=key,
                        value=type(value).__name__)
    if not value:
        raise DataError("empty_sample", "sample has empty text", url=url, key=key, value=value)
    return value


def validate_per_token(value: Any, length: int | None, *, what: str, url: str, key: str,
                       vocab_size: int | None = None) -> np.ndarray:
    """``labels`` (int64, ids below the vocabulary bound) or ``loss_mask`` (bool) of the sample's token length."""
    reason = f"bad_{what}"
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError):
        raise DataError(reason, f"{what} is not an array", url=url, key=key, value=type(value).__name__) from None
    if arr.ndim != 1 or arr.dtype.kind not in "iub":
        kind = f"{arr.dtype}{list(arr.shape)}"
        raise DataError(reason, f"{what} must be a 1-D integer array, got {kind}", url=url, key=key, value=kind)
    if length is not None and arr.shape[0] != length:
        raise DataError(reason, f"{what} has length {arr.shape[0]} != {length} tokens", url=url, key=key,
                        value=arr.shape[0])
    if what == "loss_mask":
        if arr.size and not np.isin(arr, (0, 1)).all():
            raise DataError(reason, "loss_mask values must be 0/1", url=url, key=key, value=arr[:8].tolist())
        return arr.astype(bool)
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise DataError(reason, f"{what} overflow int64", url=url, key=key, value=int(arr.max()))
    labels = arr.astype(np.int64)
    check_id_bound(labels, vocab_size, what="label", url=url, key=key)
    return labels
