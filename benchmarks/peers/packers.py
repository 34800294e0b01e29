"""The packers the peers' users run, where the peer library itself has none, and one collate.

- :func:`greedy_packs` is the greedy packing people write around webdataset: append documents
  to the open pack until the next one does not fit, then emit it (next-fit; whole documents).
- :class:`BinPackCollator` re-states llm-foundry's ``llmfoundry.data.packing.BinPackCollator``
  (0.22) and :func:`auto_packing_ratio` its ``auto_packing_ratio``: llm-foundry cannot be
  installed next to torch 2.13 (see ``benchmarks/requirements-peers.txt``), so this is the same
  algorithm written from its source: each call gets ``packing_ratio * target_batch_size`` raw
  examples, sorts them longest first, first-fits them into the bins left over from earlier
  calls plus new bins (every example gets its own bin once only as many remain as bins are
  still needed), returns the ``target_batch_size`` fullest bins and keeps the rest as leftovers
  (all of them when ``max_leftover_bins_to_keep`` is None, llm-foundry's default). It skips
  llm-foundry's pad-to-``max_seq_len``-then-trim round trip, which only costs time, so the
  numbers favour the peer.
- :func:`pad_packs` turns packs of whole documents into the same padded ``[B, capacity]``
  batch with ``cu_seqlens`` for every peer that keeps document boundaries.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

Pack = list[np.ndarray]


@dataclass(frozen=True, slots=True, kw_only=True)
class PaddedBatch:
    """``B`` packs of ``capacity`` slots, documents back to back then padding."""

    input_ids: torch.Tensor
    """int64 ``[B, capacity]``; padding is 0."""
    cu_seqlens: torch.Tensor
    """int32 ``[n + 1]``: document boundaries over the flattened ``[B * capacity]`` token axis."""
    num_tokens: int
    """Real tokens (not padding)."""


def pad_packs(packs: Sequence[Pack], capacity: int) -> PaddedBatch:
    out = np.zeros((len(packs), capacity), dtype=np.int64)
    bounds = [0]
    for row, pack in enumerate(packs):
        at = 0
        for doc in pack:
            out[row, at:at + len(doc)] = doc
            at += len(doc)
            bounds.append(row * capacity + at)
        assert at <= capacity, f"pack of {at} tokens > {capacity=}"
    tokens = sum(len(d) for p in packs for d in p)
    return PaddedBatch(input_ids=torch.from_numpy(out), cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
                       num_tokens=tokens)


def greedy_packs(docs: Iterable[np.ndarray], capacity: int) -> Iterator[Pack]:
    """Next-fit: documents in arrival order, a new pack whenever the next one does not fit."""
    pack: Pack = []
    used = 0
    for doc in docs:
        if used + len(doc) > capacity and pack:
            yield pack
            pack, used = [], 0
        pack.append(doc)
        used += len(doc)
    if pack:
        yield pack


class BinPackCollator:
    """llm-foundry's BinPackCollator over token arrays (see the module docstring)."""

    def __init__(self, *, target_batch_size: int, max_seq_len: int,
                 max_leftover_bins_to_keep: int | None = None) -> None:
        if target_batch_size < 1 or max_seq_len < 1:
            raise ValueError(f"{target_batch_size=} and {max_seq_len=} must be >= 1")
        self.out_size, self.max_seq_len = target_batch_size, max_seq_len
        self.max_leftover_bins_to_keep = max_leftover_bins_to_keep
        self.leftover: list[tuple[int, Pack]] = []
        self.n_packed_tokens = self.n_total_tokens = 0

    @property
    def waste(self) -> float:
        """Share of the tokens seen so far still in leftover bins (or dropped from them)."""
        return 1 - self.n_packed_tokens / max(1, self.n_total_tokens)

    def pack(self, examples: Sequence[np.ndarray]) -> list[Pack]:
        bins = self.leftover
        order = sorted(examples, key=len, reverse=True)
        for i, doc in enumerate(order):
            if len(order) - i <= max(0, self.out_size - len(bins)):
                bins.append((len(doc), [doc]))  # only as many left as bins still needed
                continue
            for b, (size, members) in enumerate(bins):
                if size + len(doc) <= self.max_seq_len:
                    bins.pop(b)
                    bins.append((size + len(doc), [*members, doc]))  # llm-foundry moves it to the end
                    break
            else:
                bins.append((len(doc), [doc]))
        bins = sorted(bins, key=lambda b: b[0], reverse=True)
        out, rest = bins[:self.out_size], bins[self.out_size:]
        self.leftover = rest[:self.max_leftover_bins_to_keep]
        self.n_packed_tokens += sum(size for size, _ in out)
        self.n_total_tokens += sum(len(d) for d in examples)
        return [members for _, members in out]


def auto_packing_ratio(lengths: np.ndarray, *, target_batch_size: int, max_seq_len: int,
                       num_packing_ratios: int = 20) -> float:
    """llm-foundry's ``auto_packing_ratio``: the largest ratio in ``linspace(1, max_seq_len/100)``
    (rounded to 0.1) whose profile over the first ``100 * max raw batch`` examples leaves no
    waste (no tokens stuck in leftover bins at the end)."""
    ratios: list[float] = []
    raw_sizes: list[int] = []
    for r in np.linspace(1, max_seq_len / 100, num_packing_ratios):
        r = float(np.round(10 * r) / 10)
        if int(r * target_batch_size) not in raw_sizes:
            ratios.append(r)
            raw_sizes.append(int(r * target_batch_size))
    sample = [np.empty(int(n), dtype=np.int8) for n in lengths[:max(raw_sizes) * 100]]
    chosen = 1.0
    for ratio, raw in zip(ratios, raw_sizes):
        packer = BinPackCollator(target_batch_size=target_batch_size, max_seq_len=max_seq_len)
        for start in range(0, len(sample), raw):
            if len(sample[start:start + raw]) >= target_batch_size:
                packer.pack(sample[start:start + raw])
        if packer.waste > 0:
            break
        chosen = ratio
    return chosen
