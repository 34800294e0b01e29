"""Metrics of every DataLoader worker, read from the batches the training loop already has.

Each :class:`~streampack.layout.batch.PackedBatch` carries its reader's running totals;
:class:`StreamMetrics` keeps the latest record per reader and sums them::

    metrics = StreamMetrics()
    for step, batch in enumerate(loader):
        metrics.update(batch)                     # before .hf_inputs() / .to(device): O(1)
        if step % 100 == 0:
            metrics.log_to(writer, step)          # TensorBoard, a W&B run, or a Lightning logger

A finished pass of a finite stream is folded into a base, so the sums never go backwards;
``scalars(group=...)`` sums over data-parallel ranks (an all-reduce every rank must call).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from streampack.layout.stats import WorkerStats

COUNTS = tuple(f.name for f in fields(WorkerStats) if f.name not in ("dp_rank", "worker_id", "events"))


class StreamMetrics:
    """Sums of the per-reader totals carried by batches (see the module docstring)."""

    def __init__(self) -> None:
        self._latest: dict[tuple[int, int], WorkerStats] = {}
        self._base: dict[str, float] = dict.fromkeys(COUNTS, 0)
        self._base_events: dict[str, int] = {}

    def update(self, batch_or_stats: Any) -> None:
        """Record the stats of a batch (or a :class:`WorkerStats`); batches without stats
        (built by hand with ``pack_batch``) are ignored."""
        stats = getattr(batch_or_stats, "stats", batch_or_stats)
        if not isinstance(stats, WorkerStats):
            return
        old = self._latest.get(stats.reader)
        if old is not None and stats.batches < old.batches:  # the reader started a new pass
            for name in COUNTS:
                self._base[name] += getattr(old, name)
            for kind, n in old.events.items():
                self._base_events[kind] = self._base_events.get(kind, 0) + n
        self._latest[stats.reader] = stats

    @property
    def readers(self) -> int:
        """Readers (rank, worker) seen so far."""
        return len(self._latest)

    def totals(self) -> dict[str, float]:
        """Summed counts, events by kind (``events/<kind>``) and derived ratios: ``fill``
        (real tokens / slots), ``docs_per_pack``, ``target_fraction`` (targets / tokens)."""
        out: dict[str, float] = dict(self._base)
        events: dict[str, float] = dict(self._base_events)
        for stats in self._latest.values():
            for name in COUNTS:
                out[name] += getattr(stats, name)
            for kind, n in stats.events.items():
                events[kind] = events.get(kind, 0) + n
        out.update({f"events/{k}": v for k, v in sorted(events.items())})
        return _with_ratios(out)

    def scalars(self, prefix: str = "streampack/", group: Any = None) -> dict[str, float]:
        """:meth:`totals` with ``prefix`` on every key; with ``group`` (or ``True`` for the
        default group) summed over the ranks of a ``torch.distributed`` process group."""
        totals = self.totals()
        if group is not None:
            totals = _all_reduce(totals, None if group is True else group)
        return {f"{prefix}{k}": float(v) for k, v in totals.items()}

    def log_to(self, writer: Any, step: int, prefix: str = "streampack/", group: Any = None) -> None:
        """Write :meth:`scalars` to ``writer``: anything with ``add_scalar(tag, value, step)`` (TensorBoard's
        ``SummaryWriter``), ``log_metrics(dict, step)`` (Lightning loggers) or ``log(dict, step=step)`` (a W&B run)."""
        values = self.scalars(prefix, group)
        if hasattr(writer, "add_scalar"):
            for tag, value in values.items():
                writer.add_scalar(tag, value, step)
        elif hasattr(writer, "log_metrics"):
            writer.log_metrics(values, step)
        elif hasattr(writer, "log"):
            writer.log(values, step=step)
        else:
            raise TypeError(f"{type(writer).__name__} has none of add_scalar, log_metrics, log")


def _with_ratios(totals: dict[str, float]) -> dict[str, float]:
    slots, tokens, packs = totals["slots"], totals["tokens"], totals["packs"]
    totals["fill"] = tokens / slots if slots else 0.0
    totals["docs_per_pack"] = totals["docs"] / packs if packs else 0.0
    totals["target_fraction"] = totals["targets"] / tokens if tokens else 0.0
    return totals


def _all_reduce(totals: Mapping[str, float], group: Any) -> dict[str, float]:
    """Sum every count over ``group`` (event kinds are unioned first, so every rank reduces the
    same keys in the same order); ratios are recomputed from the sums."""
    import torch
    import torch.distributed as dist

    from streampack.attention.loss import collective_device

    if not (dist.is_available() and dist.is_initialized()):
        return dict(totals)
    kinds: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(kinds, sorted(k for k in totals if k.startswith("events/")), group=group)
    keys = list(COUNTS) + sorted(set().union(*kinds))
    values = torch.tensor([float(totals.get(k, 0)) for k in keys], dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(values, group=group)
    return _with_ratios(dict(zip(keys, values.tolist())))
