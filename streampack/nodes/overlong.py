"""Overlong stage: what to do with a document longer than the pack capacity — split,
truncate, drop or error — as a policy function and the node that applies it before packing.

The right default differs by use case (pretraining wants ``split`` so no token is lost; chat
SFT often wants ``drop`` or ``truncate`` because a split conversation is not a conversation),
so the policy is explicit and every token it touches is counted; the counters travel in the
node state so metrics stay exact across a resume.

A sample with images (``media=``: the stream's :class:`~streampack.media.MediaOptions`) is never
cut through an image's or video's tokens: a cut that would fall inside one moves to its start,
and each chunk (or the truncated head) carries exactly the images whose tokens it holds, so the
decode after packing finds every image on its own run. An image or video alone longer than the
capacity cannot be placed whole in any pack: under ``split`` and ``truncate`` its sample is
dropped, counted in ``samples_dropped``/``tokens_dropped`` and ``media_overlong`` (``error``
raises, ``drop`` drops it as any overlong sample).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from torchdata.nodes import BaseNode

from streampack.errors import DataError, ErrorPolicy
from streampack.logs import get_logger, warn_every
from streampack.options.packing import OVERLONG_POLICIES
from streampack.plan.cursor import (
    Position,
    Pulled,
    Split,
    Undelivered,
    pulled_from_state,
    pulled_to_state,
    split_samples,
)
from streampack.plan.epoch_plan import chunk_lengths
from streampack.plan.state import record_of, record_text, samples_from_state, samples_to_state
from streampack.sample import Sample, SampleOrigin

if TYPE_CHECKING:  # media stays an optional part: imported where a sample has images
    from streampack.media.options import MediaOptions
    from streampack.media.stage import MediaSpans

OverlongPolicy = Literal["split", "truncate", "drop", "error"]
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
        return asdict(self)


def check_policy(policy: str) -> None:
    if policy not in OVERLONG_POLICIES:
        raise ValueError(f"overlong={policy!r} must be one of {OVERLONG_POLICIES}")


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
    check_policy(policy)
    if n <= max_len:
        return np.asarray([n], dtype=np.int64)
    if policy == "drop":
        return np.zeros(0, dtype=np.int64)
    if policy != "split":
        end = _cut(max_len, start, stop)
        return np.asarray([end] if end else [], dtype=np.int64)
    bounds = _bounds(n, max_len, start, stop)
    return np.zeros(0, dtype=np.int64) if bounds is None else np.diff(np.asarray(bounds, dtype=np.int64))


def _drop(sample: Sample, counters: OverlongCounters, max_len: int) -> list[Sample]:
    counters.samples_dropped += 1
    counters.tokens_dropped += len(sample)
    counters.media_overlong += 1
    warn_every(_log, "media_overlong", "dropped sample %r: one of its images or videos alone has more tokens "
               "than the capacity %d (counted in overlong counters' media_overlong)", sample.doc_key, max_len)
    return []


def apply_overlong(sample: Sample, max_len: int, policy: str,
                   counters: OverlongCounters | None = None, *, media: MediaOptions | None = None) -> list[Sample]:
    """Return the documents that ``sample`` becomes under ``policy`` (``[sample]`` when it fits).

    ``split`` makes ``ceil(L / max_len)`` chunks with keys ``key/0``, ``key/1``, …; each chunk is
    its own document (its last token's label is ignored, like any document end). With ``media``
    (:class:`~streampack.media.MediaOptions`) and images in ``sample``, no cut falls inside an
    image's tokens (see the module docstring): chunks may be shorter and more. A sample whose
    image tokens do not match its images is ``DataError("image_tokens_mismatch")``.
    """
    check_policy(policy)
    if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1:
        # max_len=0 would make range(0, n, 0) raise a bare error, or truncate to nothing
        raise ValueError(f"{max_len=} must be a positive int")
    n = len(sample)
    if n <= max_len:
        return [sample]
    counters = counters if counters is not None else OverlongCounters()
    if policy == "error":
        raise ValueError(f"sample {sample.doc_key!r} has {n} tokens, more than the capacity "
                         f"{max_len} (overlong='error'; use 'split', 'truncate' or 'drop')")
    if policy == "drop":
        counters.samples_dropped += 1
        counters.tokens_dropped += n
        return []
    spans = None
    if media is not None and sample.images:
        from streampack.media.stage import media_spans

        spans = media_spans(sample, media)
    start, stop = (spans.start, spans.stop) if spans is not None else (np.zeros(0, np.int64),) * 2
    if policy == "truncate":
        end = _cut(max_len, start, stop)
        if end == 0:  # the sample opens with an image longer than the capacity
            return _drop(sample, counters, max_len)
        counters.samples_truncated += 1
        counters.tokens_truncated += n - end
        return [_slice(sample, 0, end, sample.key, 0, spans)]
    bounds = _bounds(n, max_len, start, stop)
    if bounds is None:
        return _drop(sample, counters, max_len)
    chunks = [_slice(sample, s, e, f"{sample.key}/{i}", i, spans) for i, (s, e) in enumerate(zip(bounds, bounds[1:]))]
    counters.samples_split += 1
    counters.tokens_split += n
    counters.chunks_created += len(chunks)
    return chunks


class OverlongNode(BaseNode[Sample]):
    """Yields documents of at most ``max_len`` tokens according to ``policy``.

    State = upstream state + the sample being split, as a reference (where to re-read it and
    how many of its chunks were emitted; its tokens only when ``replay`` is None or the sample
    has no origin) + counters + the origin of the last sample pulled from each source: every
    sample after it in its reader's order is still unread downstream, which is what an elastic
    resume needs to know.
    """

    SOURCE_KEY = "source"
    PENDING_KEY = "pending"
    COUNTERS_KEY = "counters"
    LAST_KEY = "last"
    KIND_KEY = "kind"
    KIND = "OverlongNode"

    def __init__(self, source: BaseNode[Sample], max_len: int, policy: str = "split", *,
                 replay: Callable[[Position], list[Sample]] | None = None, media: MediaOptions | None = None,
                 error_policy: ErrorPolicy | None = None) -> None:
        super().__init__()
        # max_len and policy as checked by StreamConfig and PackOptions; apply_overlong checks them for a
        # hand-built node at its first sample
        self.source = source
        self.max_len = max_len
        self.policy = policy
        self.replay = replay
        """``Position -> every chunk of the sample there`` (a Replayer's ``chunks``), or None to
        keep pending chunks as tokens."""
        self.media = media
        """The stream's ``MediaOptions`` (None: text only): cuts avoid images' tokens."""
        # a sample whose image tokens do not match its images (default: raise)
        self._policy = error_policy if error_policy is not None else ErrorPolicy()
        self._clear()

    def _clear(self) -> None:
        self.counters = OverlongCounters()
        self._pending: deque[Sample] = deque()
        self._split: _Split | None = None
        self._last: dict[int, SampleOrigin] = {}

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._clear()
        if initial_state is None:
            self.source.reset(None)
            return
        self.source.reset(initial_state[self.SOURCE_KEY])
        self.counters = OverlongCounters(**record_of(initial_state[self.COUNTERS_KEY]))
        self._last = {p.source: p.origin() for p in pulled_from_state(initial_state[self.LAST_KEY])}
        pending = initial_state[self.PENDING_KEY]
        split = Split.from_state(pending)
        if split is None:
            self._pending = deque(samples_from_state(pending))
            return
        if self.replay is None:
            raise ValueError("this OverlongNode state holds its split sample by reference, but the node "
                             "has no replay function to re-read it")
        chunks = self.replay(split.at)
        if len(chunks) != split.count or sum(len(c) for c in chunks) != split.tokens:
            raise ValueError(f"split sample at {split.at} re-read as {len(chunks)} chunks, {split.count} when the "
                             f"state was saved: the shard changed, or a stage is not a pure function")
        self._split = _Split(origin=chunks[0].origin, lengths=tuple(len(c) for c in chunks))  # type: ignore[arg-type]
        self._pending = deque(chunks[split.next:])

    def next(self) -> Sample:
        while not self._pending:
            sample = next(self.source)
            if sample.origin is not None:
                self._last[sample.origin.source] = sample.origin
            try:
                chunks = apply_overlong(sample, self.max_len, self.policy, self.counters, media=self.media)
            except DataError as e:
                self._policy.handle(e)
                continue
            self._split = _Split(origin=sample.origin, lengths=tuple(len(c) for c in chunks)) \
                if len(chunks) > 1 and sample.origin else None
            self._pending.extend(chunks)
        return self._pending.popleft()

    def get_state(self) -> dict[str, Any]:
        return {self.KIND_KEY: self.KIND, self.SOURCE_KEY: self.source.state_dict(),
                self.PENDING_KEY: self._pending_state(), self.COUNTERS_KEY: record_text(self.counters.as_dict()),
                self.LAST_KEY: pulled_to_state(Pulled.of(o) for o in self._last.values())}

    def _pending_state(self) -> dict[str, Any]:
        if not self._pending or self._split is None or self.replay is None:
            return samples_to_state(list(self._pending))
        origin, count = self._split.origin, len(self._split.lengths)
        # cut around images, the chunks are not ceil(tokens / max_len) of max_len: an elastic
        # resume reads their lengths here (a text stream's state stays the per-row path's)
        return Split(at=Position.of(origin), next=count - len(self._pending), count=count,
                     tokens=sum(self._split.lengths),
                     lengths=self._split.lengths if self.media is not None else None).to_state()

    @classmethod
    def undelivered(cls, state: Mapping[str, Any], *, capacity: int, policy: str) -> Undelivered:
        """What a saved state (this node's or a ``ChunkNode``'s: one layout) had not delivered:
        the last sample pulled (the frontier; one source, as an elastic resume has) and the
        chunks of a split document not emitted yet, as references (a text stream's chunk
        lengths follow from ``capacity`` and ``policy``) or as the tokens the state holds."""
        pulled = pulled_from_state(state[cls.LAST_KEY])
        pending = state[cls.PENDING_KEY]
        split = Split.from_state(pending)
        if split is None:
            carry = split_samples(pending)
        else:
            lengths = split.lengths if split.lengths is not None else \
                chunk_lengths(np.asarray([split.tokens]), capacity, policy)
            carry = split.carry(np.asarray(lengths, dtype=np.int64))
        return Undelivered(pulled=pulled[0] if pulled else None, carry=carry)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Split:
    """The sample whose chunks are being emitted: where to re-read it, and its chunks' lengths."""

    origin: SampleOrigin
    lengths: tuple[int, ...]
