"""One tar sample's members -> a validated :class:`~streampack.sample.Sample`.

Fields: ``npy`` or ``<tokens_key>.npy`` (ids), ``json`` (a record), ``txt``, ``labels.npy``, ``loss_mask.npy``, and
pickle members (refused unless ``allow_pickle=True``: ``pickle_refused``). Tokens win over text; each of tokens, text,
labels and loss mask must come from one member, else ``conflicting_fields``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

from streampack.errors import DataError
from streampack.io.decode import DecodeOptions, chat_fields, make_sample, parse_json_object
from streampack.io.npy import decode_npy
from streampack.sample import Sample

PICKLE_EXTS = ("pyd", "pickle", "pkl")


def decoder_want(opts: DecodeOptions) -> Callable[[str], int]:
    """``want(member name)`` for the tar reader: -1 (read whole) for the fields the decoder
    uses, 0 (skip unread) for the rest (images, class labels...)."""
    used = {"npy", f"{opts.tokens_key}.npy", "json", "txt", "labels.npy", "loss_mask.npy"}

    def want(name: str) -> int:
        field = name.rsplit("/", 1)[-1].partition(".")[2]
        if (field in used or (opts.media is not None and opts.media.options.is_image_field(field))
                or (opts.allow_pickle and field.rsplit(".", 1)[-1] in PICKLE_EXTS)):
            return -1
        return 0

    return want


def decode_tar_sample(key: str, fields: dict[str, bytes], opts: DecodeOptions, *, url: str) -> Sample:
    """The sample held by ``fields`` (member field -> bytes); raises :class:`DataError`."""
    if len(fields) == 1 and ("npy" in fields or f"{opts.tokens_key}.npy" in fields):  # the common shape
        ((field, raw),) = fields.items()
        tokens = decode_npy(raw, member=field, url=url, key=key)
        return make_sample(url=url, key=key, tokens=tokens, vocab_size=opts.vocab_size)
    records: list[tuple[str, dict[str, Any]]] = []
    for field, raw in fields.items():
        if field.rsplit(".", 1)[-1] in PICKLE_EXTS:
            if not opts.allow_pickle:
                # bad data, not bad settings: one hostile sample must not end a run under on_error="skip"
                raise DataError("pickle_refused", f"member {field!r} is a pickle; pass allow_pickle=True to unpickle "
                                "(it runs code)", url=url, key=key, value=field)
            records.append((field, _unpickle(raw, field, url=url, key=key)))
    if "json" in fields:
        records.append(("json", parse_json_object(fields["json"], url=url, key=key,
                                                  max_depth=opts.limits.max_json_depth)))
    source = _Sources(fields, records, url=url, key=key)
    tokens = source.one("tokens", npy=("npy", f"{opts.tokens_key}.npy"), name=opts.tokens_key)
    text = source.one("text", raw=("txt",), name=opts.text_key) if tokens is None else None
    labels = mask = None
    if "labels.npy" in fields or (records and opts.labels_key):  # most samples carry neither
        labels = source.one("labels", npy=("labels.npy",), name=opts.labels_key)
    if "loss_mask.npy" in fields or (records and opts.loss_mask_key):
        mask = source.one("loss_mask", npy=("loss_mask.npy",), name=opts.loss_mask_key)
    images = () if opts.media is None else opts.media.tar_images(fields, opts.limits, url=url, key=key)
    chat = next(filter(None, (chat_fields(r) for _, r in records)), None) if text is None else None
    return make_sample(url=url, key=key, tokens=tokens, text=text, labels=labels, loss_mask=mask,
                       vocab_size=opts.vocab_size, images=images, chat=chat)


def _unpickle(raw: bytes, field: str, *, url: str, key: str) -> dict[str, Any]:
    try:
        obj = pickle.loads(raw)  # noqa: S301 - only with allow_pickle=True, the user's explicit opt-in
    except Exception as e:  # noqa: BLE001 - a broken pickle raises anything
        raise DataError("bad_pickle", f"member {field!r}: {e!r}", url=url, key=key, value=field) from None
    if not isinstance(obj, dict):
        raise DataError("bad_dtype", f"pickle member {field!r} is not a dict", url=url, key=key, value=type(obj))
    return obj


class _Sources:
    """Where each value of a sample comes from: ``.npy`` members, raw members, record fields."""

    def __init__(self, fields: dict[str, bytes], records: list[tuple[str, dict[str, Any]]], *, url: str,
                 key: str) -> None:
        self.fields, self.records, self.url, self.key = fields, records, url, key

    def one(self, what: str, *, npy: tuple[str, ...] = (), raw: tuple[str, ...] = (), name: str | None = None) -> Any:
        found = [m for m in npy if m in self.fields]
        if raw:
            found += [m for m in raw if m in self.fields]
        if name and self.records:
            found += [m for m, record in self.records if record.get(name) is not None]
        if len(found) > 1:
            raise DataError("conflicting_fields", f"{what} given by {len(found)} members {found}; keep one",
                            url=self.url, key=self.key, value=found)
        if not found:
            return None
        member = found[0]
        if member in npy:
            return decode_npy(self.fields[member], member=member, url=self.url, key=self.key)
        if member in raw:
            return self.fields[member]
        return dict(self.records)[member][name]
