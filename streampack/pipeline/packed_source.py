"""Offline-packed shards (``streampack pack``): the manifest and a reader yielding ready packs.

Layout of a packed dataset directory::

    manifest.json              capacity, align, cp/tp size, algorithm, per-pack lengths, metrics,
                               and for every shard the byte offset of each pack's first header
    packed-000000.tar          one tar sample per pack: input_ids.npy (the documents back to
    packed-000001.tar ...      back), doc_lengths.npy, keys.json, labels.npy / loss_mask.npy

A pack was made for one ``capacity`` and one per-document alignment (``2*cp*tp`` with context
parallelism): its documents were rounded up to ``align`` when they were packed, so the same
files do not fit another capacity or alignment. :class:`PackedShardReader` refuses such a
request instead of producing packs that overflow.

Sharding: the ``N`` packs of an epoch (in file order, or a permutation seeded by
``(seed, epoch)`` with ``shuffle``) are dealt round-robin to the ``G = dp_size * num_workers``
global workers; every worker gets ``N // G`` packs, so every rank yields the same number of
batches (the last ``N % G`` packs of the order are left out of that epoch). The state is
``(epoch, position)`` in this worker's list; restoring seeks straight to the pack's byte
offset from the manifest, reading nothing before it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from torchdata.nodes import BaseNode

from streampack.sample import Sample

MANIFEST_NAME = "manifest.json"
FORMAT = "streampack.packed"
FORMAT_VERSION = 1
STATE_VERSION = 1
BLOCK = 512


@dataclass(frozen=True, slots=True, kw_only=True)
class PackedShard:
    name: str
    """File name relative to the manifest's directory."""
    offsets: tuple[int, ...]
    """Byte offset of the first tar header of each pack in this shard."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """What ``manifest.json`` of a packed dataset says."""

    root: str
    """Directory holding the manifest and the shards."""
    capacity: int
    align: int
    cp_size: int
    tp_size: int
    algorithm: str
    seed: int
    shards: tuple[PackedShard, ...]
    pack_lengths: tuple[int, ...]
    """Real tokens of every pack, in file order."""
    pack_docs: tuple[int, ...]
    """Documents in every pack, in file order."""
    fields: tuple[str, ...]
    """Tar fields of every pack (``input_ids.npy``, ``doc_lengths.npy``, ``keys.json``, ...)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    """Everything else the writer recorded (sources, overlong counters, token count...)."""

    @property
    def num_packs(self) -> int:
        return len(self.pack_lengths)

    @property
    def digest(self) -> str:
        """Identifies the packed files (what a resume state is keyed on)."""
        h = hashlib.sha256(json.dumps([self.capacity, self.align, list(self.pack_lengths),
                                       [s.name for s in self.shards]]).encode())
        return h.hexdigest()[:16]

    def locations(self) -> list[tuple[int, int]]:
        """``(shard index, pack index in shard)`` of every pack, in file order."""
        return [(s, p) for s, shard in enumerate(self.shards) for p in range(len(shard.offsets))]


