"""ShardReader: the source node. Sharded tar / jsonl / parquet files -> a deterministic stream of Samples.

Order: epoch by epoch, this worker's spans (``sharding.assign_shards``, or the explicit ``work`` a finite plan or an
elastic share hands over), samples in file order, each carrying its :class:`~streampack.sample.SampleOrigin`. The
position is the byte offset and number of the next sample, so a restore opens the shard there (a ``seek``, or a
``Range`` request) without reading the bytes before it (``.jsonl.gz`` excepted). A shard that changed since the save
is refused (:class:`~streampack.io.shard_identity.ShardChanged`, never skipped): against the identities of the
``RECENT_SHARDS`` shards the state recorded, and, for a planned reader, against the manifest its plan was cut from
(whose fingerprint the state records too). Cost per reader: no request of its own; one compare at restore (the
fingerprint is O(N) once per process: 0.46 µs × N, ``benchmarks/bench_resume_check.py``) and the stat / HEAD it makes
anyway per shard it opens.
"""

from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, BinaryIO

from torchdata.nodes import BaseNode

from streampack.errors import DataError, ErrorCounter, ErrorPolicy
from streampack.io import shard_identity
from streampack.io.decode import Item
from streampack.io.formats import ShardRange, open_range, seeks_by_index
from streampack.io.index import ShardIndex, index_decode, load_or_build_index
from streampack.io.manifest import Manifest, load_saved
from streampack.io.retry import IOStats
from streampack.io.shard_identity import ShardChanged
from streampack.io.storage import OpenOptions, ShardStat
from streampack.io.urls import ShardList
from streampack.options.read import ReadOptions
from streampack.options.topology import Placement
from streampack.plan.cursor import Planned
from streampack.plan.sharding import (
    ShardSpan,
    Span,
    WorkEnds,
    assign_shards,
    span_from_state,
    span_to_state,
    spans_from_state,
    spans_to_state,
)
from streampack.plan.state import STATE_VERSION, VERSION_KEY, check_node_config, check_version, record_of, record_text
from streampack.sample import Sample, SampleOrigin

CONFIG_KEY = "config"
EPOCH_KEY = "epoch"
SHARD_POS_KEY = "shard_pos"
OFFSET_KEY = "offset"
SAMPLE_KEY = "sample"
YIELDED_KEY = "yielded"
EPOCH_YIELDED_KEY = "epoch_yielded"
START_EPOCH_KEY = "start_epoch"
WORK_KEY = "work"
ENDS_KEY = "work_ends"
KIND_KEY = "kind"
KIND = "ShardReader"
IDENTITY_KEY = "identity"
MANIFEST_KEY = "manifest"
PRINT_MODES = ("all", "tag", "size", "digest")
"""The manifest fingerprints a state records (``Manifest.fingerprint``): one per identity mode,
so a resume under another ``identity`` compares what that mode compares; ``all`` names the
saved copy of the manifest (``io.manifest.load_saved``)."""
RECENT_SHARDS = 256
"""Shards whose identity (size, ETag / mtime) a state keeps: the shard being read and the ones
read before it, where the packer's carried samples come from (~70 bytes each)."""
Work = dict[int, list[Span]]


def work_from_state(saved: dict[Any, Any]) -> Work:
    return {int(e): spans_from_state(columns) for e, columns in saved.items()}


def ends_to_state(work: Work) -> dict[int, str]:
    """Each planned epoch's ends as one JSON text of named fields (one leaf each)."""
    return {e: record_text({"head": span_to_state(spans[0]), "tail": span_to_state(spans[-1]), "spans": len(spans)})
            for e, spans in work.items() if spans}


def ends_from_state(saved: Mapping[Any, Any] | None) -> dict[int, WorkEnds]:
    out = {}
    for e, text in (saved or {}).items():
        v = record_of(text)
        out[int(e)] = WorkEnds(head=span_from_state(v["head"]), tail=span_from_state(v["tail"]), spans=int(v["spans"]))
    return out


