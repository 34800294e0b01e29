"""The unit that flows through the pipeline: one document with its provenance."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streampack.errors import NOT_TOKENIZED


@dataclass(frozen=True, slots=True, kw_only=True)
class SampleOrigin:
    """Where a sample was read: enough to read it again (a resume state stores this, not the
    tokens) and to know where the reader stood after it."""

    shard: int
    """Index of the shard in its source's URL list."""
    offset: int
    """Where the sample starts: byte offset (uncompressed for ``.gz``) handed to the format reader."""
    number: int
    """Its number in the shard (tar ordinal, jsonl line number)."""
    next_offset: int
    """Where the next sample of the shard starts."""
    next_number: int
    epoch: int = 0
    """Epoch the reader read it in."""
    source: int = 0
    """Index of the source (mixture sources sorted by name; 0 for a single source)."""
    chunk: int = -1
    """Chunk index after the overlong policy (``-1``: the whole sample)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One document between reading and packing: ``tokens`` or ``text`` (until tokenized), and per-token
    ``labels``, ``loss_mask`` and ``extras`` of the same leading length."""

    key: str
    """Sample key inside its shard (a chunk index is appended when a sample is split)."""
    url: str = ""
    """The shard the sample came from (path or URL)."""
    tokens: np.ndarray | None = None
    """int64 ``[L]`` token ids."""
    text: str | None = None
    """Raw text, before tokenization."""
    labels: np.ndarray | None = None
    """int64 ``[L]`` the sample's own *unshifted* labels (HF convention: ``labels[i]`` is the
    target for token ``i``, ``-100`` = not supervised). ``None`` = the tokens themselves."""
    loss_mask: np.ndarray | None = None
    """bool ``[L]``: ``loss_mask[i]`` says whether token ``i`` is a supervised target."""
    extras: Mapping[str, np.ndarray] = field(default_factory=dict)
    """Per-token side arrays ``[L, ...]`` (e.g. 3-D mRoPE positions), packed alongside."""
    images: tuple[Any, ...] = ()
    """The sample's images in placeholder order (:class:`streampack.media.MediaImage`: encoded
    bytes and header before packing; decoded pixels only inside the batch)."""
    chat: Mapping[str, Any] | None = None
    """A chat record's fields (``messages``, ``conversations``, ``prompt`` / ``completion``, ``system``,
    ``tools``) until the chat stage renders them (:mod:`streampack.chat`)."""
    origin: SampleOrigin | None = None
    """Set by the reader; kept through tokenizing and the overlong policy (``chunk``). A stage
    that builds a new Sample without it makes the state store that sample's tokens instead."""

    def evolve(self, *, tokens: np.ndarray | None = None, labels: np.ndarray | None = None,
               loss_mask: np.ndarray | None = None, extras: Mapping[str, np.ndarray] | None = None,
               origin: SampleOrigin | None = None, images: tuple[Any, ...] | None = None) -> Sample:
        """A copy with the given fields replaced (None keeps the field): ``dataclasses.replace`` without its
        per-call introspection (1.1 us against 6; every sample is copied twice)."""
        return Sample(key=self.key, url=self.url, text=self.text, chat=self.chat,
                      tokens=self.tokens if tokens is None else tokens,
                      labels=self.labels if labels is None else labels,
                      loss_mask=self.loss_mask if loss_mask is None else loss_mask,
                      extras=self.extras if extras is None else extras,
                      origin=self.origin if origin is None else origin,
                      images=self.images if images is None else images)

    @property
    def doc_key(self) -> str:
        """Provenance string used in ``PackedBatch.doc_keys``: ``url#key``."""
        return f"{self.url}#{self.key}" if self.url else self.key

    def __len__(self) -> int:
        if self.tokens is None:
            raise ValueError(f"sample {self.doc_key!r} {NOT_TOKENIZED}")
        return int(self.tokens.shape[0])
