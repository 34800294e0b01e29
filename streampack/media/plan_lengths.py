"""True sample lengths for planned equal batches: text plus every image's and video's tokens, per shard, cached.

The shard index knows the text ids' lengths only; :class:`MediaLengths` gives the planner's count
(:mod:`streampack.plan.epoch_plan`) the packed lengths of the shards it counts, read once through the same format
reader, image reader and :class:`~streampack.media.stage.ExpandImages` as the stream (headers only), with each sample's
image spans so the count cuts over-long samples around images as the overlong policy does. A skipped sample has length
0. The shard cut stays on the text lengths. Cached in ``cache_dir`` per shard and media setting, keyed by the shard's
identity, ``tokens_key``, the limits and ``MediaOptions.recorded()``.

**Cost per reader and epoch**: the reader's own ~N/G shards; a cache hit reads ~8 bytes per sample
and per image, a miss reads each shard once more with its images (1.6 ms per sample on a local tar of
300 samples with 0-3 images, ``benchmarks/bench_media.py``, against 0.4 ms for the text index).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from streampack.errors import DataError, ErrorPolicy
from streampack.io.formats import ShardRange, open_range
from streampack.io.index import fingerprint_of, index_decode
from streampack.io.index_cache import cache_path, load_arrays, save_arrays
from streampack.media.options import MediaOptions
from streampack.media.stage import ExpandImages, media_spans
from streampack.nodes.overlong import cut_lengths
from streampack.plan.epoch_plan import chunk_lengths

VERSION = 2
"""2: each sample's image and video token spans beside its length (the plan cuts around them)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardMedia:
    """One shard's samples as the packer will see them: lengths and where their images sit."""

    lengths: np.ndarray
    """int32 ``[n]``: each sample's length after its placeholders are expanded (0: skipped)."""
    span_counts: np.ndarray
    """int32 ``[n]``: images and videos of each sample."""
    spans: np.ndarray
    """int32 ``[Σ span_counts, 2]``: ``[start, stop)`` of each one's tokens, by sample, sorted."""

    def chunks(self, lo: int, hi: int, max_len: int, policy: str) -> np.ndarray:
        """int64: the documents samples ``lo:hi`` become under the overlong policy, in stream
        order; a sample longer than ``max_len`` with images is cut around them
        (:func:`streampack.nodes.overlong.cut_lengths`, the rule the stream's cuts follow)."""
        lengths, counts = self.lengths[lo:hi].astype(np.int64), self.span_counts[lo:hi]
        first = np.concatenate(([0], np.cumsum(self.span_counts, dtype=np.int64)))[lo:hi]
        keep = lengths > 0  # a sample the stream skips never reaches the packer
        special = np.flatnonzero(keep & (lengths > max_len) & (counts > 0))
        out, at = [], 0
        for i in special.tolist():  # only over-long samples with images: the rest in one vectorised cut
            out.append(chunk_lengths(lengths[at:i][keep[at:i]], max_len, policy))
            spans = self.spans[first[i]:first[i] + counts[i]]
            out.append(cut_lengths(int(lengths[i]), max_len, policy, spans[:, 0], spans[:, 1]))
            at = i + 1
        out.append(chunk_lengths(lengths[at:][keep[at:]], max_len, policy))
        return np.concatenate(out)


class MediaLengths:
    """The planner's count of a shard under ``media``: ``chunks(...)``, its samples as the documents the overlong
    policy cuts them into, around their images."""

    def __init__(self, manifest: Any, media: MediaOptions, options: Any, io_stats: Any = None) -> None:
        self.manifest, self.media, self.options = manifest, media, options
        self.opts = options.open_options()
        self.decode = dataclasses.replace(options.decode(), media=media.reading(self.opts, io_stats))
        self.setting = json.dumps(media.recorded(), sort_keys=True, default=str)
        self.tag = hashlib.sha1(self.setting.encode()).hexdigest()[:12]

    def chunks(self, shard: int, samples: Any, lo: int, hi: int, max_len: int, policy: str) -> np.ndarray:
        return self.media_of(shard, samples).chunks(lo, hi, max_len, policy)

    def media_of(self, shard: int, samples: Any) -> ShardMedia:
        url = self.manifest.urls[shard]
        key = index_decode(self.options.decode())
        fp = f"media-v{VERSION}|{fingerprint_of(url, key, self.manifest.identity(shard))}|{self.setting}"
        path = cache_path(f"{url}?media={self.tag}", self.options.cache_dir)
        cached = load_arrays(path, self.opts)
        if cached is not None and str(cached.get("fingerprint")) == fp and len(cached["lengths"]) == len(samples):
            return ShardMedia(lengths=cached["lengths"], span_counts=cached["span_counts"], spans=cached["spans"])
        got = shard_lengths(url, samples.offsets, self.decode, self.opts, self.media)
        save_arrays(path, {"fingerprint": np.asarray(fp), "lengths": got.lengths, "span_counts": got.span_counts,
                           "spans": got.spans}, self.opts)
        return got


def shard_lengths(url: str, offsets: np.ndarray, decode: Any, opts: Any, media: MediaOptions) -> ShardMedia:
    """Each indexed sample's length after its media placeholders are expanded (0: skipped by
    the stream) and its images' token spans, reading ``url`` once from its start."""
    lengths = np.zeros(len(offsets), dtype=np.int32)
    counts = np.zeros(len(offsets), dtype=np.int32)
    spans: dict[int, np.ndarray] = {}
    expand = ExpandImages(media, error_policy=ErrorPolicy("skip"))
    streams: list[BinaryIO] = []
    pos = 0
    try:
        for item in open_range(url, ShardRange(start=0, first=0), decode=decode, opts=opts, streams=streams):
            i = int(np.searchsorted(offsets, pos))
            known = item.sample is not None and item.sample.tokens is not None
            if known and i < len(offsets) and int(offsets[i]) == pos:
                sample = expand(item.sample)
                if sample is not None:
                    lengths[i] = len(sample)
                    if sample.images:  # expanded just now: its runs are its images' (media_spans cannot refuse)
                        at = media_spans(sample, media)
                        spans[i], counts[i] = np.stack([at.start, at.stop], 1).astype(np.int32), len(at.start)
            pos = item.next_offset
    except DataError:
        pass  # the rest of the shard is unreadable: the stream raises or skips there, and counts nothing
    finally:
        for stream in streams:
            stream.close()
    rows = [spans[i] for i in sorted(spans)]
    return ShardMedia(lengths=lengths, span_counts=counts,
                      spans=np.concatenate(rows) if rows else np.zeros((0, 2), dtype=np.int32))
