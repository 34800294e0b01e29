"""PackedShardReader: the source node of an offline-packed dataset (``streampack pack``).

The ``N`` packs of an epoch (file order, or a ``(seed, epoch)`` permutation) are grouped into batches
of ``packs_per_batch``; batch ``u`` goes to rank ``u % dp_size``, worker ``(u // dp_size) % num_workers``.
Every pack is read exactly once per epoch; :meth:`quotas` equalizes the ranks' counts with at most
``dp_size - 1`` fillers. The state is ``(epoch, position)`` (a restore seeks straight to the pack) and
``work``, pack indices that replace an epoch's dealt list after an elastic resume.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, BinaryIO

import numpy as np
from torchdata.nodes import BaseNode

from streampack.io.packed_format import (
    MANIFEST_NAME,
    check_layout,
    decode_pack,
    read_manifest,
    read_pack,
    resolve_packed,
)
from streampack.nodes.collate import BatchLayout
from streampack.options.topology import Placement
from streampack.plan.cursor import PackedPlace
from streampack.plan.epoch_plan import equalize
from streampack.plan.state import STATE_VERSION, VERSION_KEY, check_node_config, check_version
from streampack.sample import Sample


def deal(packs: np.ndarray, packs_per_batch: int, dp_size: int, num_workers: int, global_worker: int) -> np.ndarray:
    """The part of ``packs`` (in order) a global worker reads: batch ``u`` of ``packs_per_batch`` goes to
    rank ``u % dp_size``, worker ``(u // dp_size) % num_workers``."""
    rank, worker = divmod(global_worker, num_workers)
    units = np.arange(-(-len(packs) // packs_per_batch))
    mine = units[(units % dp_size == rank) & ((units // dp_size) % num_workers == worker)]
    idx = (mine[:, None] * packs_per_batch + np.arange(packs_per_batch)).ravel()
    return packs[idx[idx < len(packs)]]


class PackedShardReader(BaseNode[list[Sample]]):
    """Yields the packs of an offline-packed dataset (one ``list[Sample]`` per pack), this
    worker's share only, in a deterministic order; see the module docstring."""

    EPOCH_KEY = "epoch"
    POSITION_KEY = "position"
    NEXT_KEY = "next_pack"
    FINGERPRINT_KEY = "fingerprint"
    WORK_KEY = "work"
    KIND_KEY = "kind"
    KIND = "PackedShardReader"

    def __init__(self, urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *, layout: BatchLayout,
                 seed: int = 0, shuffle: bool = False, epochs: int | None = 1, start_epoch: int = 0,
                 place: Placement = Placement(), work: dict[int, np.ndarray] | None = None) -> None:
        super().__init__()
        # layout: the batches the packs go into (StreamConfig.batch_layout); the directory must match it
        capacity, align, packs_per_batch = layout.capacity, layout.align, layout.packs_per_batch
        root, names = resolve_packed(urls)
        self.manifest = m = read_manifest(root)
        if names is not None:  # explicit shard files: only their packs
            known = {s.name for s in m.shards}
            unknown = sorted(set(names) - known)
            if unknown:
                raise ValueError(f"shards {unknown} are not listed in {str(root / MANIFEST_NAME)!r}")
        check_layout(m, capacity, align)
        if epochs is not None and epochs < 1:
            raise ValueError(f"{epochs=} must be >= 1 or None (endless)")
        if start_epoch < 0 or (epochs is not None and start_epoch >= epochs):
            raise ValueError(f"{start_epoch=} must be in [0, {epochs=})")
        self.start_epoch = start_epoch
        self.dp_size, self.num_workers = place.dp_size, place.num_workers
        self.global_worker, self.global_workers = place.global_worker, place.global_workers
        self.packs_per_batch = packs_per_batch
        wanted = None if names is None else set(names)
        self._locations = [loc for loc in m.locations() if wanted is None or m.shards[loc[0]].name in wanted]
        if not self._locations:
            raise ValueError(f"{str(root)!r} holds no packs")
        self.seed, self.shuffle, self.epochs = seed, shuffle, epochs
        self.work: dict[int, np.ndarray] = {int(e): np.asarray(w, dtype=np.int64) for e, w in (work or {}).items()}
        self._fingerprint = {"manifest": m.digest, "shards": sorted(names or []), "capacity": capacity,
                             "align": align, "seed": seed, "shuffle": shuffle, "dp_size": place.dp_size,
                             "num_workers": place.num_workers,
                             "global_worker": self.global_worker, "packs_per_batch": packs_per_batch}
        self._epoch = start_epoch
        self._position = 0
        self._order_epoch = -1
        self._order: np.ndarray = np.zeros(0, dtype=np.int64)
        self._file: BinaryIO | None = None
        self._file_shard = -1
        if epochs is None and not len(self.dealt(start_epoch, self.global_worker)):
            raise ValueError(f"{self.num_packs} packs in batches of {packs_per_batch} cannot feed "
                             f"{self.global_workers} workers (dp_size={place.dp_size} x num_workers={place.num_workers}) "
                             f"in an endless stream")

    @property
    def num_packs(self) -> int:
        return len(self._locations)

    def dealt(self, epoch: int, global_worker: int) -> np.ndarray:
        """The packs (indices into the locations) global worker ``global_worker`` reads in ``epoch``, in order."""
        n = self.num_packs
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        return deal(order, self.packs_per_batch, self.dp_size, self.num_workers, global_worker)

    def quotas(self, epoch: int) -> list[int]:
        """Batches each global worker yields in ``epoch`` so every rank yields the same count."""
        counts = [-(-len(self.dealt(epoch, g)) // self.packs_per_batch) for g in range(self.global_workers)]
        return equalize(counts, self.dp_size)[0]

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._order_epoch = -1
        if initial_state is None:
            self._epoch, self._position = self.start_epoch, 0
            return
        check_version(initial_state, what="PackedShardReader state")
        check_node_config(initial_state[self.FINGERPRINT_KEY], self._fingerprint, node="PackedShardReader",
                          label="reader")
        self.work = {int(e): w.numpy() for e, w in initial_state.get(self.WORK_KEY, {}).items()} or self.work
        self._epoch = int(initial_state[self.EPOCH_KEY])
        self._position = int(initial_state[self.POSITION_KEY])

    @classmethod
    def undelivered(cls, state: Mapping[str, Any]) -> PackedPlace:
        """Where a saved state stood: the packs of its epoch from its position on are undelivered."""
        return PackedPlace(epoch=int(state[cls.EPOCH_KEY]), position=int(state[cls.POSITION_KEY]),
                           work={int(e): w.numpy() for e, w in state.get(cls.WORK_KEY, {}).items()})

    def get_state(self) -> dict[str, Any]:
        import torch

        nxt = next(self._ahead(), None)
        return {VERSION_KEY: STATE_VERSION, self.KIND_KEY: self.KIND, self.FINGERPRINT_KEY: dict(self._fingerprint),
                self.EPOCH_KEY: self._epoch, self.POSITION_KEY: self._position,
                self.NEXT_KEY: None if nxt is None else list(self._locations[nxt[2]]),
                self.WORK_KEY: {e: torch.from_numpy(w) for e, w in self.work.items()}}

    def next(self) -> list[Sample]:
        for epoch, position, index in self._ahead():
            self._epoch, self._position = epoch, position + 1
            return self._read(index)
        self._epoch, self._position = max(self._epoch, self.epochs or 0), 0  # as far as the epochs go
        raise StopIteration

    def _ahead(self) -> Iterator[tuple[int, int, int]]:
        """``(epoch, position, global pack index)`` of each pack this worker yields from its position on."""
        epoch, position = self._epoch, self._position
        while self.epochs is None or epoch < self.epochs:
            order = self._epoch_order(epoch)
            yield from ((epoch, p, int(order[p])) for p in range(position, len(order)))
            epoch, position = epoch + 1, 0

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            self._order = self.work[epoch] if epoch in self.work else self.dealt(epoch, self.global_worker)
            self._order_epoch = epoch
        return self._order

    def _read(self, index: int) -> list[Sample]:
        shard, pack = self._locations[index]
        info = self.manifest.shards[shard]
        url = os.path.join(self.manifest.root, info.name)
        if self._file_shard != shard:
            if self._file is not None:
                self._file.close()
            try:
                self._file = open(url, "rb")
            except OSError as e:
                raise ValueError(f"cannot open packed shard {url!r}: {e}") from None
            self._file_shard = shard
        assert self._file is not None
        members = read_pack(self._file, info.offsets[pack], self.manifest.fields, url=url)
        return decode_pack(members, url=url)

    def __del__(self) -> None:
        if getattr(self, "_file", None) is not None:
            self._file.close()
