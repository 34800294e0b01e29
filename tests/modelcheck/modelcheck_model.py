"""Reference model for the model checker (``modelcheck_driver``): what a finite run must train.

An epoch of a finite run must train every good record of every shard exactly once, as
``(shard, key, chunk, epoch)`` units: a record longer than the capacity counts once per chunk
(``overlong="split"``), and a bad record (empty, corrupt, over a limit) is never trained — with
``on_error="skip"`` it is skipped and counted, with ``"raise"`` the run stops with a
:class:`~streampack.errors.DataError` naming its shard. With ``dp_size > 1`` every rank yields
the same number of batches; a filler batch has only ``"<filler>"`` documents and no targets.

Units are read back from ``PackedBatch.doc_keys``: the driver adds a stage that tags each key
with the epoch its reader read it in (``url#key@epoch[/chunk]``), so the model needs nothing
from the pipeline's internals. Tokens are compared too: a unit trained with other tokens than
the model's (a shard rewritten under a resume) is a silent difference, never accepted.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from streampack import check_invariants
from streampack.layout.batch import PackedBatch
from streampack.nodes.collate import FILLER_KEY

BAD_KINDS = ("empty", "corrupt", "too_long", "out_of_vocab")
"""What a bad record can be: no tokens; undecodable bytes; over a byte limit; an id >= vocab_size."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Record:
    key: str
    """Sample key inside its shard (tar member prefix, jsonl line / parquet row number)."""
    tokens: tuple[int, ...]
    bad: str = ""
    """'' for a good record, else one of :data:`BAD_KINDS`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Shard:
    url: str
    """What the dataset reads (a path or an HTTP URL)."""
    records: tuple[Record, ...]


@dataclass(frozen=True, slots=True, kw_only=True, order=True)
class Unit:
    """One thing an epoch trains: a record, or one chunk of a split record (``chunk=-1``: whole)."""

    url: str
    key: str
    chunk: int
    epoch: int

    def __str__(self) -> str:
        part = "" if self.chunk < 0 else f"/{self.chunk}"
        return f"{os.path.basename(self.url)}#{self.key}{part}@epoch{self.epoch}"


def tag_epoch_key(key: str, epoch: int) -> str:
    """The key the driver's stage gives a sample (``parse_doc_key`` reads it back)."""
    return f"{key}@{epoch}"


def parse_doc_key(doc_key: str) -> Unit:
    url, _, rest = doc_key.rpartition("#")
    key, _, tail = rest.partition("@")
    epoch, _, chunk = tail.partition("/")
    return Unit(url=url, key=key, chunk=int(chunk) if chunk else -1, epoch=int(epoch))


def record_units(shard: Shard, record: Record, epoch: int, *, capacity: int,
                 overlong: str) -> dict[Unit, tuple[int, ...]]:
    """The units one good record becomes in one epoch, with their tokens."""
    tokens, unit = record.tokens, Unit(url=shard.url, key=record.key, chunk=-1, epoch=epoch)
    if len(tokens) <= capacity:
        return {unit: tokens}
    if overlong == "drop":
        return {}
    if overlong == "truncate":
        return {unit: tokens[:capacity]}
    return {Unit(url=shard.url, key=record.key, chunk=i, epoch=epoch): tokens[s:s + capacity]
            for i, s in enumerate(range(0, len(tokens), capacity))}


def expected_units(shards: Sequence[Shard], *, epochs: Iterable[int], capacity: int,
                   overlong: str = "split") -> dict[Unit, tuple[int, ...]]:
    """Every unit the given epochs must train, exactly once each, with its tokens."""
    out: dict[Unit, tuple[int, ...]] = {}
    for epoch in epochs:
        for shard in shards:
            for record in shard.records:
                if not record.bad:
                    out.update(record_units(shard, record, epoch, capacity=capacity, overlong=overlong))
    return out


@dataclass(slots=True)
class Trained:
    """What the checker saw trained (mutable: it grows batch by batch)."""

    counts: Counter = field(default_factory=Counter)
    tokens: dict[Unit, tuple[int, ...]] = field(default_factory=dict)
    """The tokens of each unit's first appearance."""

    def add(self, batch: PackedBatch) -> None:
        cu, starts = batch.cu_seqlens.tolist(), batch.cu_seqlens_padded.tolist()
        ids = batch.input_ids.tolist()
        for i, key in enumerate(batch.doc_keys):
            if key != FILLER_KEY:
                unit = parse_doc_key(key)
                self.counts[unit] += 1
                self.tokens.setdefault(unit, tuple(ids[starts[i]:starts[i] + cu[i + 1] - cu[i]]))

    def copy(self) -> Trained:
        return Trained(counts=Counter(self.counts), tokens=dict(self.tokens))