class ShardReader(BaseNode[Sample]):
    """Reads this worker's share of ``urls`` as :class:`Sample`\\ s (``tokens`` int64 or ``text``).

    ``epochs=None`` repeats forever, reshuffling each epoch (it raises only once no shard can ever give this worker a
    sample); ``epochs=N`` stops after epoch N-1, starting at ``start_epoch``. ``place`` says which reader this is
    (``Placement.current()`` for this process's); ``read`` which fields to read, their bounds, the index cache and how
    shards are fetched (``open_options`` replaces that last part when given). Bad input goes to ``error_policy``
    (default ``read.error_policy()``), reads and retries are counted in ``io_stats``. ``work`` gives explicit spans for
    some epochs; ``keep_work`` stores them in the state (after an elastic resume they cannot be recomputed). ``source``:
    the source index recorded in each sample's origin.
    """

    def __init__(self, urls: ShardList | str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *, seed: int = 0,
                 shuffle: bool = True, epochs: int | None = None, start_epoch: int = 0, place: Placement = Placement(),
                 read: ReadOptions = ReadOptions(), error_policy: ErrorPolicy | None = None,
                 open_options: OpenOptions | None = None, io_stats: IOStats | None = None, work: Work | None = None,
                 keep_work: bool = False, source: int = 0, media: Any = None,
                 saved_identities: Mapping[int, ShardStat] | None = None, manifest: Manifest | None = None) -> None:
        super().__init__()
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"{seed=} must be an int >= 0")
        if epochs is not None and (not isinstance(epochs, int) or epochs < 1):
            raise ValueError(f"{epochs=} must be None (infinite) or an int >= 1")
        if not isinstance(start_epoch, int) or start_epoch < 0 or (epochs is not None and start_epoch >= epochs):
            raise ValueError(f"{start_epoch=} must be an int in [0, {epochs=})")
        self._open = open_options if open_options is not None else read.open_options()
        self.io_stats: IOStats = io_stats if io_stats is not None else IOStats()
        shards = ShardList.of(urls, opts=self._open)
        self.urls, self._held = shards.urls, shards.held  # held: a datasets object its URLs name, kept alive
        self.seed, self.shuffle, self.epochs, self.start_epoch = seed, shuffle, epochs, start_epoch
        self.global_worker, self.global_workers = place.global_worker, place.global_workers
        self._policy = error_policy if error_policy is not None else read.error_policy()
        self.errors: ErrorCounter = self._policy.errors
        media_read = None if media is None else media.reading(self._open, self.io_stats)  # images: this reader's I/O
        self._decode = dataclasses.replace(read.decode(), media=media_read)
        self._cache_dir = read.cache_dir
        # the settings a state must match, as the state keeps them: written once, get_state runs after every batch
        self._config_text = record_text({
            "sources": shards.digest,
            "num_sources": len(self.urls),
            "seed": seed,
            "shuffle": shuffle,
            "dp_rank": place.dp_rank,
            "dp_size": place.dp_size,
            "worker_id": place.worker_id,
            "num_workers": place.num_workers,
            "fields": read.recorded_fields(),
            "vocab_size": read.vocab_size,  # both decide which samples are kept
            "limits": self._decode.limits.recorded(images=media is not None),
        })
        self.work: Work = dict(work or {})
        self.keep_work, self.source = keep_work, source
        # built once: get_state runs per batch
        self._work_tensors = {e: spans_to_state(spans) for e, spans in self.work.items()} if keep_work else {}
        self._ends = {} if keep_work else ends_to_state(self.work)
        self._spans_cache: tuple[int, list[ShardSpan | Span]] | None = None
        self._streams: list[BinaryIO] = []
        self._items: Iterator[Item] | None = None
        self._starved_shards: set[int] = set()  # shards read empty since the last sample (not state)
        self._saved_identities: dict[int, ShardStat] = dict(saved_identities or {})  # what a restored state recorded
        # recently opened shards, newest last; an elastic share starts with the old readers' record, so a
        # state saved before it opens them still names the shards its spans and carried samples point into
        self._identities: OrderedDict[int, ShardStat] = OrderedDict(list(self._saved_identities.items())[-RECENT_SHARDS:])
        self._identity_text: str | None = None  # identities_to_state(self._identities), made when they change
        self._checked: set[int] = set()  # shards this reader found unchanged in this process (not state)
        self.manifest = manifest  # what planned this reader's spans: its shards' identities and totals
        self._prints = {m: manifest.fingerprint(m) for m in PRINT_MODES} if manifest is not None else None
        self._set_position(self.start_epoch, 0, -1, 0, 0, 0)

    @property
    def epoch(self) -> int:
        """Epoch of the next sample."""
        return self._epoch

    def spans(self, epoch: int) -> list[ShardSpan | Span]:
        """What this worker reads in ``epoch``: ``work[epoch]`` when given, else ``assign_shards``."""
        if epoch in self.work:
            return self.work[epoch]
        if self._spans_cache is None or self._spans_cache[0] != epoch:
            spans: list[ShardSpan | Span] = assign_shards(len(self.urls), seed=self.seed, epoch=epoch,
                                                          shuffle=self.shuffle, global_worker=self.global_worker,
                                                          global_workers=self.global_workers)
            self._spans_cache = (epoch, spans)
        return self._spans_cache[1]

    def index(self, shard: int | str) -> ShardIndex:
        """The sample index (offsets, keys, token lengths) of a shard, built once and cached."""
        url = self.urls[shard] if isinstance(shard, int) else shard
        return load_or_build_index(url, decode=index_decode(self._decode),
                                   positions_only=True,
                                   opts=self._open, cache_dir=self._cache_dir,
                                   stats=self.io_stats)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.close()
        self._starved_shards.clear()
        self._checked.clear()
        if initial_state is None:
            self._set_position(self.start_epoch, 0, -1, 0, 0, 0)
            return
        check_version(initial_state, what="ShardReader state")
        check_node_config(record_of(initial_state.get(CONFIG_KEY)), record_of(self._config_text), node="ShardReader",
                          label="reader")
        if initial_state.get(WORK_KEY):
            self.work, self.keep_work = work_from_state(initial_state[WORK_KEY]), True
            self._work_tensors = dict(initial_state[WORK_KEY])
            self._spans_cache = None
        self.start_epoch = int(initial_state.get(START_EPOCH_KEY, self.start_epoch))
        self._set_position(*(int(initial_state[k]) for k in (EPOCH_KEY, SHARD_POS_KEY, OFFSET_KEY, SAMPLE_KEY, YIELDED_KEY, EPOCH_YIELDED_KEY)))
        self._saved_identities = identities_from_state(initial_state.get(IDENTITY_KEY))
        self._identities = OrderedDict(self._saved_identities)
        self._identity_text = None
        if self.manifest is not None:  # before any position is trusted: the plan they index may have moved
            check_manifest(initial_state.get(MANIFEST_KEY), self.manifest, self._open,
                           recorded=self._saved_identities)
        spans = self.spans(self._epoch) if self.epochs is None or self._epoch < self.epochs else []
        if self._offset >= 0 and self._shard_pos < len(spans):  # resuming inside a shard: it must be the same one
            self.verify_shard(spans[self._shard_pos].shard)

    def verify_shard(self, shard: int) -> None:
        """``ValueError`` naming the shard and what changed when ``shard`` is not the one a restored state
        read (or, not recorded there, the one the manifest planned); the replay calls it for every shard."""
        if (shard in self._saved_identities or self.manifest is not None) and self._open.identity != "off":
            self._current(shard)

    def _current(self, shard: int) -> ShardStat:
        """The identity of ``shard`` now, refused unless it is the one the state and the manifest recorded."""
        now = shard_identity.current(self.urls[shard], self._open, self.io_stats)
        saved = self._saved_identities.get(shard)
        if saved is not None:
            shard_identity.check(self.urls[shard], saved, now, self._open.identity, since="the state was saved",
                                 prefix="cannot resume: ",
                                 consequence="; the saved positions point into the old contents")
        if self.manifest is not None:
            self.manifest.check_identity(shard, now, self._open.identity)
        return now

    @staticmethod
    def undelivered(state: Mapping[str, Any]) -> Planned:
        """A saved state's plan (explicit spans, planned epochs' ends), first epoch and what the plan was cut
        from; where in it the reader stood is the overlong stage's frontier (``OverlongNode.undelivered``)."""
        return Planned(start_epoch=int(state[START_EPOCH_KEY]), work=work_from_state(state[WORK_KEY]),
                       ends=ends_from_state(state.get(ENDS_KEY)),
                       identities=identities_from_state(state.get(IDENTITY_KEY)), manifest=state.get(MANIFEST_KEY))

    def get_state(self) -> dict[str, Any]:
        return {
            VERSION_KEY: STATE_VERSION,
            KIND_KEY: KIND,
            IDENTITY_KEY: self._identity_state(),
            **({MANIFEST_KEY: dict(self._prints)} if self._prints is not None else {}),
            CONFIG_KEY: self._config_text,
            START_EPOCH_KEY: self.start_epoch,
            WORK_KEY: dict(self._work_tensors),
            ENDS_KEY: self._ends,
            EPOCH_KEY: self._epoch,
            SHARD_POS_KEY: self._shard_pos,
            OFFSET_KEY: self._offset,
            SAMPLE_KEY: self._sample,
            YIELDED_KEY: self._yielded,
            EPOCH_YIELDED_KEY: self._epoch_yielded,
        }

    def next(self) -> Sample:
        while True:
            span = self._span()
            if span is None:
                raise StopIteration
            try:
                if self._items is None:
                    self._items = self._open_span(span)
                item = next(self._items, None)
            except ShardChanged:  # a refusal, whatever on_error says: reading on would splice two versions
                raise
            except (DataError, OSError) as e:
                self._lose_span(e, span)
                continue
            if item is None:
                self._next_span()
                continue
            sample = item.sample
            if sample is not None:
                sample = sample.evolve(origin=SampleOrigin(
                    shard=span.shard, offset=self._offset, number=self._sample, next_offset=item.next_offset,
                    next_number=item.next_index, epoch=self._span_epoch(span), source=self.source))
                self._yielded += 1
                self._epoch_yielded += 1
            self._offset, self._sample = item.next_offset, item.next_index
            self._advance(item.error, next_span=item.at_end)
            if sample is not None:
                return sample

    def _span(self) -> ShardSpan | Span | None:
        """The span the next sample comes from (past the epochs that ended); None at the end of the stream."""
        while self.epochs is None or self._epoch < self.epochs:
            spans = self.spans(self._epoch)
            if self._shard_pos < len(spans):
                return spans[self._shard_pos]
            self._next_epoch()
        return None

    def close(self) -> None:
        """Release the open shard (the position is kept)."""
        self._items = None
        while self._streams:
            self._streams.pop().close()

    def _set_position(self, epoch: int, shard_pos: int, offset: int, sample: int, yielded: int, epoch_yielded: int) -> None:
        self._epoch, self._shard_pos, self._offset, self._sample = epoch, shard_pos, offset, sample
        self._yielded, self._epoch_yielded = yielded, epoch_yielded

    def _lose_span(self, e: DataError | OSError, span: ShardSpan | Span) -> None:
        """A span that cannot be read on (missing / unreachable / corrupt; an ``OSError`` is a broken ``pipe:``,
        as files and stores retry inside io.open): the rest of it is lost, counted and handled by ``on_error``."""
        if isinstance(e, OSError):
            e = DataError("corrupt_shard", f"read failed: {e!r}", url=self.urls[span.shard], value=self._offset)
        self._advance(e, next_span=True)

    def _advance(self, err: DataError | None, *, next_span: bool) -> None:
        """Count ``err``, move past the span if asked, then apply ``on_error`` — in that order, so
        a raised error (or a later restore) leaves the position *after* the bad input."""
        if err is not None:
            self.errors.record(err)
        try:
            if next_span:
                self._next_span()
        finally:
            if err is not None and self._policy.on_error == "raise":
                raise err

    def _next_span(self) -> None:
        self.close()
        self._shard_pos, self._offset, self._sample = self._shard_pos + 1, -1, 0
        # Roll over eagerly so `epoch` and the state name the epoch of the next sample.
        if (self.epochs is None or self._epoch < self.epochs) and self._shard_pos >= len(self.spans(self._epoch)):
            self._next_epoch()

    def _next_epoch(self) -> None:
        if self.epochs is None and self._epoch_yielded == 0 and self._epoch not in self.work:
            self._check_not_starved()
        elif self._epoch_yielded:
            self._starved_shards.clear()
        self._epoch, self._shard_pos, self._offset, self._sample, self._epoch_yielded = self._epoch + 1, 0, -1, 0, 0

    def _check_not_starved(self) -> None:
        """An infinite stream where this worker got nothing in the epoch that just ended: an error only once
        every shard has come up empty since its last sample (at once when every epoch reads the same
        spans), since with ``shuffle`` the next epoch draws other shards."""
        self._starved_shards.update(span.shard for span in self.spans(self._epoch))
        if self.shuffle and len(self.urls) > 1 and len(self._starved_shards) < len(self.urls):
            return
        raise ValueError(
            f"global worker {self.global_worker} of {self.global_workers} got no samples in epoch {self._epoch} "
            f"from {len(self.urls)} shard(s), and none from any shard it can be given "
            f"(too few samples per shard to split, or every sample was bad: "
            f"{self.errors.as_dict()['counts']}); an infinite stream would spin forever"
        )

    def _identity_state(self) -> str:
        if self._identity_text is None:
            self._identity_text = identities_to_state(self._identities)
        return self._identity_text

    def _remember(self, shard: int, url: str) -> None:
        """Record the identity of a shard this reader opens (a ``stat`` / ``HEAD``, two ranged reads more under
        ``identity="digest"``), keeping the ``RECENT_SHARDS`` newest; a shard that is not the one the state
        or the manifest recorded is refused before a byte of it is read."""
        if url.startswith("pipe:") or self._open.identity == "off":
            return
        if shard not in self._checked or shard not in self._identities:  # a recorded one is checked again
            self._identities[shard] = self._current(shard)
            self._checked.add(shard)
        self._identities.move_to_end(shard)
        while len(self._identities) > RECENT_SHARDS:
            self._identities.popitem(last=False)
        self._identity_text = None

    def _start(self, span: ShardSpan | Span) -> tuple[str, ShardRange]:
        """The URL of ``span`` and its range from the reader's position (the shard's identity checked first)."""
        url = self.urls[span.shard]
        if isinstance(span, Span):
            start, end, first = span.start, span.end, span.first
        elif span.parts > 1:
            start, end, first = self.index(url).part(span.part, span.parts)
        else:
            start, end, first = 0, None, 0
        self._remember(span.shard, url)
        if self._offset < 0:  # the position names where the next sample starts from now on
            self._offset, self._sample = start, first
        return url, ShardRange(start=self._offset, first=self._sample, end=end)

    def _span_epoch(self, span: ShardSpan | Span) -> int:
        return self._epoch if not isinstance(span, Span) or span.epoch is None else span.epoch

    def _open_span(self, span: ShardSpan | Span) -> Iterator[Item]:
        url, where = self._start(span)
        if where.end is not None and where.start >= where.end:
            return iter(())
        return open_range(url, where, decode=self._decode, opts=self._open, streams=self._streams, stats=self.io_stats,
                          index=self.range_index(span, url, where))

    def range_index(self, span: ShardSpan | Span, url: str, where: ShardRange) -> ShardIndex | None:
        """The index of a shard whose format starts ``where`` from a place the index records
        (:func:`~streampack.io.formats.seeks_by_index`): the manifest's (one read), else the one the span was cut
        by; a whole shard without a manifest is read from its start (building an index reads all of it)."""
        if not seeks_by_index(url, where):
            return None
        if self.manifest is not None:
            return self.manifest.load_index(span.shard, self._decode, self._open)
        return None if isinstance(span, ShardSpan) and span.parts == 1 else self.index(url)


