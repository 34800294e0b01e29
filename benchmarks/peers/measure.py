"""How every loader is measured, the same way: one interface, one epoch loop, one resume.

A peer adapter (one module per library) builds its loader the way the library's docs show
and answers four questions: how to build a loader (fresh, or continuing from a state), how
many real tokens and slots a batch holds, how to save a state mid-epoch (``None``: the library
has no resume), and what it cannot be run without (:meth:`Peer.missing`).

Per loader, :func:`measure` runs one epoch with 1 DataLoader worker and one with 2 (tokens/s
counts the real tokens handed to the loop, from ``iter()`` to the end, worker start-up
included), saves a state in the 1-worker run once ``resume_at`` of the corpus's tokens have
been delivered (the time that takes is left out of the throughput) together with the next
batch, then times a fresh loader from ``torch.load`` of that state to its first batch and
checks that batch is the one the uninterrupted run got. A loader without resume pays the
fast-forward instead: a fresh loader skipping the batches already trained on.
"""

from __future__ import annotations

import gc
import io
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .corpus import Corpus


@dataclass(frozen=True, slots=True, kw_only=True)
class Count:
    """What one batch delivers to the training loop."""

    tokens: int
    """Real tokens."""
    slots: int
    """Token slots the step computes over (packs x capacity)."""
    ids: torch.Tensor
    """The batch's token ids (compared to check a resume is exact)."""
    filler_slots: int = 0
    """Slots of packs that only complete an epoch's last batch to the batch shape (counted in
    ``slots``: the step computes over them)."""


class Peer(Protocol):
    name: str
    """Row label."""
    fmt: str
    """Storage format read."""
    packing: str
    """How documents become packs."""
    notes: list[str]
    """Non-default settings and caveats, shown in the table."""

    def missing(self) -> str | None:
        """Why this peer cannot run here (a package not installed), or None."""

    def prepare(self, corpus: Corpus) -> None:
        """Write the corpus in this peer's format (reused when already written)."""

    def loader(self, num_workers: int, state: Any | None = None) -> Iterable[Any]:
        """A fresh loader over one epoch, continuing from ``state`` when given."""

    def count(self, batch: Any) -> Count: ...

    def save(self, loader: Any, batches: int) -> Any | None:
        """The state after ``batches`` batches of ``loader``, or None without resume."""


@dataclass(slots=True, kw_only=True)
class EpochRun:
    seconds: float
    tokens: int
    slots: int
    batches: int
    state: bytes | None = None
    """``torch.save`` of the state taken mid-epoch."""
    saved_after: int = 0
    """Batches delivered when the state was taken."""
    reference: torch.Tensor | None = None
    """The batch delivered right after the state was taken."""


@dataclass(slots=True, kw_only=True)
class Result:
    peer: str
    fmt: str
    packing: str
    tokens_per_s_per_worker: dict[int, float] = field(default_factory=dict)
    fill: float = 0.0
    delivered: float = 0.0
    """Real tokens of one epoch / the corpus's tokens."""
    resume_s: float | None = None
    resume_kind: str = ""
    """``"state"`` (loaded a saved state) or ``"skip"`` (no resume: fast-forward by skipping)."""
    resume_exact: bool | None = None
    state_bytes: int | None = None
    weights_only: bool = True
    """The state loads with ``torch.load(weights_only=True)``."""
    notes: list[str] = field(default_factory=list)
    error: str = ""


