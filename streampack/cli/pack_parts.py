"""``streampack pack`` as the ranks of a job (:mod:`streampack.cli.ranks`): each rank packs every W-th input shard.

Rank ``r`` of ``W`` reads only its share of the input shards (so it holds only its share's ids), packs them, writes
``part-rank-r-of-W-000000.tar``, ... and then ``parts/pack-rank-r-of-W.json``: its shards, per-pack lengths, documents
and aligned loads, its fill and counters, what the job was asked (the expanded URL list's SHA-1 and every setting
that changes a pack) and the identity (size, ETag / mtime) of each of its input shards. Rank 0 waits for the W
records and writes ``manifest.json`` over all shards in rank order, with the whole data set's metrics and each
rank's fill under ``ranks``; the folder reads back through ``PackedDataset`` as a single process's output does
(every document once; packs never span two ranks' shares, so the fill is each share's).

Resume is per rank: a rank whose record is there for the same job, the same input identities and with its shards
present does not read its share again; a rank killed before its record was written packs its whole share again.
A rank that repacks removes its record first. Every record carries the launch's id (:attr:`JobRank.launch`), and
rank 0 merges only records of its own launch: a record an earlier launch left counts only once its rank has checked
its inputs again and rewritten it (rank 0 checks a record's job, not its inputs, which would be a ``stat`` of every
input shard on rank 0). Without a launch id (``--rank`` flags and no ``--launch-id``) an earlier launch's record of
a changed share could be merged if rank 0 read it before that rank started.

**Cost** per rank: its share's documents read and held once (ids as int64: ≈ 8 B a token), one ``stat`` per
input shard of its share, its output shards and one record written; rank 0 W record reads and O(packs) memory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from streampack.cli._data import CliError
from streampack.cli.ranks import PARTS_DIR, JobRank, gather
from streampack.io.packed_writer import PackedShards, write_json, write_packed_manifest, write_packed_shards
from streampack.io.urls import list_digest

SETTINGS = ("capacity", "algorithm", "cp_size", "tp_size", "align_multiple", "tokenizer", "tokens_key", "text_key",
            "labels_key", "loss_mask_key", "bos_id", "eos_id", "on_error", "overlong", "packs_per_shard", "seed",
            "vocab_size", "max_line_bytes", "max_member_bytes", "max_sample_bytes", "max_json_depth")
"""The flags every rank must give alike: each changes what a pack holds."""


def _record_path(out: Path, job: JobRank, rank: int | None = None) -> Path:
    return out / PARTS_DIR / f"pack-{job.part_name(rank=rank)}.json"


def _failed_path(out: Path, job: JobRank, rank: int | None = None) -> Path:
    return out / PARTS_DIR / f"pack-{job.part_name(rank=rank)}.failed.json"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CliError(f"cannot read {str(path)!r}: {e}") from None


def _asked(args: argparse.Namespace, urls: Sequence[str], align: int) -> dict[str, Any]:
    settings = {name: getattr(args, name) for name in SETTINGS}
    if args.tokenizer is not None:  # a path: what the ids depend on is its contents
        settings["tokenizer"] = hashlib.sha1(Path(args.tokenizer).read_bytes()).hexdigest()
    return {"count": len(urls), "urls_sha1": list_digest(urls), "align": align,
            "settings": settings}


def _inputs(share: Sequence[str], args: argparse.Namespace) -> str:
    """SHA-1 of the identities of this rank's input shards (one ``stat`` each): a record made of other bytes is
    not reused."""
    from streampack.io.retry import RetryPolicy
    from streampack.io.storage import OpenOptions, identity

    opts = OpenOptions(retry=RetryPolicy(budget=args.retry_budget))
    return hashlib.sha1("\n".join(f"{u}|{identity(u, opts)}" for u in share).encode()).hexdigest()


def _reusable(record: Any, asked: dict[str, Any], inputs: str, out: Path) -> bool:
    return (isinstance(record, dict) and record.get("job") == asked and record.get("inputs") == inputs
            and all((out / s["name"]).is_file() for s in record.get("shards", ())))


def run_rank(args: argparse.Namespace, job: JobRank, *, align: int,
             pack_share: Callable[[argparse.Namespace, Sequence[str], int], Any]) -> int:
    """One rank: its share packed (or its record of an earlier launch reused), and on rank 0 the manifest."""
    from streampack.io.urls import expand_urls

    out = Path(args.out)
    urls = expand_urls(args.urls)
    share = [urls[i] for i in job.share(len(urls))]
    asked = _asked(args, urls, align)
    inputs = _inputs(share, args)
    _failed_path(out, job).unlink(missing_ok=True)
    record = _read_json(_record_path(out, job))
    if _reusable(record, asked, inputs, out):
        print(f"{job.describe()}: its {len(record['shards'])} shard(s) of packs are there for these inputs: kept")
        record["launch"] = job.launch  # checked again just now: rank 0 may merge it under this launch
    else:
        _record_path(out, job).unlink(missing_ok=True)  # rank 0 must not merge it while its shards are rewritten
        prefix = f"part-{job.part_name()}-"
        for partial in out.glob(f"{prefix}*.tar.tmp"):  # an earlier launch killed mid-shard
            partial.unlink()
        record = {"job": asked, "inputs": inputs, "launch": job.launch, "shards": [], "pack_lengths": [], "pack_docs": [],
                  "pack_loads": [], "fields": None, "documents": 0, "tokens": 0, "overlong_counters": {}, "errors": {}}
        if share:
            try:
                packed = pack_share(args, share, align)
            except ValueError as e:  # CliError and DataError included: rank 0 stops at once instead of waiting
                write_json(_failed_path(out, job), {"error": str(e), "launch": job.launch})
                raise
            written = write_packed_shards(packed.docs, packed.bins, out, capacity=args.capacity, align=align,
                                          fields=packed.fields, prefix=prefix,
                                          packs_per_shard=args.packs_per_shard)
            record.update(shards=list(written.shards), pack_lengths=list(written.pack_lengths),
                          pack_docs=list(written.pack_docs), pack_loads=list(written.pack_loads), fields=packed.fields,
                          documents=len(packed.docs), tokens=int(packed.lengths.sum()),
                          overlong_counters=packed.counters.as_dict(), errors=packed.errors)
        write_json(_record_path(out, job), record)
    packs = len(record["pack_lengths"])
    fill = record["tokens"] / (packs * args.capacity) if packs else 0.0
    print(f"{job.describe()}: {len(share)} of {len(urls)} input shard(s), {record['documents']:,} documents into "
          f"{packs:,} packs, fill {fill:.2%}")
    if job.rank != 0:
        return 0
    records = gather(lambda r: _load(out, job, r, asked), job.world_size, timeout=args.wait_timeout,
                     where=str(out / PARTS_DIR))
    _write_manifest(args, out, records, align=align)
    return 0


def _load(out: Path, job: JobRank, rank: int, asked: dict[str, Any]) -> dict[str, Any] | None:
    failed = _read_json(_failed_path(out, job, rank))
    if failed is not None and failed.get("launch", "") == job.launch:
        raise CliError(f"rank {rank} failed: {failed.get('error')}: no manifest written (the ranks that finished "
                       f"keep their packs: run the job again)")
    record = _read_json(_record_path(out, job, rank))
    if record is None or record.get("launch", "") != job.launch:
        return None  # not written yet, or left by an earlier launch: rank r checks its inputs and rewrites it
    theirs = record.get("job", {})
    if theirs != asked:
        differ = sorted(k for k in {*asked["settings"], *theirs.get("settings", {})}
                        if asked["settings"].get(k) != theirs.get("settings", {}).get(k))
        what = (f"its URL list is {theirs.get('count')} shard(s), rank 0's {asked['count']}"
                if (theirs.get("count"), theirs.get("urls_sha1")) != (asked["count"], asked["urls_sha1"])
                else f"its settings differ: {', '.join(differ) or 'alignment'}")
        raise CliError(f"rank {rank} was started with other arguments than rank 0 ({what}); every rank must run "
                       f"the same `streampack pack` command (or {str(_record_path(out, job, rank))!r} is left from "
                       f"an earlier launch with other arguments: delete it)")
    return record


def _fields(records: Sequence[dict[str, Any]]) -> list[str]:
    """The one field list of every pack; ``CliError`` when ranks wrote different ones (a share whose documents
    carry labels or loss masks beside one whose documents do not: the manifest names one list for every pack)."""
    written = {tuple(r["fields"]) for r in records if r.get("fields") is not None}
    if len(written) > 1:
        ranks = {f: [i for i, r in enumerate(records) if r.get("fields") is not None and tuple(r["fields"]) == f]
                 for f in written}
        which = "; ".join(f"ranks {v}: {list(k)}" for k, v in ranks.items())
        raise CliError(f"the ranks wrote packs of different fields ({which}): pass --labels-key / --loss-mask-key "
                       f"so that every rank writes them (a document without its own is supervised on its tokens) "
                       f"and run the job again")
    return list(written.pop()) if written else []


def _write_manifest(args: argparse.Namespace, out: Path, records: Sequence[dict[str, Any]], *, align: int) -> None:
    import dataclasses

    import numpy as np

    from streampack.packing import packing_metrics

    fields = _fields(records)
    written = [PackedShards(shards=tuple(r["shards"]), pack_lengths=tuple(r["pack_lengths"]),
                            pack_docs=tuple(r["pack_docs"]), pack_loads=tuple(r["pack_loads"])) for r in records]
    loads = np.asarray([n for w in written for n in w.pack_loads], dtype=np.int64)
    if not len(loads):
        raise CliError(f"no non-empty samples in {args.urls}")
    # the metrics of every pack as one packing: each pack a bin holding its aligned load, the document count apart
    metrics = dataclasses.asdict(packing_metrics(loads, [np.array([i]) for i in range(len(loads))], args.capacity))
    documents, tokens = sum(r["documents"] for r in records), sum(r["tokens"] for r in records)
    metrics.update(num_documents=documents, docs_per_bin=documents / len(loads),
                   fill=tokens / (len(loads) * args.capacity))
    ranks = [{"rank": i, "packs": len(r["pack_lengths"]), "documents": r["documents"], "tokens": r["tokens"],
              "fill": r["tokens"] / (len(r["pack_lengths"]) * args.capacity) if r["pack_lengths"] else 0.0}
             for i, r in enumerate(records)]
    manifest = write_packed_manifest(
        out, written, capacity=args.capacity, align=align, cp_size=args.cp_size, tp_size=args.tp_size,
        algorithm=args.algorithm, seed=args.seed, fields=fields, metrics=metrics,
        extra={"sources": [str(u) for u in args.urls], "overlong": args.overlong,
               "overlong_counters": _summed([r["overlong_counters"] for r in records]),
               "errors": _summed([{k: v for k, v in r["errors"].items() if k != "recent"} for r in records]),
               "ranks": ranks})
    print(f"manifest: {manifest.num_packs:,} packs of {args.capacity} from {len(records)} ranks in "
          f"{len(manifest.shards)} shards under {out}: fill {metrics['fill']:.2%} (per rank "
          f"{', '.join(format(r['fill'], '.2%') for r in ranks)})")


def _summed(dicts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counters of every rank added key by key (nested dicts of counts included)."""
    out: dict[str, Any] = {}
    for d in dicts:
        for key, value in d.items():
            if isinstance(value, dict):
                out[key] = _summed([out.get(key, {}), value])
            elif isinstance(value, (int, float)):
                out[key] = out.get(key, 0) + value
    return out


__all__ = ["SETTINGS", "run_rank"]
