"""The offline packed format (``streampack pack``): the manifest and one pack's bytes.

Layout of a packed dataset directory::

    manifest.json              capacity, align, cp/tp size, algorithm, per-pack lengths, metrics,
                               and for every shard the byte offset of each pack's first header
    packed-000000.tar          one tar sample per pack: input_ids.npy (the documents back to
    packed-000001.tar ...      back), doc_lengths.npy, keys.json, labels.npy / loss_mask.npy

Documents were rounded up to ``align`` when packed, so the files fit only their ``capacity`` and
alignment: :func:`check_layout` refuses another instead of producing packs that overflow.
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

from streampack.io.npy import decode_npy
from streampack.sample import Sample

MANIFEST_NAME = "manifest.json"
FORMAT = "streampack.packed"
FORMAT_VERSION = 1
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


def read_manifest(root: str | os.PathLike[str]) -> Manifest:
    """Load the manifest of the packed directory ``root``; ``ValueError`` when it is missing, not json,
    or not a streampack packed manifest."""
    mpath = Path(root) / MANIFEST_NAME
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
    return Manifest(root=str(mpath.parent), capacity=int(raw["capacity"]), align=int(raw["align"]),
                    cp_size=int(raw["cp_size"]), tp_size=int(raw["tp_size"]), algorithm=str(raw["algorithm"]),
                    seed=int(raw["seed"]),
                    shards=tuple(PackedShard(name=s["name"], offsets=tuple(s["offsets"])) for s in raw["shards"]),
                    pack_lengths=tuple(raw["pack_lengths"]), pack_docs=tuple(raw["pack_docs"]),
                    fields=tuple(raw["fields"]), metrics=dict(raw.get("metrics", {})),
                    extra={k: v for k, v in raw.items() if k not in known})


def resolve_packed(urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> tuple[Path, list[str] | None]:
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
    return read_manifest(resolve_packed(urls)[0])


def is_packed_dataset(urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> bool:
    """True when ``urls`` names a packed dataset: a directory holding a streampack
    ``manifest.json``, the manifest itself, or shards that all sit in one such directory."""
    try:
        root, _ = resolve_packed(urls)
    except ValueError:
        return False
    try:  # no manifest (or a directory of that name) is an OSError
        return json.loads((root / MANIFEST_NAME).read_text()).get("format") == FORMAT
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
        return decode_npy(members[name], member=name, url=url, key="") if name in members else None

    tokens = npy("input_ids.npy").astype(np.int64)
    lengths = npy("doc_lengths.npy").astype(np.int64)
    keys = json.loads(members["keys.json"])
    labels, mask = npy("labels.npy"), npy("loss_mask.npy")
    if int(lengths.sum()) != len(tokens) or len(keys) != len(lengths):
        raise ValueError(f"pack in {url!r} is inconsistent: {len(tokens)} tokens, "
                         f"doc_lengths sum {int(lengths.sum())}, {len(keys)} keys for {len(lengths)} docs")
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [
        Sample(key=keys[i], tokens=tokens[s:e], labels=None if labels is None else labels[s:e].astype(np.int64),
               loss_mask=None if mask is None else mask[s:e].astype(bool))
        for i, (s, e) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
    ]


__all__ = ["MANIFEST_NAME", "Manifest", "PackedShard", "decode_pack", "is_packed_dataset", "read_manifest", "read_pack"]
