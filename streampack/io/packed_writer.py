"""Write packs as packed tar shards + manifest (layout: :mod:`streampack.io.packed_format`).

Tokens are stored as int32 when every id fits; shards get fixed tar metadata (the same packs
give byte-identical files) and appear under their final name only once complete; the manifest is
written last, so a directory without one is an unfinished pack run.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Callable, Sequence
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


def write_packed_dataset(docs: Sequence[Sample], bins: Sequence[np.ndarray], out_dir: str | os.PathLike[str],
                         *, capacity: int, align: int, cp_size: int, tp_size: int, algorithm: str,
                         seed: int = 0, packs_per_shard: int = 1000, metrics: dict[str, Any] | None = None,
                         extra: dict[str, Any] | None = None,
                         progress: Callable[[int], None] | None = None) -> Manifest:
    """Write ``bins`` (index arrays into ``docs``) as packed shards under ``out_dir``; returns the manifest.
    Refuses a pack whose aligned length exceeds ``capacity``; ``progress(n)`` is called every ``n`` packs."""
    if packs_per_shard < 1:
        raise ValueError(f"{packs_per_shard=} must be >= 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (out / MANIFEST_NAME).exists():
        (out / MANIFEST_NAME).unlink()  # the old manifest must not describe new shards
    with_labels = any(d.labels is not None for d in docs)
    with_mask = any(d.loss_mask is not None for d in docs)
    dtype = _token_dtype(docs)
    fields = ["input_ids.npy", "doc_lengths.npy", "keys.json"]
    fields += ["labels.npy"] * with_labels + ["loss_mask.npy"] * with_mask
    shards: list[dict[str, Any]] = []
    pack_lengths: list[int] = []
    pack_docs: list[int] = []
    for first in range(0, len(bins), packs_per_shard):
        name = f"packed-{len(shards):06d}.tar"
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
                pack_lengths.append(sum(len(d) for d in pack))
                pack_docs.append(len(pack))
        os.replace(tmp, out / name)
        shards.append({"name": name, "offsets": offsets})
        if progress is not None:
            progress(len(offsets))
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "capacity": capacity, "align": align, "cp_size": cp_size,
                "tp_size": tp_size, "algorithm": algorithm, "seed": seed, "num_packs": len(bins),
                "num_docs": int(sum(pack_docs)), "num_tokens": int(sum(pack_lengths)), "fields": fields,
                "metrics": metrics or {}, **(extra or {}), "pack_lengths": pack_lengths, "pack_docs": pack_docs,
                "shards": shards}
    written = {s["name"] for s in shards}
    for stale in out.glob("packed-*.tar"):  # shards of an earlier, larger packing of this folder
        if stale.name not in written:
            stale.unlink()
    tmp = out / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / MANIFEST_NAME)
    return read_manifest(out)


__all__ = ["pack_members", "write_packed_dataset"]
