"""Write packs as packed tar shards + manifest (layout: :mod:`streampack.io.packed_format`).

Tokens are stored as int32 when every id fits; shards get fixed tar metadata (the same packs
give byte-identical files) and appear under their final name only once complete; the manifest is
written last, so a directory without one is an unfinished pack run. The ranks of a job
(``streampack pack`` on W processes) each write their own shards, ``part-rank-RRRRR-of-WWWWW-*.tar``, and rank 0
writes the one manifest over all of them.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from streampack.io.packed_format import FORMAT, FORMAT_VERSION, MANIFEST_NAME, Manifest, read_manifest
from streampack.sample import Sample


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """Append one regular file with fixed metadata, so the same contents give byte-identical shards."""
    info = tarfile.TarInfo(name)  # TarInfo's defaults are fixed: mtime 0, mode 0o644, uid/gid 0, no owner names
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _token_dtype(docs: Sequence[Sample]) -> type:
    top = max((int(d.tokens.max()) for d in docs if d.tokens is not None and len(d.tokens)), default=0)
    return np.int32 if top <= np.iinfo(np.int32).max else np.int64


def pack_members(pack: Sequence[Sample], *, token_dtype: type, with_labels: bool, with_mask: bool) -> dict[str, bytes]:
    """The tar fields of one pack: concatenated arrays plus per-document lengths and keys."""
    members = {"input_ids.npy": _npy(np.concatenate([d.tokens for d in pack]).astype(token_dtype)),
               "doc_lengths.npy": _npy(np.asarray([len(d) for d in pack], dtype=np.int32)),
               "keys.json": json.dumps([d.doc_key for d in pack]).encode()}
    if with_labels:  # a document without its own labels is supervised on its tokens
        members["labels.npy"] = _npy(np.concatenate(
            [d.tokens if d.labels is None else d.labels for d in pack]).astype(np.int64))
    if with_mask:
        members["loss_mask.npy"] = _npy(np.concatenate(
            [np.ones(len(d), bool) if d.loss_mask is None else d.loss_mask.astype(bool) for d in pack]))
    return members


@dataclass(frozen=True, slots=True, kw_only=True)
class PackedShards:
    """What :func:`write_packed_shards` wrote: the ``manifest.json`` entries of its shards and packs."""

    shards: tuple[dict[str, Any], ...]
    """Per shard ``{"name", "offsets"}`` (byte offset of each pack's first header)."""
    pack_lengths: tuple[int, ...]
    """Real tokens of every pack, in file order."""
    pack_docs: tuple[int, ...]
    """Documents in every pack, in file order."""
    pack_loads: tuple[int, ...]
    """Aligned tokens of every pack (what the capacity bounds)."""


def packed_fields(*, with_labels: bool, with_mask: bool) -> list[str]:
    """The tar fields of every pack."""
    return ["input_ids.npy", "doc_lengths.npy", "keys.json"] + ["labels.npy"] * with_labels + \
        ["loss_mask.npy"] * with_mask


def write_packed_shards(docs: Sequence[Sample], bins: Sequence[np.ndarray], out_dir: str | os.PathLike[str], *,
                        capacity: int, align: int, fields: Sequence[str], prefix: str = "packed-",
                        packs_per_shard: int = 1000, progress: Callable[[int], None] | None = None) -> PackedShards:
    """Write ``bins`` (index arrays into ``docs``) as shards ``{prefix}000000.tar``, ... under ``out_dir``, each
    under its final name only once complete. Refuses a pack whose aligned length exceeds ``capacity``;
    ``progress(n)`` is called every ``n`` packs."""
    if packs_per_shard < 1:
        raise ValueError(f"{packs_per_shard=} must be >= 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with_labels, with_mask = "labels.npy" in fields, "loss_mask.npy" in fields
    dtype = _token_dtype(docs)
    shards: list[dict[str, Any]] = []
    lengths: list[int] = []
    counts: list[int] = []
    loads: list[int] = []
    for first in range(0, len(bins), packs_per_shard):
        name = f"{prefix}{len(shards):06d}.tar"
        offsets: list[int] = []
        tmp = out / (name + ".tmp")
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
            for index in range(first, min(first + packs_per_shard, len(bins))):
                pack = [docs[int(i)] for i in bins[index]]
                used = sum(-(-len(d) // align) * align for d in pack)
                if used > capacity:
                    raise ValueError(f"pack {index} needs {used} tokens after {align=}, more than {capacity=}")
                offsets.append(tar.offset)
                members = pack_members(pack, token_dtype=dtype, with_labels=with_labels, with_mask=with_mask)
                for fld in fields:
                    add_member(tar, f"pack{index:08d}.{fld}", members[fld])
                lengths.append(sum(len(d) for d in pack))
                counts.append(len(pack))
                loads.append(used)
        os.replace(tmp, out / name)
        shards.append({"name": name, "offsets": offsets})
        if progress is not None:
            progress(len(offsets))
    return PackedShards(shards=tuple(shards), pack_lengths=tuple(lengths), pack_docs=tuple(counts),
                        pack_loads=tuple(loads))


def write_packed_manifest(out_dir: str | os.PathLike[str], written: Sequence[PackedShards], *, capacity: int,
                          align: int, cp_size: int, tp_size: int, algorithm: str, seed: int, fields: Sequence[str],
                          metrics: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> Manifest:
    """Write ``manifest.json`` over the shards of ``written`` (in that order) and remove the ``.tar`` shards of
    an earlier packing of this folder that it does not list; returns the manifest read back."""
    out = Path(out_dir)
    shards = [s for part in written for s in part.shards]
    pack_lengths = [n for part in written for n in part.pack_lengths]
    pack_docs = [n for part in written for n in part.pack_docs]
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "capacity": capacity, "align": align, "cp_size": cp_size,
                "tp_size": tp_size, "algorithm": algorithm, "seed": seed, "num_packs": len(pack_lengths),
                "num_docs": int(sum(pack_docs)), "num_tokens": int(sum(pack_lengths)), "fields": list(fields),
                "metrics": metrics or {}, **(extra or {}), "pack_lengths": pack_lengths, "pack_docs": pack_docs,
                "shards": shards}
    listed = {s["name"] for s in shards}
    for pattern in ("packed-*.tar", "part-*.tar"):  # shards of an earlier, larger packing of this folder
        for stale in out.glob(pattern):
            if stale.name not in listed:
                stale.unlink()
    write_json(out / MANIFEST_NAME, manifest, indent=1)
    return read_manifest(out)


def write_json(path: Path, value: Any, *, indent: int | None = None) -> None:
    """``value`` as JSON at ``path``, atomically: a reader sees the whole file or none (the temporary file's name
    carries the process id, so ranks writing beside each other never share one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=indent))
    os.replace(tmp, path)


def write_packed_dataset(docs: Sequence[Sample], bins: Sequence[np.ndarray], out_dir: str | os.PathLike[str],
                         *, capacity: int, align: int, cp_size: int, tp_size: int, algorithm: str,
                         seed: int = 0, packs_per_shard: int = 1000, metrics: dict[str, Any] | None = None,
                         extra: dict[str, Any] | None = None, fields: Sequence[str] | None = None,
                         progress: Callable[[int], None] | None = None) -> Manifest:
    """Write ``bins`` (index arrays into ``docs``) as packed shards under ``out_dir`` and their manifest; returns
    the manifest. ``fields`` default: labels and loss masks where any document carries them."""
    out = Path(out_dir)
    if (out / MANIFEST_NAME).exists():
        (out / MANIFEST_NAME).unlink()  # the old manifest must not describe new shards
    if fields is None:
        fields = packed_fields(with_labels=any(d.labels is not None for d in docs),
                               with_mask=any(d.loss_mask is not None for d in docs))
    written = write_packed_shards(docs, bins, out, capacity=capacity, align=align, fields=fields,
                                  packs_per_shard=packs_per_shard, progress=progress)
    return write_packed_manifest(out, [written], capacity=capacity, align=align, cp_size=cp_size, tp_size=tp_size,
                                 algorithm=algorithm, seed=seed, fields=fields, metrics=metrics, extra=extra)


__all__ = ["PackedShards", "pack_members", "packed_fields", "write_packed_dataset", "write_packed_manifest",
           "write_json", "write_packed_shards"]
