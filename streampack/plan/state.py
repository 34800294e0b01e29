"""Resume state: versioned, fingerprinted, plain data, bounded by the window.

A :class:`~streampack.dataset.PackedDataset` state (one per DataLoader worker) is ``{"version", "fingerprint", "worker":
{"dp_rank", "worker_id"}, "passes", "graph", "metrics"}``: ``graph`` is the nested node state (None: the start of the
pass); settings and counters records (the fingerprint and metrics, each node's ``config``, ``identity``, ``counters``,
``metrics``) are one JSON text each (:func:`record_text`). A state of another :data:`STATE_VERSION` is refused. Only
ints, strings, lists, dicts and tensors appear, so ``torch.load(weights_only=True)`` accepts it.

Samples held in buffers are stored as references, one :data:`REF` record (56 bytes) saying where to re-read the sample
and which chunk it was (:mod:`streampack.plan.replay`), so a state grows with the window's sample count, never with
document length; only a graph that cannot replay (a user node stage) stores tokens (:func:`samples_to_state`). Both are
a few flat tensors, not one object per sample: StatefulDataLoader diffs every worker state at each snapshot, and a
handful of tensors compares in microseconds where a list of 1024 dicts does not.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from streampack.sample import Sample

STATE_VERSION = 5
VERSION_KEY = "version"
FINGERPRINT_KEY = "fingerprint"
WORKER_KEY = "worker"
PASSES_KEY = "passes"
GRAPH_KEY = "graph"
METRICS_KEY = "metrics"
LOADER_KIND = "streampack.PackedLoader"
"""The ``kind`` of a :class:`~streampack.PackedLoader` state with workers."""
LOADER_VERSION = 1
STALE_KEY = "batches_after_snapshot"
"""Set by :func:`dataset_states` on a worker state older than its loader state: the batches delivered since."""


def samples_to_state(samples: Sequence[Sample]) -> dict[str, Any]:
    """Samples -> plain data: concatenated tokens and, per optional field, its values and a presence flag."""
    out: dict[str, Any] = {"keys": [s.key for s in samples], "urls": [s.url for s in samples],
                           "lengths": torch.tensor([len(s) for s in samples], dtype=torch.int64),
                           "tokens": _cat([s.tokens for s in samples], np.int64)}

    def optional(values: list[np.ndarray | None]) -> dict[str, torch.Tensor]:
        return {"present": torch.tensor([v is not None for v in values], dtype=torch.bool),
                "values": _cat([v for v in values if v is not None], None)}

    for name in ("labels", "loss_mask"):
        if any(getattr(s, name) is not None for s in samples):
            out[name] = optional([getattr(s, name) for s in samples])
    names = sorted({n for s in samples for n in s.extras})
    if names:
        out["extras"] = {n: optional([s.extras.get(n) for s in samples]) for n in names}
    return out


def _cat(arrays: list[np.ndarray], dtype: Any) -> torch.Tensor:
    if not arrays:
        return torch.zeros(0, dtype=torch.int64)
    cat = np.concatenate(arrays)
    if dtype is not None:
        cat = cat.astype(dtype, copy=False)
    return torch.from_numpy(np.ascontiguousarray(cat))


def samples_from_state(state: Mapping[str, Any]) -> list[Sample]:
    """Inverse of :func:`samples_to_state`."""
    lengths = state["lengths"].tolist()
    bounds = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    tokens = state["tokens"].numpy()
    fields = {n: _split_optional(state.get(n), lengths) for n in ("labels", "loss_mask")}
    extras = {n: _split_optional(v, lengths) for n, v in state.get("extras", {}).items()}
    out = []
    for i, (key, url) in enumerate(zip(state["keys"], state["urls"])):
        out.append(Sample(key=key, url=url, tokens=tokens[bounds[i]:bounds[i + 1]].copy(), labels=fields["labels"][i],
                          loss_mask=fields["loss_mask"][i],
                          extras={n: v[i] for n, v in extras.items() if v[i] is not None}))
    return out


def _split_optional(field: Mapping[str, Any] | None, lengths: list[int]) -> list[np.ndarray | None]:
    if field is None:
        return [None] * len(lengths)
    values = field["values"].numpy()
    out: list[np.ndarray | None] = []
    pos = 0
    for present, n in zip(field["present"].tolist(), lengths):
        if present:
            out.append(values[pos:pos + n].copy())
            pos += n
        else:
            out.append(None)
    return out


# ----------------------------------------------------------------- carried samples by reference
REF_COLUMNS = ("source", "shard", "offset", "number", "epoch", "chunk", "length")
"""Where to re-read a carried sample, which chunk it was, and its length (checked when re-read: a stage
that is not a pure function of the sample is caught instead of silently changing the stream)."""
REF = np.dtype([(name, np.int64) for name in REF_COLUMNS])
"""A table of references, read by field; a state keeps one int64 tensor per column, by name."""


def require_fields(record: Mapping[str, Any], names: Iterable[str], what: str) -> None:
    """``ValueError`` naming the fields of ``names`` that ``record`` lacks: a state of another layout."""
    missing = [n for n in names if n not in record]
    if missing:
        raise ValueError(f"{what} without the field(s) {missing}: was the state saved by another streampack "
                         f"version (state version={STATE_VERSION})?")


def make_table(is_ref: np.ndarray, refs: np.ndarray, stored: Sequence[Sample]) -> dict[str, Any]:
    """The one layout of a table: which rows are references (bool ``[n]``), the references (an array of
    :data:`REF`, in order) and the tokens of the other rows (:func:`samples_to_state`, in order)."""
    # a copy: torch.from_numpy of an empty array may share its (null) storage with the empty refs columns,
    # which torch.save refuses as one storage seen as two types
    return {"is_ref": torch.tensor(np.asarray(is_ref, dtype=bool), dtype=torch.bool),
            "refs": {name: torch.from_numpy(np.ascontiguousarray(refs[name])) for name in REF_COLUMNS},
            "stored": samples_to_state(stored)}


def samples_to_table(samples: Sequence[Sample]) -> dict[str, Any]:
    """Samples -> a table of their tokens (what a graph that cannot re-read carries; the packer writes its
    references itself)."""
    return make_table(np.zeros(len(samples), dtype=bool), np.zeros(0, dtype=REF), samples)


def table_refs(table: Mapping[str, Any]) -> np.ndarray:
    """The references of a table, as a :data:`REF` array (``ValueError`` naming a missing column)."""
    columns = table["refs"]
    require_fields(columns, REF_COLUMNS, "a reference table")
    out = np.zeros(len(columns["length"]), dtype=REF)
    for name in REF_COLUMNS:
        out[name] = np.asarray(columns[name], dtype=np.int64)
    return out


def table_size(table: Mapping[str, Any]) -> int:
    return int(table["is_ref"].shape[0])


def table_slice(table: Mapping[str, Any], lo: int, hi: int) -> dict[str, Any]:
    """Rows ``[lo, hi)`` of a table (by position, references and stored samples alike)."""
    is_ref = table["is_ref"]
    before = int(is_ref[:lo].sum())
    inside = int(is_ref[lo:hi].sum())
    stored = samples_from_state(table["stored"])
    s_before = lo - before
    return make_table(is_ref[lo:hi].numpy().copy(), table_refs(table)[before:before + inside],
                      stored[s_before:s_before + (hi - lo - inside)])


def concat_tables(tables: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    if not tables:
        return samples_to_table([])
    return make_table(torch.cat([t["is_ref"] for t in tables]).numpy(), np.concatenate([table_refs(t) for t in tables]),
                      [s for t in tables for s in samples_from_state(t["stored"])])


def table_lengths(table: Mapping[str, Any]) -> np.ndarray:
    """int64 ``[n]`` token length of every row."""
    out = np.zeros(table_size(table), dtype=np.int64)
    is_ref = table["is_ref"].numpy()
    out[is_ref] = table_refs(table)["length"]
    out[~is_ref] = table["stored"]["lengths"].numpy()
    return out


def check_version(state: Mapping[str, Any], *, what: str = "state") -> None:
    """``STATE_VERSION``: one number for the whole library, bumped when any layout changes."""
    version = state.get(VERSION_KEY) if isinstance(state, Mapping) else None
    if version != STATE_VERSION:
        raise ValueError(f"{what} version={version!r} is not the supported version={STATE_VERSION}; "
                         f"was it saved by another streampack version or another dataset?")


def check_node_config(saved: Mapping[str, Any], current: Mapping[str, Any], *, node: str,
                      label: str) -> None:
    """A node's own settings check on restore: ``ValueError`` naming each differing setting as
    ``key: state=<saved> <label>=<current>``."""
    diffs = [f"{k}: state={saved.get(k)!r} {label}={v!r}" for k, v in current.items() if saved.get(k) != v]
    if diffs:
        raise ValueError(f"{node} state was saved with different settings: " + "; ".join(diffs))


def record_text(record: Mapping[str, Any]) -> str:
    """A settings or counters record as one JSON text. StatefulDataLoader diffs every worker's state leaf
    by leaf after every batch: one text per record makes a finite epoch's state 44 leaves instead of 154,
    and ``state_dict()`` plus torchdata's delta ~160 µs a batch instead of ~285."""
    return json.dumps(record, separators=(",", ":"), default=_plain)


