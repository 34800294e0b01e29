"""Re-reading carried documents from where they were read, instead of storing their tokens.

A resume state refers to each document that sat in a buffer (the packer's window, a split sample's pending chunks) by
its origin (:data:`~streampack.plan.state.REF`), and the :class:`Replayer` turns those references back into the very
documents the buffer held, checking each one's length against the one recorded: a stage that is not a pure function of
the sample, or a shard changed since the save, is an error, not a silently different stream. A graph with a user
``BaseNode`` stage cannot be replayed (the node may hold its own buffer): its states store tokens.

Where a stream's documents are the shards' own token ids (no tokenizer, stage or images), only the wanted documents
are re-read, as blocks: in a tar shard they are picked at their offsets and checked alone
(:func:`~streampack.io.blocks.read_samples_at`); in a parquet shard each row group holding wanted rows is read once per
restore and kept until the packer says every carried row is read again (:meth:`Replayer.forget`); elsewhere the shard
is read as blocks from each cluster's first position. Positions farther apart than ``REOPEN_GAP`` bytes remotely
(:data:`PICK_GAP`, :data:`BLOCK_GAP` locally) are separate reads. A position the blocks do not reach, and every
document of any other stream, is re-read per sample: read, tokenized with the graph's own encoder,
passed through the function stages and cut by the overlong policy, one pass per shard in offset order.

**Cost per reader** of a restore (W documents in the saved window, over S_W shards): S_W identity checks at the
restore (a ``stat``, or a ``HEAD`` remotely); then, as the restored packs leave (``WindowPacker.READ_AHEAD`` at a
time), one read per cluster of their documents: for tar, CPU and bytes O(W) in all (~15 µs a document read on its
own, ~0.4 ms a re-read for the checks of all its shards, ``benchmarks/bench_restore.py``); for parquet, each row group
holding a carried row read once. Memory: W rows of 104 bytes (``rows.ROW``), plus those row groups until their last
carried row is re-read. Reading only the carried documents, the 25 batches after a restore read 8.5 MB where reading
their clusters whole read 31.7 MB (uninterrupted: 3.6 MB; window 1024).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, BinaryIO

import numpy as np

from streampack.errors import DataError
from streampack.io.blocks import read_blocks, read_groups_at, read_samples_at
from streampack.io.compression import compression_of
from streampack.io.decode import DecodeOptions
from streampack.io.formats import ShardRange, open_range
from streampack.io.storage import OpenOptions, is_remote
from streampack.io.token_block import TokenBlock
from streampack.io.urls import ShardList, shard_format
from streampack.nodes.overlong import apply_overlong, expand
from streampack.nodes.tokenize import TextEncoder
from streampack.plan.cursor import POSITION_FIELDS, Position
from streampack.plan.rows import BlockStore, block_rows, put, rows_of, sample_rows, take
from streampack.plan.state import REF, REF_COLUMNS
from streampack.sample import Sample, SampleOrigin

REOPEN_GAP = 1 << 20
"""Bytes between two wanted samples of a seekable remote shard above which one more ranged
read (an HTTP ``Range`` request) is cheaper than reading through."""
LOCAL_REOPEN_GAP = 1 << 16
"""The same for a local file, where reopening is a seek: reading through costs a full parse and
decode of every sample in between (~100 µs each). tests/unit/plan/test_resume_reread.py: restoring a window
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


def _changed(where: str, chunk: int, got: int | None, saved: int) -> ValueError:
    return ValueError(f"carried sample {where} chunk {chunk} re-read with {got} tokens, {saved} when the state was "
                      f"saved: the shard changed since, or a stage is not a pure function of the sample")


def _records(refs: np.ndarray) -> list[dict[str, int]]:
    """Each reference of a ``state.REF`` array as a dict of its fields (Python ints)."""
    columns = [refs[name].tolist() for name in REF_COLUMNS]
    return [dict(zip(REF_COLUMNS, values)) for values in zip(*columns)]


BLOCK_GAP = 262144
"""Bytes between two wanted samples of a local shard above which a cluster ends: the block
reader parses ~1 MB in ~1 ms here, so reading through a gap beats reopening up to about this
(re-reading per sample decodes each sample read through, so its gap is 64 KiB)."""
PICK_GAP = 16384
"""The same for a local tar shard whose wanted samples are picked (:mod:`streampack.io.tar_pick`):
bytes read through are copied but not parsed, ~2-4 GB/s from the page cache, against a few µs
for another seek and read."""


