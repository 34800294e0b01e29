"""What :func:`~streampack.layout.batch.pack_batch` accepts, checked before anything is laid out.

A Sample, a mapping or a plain id sequence, each ending as a Sample whose per-token fields have one
row per token and whose ids are int64 (numpy would otherwise broadcast a wrong-length field or cast
``-100`` into an unsigned dtype without a word, which trains on padding).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from streampack.errors import NOT_TOKENIZED
from streampack.sample import Sample

_HF_IGNORE = -100
"""What :class:`~streampack.sample.Sample` labels use for "not supervised" (HF convention)."""
_INT64_MAX = np.iinfo(np.int64).max


def _as_array(value: Any, what: str, key: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            value = value.float()  # numpy has no bfloat16; float32 holds every value exactly
        value = value.numpy()
    arr = np.asarray(value)
    if arr.ndim != 1 and what in ("tokens", "labels", "loss_mask"):
        raise ValueError(f"{what} of document {key!r} must be 1-D, got shape {arr.shape}")
    if arr.ndim == 0:
        raise ValueError(f"extra {what!r} of document {key!r} must be per-token [L, ...], "
                         f"got a scalar")
    return arr


def _as_ids(arr: np.ndarray, what: str, key: str) -> np.ndarray:
    """Integer ids as int64; non-integral floats or values past int64 are a ``ValueError``
    (a silent cast would truncate 1.5 to 1, or wrap 2**63 to a negative id)."""
    if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.integer)
                                     or np.issubdtype(arr.dtype, np.floating)):
        if arr.size:
            raise ValueError(f"{what} of document {key!r} must be integer ids, got {arr.dtype}")
        return arr.astype(np.int64, copy=False)
    if np.issubdtype(arr.dtype, np.floating):
        if arr.size and not (np.isfinite(arr).all() and (arr == np.round(arr)).all()):
            raise ValueError(f"{what} of document {key!r} must be integer ids, got non-integral "
                             f"{arr.dtype} values")
    if arr.size and arr.dtype == np.uint64 and int(arr.max()) > _INT64_MAX:
        raise ValueError(f"{what} of document {key!r} has id {int(arr.max())} past int64")
    return arr.astype(np.int64, copy=False)


def normalize(doc: Any, index: tuple[int, int]) -> Sample:
    """A Sample from a Sample, a mapping (other keys than the known ones are extras) or a sequence of ids."""
    if isinstance(doc, Sample):
        return doc
    default_key = f"pack{index[0]}/doc{index[1]}"
    if isinstance(doc, Mapping):
        doc = dict(doc)
        key = str(doc.pop("key", default_key))
        tokens = doc.pop("input_ids", doc.pop("tokens", None))
        if tokens is None:
            raise ValueError(f"document {key!r} has no 'input_ids' (keys: {sorted(doc)})")
        labels = doc.pop("labels", None)
        mask = doc.pop("loss_mask", None)
        return Sample(key=key, tokens=_as_array(tokens, "tokens", key),
                      labels=None if labels is None else _as_array(labels, "labels", key),
                      loss_mask=None if mask is None else _as_array(mask, "loss_mask", key),
                      extras={k: _as_array(v, k, key) for k, v in doc.items()})
    return Sample(key=default_key, tokens=_as_array(doc, "tokens", default_key))


def check_doc(doc: Sample, ignore_index: int) -> Sample:
    """Validate one document's per-token fields against its tokens; ids become int64 and a
    label of ``-100`` (the Sample convention for "not supervised") becomes ``ignore_index``."""
    key = doc.doc_key
    if doc.tokens is None:
        raise ValueError(f"sample {key!r} {NOT_TOKENIZED}")
    tokens = _as_ids(_as_array(doc.tokens, "tokens", key), "tokens", key)
    n = tokens.shape[0]
    labels = doc.labels
    if labels is not None:
        labels = _as_ids(_as_array(labels, "labels", key), "labels", key)
        if labels.shape[0] != n:
            raise ValueError(f"labels of document {key!r} have {labels.shape[0]} entries for "
                             f"{n} tokens")
        labels = np.where(labels == _HF_IGNORE, ignore_index, labels)
        bad = (labels < 0) & (labels != ignore_index)
        if bad.any():
            raise ValueError(f"labels of document {key!r} hold {int(labels[bad][0])}: a label is "
                             f"a token id, -100 or ignore_index={ignore_index}")
    mask = doc.loss_mask
    if mask is not None:
        mask = _as_array(mask, "loss_mask", key)
        if mask.shape[0] != n:
            raise ValueError(f"loss_mask of document {key!r} has {mask.shape[0]} entries for "
                             f"{n} tokens")
    extras = {k: _as_array(v, k, key) for k, v in doc.extras.items()}
    # labels / loss_mask stay None when they were: evolve keeps a field given as None
    return doc.evolve(tokens=tokens, labels=labels, loss_mask=mask, extras=extras)


def targets(doc: Sample, ignore_index: int) -> np.ndarray:
    """Unshifted per-token targets of one document (token i's target value, or ignore)."""
    target = doc.tokens if doc.labels is None else doc.labels
    if doc.loss_mask is not None:
        target = np.where(doc.loss_mask.astype(bool), target, ignore_index)
    return target


def check_extras(docs: list[list[Sample]]) -> list[str]:
    """Extra names, present on every document with the same trailing shape: numpy would otherwise broadcast a ``[L, 1]``
    (or, when ``L`` happens to match, an ``[L]``) extra into another document's ``[L, 3]`` layout without a word."""
    flat = [d for pack in docs for d in pack]
    names = sorted(flat[0].extras) if flat else []
    for d in flat:
        if sorted(d.extras) != names:
            raise ValueError(f"document {d.doc_key!r} has extras {sorted(d.extras)}, "
                             f"others have {names}")
        for name in names:
            if d.tokens is not None and d.extras[name].shape[0] != len(d):
                raise ValueError(f"extra {name!r} of document {d.doc_key!r} has "
                                 f"{d.extras[name].shape[0]} rows for {len(d)} tokens")
            trailing, first = d.extras[name].shape[1:], flat[0].extras[name].shape[1:]
            if trailing != first:
                raise ValueError(f"extra {name!r} of document {d.doc_key!r} has per-token shape "
                                 f"{trailing}, document {flat[0].doc_key!r} has {first}")
    return names


def alloc_extras(docs: list[list[Sample]], names: list[str], total: int) -> dict[str, np.ndarray]:
    """Zero-filled ``[T, ...]`` arrays; the dtype holds every document's values (an int extra
    of one document and a float extra of another give float, never a truncating cast)."""
    flat = [d for pack in docs for d in pack]
    out = {}
    for name in names:
        dtype = np.result_type(*(d.extras[name].dtype for d in flat))
        out[name] = np.zeros((total, *flat[0].extras[name].shape[1:]), dtype=dtype)
    return out
