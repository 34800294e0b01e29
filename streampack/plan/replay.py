"""Re-reading carried samples from where they were read, instead of storing their tokens.

A resume state refers to each sample that sat in a buffer (the packer's window, a split
document's pending chunks) by its origin — source, shard, byte offset, number, chunk — and
:class:`Replayer` turns those references back into the very samples the buffer held: it reads
the raw samples again (grouped by shard, one pass per shard in offset order, reopening at the
next wanted offset only where that skips more than ``REOPEN_GAP`` bytes of a seekable remote
shard, ``LOCAL_REOPEN_GAP`` of a local file;
``.jsonl.gz`` is inflated once from the start), tokenizes them with the graph's own
:class:`~streampack.nodes.tokenize.TextEncoder`, applies the function stages, and cuts the
same chunk with the overlong policy. Each result's length is checked against the one
recorded, so a stage that is not a pure function of the sample, or a shard changed since the
save, is an error rather than a silently different stream.

Why: a state that stores tokens grows with document length (one 4M-token document under
``overlong="split"`` made every checkpoint 28.5 MB; capacity 32k with window 256 gave 17.6 MB
per worker). References cost 56 bytes per carried sample whatever its length: ~65 KB per worker at
window 1024 whether the capacity is 4k or 128k (63 MB with tokens at 128k;
``benchmarks/bench_state.py``, provisional); restoring costs one read of the carried samples.

A graph with a user ``BaseNode`` stage cannot be replayed per sample (the node may hold its own
buffer): it has no Replayer and its states keep storing tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, BinaryIO

import numpy as np

from streampack.errors import DataError
from streampack.io.compression import compression_of
from streampack.io.decode import DecodeOptions
from streampack.io.formats import ShardRange, open_range
from streampack.io.storage import OpenOptions, is_remote
from streampack.io.urls import ShardList
from streampack.nodes.overlong import apply_overlong
from streampack.nodes.tokenize import TextEncoder
from streampack.plan.cursor import Position
from streampack.plan.state import REF_COLUMNS
from streampack.sample import Sample, SampleOrigin

REOPEN_GAP = 1 << 20
"""Bytes between two wanted samples of a seekable remote shard above which one more ranged
read (an HTTP ``Range`` request) is cheaper than reading through."""
LOCAL_REOPEN_GAP = 1 << 16
"""The same for a local file, where reopening is a seek: reading through costs a full parse and
decode of every sample in between (~100 µs each). tests/test_resume_reread.py: restoring a window
of 64 from one local tar shard decodes 103 samples at this gap, 268 at ``REOPEN_GAP``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplaySpec:
    """What a graph does to a raw sample before packing: everything a replay repeats."""

    sources: Sequence[ShardList]
    """URL list of each source, by source index."""
    decode: DecodeOptions
    opts: OpenOptions
    encoder: TextEncoder | None
    stages: Sequence[Callable[[Sample], Sample | None]]
    """The function stages, in order (a graph with node stages is not replayable)."""
    max_len: int
    policy: str
    media: Any = None
    """The stream's ``MediaOptions`` (None: text only), which the overlong policy's cuts read."""
    verify: Callable[[int, int], None] | None = None
    """``verify(source, shard)`` raises when the shard is not the one the state was saved from
    (:meth:`~streampack.nodes.reader.ShardReader.verify_shard`)."""