def run_epoch(peer: Peer, num_workers: int, *, checkpoint_at: int | None = None) -> EpochRun:
    loader = peer.loader(num_workers)
    run = EpochRun(seconds=0.0, tokens=0, slots=0, batches=0)
    paused = 0.0
    want_reference = False
    start = time.perf_counter()
    for batch in loader:
        c = peer.count(batch)
        run.tokens += c.tokens
        run.slots += c.slots
        run.batches += 1
        if want_reference:
            run.reference, want_reference = c.ids.clone(), False
        if checkpoint_at is not None and run.saved_after == 0 and run.tokens >= checkpoint_at:
            t = time.perf_counter()
            state = peer.save(loader, run.batches)
            if state is not None:
                buf = io.BytesIO()
                torch.save(state, buf)
                run.state = buf.getvalue()
            run.saved_after, want_reference = run.batches, True
            paused += time.perf_counter() - t
    run.seconds = time.perf_counter() - start - paused
    del loader
    gc.collect()  # shut worker processes down before the next run starts its own
    return run


@dataclass(frozen=True, slots=True, kw_only=True)
class Resume:
    seconds: float
    """From loading the state (or building a fresh loader) to the first batch after the checkpoint."""
    exact: bool | None
    """That batch is the one the uninterrupted run delivered (None: nothing to compare)."""
    weights_only: bool
    """The state loaded with ``torch.load(weights_only=True)``."""


def load_state(blob: bytes) -> tuple[Any, bool]:
    """The state, and whether it loaded with ``weights_only=True`` (plain data)."""
    try:
        return torch.load(io.BytesIO(blob), weights_only=True), True
    except Exception:  # noqa: BLE001 - our own bytes from this run: report the peer needs pickle, load anyway
        return torch.load(io.BytesIO(blob), weights_only=False), False


def time_resume(peer: Peer, run: EpochRun, num_workers: int) -> Resume:
    start = time.perf_counter()
    weights_only = True
    if run.state is not None:
        state, weights_only = load_state(run.state)
        it = iter(peer.loader(num_workers, state=state))
    else:
        it = iter(peer.loader(num_workers))
        for _ in range(run.saved_after):
            next(it)
    first = next(it, None)
    seconds = time.perf_counter() - start
    del it
    gc.collect()
    if first is None or run.reference is None:
        return Resume(seconds=seconds, exact=None, weights_only=weights_only)
    ids = peer.count(first).ids
    exact = ids.shape == run.reference.shape and bool(torch.equal(ids, run.reference))
    return Resume(seconds=seconds, exact=exact, weights_only=weights_only)


def measure(peer: Peer, corpus: Corpus, *, workers: tuple[int, ...] = (1, 2), resume_at: float = 0.8) -> Result:
    peer.prepare(corpus)  # may settle notes (settings it derives from the corpus)
    result = Result(peer=peer.name, fmt=peer.fmt, packing=peer.packing, notes=list(peer.notes))
    checkpoint_at = int(resume_at * corpus.num_tokens)
    first: EpochRun | None = None
    for n in workers:
        run = run_epoch(peer, n, checkpoint_at=checkpoint_at if first is None else None)
        result.tokens_per_s_per_worker[n] = run.tokens / run.seconds / n
        first = first or run
    assert first is not None
    result.fill = first.tokens / max(1, first.slots)
    result.delivered = first.tokens / corpus.num_tokens
    result.state_bytes = len(first.state) if first.state is not None else None
    result.resume_kind = "state" if first.state is not None else "skip"
    if first.saved_after:
        resume = time_resume(peer, first, workers[0])
        result.resume_s, result.resume_exact, result.weights_only = resume.seconds, resume.exact, resume.weights_only
    return result


def best_of(results: list[Result]) -> Result:
    """Repeated measurements of one loader as one: the fastest of each timing (a shared machine
    only ever slows a run down), exact only if every resume was."""
    best = results[0]
    for r in results[1:]:
        for n, rate in r.tokens_per_s_per_worker.items():
            best.tokens_per_s_per_worker[n] = max(rate, best.tokens_per_s_per_worker.get(n, 0.0))
        if r.resume_s is not None:
            best.resume_s = r.resume_s if best.resume_s is None else min(r.resume_s, best.resume_s)
        if best.resume_exact is not None and r.resume_exact is not None:
            best.resume_exact = best.resume_exact and r.resume_exact
    return best
