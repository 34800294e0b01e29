"""Schedules for the model checker: records of what to run, drawn from a seed, and their shrinks.

A :class:`Schedule` is plain frozen data (a corpus, the dataset settings, a start topology and
steps), so a failing one prints as readable steps and shrinks by dropping steps and
shrinking sizes (:func:`smaller`); ``modelcheck_driver`` runs it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
from modelcheck_corpus import VOCAB, bad_tokens
from modelcheck_model import BAD_KINDS, Record

FORMATS = ("jsonl", "zst", "tar", "parquet")
CHANGES = ("rewrite", "truncate", "restage")
F = TypeVar("F", bound=Any)
"""A finding: anything with a ``kind``."""
FAULTS = ("503", "short", "reset", "truncate")


def topology(dp_size: int, num_workers: int) -> str:
    return f"{dp_size} rank{'s' if dp_size > 1 else ''} x {num_workers} workers"


@dataclass(frozen=True, slots=True, kw_only=True)
class BadRecord:
    shard: int
    index: int
    kind: str
    """One of ``modelcheck_model.BAD_KINDS``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Corpus:
    fmt: str
    """'jsonl', 'zst' (jsonl.zst), 'tar' (npy members) or 'parquet' (an int32 list column)."""
    shards: int
    docs: int
    """Records per shard."""
    long: float
    """Share of records longer than the capacity (split into chunks)."""
    bad: tuple[BadRecord, ...] = ()
    seed: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    capacity: int
    window: int
    packs_per_batch: int
    epochs: int
    on_error: str
    balance: bool
    """``balance="cost"`` with a cost model."""
    http: bool
    """Served by ``helpers_faults.serve_faulty`` (faults queued at the start and at resumes)."""
    seed: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    batches: int = 0
    """A run step: take this many batches from every rank (fewer if the run ends)."""
    dp_size: int = 0
    """A resume step (``dp_size > 0``): save every reader, resume on ``dp_size x num_workers``."""
    num_workers: int = 0
    elastic: bool = True
    """Each new reader loads the list of every reader's state (else its own: same topology only)."""
    change: str = ""
    """Between save and resume: 'rewrite', 'truncate' or 'restage' shard ``shard``."""
    shard: int = 0
    faults: tuple[str, ...] = ()
    """HTTP faults queued for the resumed readers' requests."""

    def describe(self) -> str:
        if not self.dp_size:
            return f"run {self.batches} batches on every rank"
        how = "elastic load_state_dict([all states])" if self.elastic else "each reader loads its own state"
        change = f"{self.change} shard {self.shard}, then " if self.change else ""
        faults = f" (HTTP faults {', '.join(self.faults)})" if self.faults else ""
        return f"save; {change}resume on {topology(self.dp_size, self.num_workers)}: {how}{faults}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    seed: int
    corpus: Corpus
    setup: Setup
    dp_size: int
    num_workers: int
    faults: tuple[str, ...] = ()
    steps: tuple[Step, ...] = ()

    def describe(self) -> str:
        c, u = self.corpus, self.setup
        bad = ", ".join(f"shard {b.shard} record {b.index} {b.kind}" for b in c.bad) or "none"
        lines = [f"corpus: {c.shards} {c.fmt} shards x {c.docs} records ({c.long:.0%} over capacity, seed {c.seed}); "
                 f"bad records: {bad}",
                 f"PackedDataset(capacity={u.capacity}, window={u.window}, packs_per_batch={u.packs_per_batch}, "
                 f"epochs={u.epochs}, on_error={u.on_error!r}, seed={u.seed}"
                 + (", balance='cost'" if u.balance else "") + ")" + (" over faulty HTTP" if u.http else " local"),
                 f"start on {topology(self.dp_size, self.num_workers)}" + (f" (HTTP faults {', '.join(self.faults)})"
                                                                    if self.faults else "")]
        lines += [f"{i + 1}. {step.describe()}" for i, step in enumerate(self.steps)]
        return "\n".join(lines + [f"{len(self.steps) + 1}. run every rank to the end; compare with the model"])


def corpus_records(c: Corpus, capacity: int) -> list[list[Record]]:
    """The records of every shard (bad ones in place), deterministic in ``c``."""
    rng = np.random.default_rng([c.seed, capacity])
    bad = {(b.shard, b.index): b.kind for b in c.bad}
    out = []
    for s in range(c.shards):
        records = []
        for i in range(c.docs):
            long = rng.random() < c.long
            n = int(rng.integers(capacity + 1, 3 * capacity + 4) if long else rng.integers(1, capacity + 1))
            tokens = tuple(rng.integers(0, VOCAB, n).tolist())
            key = f"{i:08d}" if c.fmt == "tar" else str(i)
            kind = bad.get((s, i), "")
            records.append(Record(key=key, tokens=bad_tokens(kind) if kind else tokens, bad=kind))
        out.append(records)
    return out


def _topology(rng: np.random.Generator, fmt: str, slow: bool) -> tuple[int, int]:
    # parquet has no token lengths in its index: finite runs over several ranks need equal_batches='sync'
    dp = 1 if fmt == "parquet" else int(rng.choice([1, 2, 3, 4] if slow else [1, 1, 2, 2, 3]))
    return dp, int(rng.integers(0, 4 if slow else 3))