@dataclass(frozen=True, slots=True, kw_only=True)
class Diff:
    expected: int
    trained: int
    duplicated: tuple[Unit, ...]
    missing: tuple[Unit, ...]
    unexpected: tuple[Unit, ...]
    wrong: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not (self.duplicated or self.missing or self.unexpected or self.wrong)

    @property
    def worst(self) -> str:
        return next(name for name, bad in (("duplicated", self.duplicated), ("missing", self.missing),
                                           ("unexpected", self.unexpected), ("wrong tokens", self.wrong), ("ok", True))
                    if bad)

    def describe(self) -> str:
        head = (f"{self.trained} (document, epoch) chunks trained against {self.expected} expected, "
                f"{len(self.duplicated)} duplicated, {len(self.missing)} missing, {len(self.unexpected)} unexpected")
        shown = [("duplicated", self.duplicated), ("missing", self.missing), ("unexpected", self.unexpected)]
        lines = [f"  {name}: " + ", ".join(map(str, units[:4])) + (" ..." if len(units) > 4 else "")
                 for name, units in shown if units]
        return "\n".join([head, *lines, *(f"  wrong tokens: {w}" for w in self.wrong)])


def compare(expected: Mapping[Unit, tuple[int, ...]], trained: Trained, *, complete: bool = True,
            changed: str = "") -> Diff:
    """Exactly once against the model; ``complete=False`` (a run that stopped early) only
    checks that nothing was trained twice or out of the model; units of the ``changed`` shard
    are left out (:func:`changed_shard_problems` judges them)."""
    counts = Counter({u: n for u, n in trained.counts.items() if u.url != changed})
    expected = {u: t for u, t in expected.items() if u.url != changed}
    wrong = [f"{u} trained {len(trained.tokens[u])} tokens unlike the shard's {len(t)}"
             for u, t in expected.items() if u in counts and trained.tokens[u] != t]
    return Diff(expected=len(expected), trained=sum(counts.values()),
                duplicated=tuple(sorted(u for u, n in counts.items() if n > 1)),
                missing=tuple(sorted(u for u in expected if u not in counts)) if complete else (),
                unexpected=tuple(sorted(u for u in counts if u not in expected)), wrong=tuple(wrong[:5]))


def changed_shard_problems(trained: Trained, url: str, versions: Sequence[Mapping[Unit, tuple[int, ...]]],
                           epochs: Iterable[int]) -> list[str]:
    """A shard changed under a resume that did not refuse: each epoch must have trained exactly
    one version of it (every unit of that version once, with its tokens), never a splice."""
    out = []
    for epoch in epochs:
        got = {u: n for u, n in trained.counts.items() if u.url == url and u.epoch == epoch}
        seen = {u: trained.tokens[u] for u in got}
        wanted = [{u: t for u, t in v.items() if u.epoch == epoch} for v in versions]
        if max(got.values(), default=1) > 1 or not any(seen == w for w in wanted):
            out.append(f"epoch {epoch} trained {sum(got.values())} units of {os.path.basename(url)}, "
                       f"{sorted(map(str, got))[:4]}..., matching neither its old nor its new contents")
    return out


def batch_problems(batch: PackedBatch, *, capacity: int, packs_per_batch: int) -> list[str]:
    """The PackedBatch contract on one batch (fillers included)."""
    out = []
    try:
        check_invariants(batch)
    except AssertionError as e:  # check_invariants asserts: report it as a finding, not a crash
        out.append(f"batch invariants: {e}")
    if batch.total_tokens != capacity * packs_per_batch:
        out.append(f"batch of {batch.total_tokens} tokens, want {capacity * packs_per_batch}")
    if all(k == FILLER_KEY for k in batch.doc_keys) and batch.num_targets != 0:
        out.append(f"filler batch with {batch.num_targets} targets")
    return out


def unequal_counts(counts: Sequence[int]) -> str | None:
    """The batch-count rule: every rank yields the same number of batches."""
    return None if len(set(counts)) <= 1 else f"ranks yielded different numbers of batches: {list(counts)}"


def batch_epoch(batch: PackedBatch) -> int | None:
    """The epoch a batch belongs to (its newest unit's); None for a filler (any epoch's end)."""
    return max((parse_doc_key(k).epoch for k in batch.doc_keys if k != FILLER_KEY), default=None)


def unequal_epochs(labels: Sequence[Sequence[int | None]]) -> str | None:
    """The batch-count rule per epoch, for ranks stepped together (``labels[r][i]``: epoch of
    rank r's i-th batch): equal counts per epoch means common epoch boundaries, so every batch
    of an epoch on any rank comes before every batch of a later epoch on any rank."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for rank in labels:
        for i, epoch in enumerate(rank):
            if epoch is not None:
                first[epoch], last[epoch] = min(first.get(epoch, i), i), max(last.get(epoch, i), i)
    for a in last:
        for b in first:
            if a < b and last[a] >= first[b]:
                return (f"batches per epoch differ between ranks: a rank's batch {last[a]} is in epoch {a} while "
                        f"a rank's batch {first[b]} is already in epoch {b}")
    return None


def named_refusal(exc: BaseException, urls: Iterable[str]) -> str | None:
    """The shard a ValueError names (its URL or file name), or None when it names none."""
    if not isinstance(exc, ValueError):
        return None
    text = str(exc)
    return next((u for u in urls if u in text or os.path.basename(u) in text), None)
