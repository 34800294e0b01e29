"""PackedShardReader: the source node of an offline-packed dataset (``streampack pack``).

Sharding: the ``N`` packs of an epoch (in file order, or a permutation seeded by
``(seed, epoch)`` with ``shuffle``) are dealt round-robin to the ``G = dp_size * num_workers``
global workers; every worker gets ``N // G`` packs, so every rank yields the same number of
batches (the last ``N % G`` packs of the order are left out of that epoch). The state is
``(epoch, position)`` in this worker's list; restoring seeks straight to the pack's byte
offset from the manifest, reading nothing before it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
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
from streampack.sample import Sample
from streampack.state import STATE_VERSION, VERSION_KEY, check_version


class PackedShardReader(BaseNode[list[Sample]]):
    """Yields the packs of an offline-packed dataset (one ``list[Sample]`` per pack), this
    worker's share only, in a deterministic order; see the module docstring."""

    EPOCH_KEY = "epoch"
    POSITION_KEY = "position"
    NEXT_KEY = "next_pack"
    FINGERPRINT_KEY = "fingerprint"

    def __init__(self, urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *, capacity: int,
                 align: int = 1, seed: int = 0, shuffle: bool = False, epochs: int | None = 1, start_epoch: int = 0,
                 dp_rank: int = 0, dp_size: int = 1, worker_id: int = 0, num_workers: int = 1) -> None:
        super().__init__()
        root, names = resolve_packed(urls)
        self.manifest = m = read_manifest(root)
        if names is not None:  # explicit shard files: only their packs
            known = {s.name for s in m.shards}
            unknown = sorted(set(names) - known)
            if unknown:
                raise ValueError(f"shards {unknown} are not listed in {str(root / MANIFEST_NAME)!r}")
        check_layout(m, capacity, align)
        if not (0 <= dp_rank < dp_size and 0 <= worker_id < num_workers):
            raise ValueError(f"need 0 <= {dp_rank=} < {dp_size=} and 0 <= {worker_id=} < {num_workers=}")
        if epochs is not None and epochs < 1:
            raise ValueError(f"{epochs=} must be >= 1 or None (endless)")
        if start_epoch < 0 or (epochs is not None and start_epoch >= epochs):
            raise ValueError(f"{start_epoch=} must be in [0, {epochs=})")
        self.start_epoch = start_epoch
        self.global_worker = dp_rank * num_workers + worker_id
        self.global_workers = dp_size * num_workers
        wanted = None if names is None else set(names)
        self._locations = [loc for loc in m.locations() if wanted is None or m.shards[loc[0]].name in wanted]
        self.per_worker = len(self._locations) // self.global_workers
        if self.per_worker == 0:
            raise ValueError(f"{len(self._locations)} packs cannot feed {self.global_workers} workers "
                             f"({dp_size=} x {num_workers=})")
        self.seed, self.shuffle, self.epochs = seed, shuffle, epochs
        self._fingerprint = {"manifest": m.digest, "shards": sorted(names or []), "capacity": capacity,
                             "align": align, "seed": seed, "shuffle": shuffle, "dp_size": dp_size, "num_workers": num_workers,
                             "global_worker": self.global_worker}
        self._epoch = start_epoch
        self._position = 0
        self._order_epoch = -1
        self._order: np.ndarray = np.zeros(0, dtype=np.int64)
        self._file: BinaryIO | None = None
        self._file_shard = -1

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self._epoch, self._position = self.start_epoch, 0
            return
        check_version(initial_state, what="PackedShardReader state")
        saved = initial_state[self.FINGERPRINT_KEY]
        for name, value in self._fingerprint.items():
            if saved.get(name) != value:
                raise ValueError(f"cannot restore PackedShardReader state: it was saved with "
                                 f"{name}={saved.get(name)!r}, this reader has {name}={value!r}")
        self._epoch = int(initial_state[self.EPOCH_KEY])
        self._position = int(initial_state[self.POSITION_KEY])

    def get_state(self) -> dict[str, Any]:
        nxt = self._peek()
        return {VERSION_KEY: STATE_VERSION, self.FINGERPRINT_KEY: dict(self._fingerprint),
                self.EPOCH_KEY: self._epoch, self.POSITION_KEY: self._position,
                self.NEXT_KEY: None if nxt is None else list(self._locations[nxt])}

    def next(self) -> list[Sample]:
        index = self._peek()
        if index is None:
            raise StopIteration
        if self._position >= self.per_worker:  # crossed into the next epoch
            self._epoch, self._position = self._epoch + 1, 0
        self._position += 1
        return self._read(index)

    def _peek(self) -> int | None:
        """Global index of the next pack this worker yields, or None at the end."""
        epoch, position = self._epoch, self._position
        if position >= self.per_worker:
            if self.epochs is not None and epoch + 1 >= self.epochs:
                return None
            epoch, position = epoch + 1, 0
        return int(self._epoch_order(epoch)[position])  # index into self._locations

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            n = len(self._locations)
            order = (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle
                     else np.arange(n))
            self._order = order[self.global_worker::self.global_workers][: self.per_worker]
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
