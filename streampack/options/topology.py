"""TopologyOptions: where this process sits among the parallel ranks (``PackedDataset(topology=...)``), and
:class:`Placement`: which reader a graph is, in the resolved numbers the graph and its reader take."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from streampack.layout.batch import alignment
from streampack.options._check import need_choice, need_int, need_type
from streampack.plan.topology import current_worker, resolve_topology, validate_topology

EQUAL_BATCHES = ("plan", "count", "sync")


@dataclass(frozen=True, slots=True, kw_only=True)
class TopologyOptions:
    """Data-parallel rank and size, CP/TP alignment, and equal batch counts across ranks."""

    dp_group: Any = None
    """The data-parallel process group: rank and size within it come first (required once
    ``torch.distributed`` has TP/CP/PP groups, unless ``dp_rank``/``dp_size`` are given).
    A runtime object: ``PackedDataset`` resolves it at construction and keeps only the numbers."""
    dp_rank: int | None = None
    """Explicit data-parallel rank; else ``torch.distributed`` (only while the world group is its
    only group), else ``RANK``; else 0."""
    dp_size: int | None = None
    """Explicit data-parallel size; else as ``dp_rank`` (``WORLD_SIZE``); else 1."""
    cp_size: int = 1
    """Context-parallel size: documents aligned to ``2 * cp_size * tp_size``."""
    tp_size: int = 1
    """Tensor-parallel size: documents aligned to ``tp_size`` with sequence parallelism."""
    sequence_parallel: bool = True
    """Whether ``tp_size > 1`` means sequence parallelism (align to ``tp_size``)."""
    align_multiple: int = 1
    """An extra per-document multiple (lcm with the above), e.g. 16 for FP8."""
    equal_batches: str = "plan"
    """Finite stream, several ranks: how every rank yields the same number of batches (N shards, T samples, G readers of
    all ranks). ``plan``: each reader counts its own batches from the manifest's token lengths and the readers agree
    through the job's c10d store (refused without ``torch.distributed``): O(T/G) index reads and CPU per reader per
    epoch, 5 store requests. ``count``: each reader counts every reader's batches itself, no store: O(T) per reader per
    epoch (every shard's index, ~1-6 µs of packer count per sample; ~100 s at 2,000 shards), for ranks simulated in one
    process and small data sets; the same batches as ``plan``. ``sync``: the training loop agrees per step
    (``streampack.sync_batches``, one all-reduce), for text shards and stages that change lengths."""
    batches_per_epoch: int | None = None
    """Finite stream: a fixed count of batches per rank per epoch (a multiple of the worker
    count) that overrides ``equal_batches``."""
    agree_timeout_s: float | None = None
    """Several ranks under ``torch.distributed``: the longest a reader waits for the others to agree
    through the job's store (on the settings, and on each finite epoch's batch counts); then it fails
    naming the readers that did not arrive. None: the process group's timeout (30 min by default)."""

    def __post_init__(self) -> None:
        need_int("TopologyOptions", "dp_rank", self.dp_rank, 0, optional=True)
        need_int("TopologyOptions", "dp_size", self.dp_size, 1, optional=True)
        if self.dp_rank is not None and self.dp_size is not None:
            try:
                validate_topology(self.dp_rank, self.dp_size, 0, 1)
            except ValueError as e:
                raise ValueError(f"TopologyOptions: {e}") from None
        need_type("TopologyOptions", "sequence_parallel", self.sequence_parallel, bool)
        need_choice("TopologyOptions", "equal_batches", self.equal_batches, EQUAL_BATCHES)
        need_int("TopologyOptions", "batches_per_epoch", self.batches_per_epoch, 1, optional=True)
        need_type("TopologyOptions", "agree_timeout_s", self.agree_timeout_s, (int, float), optional=True)
        timeout = self.agree_timeout_s
        if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
            raise ValueError(f"TopologyOptions(agree_timeout_s={self.agree_timeout_s!r}): must be None or seconds > 0")
        try:
            self.align  # noqa: B018  (cp_size, tp_size and align_multiple, checked by alignment())
        except ValueError as e:
            raise ValueError(f"TopologyOptions: {e}".replace("multiple=", "align_multiple=")) from None

    @property
    def align(self) -> int:
        """The per-document alignment every pack's spans are padded to."""
        return alignment(self.cp_size, self.tp_size, sequence_parallel=self.sequence_parallel,
                         multiple=self.align_multiple)


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """Which reader this graph is: data-parallel rank and DataLoader worker (checked here, once)."""

    dp_rank: int = 0
    dp_size: int = 1
    worker_id: int = 0
    num_workers: int = 1
    """Readers on this rank (``max(DataLoader num_workers, 1)``)."""
    passes: int = 0
    """Finite mode: completed passes before this one (pass ``p`` reads epochs ``[p*N, (p+1)*N)``)."""

    def __post_init__(self) -> None:
        try:
            validate_topology(self.dp_rank, self.dp_size, self.worker_id, self.num_workers)
        except ValueError as e:
            raise ValueError(f"Placement: {e}") from None
        need_int("Placement", "passes", self.passes, 0)

    @classmethod
    def current(cls, dp_rank: int | None = None, dp_size: int | None = None, dp_group: Any = None) -> Placement:
        """This process's placement: the rank as :func:`~streampack.plan.topology.resolve_topology`
        resolves it (``dp_group``, the explicit values, ``torch.distributed``, ``RANK``/``WORLD_SIZE``)
        and the DataLoader worker it runs in (worker 0 of 1 outside one)."""
        rank, size = resolve_topology(dp_rank, dp_size, dp_group)
        here = current_worker()
        return cls(dp_rank=rank, dp_size=size, worker_id=here.id, num_workers=here.readers)

    @property
    def global_worker(self) -> int:
        return self.dp_rank * self.num_workers + self.worker_id

    @property
    def global_workers(self) -> int:
        return self.dp_size * self.num_workers