def record_of(value: str | None) -> dict[str, Any]:
    """The record a state keeps as :func:`record_text`, decoded; ``{}`` for None."""
    if value is None:
        return {}
    if not isinstance(value, str):
        raise ValueError(f"a state record is a {type(value).__name__}, not the JSON text this streampack "
                         f"writes (state version={STATE_VERSION}): was it saved by another streampack version?")
    return json.loads(value)


def dataset_record(state: Mapping[str, Any], key: str) -> dict[str, Any]:
    """A dataset state's fingerprint or metrics (``key``), from its JSON text or the dict
    :func:`dataset_states` decoded (through JSON again, so both compare equal); ``{}`` when absent."""
    value = state.get(key)
    return json.loads(record_text(value)) if isinstance(value, Mapping) else record_of(value)


def decoded_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A dataset state with its fingerprint and metrics as dicts (a shallow copy)."""
    out = dict(state)
    for key in (FINGERPRINT_KEY, METRICS_KEY):
        if isinstance(out.get(key), str):
            out[key] = record_of(out[key])
    return out


def _plain(value: Any) -> Any:
    """Numpy values as Python numbers and lists, sets as sorted lists."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"a state record holds {type(value).__name__} {value!r}, which is not plain data")


def check_fingerprint(saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming every setting whose saved value differs from the current one."""
    diffs = [f"{k}: saved {saved.get(k)!r}, now {current.get(k)!r}"
             for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
    if diffs:
        raise ValueError("cannot resume: the state was saved with different settings that change "
                         "the stream (" + "; ".join(diffs) + ")")


def check_loader_state(loader_state: Mapping[str, Any], num_workers: int) -> None:
    """Check a ``StatefulDataLoader`` or ``PackedLoader`` ``state_dict()`` against the loader's ``num_workers``
    (StatefulDataLoader itself fails with a bare ``AssertionError``, or silently restarts workers)."""
    snapshot = loader_state.get("_snapshot")
    if loader_state.get("kind") == LOADER_KIND:
        saved = loader_state["num_workers"]
    elif snapshot is None:
        saved = 0
    else:
        saved = snapshot.get("_main_snapshot", {}).get("_num_workers", len(snapshot.get("_worker_snapshots", {})))
    if saved != num_workers:
        raise ValueError(f"cannot resume: the loader state was saved with num_workers={saved}, "
                         f"the loader now has num_workers={num_workers}; resume with num_workers={saved}, "
                         f"or load the dataset states of every rank into the dataset instead "
                         f"(ds.load_state_dict(all_states), all_states from streampack.plan.state.dataset_states) "
                         f"for an elastic resume on the new worker count")


def load_loader_state(loader: Any, loader_state: Mapping[str, Any]) -> None:
    """``loader.load_state_dict(loader_state)`` after :func:`check_loader_state`; a ``PackedDataset`` then
    reads once, before the loader starts its workers, what each worker's restore would read
    (``PackedDataset.before_workers``)."""
    check_loader_state(loader_state, loader.num_workers)
    loader.load_state_dict(loader_state)
    before_workers = getattr(loader.dataset, "before_workers", None)  # plan/ cannot import the dataset's class
    if before_workers is not None:
        before_workers(loader.num_workers)


def dataset_states(loader_state: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The PackedDataset state of every worker inside a StatefulDataLoader or PackedLoader state
    (:func:`decoded_state`).

    A state taken between the workers' snapshots (``snapshot_every_n_steps`` > 1) holds each worker's state as of
    its last snapshot, and only the loader replays the batches since: each such state is marked with their count
    (:data:`STALE_KEY`), and loading it into a dataset is refused (:func:`check_current`); its metrics read as they
    were at the snapshot."""
    if loader_state.get("kind") == LOADER_KIND:  # a PackedLoader's: each worker's own count since its snapshot
        return [{**decoded_state(w["dataset_state"]), **({STALE_KEY: w["since"]} if w["since"] else {})}
                for w in loader_state["workers"] if w["dataset_state"]]
    snapshot = loader_state.get("_snapshot")
    if snapshot is None:
        return [decoded_state(loader_state["dataset_state"])] if loader_state.get("dataset_state") else []
    since = loader_state.get("_steps_since_snapshot", 0)
    workers = snapshot.get("_worker_snapshots", {})
    states = [decoded_state(w["dataset_state"]) for _, w in sorted(workers.items()) if w.get("dataset_state")]
    return [{**state, STALE_KEY: since} for state in states] if since else states


def check_current(state: Mapping[str, Any]) -> None:
    """Refuse a dataset state :func:`dataset_states` took from between a loader's snapshots: a dataset loading it
    would deliver the batches since that snapshot again."""
    since = state.get(STALE_KEY)
    if since:
        raise ValueError(f"this dataset state comes from a loader state taken {since} batches after its workers' "
                         f"last snapshot (snapshot_every_n_steps > 1): loaded, it would deliver those batches "
                         f"again; resume the loader state itself with load_loader_state on the same dp_size and "
                         f"num_workers, or save on the snapshot interval (or with snapshot_every_n_steps=1) for an "
                         f"elastic resume")


def state_nbytes(state: Any) -> int:
    """Size of ``torch.save(state)`` in bytes (what a checkpoint pays for the data state)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.tell()


def check_node_versions(tree: Any, who: str) -> None:
    """Every node state nested in ``tree`` that records a version has this library's."""
    for node in nested(tree):
        if VERSION_KEY in node:
            check_version(node, what=f"{node.get('kind', 'node')} state of {who}")


def nested(tree: Any) -> Iterator[Mapping[str, Any]]:
    """Every mapping nested in ``tree`` (itself included), depth first."""
    if isinstance(tree, Mapping):
        yield tree
        children: Any = tree.values()
    elif isinstance(tree, (list, tuple)):
        children = tree
    else:
        return
    for child in children:
        yield from nested(child)