def _manifest_path(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    return p / MANIFEST_NAME if p.is_dir() else p


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Load the manifest from a packed directory or a ``manifest.json`` path; ``ValueError``
    when it is missing, not json, or not a streampack packed manifest."""
    mpath = _manifest_path(path)
    try:
        raw = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise ValueError(f"no packed-dataset manifest at {str(mpath)!r}") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read manifest {str(mpath)!r}: {e}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ValueError(f"{str(mpath)!r} is not a streampack packed manifest (format != {FORMAT!r})")
    if raw.get("version") != FORMAT_VERSION:
        raise ValueError(f"manifest {str(mpath)!r} has version={raw.get('version')!r}, "
                         f"this streampack reads version={FORMAT_VERSION}")
    known = {"format", "version", "capacity", "align", "cp_size", "tp_size", "algorithm", "seed",
             "shards", "pack_lengths", "pack_docs", "fields", "metrics"}
    return Manifest(
        root=str(mpath.parent), capacity=int(raw["capacity"]), align=int(raw["align"]),
        cp_size=int(raw["cp_size"]), tp_size=int(raw["tp_size"]), algorithm=str(raw["algorithm"]),
        seed=int(raw["seed"]),
        shards=tuple(PackedShard(name=s["name"], offsets=tuple(s["offsets"])) for s in raw["shards"]),
        pack_lengths=tuple(raw["pack_lengths"]), pack_docs=tuple(raw["pack_docs"]),
        fields=tuple(raw["fields"]), metrics=dict(raw.get("metrics", {})),
        extra={k: v for k, v in raw.items() if k not in known},
    )


def _resolve(urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> tuple[Path, list[str] | None]:
    """(packed directory, shard file names named explicitly or None = all shards) of ``urls``:
    a directory, its ``manifest.json``, or shard files that all sit in one directory."""
    items = [urls] if isinstance(urls, (str, os.PathLike)) else list(urls)
    if not items or any("://" in str(item) for item in items):
        raise ValueError(f"not a local packed dataset: {urls!r}")
    paths = [Path(item) for item in items]
    if len(paths) == 1 and (paths[0].is_dir() or paths[0].name == MANIFEST_NAME):
        return (paths[0] if paths[0].is_dir() else paths[0].parent), None
    parents = {p.parent for p in paths}
    if len(parents) != 1 or any(p.is_dir() or p.name == MANIFEST_NAME for p in paths):
        raise ValueError(f"packed shards must all be files in one directory, got {urls!r}")
    return parents.pop(), [p.name for p in paths]


def check_layout(m: Manifest, capacity: int, align: int) -> None:
    """Packs are final: they can only be read with the capacity and alignment they were made for."""
    if m.capacity != capacity or m.align != align:
        raise ValueError(f"packed dataset {m.root!r} was packed for capacity={m.capacity}, "
                         f"align={m.align} (cp_size={m.cp_size}, tp_size={m.tp_size}); requested "
                         f"{capacity=}, {align=}: re-pack with `streampack pack`")


def packed_manifest(urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> Manifest:
    """The manifest of the packed dataset ``urls`` names (a directory, its manifest, or shards)."""
    return read_manifest(_resolve(urls)[0])


def is_packed_dataset(urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> bool:
    """True when ``urls`` names a packed dataset: a directory holding a streampack
    ``manifest.json``, the manifest itself, or shards that all sit in one such directory."""
    try:
        root, _ = _resolve(urls)
    except ValueError:
        return False
    mpath = root / MANIFEST_NAME
    if not mpath.is_file():
        return False
    try:
        return json.loads(mpath.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def read_pack(f: BinaryIO, offset: int, fields: Sequence[str], *, url: str) -> dict[str, bytes]:
    """The members of the pack whose first header is at ``offset`` (``{field: data}``)."""
    f.seek(offset)
    out: dict[str, bytes] = {}
    for _ in fields:
        header = f.read(BLOCK)
        try:
            info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
        except tarfile.TarError as e:
            raise ValueError(f"corrupt packed shard {url!r} at byte {offset}: {e}") from None
        data = f.read(info.size)
        if len(data) != info.size:
            raise ValueError(f"packed shard {url!r} is truncated at member {info.name!r}")
        f.seek(-info.size % BLOCK, io.SEEK_CUR)
        out[info.name.split(".", 1)[1]] = data
    missing = set(fields) - set(out)
    if missing:
        raise ValueError(f"pack at byte {offset} of {url!r} lacks fields {sorted(missing)}")
    return out


def decode_pack(members: dict[str, bytes], *, url: str) -> list[Sample]:
    """Split one pack's concatenated arrays back into its documents."""
    def npy(name: str) -> np.ndarray | None:
        return np.load(io.BytesIO(members[name]), allow_pickle=False) if name in members else None

    tokens = npy("input_ids.npy").astype(np.int64)
    lengths = npy("doc_lengths.npy").astype(np.int64)
    keys = json.loads(members["keys.json"])
    labels, mask = npy("labels.npy"), npy("loss_mask.npy")
    if int(lengths.sum()) != len(tokens) or len(keys) != len(lengths):
        raise ValueError(f"pack in {url!r} is inconsistent: {len(tokens)} tokens, "
                         f"doc_lengths sum {int(lengths.sum())}, {len(keys)} keys for {len(lengths)} docs")
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [
        Sample(key=keys[i], tokens=tokens[s:e],
               labels=None if labels is None else labels[s:e].astype(np.int64),
               loss_mask=None if mask is None else mask[s:e].astype(bool))
        for i, (s, e) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
    ]


class PackedShardReader(BaseNode[list[Sample]]):
    """Yields the packs of an offline-packed dataset (one ``list[Sample]`` per pack), this
    worker's share only, in a deterministic order; see the module docstring."""

    EPOCH_KEY = "epoch"
    POSITION_KEY = "position"
    NEXT_KEY = "next_pack"
    VERSION_KEY = "version"
    FINGERPRINT_KEY = "fingerprint"

    def __init__(self, urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *, capacity: int,
                 align: int = 1, seed: int = 0, shuffle: bool = False, epochs: int | None = 1,
                 dp_rank: int = 0, dp_size: int = 1, worker_id: int = 0, num_workers: int = 1) -> None:
        super().__init__()
        root, names = _resolve(urls)
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
        self._epoch = 0
        self._position = 0
        self._order_epoch = -1
        self._order: np.ndarray = np.zeros(0, dtype=np.int64)
        self._file: BinaryIO | None = None
        self._file_shard = -1

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self._epoch, self._position = 0, 0
            return
        if initial_state.get(self.VERSION_KEY) != STATE_VERSION:
            raise ValueError(f"state version={initial_state.get(self.VERSION_KEY)!r}, "
                             f"this reader restores version={STATE_VERSION}")
        saved = initial_state[self.FINGERPRINT_KEY]
        for name, value in self._fingerprint.items():
            if saved.get(name) != value:
                raise ValueError(f"cannot restore PackedShardReader state: it was saved with "
                                 f"{name}={saved.get(name)!r}, this reader has {name}={value!r}")
        self._epoch = int(initial_state[self.EPOCH_KEY])
        self._position = int(initial_state[self.POSITION_KEY])

    def get_state(self) -> dict[str, Any]:
        nxt = self._peek()
        return {self.VERSION_KEY: STATE_VERSION, self.FINGERPRINT_KEY: dict(self._fingerprint),
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


__all__ = ["MANIFEST_NAME", "Manifest", "PackedShard", "PackedShardReader", "decode_pack",
           "is_packed_dataset", "read_manifest", "read_pack"]