class Replayer:
    """``replayer(refs) -> samples``: re-reads references (an array of ``state.REF``)."""

    def __init__(self, spec: ReplaySpec) -> None:
        self.spec = spec

    def __call__(self, refs: np.ndarray) -> list[Sample]:
        records = _records(refs)
        raw = self._read_all(records)
        keys = {(r["source"], r["shard"], r["offset"], r["epoch"]) for r in records}
        ready = self._prepare({k: raw[k[:3]] for k in sorted(keys)})
        out = []
        for r in records:
            chunks = ready[(r["source"], r["shard"], r["offset"], r["epoch"])]
            chunk = chunks[max(r["chunk"], 0)] if max(r["chunk"], 0) < len(chunks) else None
            if chunk is None or len(chunk) != r["length"]:
                got = None if chunk is None else len(chunk)
                raise ValueError(f"carried sample {self._where(r)} chunk {r['chunk']} re-read with "
                                 f"{got} tokens, {r['length']} when the state was saved: the shard changed "
                                 f"since, or a stage is not a pure function of the sample")
            out.append(chunk)
        return out

    def chunks(self, at: Position) -> list[Sample]:
        """Every chunk the overlong policy cuts from the sample at ``at``."""
        raw = self._read_shard(at.source, at.shard, [(at.offset, at.number)])
        key = (at.source, at.shard, at.offset, at.epoch)
        return self._prepare({key: raw[at.offset]})[key]

    def _where(self, r: dict[str, int]) -> str:
        return f"{self.spec.sources[r['source']].urls[r['shard']]!r}@{r['offset']}"

    def _read_all(self, records: list[dict[str, int]]) -> dict[tuple[int, int, int], Sample]:
        wanted: dict[tuple[int, int], dict[int, int]] = {}
        for r in records:
            wanted.setdefault((r["source"], r["shard"]), {})[r["offset"]] = r["number"]
        out: dict[tuple[int, int, int], Sample] = {}
        for (source, shard), where in sorted(wanted.items()):
            for offset, sample in self._read_shard(source, shard, sorted(where.items())).items():
                out[(source, shard, offset)] = sample
        return out

    def _read_shard(self, source: int, shard: int, wanted: list[tuple[int, int]]) -> dict[int, Sample]:
        """Raw samples at ``wanted`` ``(offset, number)`` positions of one shard, in one pass
        (reopening only across gaps larger than ``REOPEN_GAP``)."""
        url = self.spec.sources[source].urls[shard]
        if self.spec.verify is not None:
            self.spec.verify(source, shard)
        seekable = compression_of(url) is None
        gap = REOPEN_GAP if is_remote(url) else LOCAL_REOPEN_GAP
        found: dict[int, Sample] = {}
        i = 0
        while i < len(wanted):
            start = wanted[i][0]
            pos, num = wanted[i]
            streams: list[BinaryIO] = []
            try:
                for item in open_range(url, ShardRange(start=pos, first=num), decode=self.spec.decode,
                                       opts=self.spec.opts, streams=streams):
                    if pos > wanted[i][0]:
                        break  # no sample starts there: reopen at it, which reports the problem
                    if pos == wanted[i][0]:
                        if item.sample is None:
                            raise ValueError(f"cannot re-read carried sample {url!r}@{pos}: {item.error} "
                                             f"(the shard changed since the state was saved?)")
                        origin = SampleOrigin(shard=shard, offset=pos, number=num, next_offset=item.next_offset,
                                              next_number=item.next_index, source=source)
                        found[pos] = item.sample.evolve(origin=origin)
                        i += 1
                        if i == len(wanted) or (seekable and wanted[i][0] - item.next_offset > gap):
                            break
                    pos, num = item.next_offset, item.next_index
            except DataError as e:
                raise ValueError(f"cannot re-read carried samples of {url!r}: {e}") from None
            finally:
                for stream in streams:
                    stream.close()
            if start not in found:
                raise ValueError(f"no sample starts at offset {start} of {url!r} any more "
                                 f"(the shard changed since the state was saved)")
        return found

    def _prepare(self, raw: dict[tuple[int, int, int, int], Sample]) -> dict[tuple[int, int, int, int], list[Sample]]:
        """Tokenize, apply the function stages and the overlong policy, as the graph did
        (keys: source, shard, offset, epoch — the epoch the sample was read in)."""
        keys = list(raw)
        samples = [raw[k].evolve(origin=replace(raw[k].origin, epoch=k[3])) for k in keys]
        if self.spec.encoder is not None:
            encoded = self.spec.encoder.encode(samples)
            for k, s in zip(keys, encoded):
                if not isinstance(s, Sample):
                    raise ValueError(f"carried sample {raw[k].doc_key!r} no longer tokenizes ({s!r})")
            samples = encoded  # type: ignore[assignment]
        out = {}
        for k, sample in zip(keys, samples):
            for fn in self.spec.stages:
                result = fn(sample)
                if not isinstance(result, Sample):
                    raise ValueError(f"stage {fn!r} returned {result!r} for carried sample {sample.doc_key!r}, "
                                     f"which it kept when the state was saved: stages must be pure functions")
                sample = result
            out[k] = apply_overlong(sample, self.spec.max_len, self.spec.policy, media=self.spec.media)
        return out


def _records(refs: np.ndarray) -> list[dict[str, int]]:
    """Each reference of a ``state.REF`` array as a dict of its fields (Python ints)."""
    columns = [refs[name].tolist() for name in REF_COLUMNS]
    return [dict(zip(REF_COLUMNS, values)) for values in zip(*columns)]