def identities_to_state(identities: Mapping[int, ShardStat]) -> str:
    """Shard identities as one JSON text of plain lists (``size`` -1 where the store gave none)."""
    return record_text({"shards": list(identities),
                        "sizes": [-1 if v.size is None else v.size for v in identities.values()],
                        "tags": [v.tag for v in identities.values()]})


def identities_from_state(saved: str | None) -> dict[int, ShardStat]:
    """What :func:`identities_to_state` wrote."""
    saved = record_of(saved)
    if not saved:
        return {}
    return {int(shard): ShardStat(size=None if size < 0 else int(size), tag=str(tag))
            for shard, size, tag in zip(saved["shards"], saved["sizes"], saved["tags"])}


def check_manifest(saved: Mapping[str, str] | None, manifest: Manifest, opts: OpenOptions, *,
                   recorded: Mapping[int, ShardStat] | None = None, states: str = "the state was") -> None:
    """:class:`~streampack.io.shard_identity.ShardChanged` naming the shards that changed when ``manifest``
    (the one planning now) differs from the fingerprints a state recorded (``saved``) as ``opts.identity``
    compares. Only on a difference is the saved manifest's copy read (1 read), to name the shards."""
    mode = opts.identity
    if mode == "off" or not saved or saved.get(mode) == manifest.fingerprint(mode):
        return
    old = load_saved(manifest.location, str(saved.get("all", "")), opts)
    if old is not None and old.urls == manifest.urls:
        changed = [(c.url, c.describe(mode), shard_identity.hint(c.old, c.new, mode))
                   for c in manifest.changes_since(old, mode)]
    else:  # its copy is gone (another machine, a cleared cache): what this reader recorded
        changed = [(manifest.urls[s], f"shard {manifest.urls[s]!r} ({'; '.join(diff)})",
                    shard_identity.hint(ident, manifest.recorded(s, mode), mode))
                   for s, ident in sorted((recorded or {}).items()) if s < len(manifest)
                   for diff in [shard_identity.changes(ident, manifest.recorded(s, mode), mode)] if diff]
    why = (f"; the positions saved belong to an epoch plan cut from the old contents (manifest at "
           f"{manifest.location!r}, fingerprint {saved.get(mode)} -> {manifest.fingerprint(mode)} under "
           f"identity={mode!r}): put the original bytes back to resume exactly, or start afresh")
    if not changed:
        raise ShardChanged("shard_changed", f"cannot resume: the data set's shards changed since {states} saved, "
                           f"and the manifest of that save is no longer kept to name them{why}",
                           url=manifest.location)
    shown = "; ".join(text for _, text, _ in changed[:4]) + (f"; ... ({len(changed)} in all)" if len(changed) > 4
                                                           else "")
    raise ShardChanged("shard_changed", f"cannot resume: {len(changed)} shard(s) changed since {states} saved: "
                       f"{shown}{why}{changed[0][2]}", url=changed[0][0])
