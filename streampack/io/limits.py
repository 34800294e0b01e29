"""The limits a reader enforces on untrusted shards, on *declared* or *so-far-read* sizes, before allocating (the
table of limits and reasons: docs/reliability.md). 32 MiB of line or member leaves room for a 1M-token document (~7 MB
as a json id list) while bounding a reader's peak at a few hundred MiB.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

MiB = 1 << 20
MAX_EXTENSION_BYTES = 1 * MiB
"""Largest pax / GNU long-name header accepted (a larger one is ``corrupt_shard``)."""
MAX_JSON_DEPTH_CEILING = 500
"""``max_json_depth`` must stay well under CPython's default recursion limit (1000)."""
INT32_IDS = 2**31
"""Token ids must be below this when no ``vocab_size`` is given (int32 embedding indices)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """User-set bounds on what one sample may make the reader hold (the table: docs/reliability.md)."""

    max_line_bytes: int = 32 * MiB
    """Bytes of one jsonl line (its newline excluded)."""
    max_member_bytes: int = 32 * MiB
    """Declared bytes of one tar member that the decoder reads."""
    max_sample_bytes: int = 64 * MiB
    """Declared bytes of the read members of one tar sample, together; decoded bytes of the
    read columns of one parquet row."""
    max_json_depth: int = 128
    """Nesting depth of one json document (``[[1]]`` is 2)."""
    max_image_pixels: int = 32 * MiB
    """Declared pixels (width x height) of one image."""
    max_sample_pixels: int = 128 * MiB
    """Declared pixels of one sample's images together."""

    def __post_init__(self) -> None:
        for name in ("max_line_bytes", "max_member_bytes", "max_sample_bytes", "max_json_depth", "max_image_pixels",
                     "max_sample_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if self.max_json_depth > MAX_JSON_DEPTH_CEILING:
            raise ValueError(f"max_json_depth={self.max_json_depth} must be <= {MAX_JSON_DEPTH_CEILING}: "
                             f"deeper json overflows CPython's recursion limit while parsing")

    def recorded(self, *, images: bool) -> dict[str, int]:
        """The limits a resume state records: image limits at their defaults are left out (they decide
        nothing for a text stream)."""
        values, defaults = dataclasses.asdict(self), Limits()
        if not images:
            for name in IMAGE_LIMITS:
                if values[name] == getattr(defaults, name):
                    del values[name]
        return values


IMAGE_LIMITS = ("max_image_pixels", "max_sample_pixels")


def check_vocab_size(vocab_size: int | None) -> int | None:
    """``vocab_size`` as given, after checking it is None or an int in ``[1, 2**31]``."""
    if vocab_size is None:
        return None
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= INT32_IDS:
        raise ValueError(f"vocab_size={vocab_size!r} must be None or an int in [1, 2**31]")
    return vocab_size


def id_bound(vocab_size: int | None) -> int:
    """Token ids must be ``< id_bound(vocab_size)``."""
    return INT32_IDS if vocab_size is None else vocab_size


def unsigned_ids(ids: np.ndarray, bound: int) -> tuple[np.ndarray, int]:
    """``ids`` read as unsigned of their width, and ``bound`` for them: a negative id reads as at least
    ``2**(bits - 1)``, so "every id in ``[0, bound)``" is one comparison a id (one pass, not a minimum and a
    maximum)."""
    if ids.dtype.kind != "i":
        return ids, bound
    return ids.view(ids.dtype.str.replace("i", "u")), min(bound, 1 << (8 * ids.itemsize - 1))


def documents_in_bound(ids: np.ndarray, lengths: np.ndarray, bound: int) -> int:
    """How many of the documents ``lengths`` (back to back in ``ids``) come before the first holding an id outside
    ``[0, bound)``. One pass, a maximum over :func:`unsigned_ids` (two comparisons, their union and a search made
    four over every id); the search only for a bad id."""
    if not ids.size:
        return int(lengths.size)
    unsigned, bound = unsigned_ids(ids, bound)
    if int(unsigned.max()) < bound:
        return int(lengths.size)
    first_bad = int(np.argmax(unsigned >= bound))
    return int(np.searchsorted(np.cumsum(lengths), first_bad, side="right"))