class Replayer:
    """``replay(refs, store) -> rows`` (references: an array of ``state.REF``, in order; the rows
    point into blocks added to ``store``) and ``replay.chunks(position, store)``."""

    def __init__(self, spec: ReplaySpec) -> None:
        self.spec = spec
        # a stream whose documents are the shards' own token ids re-reads them as blocks and cuts
        # them as columns; a tokenizer, a stage or images make every document a Sample again
        self.blocks = spec.encoder is None and not spec.stages and spec.media is None
        self._groups: dict[tuple[int, int], list[TokenBlock]] = {}

    def forget(self) -> None:
        """Drop the parquet row groups kept for carried rows not re-read yet (the packer calls
        this when none is left, and at a reset)."""
        self._groups.clear()

    def __call__(self, refs: np.ndarray, store: BlockStore) -> np.ndarray:
        if not self.blocks:
            return sample_rows(self._samples(refs), store)
        found = self._read_all(refs)
        out = rows_of(len(refs))
        where = [found[key] for key in zip(refs["source"].tolist(), refs["shard"].tolist(), refs["offset"].tolist())]
        groups: dict[int, list[int]] = {}
        for i, doc in enumerate(where):
            groups.setdefault(id(doc[0]), []).append(i)
        for members in groups.values():  # one block at a time, as columns
            block, _, source, shard = where[members[0]]
            idx = np.asarray(members, dtype=np.int64)
            docs = np.fromiter((where[i][1] for i in members), dtype=np.int64, count=len(members))
            put(out, idx, block_rows(block, docs, store, source=source, shard=shard))
        out["epoch"] = refs["epoch"]
        return self._cut_as_saved(out, refs)

    def _cut_as_saved(self, rows: np.ndarray, refs: np.ndarray) -> np.ndarray:
        """The chunk each reference names of its re-read document (:func:`expand`, the node's own cut); the first
        that is not there, or has another length, raises as the per-sample path does."""
        max_len, policy = self.spec.max_len, self.spec.policy
        cut, counts = expand(rows, max_len, policy)
        c = np.maximum(refs["chunk"], 0)
        bad = (c >= counts) | ((policy == "error") & (rows["length"] > max_len))
        if not bad.any():
            rows = take(cut, np.cumsum(counts) - counts + c)
            bad = rows["length"] != refs["length"]
        if bad.any():
            i = int(bad.argmax())
            ref = refs[i]
            url = self.spec.sources[int(ref["source"])].urls[int(ref["shard"])]
            raise _changed(f"{url!r}@{int(ref['offset'])}", int(ref["chunk"]),
                           None if c[i] >= counts[i] else int(rows["length"][i]), int(ref["length"]))
        return rows

    def verify(self, refs: np.ndarray) -> None:
        """Check every shard ``refs`` point into is the one the state was saved from (what the
        Replayer checks before re-reading a shard), without reading."""
        if self.spec.verify is None:
            return
        for source, shard in sorted(set(zip(refs["source"].tolist(), refs["shard"].tolist()))):
            self.spec.verify(source, shard)

    def chunks(self, at: Position, store: BlockStore) -> np.ndarray:
        """Every chunk the overlong policy cuts from the sample at ``at``."""
        if not self.blocks:
            return sample_rows(self._sample_chunks(at), store)
        one = np.zeros(1, dtype=REF)
        for name in POSITION_FIELDS:
            one[name] = getattr(at, name)
        # a split sample's chunks, at a restore: no row group kept for it
        block, i, source, shard = self._read_all(one, keep=False)[(at.source, at.shard, at.offset)]
        rows = block_rows(block, slice(i, i + 1), store, source=source, shard=shard, epoch=at.epoch)
        return expand(rows, self.spec.max_len, self.spec.policy)[0]

    def _read_all(self, refs: np.ndarray,
                  keep: bool = True) -> dict[tuple[int, int, int], tuple[TokenBlock, int, int, int]]:
        wanted: dict[tuple[int, int], dict[int, int]] = {}
        lengths: dict[tuple[int, int], dict[int, int]] = {}
        for source, shard, offset, number, length in zip(*(refs[name].tolist() for name in
                                                           ("source", "shard", "offset", "number", "length"))):
            wanted.setdefault((source, shard), {})[offset] = number
            lengths.setdefault((source, shard), {})[offset] = length
        out: dict[tuple[int, int, int], tuple[TokenBlock, int, int, int]] = {}
        shards = [(source, shard, sorted(where.items())) for (source, shard), where in sorted(wanted.items())]
        self.verify(refs)
        tar = [(s, h, p, lengths[(s, h)]) for s, h, p in shards
               if shard_format(self.spec.sources[s].urls[h]) == "tar"]
        picked = self._pick(tar)
        if not picked and len(tar) > 1:  # a sample that is not plain: pick the other shards alone
            for one in tar:
                picked.update(self._pick([one]))
        for source, shard, positions in shards:
            if (source, shard) in picked:
                got = {offset: (picked[(source, shard)], i) for i, (offset, _) in enumerate(positions)}
            else:
                got = self._read_shard(source, shard, positions, lengths[(source, shard)], keep)
            missing = [p for p in positions if p[0] not in got]
            if missing:  # the per-sample reader: its checks, its errors
                for offset, sample in self._read_sample_shard(source, shard, missing).items():
                    got[offset] = (TokenBlock.of_samples([sample], done=False), 0)
            for offset, (block, i) in got.items():
                out[(source, shard, offset)] = (block, i, source, shard)
        return out

    def _read_shard(self, source: int, shard: int, positions: list[tuple[int, int]],
                    lengths: dict[int, int], keep: bool = True) -> dict[int, tuple[TokenBlock, int]]:
        """The wanted ``(offset, number)`` positions of one shard that no pick took (a parquet
        shard, or a tar sample that is not plain) as ``(block, index)``, read one cluster at a
        time, each in one read sized from its span and its last document's length (``lengths``;
        the tar reader reads on if that was short)."""
        url = self.spec.sources[source].urls[shard]
        parquet, remote = shard_format(url) == "parquet", is_remote(url)
        gap = 1 << 62 if parquet else REOPEN_GAP if remote else BLOCK_GAP
        found: dict[int, tuple[TokenBlock, int]] = {}
        streams: list = []
        try:
            if parquet:
                kept = self._from_groups(source, shard, url, positions, streams, keep)
                if kept is not None:
                    return kept
            for cluster in _clusters(positions, gap):
                size = _span(cluster, lengths, remote)
                first, last = cluster[0][0], cluster[-1][0]
                blocks = read_blocks(url, ShardRange(start=first, first=cluster[0][1], end=last + 1 if parquet else None),
                                     decode=self.spec.decode, opts=self.spec.opts, streams=streams, chunk_bytes=size)
                if blocks is None:
                    return found
                want = np.array([p for p, _ in cluster], dtype=np.int64)
                for block in blocks:
                    if len(block):
                        at = np.searchsorted(block.offsets, want)
                        hit = (at < len(block)) & (block.offsets[np.minimum(at, len(block) - 1)] == want)
                        for offset, i in zip(want[hit].tolist(), at[hit].tolist()):
                            found[offset] = (block, i)
                        if int(block.offsets[-1]) >= last:
                            break
        finally:
            for f in streams:
                f.close()
        return found

    def _pick(self, tar: list[tuple[int, int, list[tuple[int, int]], dict[int, int]]]
              ) -> dict[tuple[int, int], TokenBlock]:
        """The wanted samples of tar shards (source, shard, positions, their lengths), picked and
        checked in one pass (:func:`~streampack.io.blocks.read_samples_at`), a block per shard;
        empty when one of them is not a plain sample."""
        if not tar:
            return {}
        wanted = []
        for source, shard, positions, lengths in tar:
            url = self.spec.sources[source].urls[shard]
            remote = is_remote(url)  # the bytes between two samples: read remotely, not locally
            wanted.append((url, [(c, _span(c, lengths, remote)) for c in _clusters(positions, REOPEN_GAP if remote
                                                                                   else PICK_GAP)]))
        streams: list = []
        try:
            blocks = read_samples_at(wanted, decode=self.spec.decode, opts=self.spec.opts, streams=streams)
        finally:
            for f in streams:
                f.close()
        return {} if blocks is None else {(s, h): b for (s, h, _, _), b in zip(tar, blocks)}

    def _from_groups(self, source: int, shard: int, url: str, positions: list[tuple[int, int]],
                     streams: list, keep: bool) -> dict[int, tuple[TokenBlock, int]] | None:
        """The wanted rows of a parquet shard from whole row groups, read once per restore: the
        carried rows of one group leave over many re-reads (``READ_AHEAD`` packs at a time), and
        reading the group each time, the 25 batches after a restore cost 370 CPU-ms, reading it
        once 154, uninterrupted 33 (``benchmarks/bench_restore.py``). Kept (``keep``) until
        :meth:`forget`: the groups the window's rows are in, which the stream held too."""
        kept = self._groups.setdefault((source, shard), []) if keep else list(self._groups.get((source, shard), []))
        rows = [offset for offset, _ in positions]
        missing = [r for r in rows if _group_of(kept, r) is None]
        if missing:
            read = read_groups_at(url, missing, decode=self.spec.decode, opts=self.spec.opts, streams=streams)
            if read is None:
                return None
            kept += read
        found = {}
        for r in rows:
            block = _group_of(kept, r)
            if block is None:
                return None
            found[r] = (block, r - int(block.offsets[0]))
        return found


    # ------------------------------------------------ per sample: read, tokenize, stages, overlong cut
    def _samples(self, refs: np.ndarray) -> list[Sample]:
        """The documents ``refs`` name, re-read as the graph made them."""
        records = _records(refs)
        raw = self._read_samples(records)
        keys = {(r["source"], r["shard"], r["offset"], r["epoch"]) for r in records}
        ready = self._prepare({k: raw[k[:3]] for k in sorted(keys)})
        out = []
        for r in records:
            chunks = ready[(r["source"], r["shard"], r["offset"], r["epoch"])]
            chunk = chunks[max(r["chunk"], 0)] if max(r["chunk"], 0) < len(chunks) else None
            if chunk is None or len(chunk) != r["length"]:
                url = self.spec.sources[r["source"]].urls[r["shard"]]
                raise _changed(f"{url!r}@{r['offset']}", r["chunk"], None if chunk is None else len(chunk), r["length"])
            out.append(chunk)
        return out

    def _sample_chunks(self, at: Position) -> list[Sample]:
        raw = self._read_sample_shard(at.source, at.shard, [(at.offset, at.number)])
        key = (at.source, at.shard, at.offset, at.epoch)
        return self._prepare({key: raw[at.offset]})[key]

    def _read_samples(self, records: list[dict[str, int]]) -> dict[tuple[int, int, int], Sample]:
        wanted: dict[tuple[int, int], dict[int, int]] = {}
        for r in records:
            wanted.setdefault((r["source"], r["shard"]), {})[r["offset"]] = r["number"]
        out: dict[tuple[int, int, int], Sample] = {}
        for (source, shard), where in sorted(wanted.items()):
            for offset, sample in self._read_sample_shard(source, shard, sorted(where.items())).items():
                out[(source, shard, offset)] = sample
        return out

    def _read_sample_shard(self, source: int, shard: int, wanted: list[tuple[int, int]]) -> dict[int, Sample]:
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


