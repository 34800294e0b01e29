"""What each batch tells the training process about the reader that built it.

Every batch carries a :class:`WorkerStats` (~1 KB pickled): its reader and that reader's running
totals, which :class:`streampack.integrations.metrics.StreamMetrics` keeps per reader and sums.
Totals, not deltas: an unlogged batch loses nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


# Not frozen, like PackedBatch: Lightning's apply_to_collection rebuilds nested dataclasses by
# setattr on a copy and refuses frozen ones (see streampack.layout.batch).
@dataclass(slots=True, kw_only=True, eq=False)
class WorkerStats:
    """Running totals of one reader since the start of its stream (the counts are restored on
    resume; a new pass of a finite stream starts them again from 0)."""

    dp_rank: int
    """Data-parallel rank of the reader."""
    worker_id: int
    """DataLoader worker id of the reader (0 in the main process)."""
    batches: int = 0
    """Batches built, fillers included."""
    fillers: int = 0
    """Filler batches (all padding, zero targets) emitted to reach ``batches_per_epoch``."""
    packs: int = 0
    docs: int = 0
    """Documents (chunks of split samples count once each)."""
    tokens: int = 0
    """Real (non-padding) tokens."""
    slots: int = 0
    """Token slots of the packs (``packs x capacity``): ``tokens / slots`` is the fill."""
    targets: int = 0
    """Supervised target tokens."""
    cost: float = 0.0
    """Estimated compute of the real packs (``PackedBatch.est_cost`` summed; 0 without a cost
    model): ``cost / batches`` against other readers' shows a standing imbalance."""
    skipped: int = 0
    """Samples (or shard remainders) dropped under ``on_error="skip"``, all reasons."""
    build_seconds: float = 0.0
    """Wall time this reader's process spent building batches (reads, tokenizing and packing
    included); like ``events``, counted since the process started reading, not restored."""
    events: Mapping[str, int] = field(default_factory=dict)
    """Counts of the rate-limited log events of the reader's process by kind (``retry``,
    ``slow_batch``, ...; see :mod:`streampack.logs`), suppressed ones included."""

    @property
    def reader(self) -> tuple[int, int]:
        """``(dp_rank, worker_id)``: which reader this is."""
        return (self.dp_rank, self.worker_id)

    @property
    def fill(self) -> float:
        return self.tokens / self.slots if self.slots else 0.0
