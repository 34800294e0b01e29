"""BlockReader: the graph's reader, which hands out runs of documents read as token blocks.

:meth:`BlockReader.run` returns the documents from the position to the end of their block (a :class:`DocRun`: a
:class:`~streampack.io.token_block.TokenBlock` and a row range, nothing per document), and :meth:`BlockReader.consume`
moves past the first ``k`` exactly as ``k`` calls of :meth:`ShardReader.next` would, so its state is a ShardReader
state. Where no block reader applies (:mod:`streampack.io.blocks`), or a span's blocks stop part way, the span is read
per sample from where its reading began, skipping what was handed out, so the stream, errors included, is the
per-sample reader's (the samples before a bad one are parsed twice).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from streampack.errors import DataError
from streampack.io.blocks import block_format, read_blocks
from streampack.io.decode import Item
from streampack.io.formats import ShardRange, open_range
from streampack.io.index import ShardIndex
from streampack.io.shard_identity import ShardChanged
from streampack.io.token_block import TokenBlock
from streampack.nodes.reader import ShardReader
from streampack.plan.sharding import ShardSpan, Span


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class DocRun:
    """Documents ``[lo, hi)`` of ``block``, read in ``epoch`` from shard ``shard`` of source
    ``source``; ``consumed``: already handed out (a run of the per-sample reader)."""

    block: TokenBlock
    lo: int
    hi: int
    epoch: int
    source: int
    shard: int
    consumed: bool = False

    def __len__(self) -> int:
        return self.hi - self.lo


class _NewSpan(Exception):
    """Raised inside ``ShardReader.next`` when it reaches a span that should be tried as blocks
    first: nothing of that span is read yet, so the position is exactly its start."""


class BlockReader(ShardReader):
    """A :class:`ShardReader` with :meth:`run` / :meth:`consume`; ``chunk_bytes``: the tar block read size."""

    def __init__(self, *args: Any, chunk_bytes: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chunk_bytes = chunk_bytes
        self.sample_reads = 0
        """Documents this process read per sample, not as blocks (a diagnostic, not state)."""
        self._in_run = False
        self._clear_blocks()

    def _clear_blocks(self) -> None:
        self._blocks: Iterator[TokenBlock] | None = None
        self._block: TokenBlock | None = None
        self._pos = 0
        self._range: tuple[str, ShardRange] | None = None  # where this span's reading began
        self._index: ShardIndex | None = None  # its shard's index, where the range starts by it
        self._per_sample: tuple[int, int] | None = None  # (epoch, shard_pos) read per sample

    def close(self) -> None:
        super().close()
        self._clear_blocks()

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._clear_blocks()

    def run(self) -> DocRun | None:
        """The next documents (not yet consumed, unless ``consumed``); None at the end."""
        while True:
            span = self._span()
            if span is None:
                return None
            if self._block is not None and self._pos < len(self._block):
                return DocRun(block=self._block, lo=self._pos, hi=len(self._block), epoch=self._span_epoch(span),
                              source=self.source, shard=span.shard)
            here = (self._epoch, self._shard_pos)
            if self._items is None and self._per_sample != here:
                if self._blocks is None:
                    try:  # what ShardReader.next does when a span cannot be opened
                        self._blocks = self._open_blocks(span)
                    except ShardChanged:
                        raise
                    except (DataError, OSError) as e:
                        self._lose_span(e, span)
                        continue
                if self._blocks is None:
                    self._per_sample = here
                else:
                    block = next(self._blocks, None)
                    if block is not None:
                        if block.done and not len(block):
                            self._next_span()
                        elif len(block):
                            self._block, self._pos = block, 0
                        continue
                    self._take_over(here)
            self._in_run = True
            try:
                sample = ShardReader.next(self)
            except _NewSpan:
                continue
            except StopIteration:
                return None
            finally:
                self._in_run = False
            self.sample_reads += 1
            block = TokenBlock.of_samples([sample], done=False)
            return DocRun(block=block, lo=0, hi=1, epoch=sample.origin.epoch, source=self.source,  # type: ignore[union-attr]
                          shard=sample.origin.shard, consumed=True)  # type: ignore[union-attr]

    def consume(self, k: int) -> None:
        """Hand out the first ``k`` documents of the current block's run."""
        block = self._block
        assert block is not None and 0 < k <= len(block) - self._pos, (k, self._pos)
        last = self._pos + k - 1
        self._offset, self._sample = int(block.next_offsets[last]), int(block.next_numbers[last])
        self._yielded += k
        self._epoch_yielded += k
        self._pos += k
        if self._pos == len(block):
            self._block = None
            if block.done:  # the per-sample reader moves on with the range's last sample
                self._next_span()

    def _open_span(self, span: ShardSpan | Span) -> Iterator[Item]:
        if self._in_run and self._per_sample != (self._epoch, self._shard_pos):
            raise _NewSpan
        return super()._open_span(span)

    def _open_blocks(self, span: ShardSpan | Span) -> Iterator[TokenBlock] | None:
        """The blocks of ``span`` from the reader's position, or None when its format has none."""
        if not block_format(self.urls[span.shard]) or self._decode.media is not None:
            return None
        url, where = self._range = self._start(span)
        if where.end is not None and where.start >= where.end:
            return iter([TokenBlock.of_samples([], done=True)])
        self._index = self.range_index(span, url, where)
        return read_blocks(url, where, decode=self._decode, opts=self._open, streams=self._streams,
                           stats=self.io_stats, chunk_bytes=self.chunk_bytes, index=self._index)

    def _take_over(self, here: tuple[int, int]) -> None:
        """The per-sample reader reads the rest of the span (see the module docstring)."""
        assert self._range is not None
        url, where = self._range
        self._blocks, self._block, self._per_sample = None, None, here
        self._items = self._skipping(url, where, self._offset)

    def _skipping(self, url: str, where: ShardRange, at: int) -> Iterator[Item]:
        for item in open_range(url, where, decode=self._decode, opts=self._open, streams=self._streams,
                               stats=self.io_stats, index=self._index):
            if item.next_offset <= at:
                continue
            yield item


__all__ = ["BlockReader", "DocRun"]