def _group_of(blocks: list[TokenBlock], row: int) -> TokenBlock | None:
    for block in blocks:
        if int(block.offsets[0]) <= row <= int(block.offsets[-1]):
            return block
    return None


def _span(cluster: list[tuple[int, int]], lengths: dict[int, int], remote: bool) -> int:
    """Bytes to read for ``cluster`` in one read: its span and its last sample (64 KiB when its
    length is not known). The readers read on when that is short, which remotely is another
    request: there the sample is sized for int64 ids and 4 KiB of headers, locally for int32
    ids (what tokenizers below 2^31 write) and 2 KiB (a pax header, a header, an ``.npy`` header)."""
    first, last = cluster[0][0], cluster[-1][0]
    n = lengths.get(last, 0)
    return last - first + (64 << 10 if not n else 8 * n + 4096 if remote else 4 * n + 2048)


def _clusters(positions: list[tuple[int, int]], gap: int) -> list[list[tuple[int, int]]]:
    out: list[list[tuple[int, int]]] = []
    for p in positions:
        if out and p[0] - out[-1][-1][0] <= gap:
            out[-1].append(p)
        else:
            out.append([p])
    return out


__all__ = ["BLOCK_GAP", "LOCAL_REOPEN_GAP", "PICK_GAP", "REOPEN_GAP", "ReplaySpec", "Replayer"]
