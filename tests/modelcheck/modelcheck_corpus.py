"""The model checker's corpus on disk: shards written from ``modelcheck_model.Record`` lists
(bad records injected in each format's own way), the dataset settings that read them, and the
shard changes a schedule makes between a save and a resume (rewrite, truncate, re-stage) with
what each may legitimately train after.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard
from helpers_data import tar_members, write_tar
from modelcheck_model import Record, Shard, Unit, expected_units, tag_epoch_key

import streampack.options.read as read_options
from streampack.io.decode import DecodeOptions
from streampack.io.index import index_decode
from streampack.io.limits import Limits
from streampack.io.manifest import build_manifest
from streampack.io.retry import RetryPolicy
from streampack.options import CostOptions, PackOptions, ReadOptions
from streampack.packing.cost import CostModel

if TYPE_CHECKING:
    from modelcheck_schedule import Setup

VOCAB = 1000
"""Token ids of good records are below this (the driver passes it as ``vocab_size``)."""
BYTE_LIMIT = 1536
"""``max_line_bytes`` / ``max_member_bytes``: above every good record (<= 128 ids), below a too_long one."""


def bad_tokens(kind: str) -> tuple[int, ...]:
    return {"empty": (), "too_long": tuple(range(400)), "out_of_vocab": (5, VOCAB + 7, 9)}.get(kind, (1, 2, 3))


def _json_line(record: Record) -> bytes:
    if record.bad == "corrupt":
        return b'{"input_ids": [1, 2,\n'
    return (json.dumps({"input_ids": list(record.tokens)}) + "\n").encode()


def _tar_member(record: Record) -> dict[str, bytes]:
    if record.bad == "corrupt":
        return {"npy": b"\x93NUMPY\x01\x00garbage that is not a header"}
    return tar_members(list(record.tokens), fmt="npy")


def write_shard(path: str, records: Sequence[Record], fmt: str) -> None:
    """One shard's file: ``fmt`` is 'jsonl', 'zst' (jsonl.zst), 'tar' or 'parquet'."""
    if fmt == "tar":
        write_tar(path, [(r.key, _tar_member(r)) for r in records])
        return
    if fmt == "parquet":  # no byte limit per row: its bad kinds are empty, out_of_vocab and a negative id
        rows = [[-3, 4] if r.bad == "corrupt" else list(r.tokens) for r in records]
        pq.write_table(pa.table({"input_ids": pa.array(rows, pa.list_(pa.int32()))}), path, row_group_size=4)
        return
    data = b"".join(_json_line(r) for r in records)
    with open(path, "wb") as f:
        f.write(zstandard.ZstdCompressor(level=3).compress(data) if fmt == "zst" else data)


SUFFIX = {"jsonl": ".jsonl", "zst": ".jsonl.zst", "tar": ".tar", "parquet": ".parquet"}


def shard_name(index: int, fmt: str) -> str:
    return f"shard-{index:06d}{SUFFIX[fmt]}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """A shard changed between save and resume, and how to put it back."""

    kind: str
    index: int
    path: str
    data: bytes
    times: tuple[int, int]


def rewritten(records: tuple[Record, ...]) -> list[Record]:
    """Every good record with other ids (the same count, so jsonl lines keep their numbers)."""
    return [r if r.bad else Record(key=r.key, tokens=tuple((t + 1) % VOCAB for t in r.tokens)) for r in records]


def change_versions(change: Change, shard: Shard, *, epochs: int, capacity: int) -> list[dict[Unit, tuple[int, ...]]]:
    """What a shard may train per epoch after a change that was not refused: its old contents,
    its new ones (rewrite), or a prefix of its records (truncate: the rest is damage)."""
    def units(records: Sequence[Record]) -> dict[Unit, tuple[int, ...]]:
        return expected_units([replace(shard, records=tuple(records))], epochs=range(epochs), capacity=capacity)

    if change.kind == "rewrite":
        return [units(shard.records), units(rewritten(shard.records))]
    if change.kind == "truncate":
        return [units(shard.records[:k]) for k in range(len(shard.records) + 1)]
    return [units(shard.records)]


def apply_change(kind: str, index: int, path: str, shards: list[Shard], fmt: str) -> Change:
    st = os.stat(path)
    with open(path, "rb") as f:
        change = Change(kind=kind, index=index, path=path, data=f.read(), times=(st.st_atime_ns, st.st_mtime_ns))
    if kind == "rewrite":  # every good record gets other ids: any read of the new bytes shows
        write_shard(path, rewritten(shards[index].records), fmt)
    else:
        os.remove(path)
        with open(path, "wb") as f:
            f.write(change.data[: len(change.data) // 2] if kind == "truncate" else change.data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    return change


def restore(change: Change) -> None:
    with open(change.path, "wb") as f:
        f.write(change.data)
    os.utime(change.path, ns=change.times)


def tag_epoch(sample: Any) -> Any:
    """The stage every reader runs: the epoch it read the sample in goes into the key."""
    return replace(sample, key=tag_epoch_key(sample.key, sample.origin.epoch))


@contextlib.contextmanager
def fast_retries() -> Iterator[None]:
    """Backoff of 10-50 ms instead of 0.5-15 s, so a schedule with HTTP faults stays fast."""
    saved = read_options.RetryPolicy  # what ReadOptions.open_options() builds
    read_options.RetryPolicy = lambda **kw: RetryPolicy(**kw, backoff=0.01, max_backoff=0.05)  # type: ignore
    try:
        yield
    finally:
        read_options.RetryPolicy = saved


def dataset_options(u: Setup) -> dict[str, Any]:
    """The PackedDataset settings of a schedule (every reader of every topology uses them)."""
    read = ReadOptions(on_error=u.on_error, vocab_size=VOCAB,
                       limits=Limits(max_line_bytes=BYTE_LIMIT, max_member_bytes=BYTE_LIMIT))
    if u.http:
        read = replace(read, retry_budget=10.0, connect_timeout=2.0, read_timeout=2.0)
    else:
        # a re-staged local shard (same bytes, new mtime) must resume: the default identity ("tag")
        # refuses it by design, "digest" compares the bytes (a tiny shard lies within its 64 KiB ends)
        read = replace(read, identity="digest")
    kw: dict[str, Any] = {
        "capacity": u.capacity, "packs_per_batch": u.packs_per_batch, "epochs": u.epochs, "seed": u.seed,
        "stages": [tag_epoch], "packing": PackOptions(window=u.window, max_wait=2), "read": read}
    if u.balance:
        kw.update(cost=CostOptions(model=CostModel(linear=1.0, attention=0.05), balance="cost"))
    return kw


def served_manifest(urls: list[str], directory: str, options: dict[str, Any]) -> str:
    """A manifest of the served shards (a finite run over remote shards is refused without one)."""
    location = os.path.join(directory, "manifest")
    build_manifest(urls, location, decode=index_decode(DecodeOptions(limits=options["read"].limits)))
    return location