def schedule_for(seed: int, *, slow: bool = False) -> Schedule:
    """The schedule of ``seed`` (the fast set draws smaller corpora and fewer steps)."""
    rng = np.random.default_rng([seed, 18, int(slow)])
    fmt = str(rng.choice(FORMATS))
    corpus = Corpus(fmt=fmt, shards=int(rng.integers(1, 5 if slow else 4)),
                    docs=int(rng.integers(2, 16 if slow else 7)),
                    long=float(rng.choice([0.0, 0.15, 0.3])), seed=seed)
    kinds = [k for k in BAD_KINDS if not (fmt == "parquet" and k == "too_long")]
    if rng.random() < 0.3:
        corpus = replace(corpus, bad=tuple(BadRecord(shard=int(rng.integers(corpus.shards)),
                                                     index=int(rng.integers(corpus.docs)), kind=str(rng.choice(kinds)))
                                           for _ in range(int(rng.integers(1, 3)))))
    setup = Setup(capacity=int(rng.choice([16, 24, 32])), window=int(rng.choice([1, 2, 4, 8])),
                  packs_per_batch=int(rng.integers(1, 3)), epochs=int(rng.choice([1, 2, 2, 3])),
                  on_error="raise" if corpus.bad and rng.random() < 0.2 else "skip", balance=bool(rng.random() < 0.3),
                  http=bool(rng.random() < 0.12), seed=int(rng.integers(100)))
    faults = lambda: tuple(rng.choice(FAULTS, int(rng.integers(0, 3))).tolist()) if setup.http else ()  # noqa: E731
    start = dp, nw = _topology(rng, fmt, slow)
    per_rank = corpus.shards * corpus.docs * setup.epochs * (1 + corpus.long * 2) / 2 / setup.packs_per_batch / dp
    steps, changed = [], False
    for _ in range(int(rng.integers(1, 5 if slow else 4))):
        steps.append(Step(batches=int(rng.integers(0, max(2, int(per_rank * 0.6))))))
        new = _topology(rng, fmt, slow) if rng.random() < 0.7 else (dp, nw)
        change = str(rng.choice(CHANGES)) if not changed and rng.random() < 0.2 else ""
        changed |= bool(change)
        steps.append(Step(dp_size=new[0], num_workers=new[1], elastic=new != (dp, nw) or bool(rng.random() < 0.5),
                          change=change, shard=int(rng.integers(corpus.shards)), faults=faults()))
        dp, nw = new
    return Schedule(seed=seed, corpus=corpus, setup=setup, dp_size=start[0], num_workers=start[1], faults=faults(),
                    steps=tuple(steps))


def normalized(s: Schedule) -> Schedule:
    """``s`` made valid again after a shrink: a resume onto another topology is elastic, and
    bad records and changes name shards and records that exist."""
    c = s.corpus
    bad = tuple(b for b in c.bad if b.shard < c.shards and b.index < c.docs)
    steps, topology = [], (s.dp_size, s.num_workers)
    for step in s.steps:
        if step.dp_size:
            new = (step.dp_size, step.num_workers)
            step = replace(step, elastic=step.elastic or new != topology, shard=min(step.shard, c.shards - 1))
            topology = new
        steps.append(step)
    on_error = s.setup.on_error if bad else "skip"
    return replace(s, corpus=replace(c, bad=bad), setup=replace(s.setup, on_error=on_error), steps=tuple(steps))


def _step_shrinks(step: Step) -> Iterator[Step]:
    if not step.dp_size:
        yield from (replace(step, batches=n) for n in {step.batches // 2, step.batches - 1} if 0 <= n < step.batches)
        return
    if step.change:
        yield replace(step, change="")
    if step.faults:
        yield replace(step, faults=())
    if step.num_workers:
        yield replace(step, num_workers=step.num_workers - 1)
    if step.dp_size > 1:
        yield replace(step, dp_size=step.dp_size - 1)
    if step.elastic:
        yield replace(step, elastic=False)


def smaller(s: Schedule) -> Iterator[Schedule]:
    """Every one-edit smaller variant of ``s`` (the shrinking loop keeps the first that still fails)."""
    for i in range(len(s.steps)):
        yield replace(s, steps=s.steps[:i] + s.steps[i + 1:])
    c, u = s.corpus, s.setup
    for corpus in (replace(c, shards=c.shards - 1) if c.shards > 1 else None, replace(c, docs=c.docs // 2),
                   replace(c, docs=c.docs - 1), replace(c, long=0.0) if c.long else None,
                   *(replace(c, bad=c.bad[:i] + c.bad[i + 1:]) for i in range(len(c.bad)))):
        if corpus is not None and corpus.docs >= 1:
            yield replace(s, corpus=corpus)
    for setup in (replace(u, epochs=u.epochs - 1) if u.epochs > 1 else None, replace(u, http=False) if u.http else None,
                  replace(u, balance=False) if u.balance else None, replace(u, window=1) if u.window > 1 else None,
                  replace(u, packs_per_batch=1) if u.packs_per_batch > 1 else None):
        if setup is not None:
            yield replace(s, setup=setup)
    if s.faults:
        yield replace(s, faults=())
    if s.num_workers:
        yield replace(s, num_workers=s.num_workers - 1)
    if s.dp_size > 1:
        yield replace(s, dp_size=s.dp_size - 1)
    for i, step in enumerate(s.steps):
        for new in _step_shrinks(step):
            yield replace(s, steps=s.steps[:i] + (new,) + s.steps[i + 1:])


def shrink(s: Schedule, finding: F, check: Callable[[Schedule], F | None], *,
           seconds: float = 20.0) -> tuple[Schedule, F]:
    """Delta debugging: keep the first smaller variant that ``check`` finds failing the same way
    (the same ``kind``), until none does (or ``seconds`` run out)."""
    deadline = time.monotonic() + seconds
    progress = True
    while progress and time.monotonic() < deadline:
        progress = False
        for candidate in map(normalized, smaller(s)):
            if candidate == s or time.monotonic() > deadline:
                continue
            found = check(candidate)
            if found is not None and found.kind == finding.kind:
                s, finding, progress = candidate, found, True
                break
    return s, finding
