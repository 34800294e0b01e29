"""Overlong stage: what to do with a document longer than the pack capacity — split, truncate, drop or error — as a
policy function and the node that applies it before packing.

The right default differs by use case (pretraining wants ``split`` so no token is lost; chat SFT often wants ``drop``
or ``truncate`` because a split conversation is not a conversation), so the policy is explicit and every token it
touches is counted; the counters travel in the node state so metrics stay exact across a resume. A sample with images
(``media=``) is never cut through an image's or video's tokens, and one whose image alone is over the capacity is
dropped under ``split`` and ``truncate``, counted in ``media_overlong`` (``docs/multimodal.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from torchdata.nodes import BaseNode

from streampack.errors import DataError, ErrorPolicy
from streampack.logs import get_logger, warn_every
from streampack.nodes.block_reader import BlockReader
from streampack.options.packing import OVERLONG_POLICIES
from streampack.plan.cursor import (
    POSITION_FIELDS,
    PULLED_FIELDS,
    Position,
    Pulled,
    Split,
    Undelivered,
    pulled_from_state,
    pulled_to_state,
)
from streampack.plan.epoch_plan import chunk_lengths
from streampack.plan.rows import BlockStore, PackRows, block_rows, cat, repeat, rows_of, sample_rows
from streampack.plan.state import record_of, record_text, samples_from_state, samples_to_state, samples_to_table
from streampack.sample import Sample

if TYPE_CHECKING:  # media stays an optional part: imported where a sample has images
    from streampack.media.options import MediaOptions
    from streampack.media.stage import MediaSpans


class Rechunk(Protocol):
    """What the node re-reads a split sample with (a :class:`~streampack.plan.replay.Replayer`)."""

    def chunks(self, at: Position, store: BlockStore) -> np.ndarray: ...

_log = get_logger(__name__)


@dataclass(slots=True)
class OverlongCounters:
    """Running counts of what the policy did (tokens = tokens of the affected samples that
    were split / removed by truncation / dropped)."""

    samples_split: int = 0
    tokens_split: int = 0
    chunks_created: int = 0
    samples_truncated: int = 0
    tokens_truncated: int = 0
    samples_dropped: int = 0
    tokens_dropped: int = 0
    media_overlong: int = 0
    """Of ``samples_dropped``: samples dropped under ``split`` or ``truncate`` because one of
    their images or videos alone has more tokens than the capacity."""

    def as_dict(self) -> dict[str, int]:
        # not dataclasses.asdict, which deep-copies each value: this runs in every per-batch state snapshot
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _too_long(doc_key: str, n: int, max_len: int) -> ValueError:
    return ValueError(f"sample {doc_key!r} has {n} tokens, more than the capacity {max_len} (overlong='error'; "
                      f"use 'split', 'truncate' or 'drop')")


def _slice(sample: Sample, start: int, stop: int, key: str, chunk: int, spans: MediaSpans | None = None) -> Sample:
    def cut(a):
        return None if a is None else a[start:stop]

    origin = None if sample.origin is None else replace(sample.origin, chunk=chunk)
    images = sample.images
    if spans is not None:  # the images whose tokens lie in [start, stop), in their order
        inside = np.sort(spans.item[(spans.start >= start) & (spans.stop <= stop)])
        images = tuple(sample.images[i] for i in inside.tolist())
    return replace(sample, key=key, tokens=sample.tokens[start:stop], labels=cut(sample.labels),
                   loss_mask=cut(sample.loss_mask), images=images,
                   extras={k: v[start:stop] for k, v in sample.extras.items()}, origin=origin)


def _cut(end: int, start: np.ndarray, stop: np.ndarray) -> int:
    """``end``, or the start of the span (an image's or video's tokens, sorted) it would cut through."""
    i = int(np.searchsorted(stop, end, side="right"))  # first span ending after ``end``
    return int(start[i]) if i < len(stop) and int(start[i]) < end else end


def _bounds(n: int, max_len: int, start: np.ndarray, stop: np.ndarray) -> list[int] | None:
    """Chunk boundaries ``[0, ..., n]`` of at most ``max_len`` tokens that cut through no span
    (each cut as late as it can be); None when a span alone is longer than ``max_len``."""
    if not len(start):
        return [*range(0, n, max_len), n]
    if int((stop - start).max()) > max_len:
        return None
    bounds = [0]
    while bounds[-1] + max_len < n:
        bounds.append(_cut(bounds[-1] + max_len, start, stop))  # > bounds[-1]: no span is longer than max_len
    return [*bounds, n]


def cut_lengths(n: int, max_len: int, policy: str, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """int64: the document lengths :func:`apply_overlong` makes, with ``media``, of a sample of
    ``n`` tokens whose images and videos span ``[start, stop)`` (sorted); what an epoch plan
    counts and an elastic resume re-cuts (``error`` counts as ``truncate``, as the plan does)."""
    if n <= max_len:
        return np.asarray([n], dtype=np.int64)
    if policy == "drop":
        return np.zeros(0, dtype=np.int64)
    if policy != "split":
        end = _cut(max_len, start, stop)
        return np.asarray([end] if end else [], dtype=np.int64)
    bounds = _bounds(n, max_len, start, stop)
    return np.zeros(0, dtype=np.int64) if bounds is None else np.diff(np.asarray(bounds, dtype=np.int64))


def apply_overlong(sample: Sample, max_len: int, policy: str,
                   counters: OverlongCounters | None = None, *, media: MediaOptions | None = None) -> list[Sample]:
    """Return the documents that ``sample`` becomes under ``policy`` (``[sample]`` when it fits).

    ``split`` makes ``ceil(L / max_len)`` chunks with keys ``key/0``, ``key/1``, …; each chunk is
    its own document (its last token's label is ignored, like any document end). With ``media``
    (:class:`~streampack.media.MediaOptions`) and images in ``sample``, no cut falls inside an
    image's tokens: chunks may be shorter and more. A sample whose
    image tokens do not match its images is ``DataError("image_tokens_mismatch")``.
    """
    if policy not in OVERLONG_POLICIES:
        raise ValueError(f"overlong={policy!r} must be one of {OVERLONG_POLICIES}")
    if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1:
        # max_len=0 would make range(0, n, 0) raise a bare error, or truncate to nothing
        raise ValueError(f"{max_len=} must be a positive int")
    n = len(sample)
    if n <= max_len:
        return [sample]
    counters = counters if counters is not None else OverlongCounters()
    if policy == "error":
        raise _too_long(sample.doc_key, n, max_len)
    spans = None
    if media is not None and sample.images and policy != "drop":
        from streampack.media.stage import media_spans

        spans = media_spans(sample, media)
    start, stop = (spans.start, spans.stop) if spans is not None else (np.zeros(0, np.int64),) * 2
    bounds = [0, *np.cumsum(cut_lengths(n, max_len, policy, start, stop)).tolist()]
    if len(bounds) == 1:  # dropped: by the policy, or an image or video alone is longer than the capacity
        counters.samples_dropped += 1
        counters.tokens_dropped += n
        if policy != "drop":
            counters.media_overlong += 1
            warn_every(_log, "media_overlong", "dropped sample %r: one of its images or videos alone has more "
                       "tokens than the capacity %d (counted in overlong counters' media_overlong)", sample.doc_key,
                       max_len)
        return []
    if policy == "truncate":
        counters.samples_truncated += 1
        counters.tokens_truncated += n - bounds[1]
        return [_slice(sample, 0, bounds[1], sample.key, 0, spans)]
    chunks = [_slice(sample, s, e, f"{sample.key}/{i}", i, spans) for i, (s, e) in enumerate(zip(bounds, bounds[1:]))]
    counters.samples_split += 1
    counters.tokens_split += n
    counters.chunks_created += len(chunks)
    return chunks


def chunk_counts(lengths: np.ndarray, max_len: int, policy: str) -> np.ndarray:
    """Documents each of ``lengths`` becomes under ``policy`` (``apply_overlong``)."""
    if policy == "split":
        return np.maximum(-(-lengths // max_len), 1)
    if policy == "drop":
        return (lengths <= max_len).astype(np.int64)
    return np.ones(lengths.shape[0], dtype=np.int64)


def expand(rows: np.ndarray, max_len: int, policy: str) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` after the overlong policy (every chunk), and the chunk count of each."""
    lengths = rows["length"]
    counts = chunk_counts(lengths, max_len, policy)
    over = lengths > max_len
    if not over.any():
        return rows, counts
    out = repeat(rows, counts)
    mine = np.repeat(over, counts)
    if policy == "truncate":
        out["chunk"][mine] = 0
        out["length"][mine] = max_len
        return out, counts
    # split: chunk j of a document starts j * max_len tokens in
    j = np.arange(out.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
    out["chunk"] = np.where(mine, j, out["chunk"])
    out["start"] += np.where(mine, j * max_len, 0)
    out["length"] = np.where(mine, np.minimum(max_len, out["length"] - j * max_len), out["length"])
    out["cut"] = mine
    return out, counts


class OverlongNode(BaseNode[Sample]):
    """Documents of at most ``max_len`` tokens according to ``policy``, as rows (:mod:`streampack.plan.rows`):
    :meth:`take` hands out the next ``n`` (the packer reads those); ``next()`` yields one as a Sample.

    Its source is the reader, or whatever node yields Samples before it. A
    :class:`~streampack.nodes.block_reader.BlockReader` that is its direct source hands it runs of documents read as
    blocks: it consumes exactly the documents that give ``n`` (one ``searchsorted`` over the run's cumulative chunk
    counts) and cuts them as columns (:func:`expand`). Samples are cut one by one (:func:`apply_overlong`, which keeps
    images whole). Either way the reader's position, the chunks left of a split document and the counters are the same.

    State = upstream state + the sample being split, as a reference (its tokens only when ``replay`` is None or the
    sample has no origin) + counters + the last sample pulled from each source (every sample after it in its reader's
    order is unread downstream: an elastic resume's frontier). ``replay`` (a
    :class:`~streampack.plan.replay.Replayer`) re-reads a split sample's chunks at a restore.
    """

    SOURCE_KEY = "source"
    PENDING_KEY = "pending"
    COUNTERS_KEY = "counters"
    LAST_KEY = "last"
    KIND_KEY = "kind"
    KIND = "OverlongNode"

    def __init__(self, source: BaseNode[Sample], max_len: int, policy: str = "split", *,
                 replay: Rechunk | None = None, media: MediaOptions | None = None,
                 error_policy: ErrorPolicy | None = None) -> None:
        super().__init__()
        # max_len and policy as checked by StreamConfig and PackOptions; apply_overlong checks them for a
        # hand-built node at its first sample
        self.source, self.max_len, self.policy, self.replay, self.media = source, max_len, policy, replay, media
        self.store = BlockStore()
        """The blocks this node's rows point into (the packer reading :meth:`take` shares it)."""
        # a sample whose image tokens do not match its images (default: raise)
        self._policy = error_policy if error_policy is not None else ErrorPolicy()
        self.reads_blocks = isinstance(source, BlockReader)
        self._clear()

    def _clear(self) -> None:
        self.counters = OverlongCounters()
        self.pending = rows_of(0)
        self._split: Split | None = None  # the sample split (``next`` unset: the chunks left are ``pending``)
        self._last: dict[int, Pulled] = {}

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._clear()
        if initial_state is None:
            self.source.reset(None)
            return
        self.source.reset(initial_state[self.SOURCE_KEY])
        self.counters = OverlongCounters(**record_of(initial_state[self.COUNTERS_KEY]))
        self._last = {p.source: p for p in pulled_from_state(initial_state[self.LAST_KEY])}
        pending = initial_state[self.PENDING_KEY]
        split = Split.from_state(pending)
        if split is None:
            stored = samples_from_state(pending)
            if stored:
                self.pending = sample_rows(stored, self.store)
            return
        if self.replay is None:
            raise ValueError("this OverlongNode state holds its split sample by reference, but the node "
                             "has no replay function to re-read it")
        chunks = self.replay.chunks(split.at, self.store)
        if len(chunks) != split.count or int(chunks["length"].sum()) != split.tokens:
            raise ValueError(f"split sample at {split.at} re-read as {len(chunks)} chunks, {split.count} when the "
                             f"state was saved: the shard changed, or a stage is not a pure function")
        self._split = split
        self.pending = chunks[split.next:]

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` rows (fewer only when the stream ended)."""
        parts = []
        if len(self.pending):
            parts.append(self.pending[:n])
            self.pending = self.pending[n:]
        have = sum(len(p) for p in parts)
        while have < n:
            pulled = self._pull_run(n - have) if self.reads_blocks else self._pull_samples(n - have)
            if pulled is None:
                break
            rows, split = pulled
            parts.append(rows[:n - have])
            self.pending = rows[n - have:]
            have += min(len(rows), n - have)
            if len(self.pending):
                self._split = split
        if len(parts) == 1:
            return parts[0]
        return cat(parts)

    def _pull_run(self, want: int) -> tuple[np.ndarray, Split | None] | None:
        """Consume the documents of the reader's next run that give ``want`` rows; their rows, and
        the last one's split (None: the stream ended)."""
        run = self.source.run()  # type: ignore[attr-defined]
        if run is None:
            return None
        lengths = run.block.lengths[run.lo:run.hi]
        counts = chunk_counts(lengths, self.max_len, self.policy)
        k = 1 if run.consumed else min(int(np.searchsorted(np.cumsum(counts), want)) + 1, len(run))
        over = lengths[:k] > self.max_len
        bad = int(over.argmax()) if self.policy == "error" and over.any() else -1
        if bad >= 0:
            k = bad + 1
        if not run.consumed:
            self.source.consume(k)  # type: ignore[attr-defined]
        rows = block_rows(run.block, slice(run.lo, run.lo + k), self.store, source=run.source, shard=run.shard,
                          epoch=run.epoch)
        last = Pulled(**{name: int(rows[-1][name]) for name in PULLED_FIELDS})
        self._last[last.source] = last
        if bad >= 0:
            raise _too_long(run.block.doc_key(run.lo + bad), int(lengths[bad]), self.max_len)
        if over.any():
            self._count(lengths[:k][over], counts[:k][over])
        out, counts = expand(rows, self.max_len, self.policy)
        n = int(counts[-1])
        at = Position(**{name: int(rows[-1][name]) for name in POSITION_FIELDS})
        return out, Split(at=at, next=0, count=n, tokens=int(out["length"][-n:].sum()) if n else 0)

    def _pull_samples(self, want: int) -> tuple[np.ndarray, Split | None] | None:
        """Samples from the source, cut one by one, until they give ``want`` rows (fewer when the
        stream ends); their rows, and the last sample's split when it has an origin."""
        chunks: list[Sample] = []
        last: tuple[Sample, list[Sample]] | None = None
        while len(chunks) < want:
            try:
                sample = next(self.source)
            except StopIteration:
                break
            if sample.origin is not None:
                self._last[sample.origin.source] = Pulled.of(sample.origin)
            try:
                cut = apply_overlong(sample, self.max_len, self.policy, self.counters, media=self.media)
            except DataError as e:
                self._policy.handle(e)
                continue
            chunks += cut
            last = (sample, cut)
        if not chunks:
            return None
        sample, cut = last  # type: ignore[misc]
        split = None
        if sample.origin is not None:
            lengths = tuple(len(c) for c in cut)
            # cut around images, the chunks are not ceil(tokens / max_len) of max_len: an elastic
            # resume reads their lengths here (a text stream's state stays as a block stream's)
            split = Split(at=Position.of(sample.origin), next=0, count=len(cut), tokens=sum(lengths),
                          lengths=lengths if self.media is not None else None)
        return sample_rows(chunks, self.store), split

    def _count(self, lengths: np.ndarray, counts: np.ndarray) -> None:
        c, n, total = self.counters, len(lengths), int(lengths.sum())
        if self.policy == "split":
            c.samples_split += n
            c.tokens_split += total
            c.chunks_created += int(counts.sum())
        elif self.policy == "truncate":
            c.samples_truncated += n
            c.tokens_truncated += total - n * self.max_len
        elif self.policy == "drop":
            c.samples_dropped += n
            c.tokens_dropped += total

    def next(self) -> Sample:
        rows = self.take(1)
        if not len(rows):
            raise StopIteration
        (sample,) = PackRows(rows=rows, blocks=self.store.subset(rows)).samples()
        self.store.keep(self.pending)  # read by next(), no packer prunes the store
        return sample

    def get_state(self) -> dict[str, Any]:
        if len(self.pending) and self._split is not None and self.replay is not None:
            pending = replace(self._split, next=self._split.count - len(self.pending)).to_state()
        else:
            pending = samples_to_state(PackRows(rows=self.pending, blocks=self.store.subset(self.pending)).samples())
        return {self.KIND_KEY: self.KIND, self.SOURCE_KEY: self.source.state_dict(), self.PENDING_KEY: pending,
                self.COUNTERS_KEY: record_text(self.counters.as_dict()),
                self.LAST_KEY: pulled_to_state(self._last.values())}

    @classmethod
    def undelivered(cls, state: Mapping[str, Any], *, capacity: int, policy: str) -> Undelivered:
        """What a saved state had not delivered: the last sample pulled (the frontier; one source,
        as an elastic resume has) and the chunks of a split document not emitted yet, as
        references (a text stream's chunk lengths follow from ``capacity`` and ``policy``) or as
        the tokens the state holds."""
        pulled = pulled_from_state(state[cls.LAST_KEY])
        pending = state[cls.PENDING_KEY]
        split = Split.from_state(pending)
        if split is None:
            carry = samples_to_table(samples_from_state(pending))
        else:
            lengths = split.lengths if split.lengths is not None else \
                chunk_lengths(np.asarray([split.tokens]), capacity, policy)
            carry = split.carry(np.asarray(lengths, dtype=np.int64))
        return Undelivered(pulled=pulled[0] if pulled else None, carry=carry)


assert OVERLONG_POLICIES == ("split", "truncate", "drop", "error")
__all__ = ["OverlongCounters", "OverlongNode", "apply_overlong", "chunk_counts", "cut_lengths", "expand"]
