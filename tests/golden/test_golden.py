"""Golden streams: digests of the batches, the state and the metrics of a matrix of
configurations, recorded once, so a refactor proves it yields bit-identical batches.

Each configuration writes tiny shards with a fixed seed into a temporary working directory and
names them by relative path (a shard's URL is part of every ``doc_key`` and of the state's
fingerprint, so an absolute temporary path would change every digest); every file gets one fixed
mtime (the shard identity a state records). It streams a few batches through the public
``PackedDataset`` (a 2-worker ``StatefulDataLoader`` for some), digests each batch field by field,
the state after batch ``save_at`` and ``metrics()`` there, then restores that state (through
``torch.save`` / ``torch.load(weights_only=True)``) into a fresh dataset and checks the batches
after it equal the uninterrupted ones.

Digests are of a canonical form: every tensor as int64 (integers and bools) or float64,
contiguous, with its shape, so a change of storage dtype (``input_ids`` stored as int32) keeps
them; ``doc_keys`` as text. They are sha256, cut to 16 hex digits (a golden file is a test
fixture, not a security boundary).

Re-record after an intended change of behaviour (and say why in the commit)::

    PYTHONPATH=. python tests/golden/test_golden.py --record            # every configuration
    PYTHONPATH=. python tests/golden/test_golden.py --record media cost  # some
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers, also when run as a script

from helpers_data import make_token_docs, write_jsonl_shards, write_tar_shards  # noqa: E402
from helpers_formats import write_parquet_shards, write_zst_shards  # noqa: E402

from streampack import PackedDataset  # noqa: E402
from streampack.options import CostOptions, PackOptions, ReadOptions, TokenizeOptions, TopologyOptions  # noqa: E402

GOLDEN = Path(__file__).parent
MTIME_NS = 1_700_000_000 * 10**9
READ = ReadOptions(cache_dir="cache")
"""Indexes cached inside the working directory: the default cache is shared and keyed by URL,
and these URLs are relative."""
BATCH_FIELDS = ("input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_padded", "max_seqlen",
                "varlen_cu_seqlens", "varlen_max_seqlen", "varlen_cu_seqlens_bidirectional", "num_tokens",
                "num_targets", "num_target_docs", "doc_keys", "capacity", "num_packs", "align", "est_cost",
                "extras", "vision")
"""What a batch is to its consumers (the stored and the derived fields alike, read by name)."""


# ----------------------------------------------------------------------------- canonical digests
def _plain(value: Any) -> Any:
    """JSON-able canonical form: tensors and arrays as int64 / float64 with their shape."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        wide = value.to(torch.float64) if value.is_floating_point() else value.to(torch.int64)
        return {"shape": list(wide.shape), "float": value.is_floating_point(), "values": wide.contiguous().tolist()}
    if isinstance(value, np.ndarray):
        return _plain(torch.from_numpy(np.ascontiguousarray(value)))
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, float):
        return repr(value)  # exact, and NaN-safe
    return value


def digest(value: Any) -> str:
    if isinstance(value, torch.Tensor):  # the hot case: hash the canonical bytes, not a JSON list
        value = value.detach().cpu()
        wide = value.to(torch.float64) if value.is_floating_point() else value.to(torch.int64)
        head = json.dumps([list(wide.shape), value.is_floating_point()]).encode()
        return hashlib.sha256(head + wide.contiguous().numpy().tobytes()).hexdigest()[:16]
    text = json.dumps(_plain(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def batch_digest(batch: Any) -> dict[str, str]:
    out = {}
    for name in BATCH_FIELDS:
        value = getattr(batch, name)
        if name == "doc_keys":
            value = "\n".join(value)
        elif name == "extras":
            value = {k: digest(v) for k, v in sorted(value.items())}
        elif name == "vision" and value is not None:
            value = {f.name: digest(getattr(value, f.name)) for f in dataclasses.fields(value)}
        out[name] = digest(value)
    return out


def roundtrip(state: Any) -> Any:
    """What a checkpoint hands back: ``torch.save`` then ``torch.load(weights_only=True)``."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def loader_dataset_states(loader_state: dict[str, Any]) -> list[Any]:
    """The PackedDataset state of each worker inside a StatefulDataLoader state (torchdata's own
    layout; the loader's random base seed around them differs per run and is left out)."""
    workers = loader_state["_snapshot"]["_worker_snapshots"]
    return [w["dataset_state"] for _, w in sorted(workers.items())]


# ----------------------------------------------------------------------------- the configurations
def _fix_mtimes(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            os.utime(path, ns=(MTIME_NS, MTIME_NS))


def _rel(paths: list[str]) -> list[str]:
    return [os.path.relpath(p) for p in paths]


def _word_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i + 1 for i in range(97)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def _word_texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(f"w{w}" for w in rng.integers(0, 97, int(rng.integers(1, 90)))) for _ in range(n)]


def keep_not_seven(sample: Any) -> Any:
    """A user stage that drops samples (keys ending in 7)."""
    return None if sample.key.endswith("7") else sample


def reverse_tokens(sample: Any) -> Any:
    """A user stage that changes tokens."""
    return dataclasses.replace(sample, tokens=sample.tokens[::-1].copy())


Make = Callable[[], PackedDataset]


def tar_tokens() -> Make:
    urls = _rel(write_tar_shards("d", make_token_docs(60, seed=1, max_len=90), 3))
    return lambda: PackedDataset(urls, capacity=64, epochs=1, seed=1, packing=PackOptions(window=8), read=READ)


def jsonl_text() -> Make:
    urls = _rel(write_jsonl_shards("d", _word_texts(50, seed=2), 2))
    tok = _word_tokenizer()
    return lambda: PackedDataset(urls, capacity=96, epochs=1, seed=2, tokenizer=tok,
                                 tokenize=TokenizeOptions(eos_id=0, block_size=5), packing=PackOptions(window=6),
                                 read=READ)


def zst_tokens_infinite() -> Make:
    """jsonl.zst in two frames a shard; an infinite stream over a tiny set crosses epochs."""
    urls = _rel(write_zst_shards("d", make_token_docs(24, seed=3, max_len=70), 2, frames=2))
    return lambda: PackedDataset(urls, capacity=128, seed=3, packs_per_batch=2,
                                 packing=PackOptions(window=8, algorithm="ffd"), read=READ)


def parquet_tokens() -> Make:
    urls = _rel(write_parquet_shards("d", make_token_docs(70, seed=4, max_len=120), 3, row_group_size=8))
    return lambda: PackedDataset(urls, capacity=64, epochs=1, seed=4,
                                 packing=PackOptions(window=10, overlong="truncate"), read=READ)


def parquet_text() -> Make:
    urls = _rel(write_parquet_shards("d", _word_texts(40, seed=5), 2, row_group_size=8))
    tok = _word_tokenizer()
    return lambda: PackedDataset(urls, capacity=128, epochs=1, seed=5, tokenizer=tok,
                                 tokenize=TokenizeOptions(bos_id=1, eos_id=0), packing=PackOptions(window=8), read=READ)


def labels_cp_aligned() -> Make:
    """Explicit loss masks, context-parallel alignment (align 4) and two packs a batch."""
    docs = make_token_docs(60, seed=6, max_len=60)
    rng = np.random.default_rng(6)
    mask = [rng.integers(0, 2, len(d)).tolist() for d in docs]
    urls = _rel(write_jsonl_shards("d", docs, 3, loss_mask=mask))
    return lambda: PackedDataset(urls, capacity=64, epochs=1, seed=6, packs_per_batch=2,
                                 read=ReadOptions(loss_mask_key="loss_mask", cache_dir="cache"),
                                 packing=PackOptions(window=8, pad_id=7), topology=TopologyOptions(cp_size=2))


def stages() -> Make:
    urls = _rel(write_tar_shards("d", make_token_docs(60, seed=7, max_len=70), 3, fmt="json"))
    return lambda: PackedDataset(urls, capacity=64, epochs=1, seed=7, stages=[keep_not_seven, reverse_tokens],
                                 packing=PackOptions(window=8), read=READ)


def media() -> Make:
    from helpers_media import write_tar as write_media_tar

    from streampack.media import DynamicResolution, MediaOptions

    url = os.path.relpath(write_media_tar(Path("m.tar"), 30, seed=8, max_images=3, sizes=(28, 60)))
    rule = DynamicResolution(patch_size=14, merge_size=2, min_pixels=28 * 28, max_pixels=28 * 28 * 4)
    from helpers_media import IMAGE_ID

    return lambda: PackedDataset([url], capacity=96, epochs=1, seed=8,
                                 media=MediaOptions(rule=rule, image_token_id=IMAGE_ID), packing=PackOptions(window=6),
                                 read=READ)


def balance_cost() -> Make:
    urls = _rel(write_jsonl_shards("d", make_token_docs(80, seed=9, max_len=120), 2))
    cost = CostOptions(model={"hidden": 64, "layers": 2, "heads": 4, "ffn": 128}, balance="cost")
    return lambda: PackedDataset(urls, capacity=128, epochs=1, seed=9, packing=PackOptions(window=12), cost=cost,
                                 read=READ)


def loader_tar_text() -> Make:
    """Text in tar members through a 2-worker StatefulDataLoader."""
    urls = _rel(write_tar_shards("d", _word_texts(60, seed=10), 4, fmt="txt"))
    tok = _word_tokenizer()
    return lambda: PackedDataset(urls, capacity=96, epochs=1, seed=10, tokenizer=tok,
                                 tokenize=TokenizeOptions(eos_id=0), packing=PackOptions(window=6), read=READ)


def loader_tokens_infinite() -> Make:
    urls = _rel(write_tar_shards("d", make_token_docs(30, seed=11, max_len=80), 3))
    return lambda: PackedDataset(urls, capacity=64, seed=11, packs_per_batch=2, packing=PackOptions(window=6),
                                 read=READ)


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """One golden stream."""

    name: str
    build: Callable[[], Make]
    """Writes the shards into the working directory; returns a maker of fresh datasets."""
    batches: int = 8
    """Batches streamed (fewer when the stream ends)."""
    save_at: int = 3
    """Batches taken before the state is saved."""
    workers: int = 0
    """DataLoader workers (0: the dataset is iterated directly)."""
    slow: bool = False


CONFIGS = [
    Config(name="tar_tokens", build=tar_tokens),
    Config(name="jsonl_text", build=jsonl_text),
    Config(name="zst_tokens_infinite", build=zst_tokens_infinite, save_at=5),
    Config(name="parquet_tokens", build=parquet_tokens),
    Config(name="parquet_text", build=parquet_text),
    Config(name="labels_cp_aligned", build=labels_cp_aligned),
    Config(name="stages", build=stages),
    Config(name="media", build=media, batches=6),
    Config(name="balance_cost", build=balance_cost),
    Config(name="loader_tar_text", build=loader_tar_text, workers=2, slow=True),
    Config(name="loader_tokens_infinite", build=loader_tokens_infinite, workers=2, save_at=4),
]


@contextlib.contextmanager
def workdir() -> Iterator[Path]:
    """A fresh temporary working directory (shards are named relative to it)."""
    old = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        os.chdir(tmp)
        try:
            yield Path(tmp)
        finally:
            os.chdir(old)


def _take(source: Any, n: int) -> list[Any]:
    it = iter(source)
    out = []
    for _ in range(n):
        batch = next(it, None)
        if batch is None:
            break
        out.append(batch)
    return out


def _stop_workers(source: Any) -> None:
    iterator = getattr(source, "_iterator", None)  # a StatefulDataLoader keeps its last iterator
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def run_stream(config: Config) -> dict[str, Any]:
    """The digests of one configuration; asserts the restored stream equals the uninterrupted one."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    with workdir() as root:
        make = config.build()
        _fix_mtimes(root)
        loader = (lambda ds: StatefulDataLoader(ds, batch_size=None, num_workers=config.workers)) \
            if config.workers else (lambda ds: ds)
        first = loader(make())
        whole = [batch_digest(b) for b in _take(first, config.batches)]
        assert len(whole) > config.save_at, f"{config.name}: the stream must go on after the save point"
        ds = make()
        source = loader(ds)
        it = iter(source)
        head = [batch_digest(next(it)) for _ in range(config.save_at)]
        if config.workers:
            state = source.state_dict()
            data_state, metrics = loader_dataset_states(state), None
        else:
            state = data_state = ds.state_dict()
            metrics = ds.metrics()
        del it
        again = make()
        restored = loader(again)
        restored.load_state_dict(roundtrip(state))
        rest = [batch_digest(b) for b in _take(restored, config.batches - config.save_at)]
        for used in (first, source, restored):  # stop prefetching workers before their shards go
            _stop_workers(used)
    assert head == whole[:config.save_at], f"{config.name}: a second run differs from the first"
    assert head + rest == whole, f"{config.name}: the batches after a restore differ from the uninterrupted ones"
    out: dict[str, Any] = {"batches": whole, "save_at": config.save_at, "state": digest(data_state)}
    if metrics is not None:
        out["metrics"] = {k: digest(v) for k, v in sorted(metrics.items())}
    return out


# ----------------------------------------------------------------------------- multi-rank streams
def _finite_ranks_shards() -> list[str]:
    from streampack.cli.main import main

    urls = _rel(write_tar_shards("d", make_token_docs(60, seed=12, max_len=100), 5))
    _fix_mtimes(Path("d"))  # the manifest records each shard's identity
    assert main(["index", *urls, "--out", "manifest", "--quiet", "--pool", "threads"]) == 0
    return urls


def finite_ranks() -> dict[str, Any]:
    """dp_size=2 with explicit ranks, a manifest and ``equal_batches="plan"``: both ranks' whole
    epochs (the same count), a state of rank 1 mid-epoch and its exact resume."""
    with workdir() as root:
        urls = _finite_ranks_shards()
        _fix_mtimes(root)

        def make(rank: int) -> PackedDataset:
            return PackedDataset(urls, capacity=64, epochs=1, seed=12, packing=PackOptions(window=8),
                                 read=ReadOptions(manifest="manifest", cache_dir="cache"),
                                 topology=TopologyOptions(dp_rank=rank, dp_size=2, equal_batches="count"))

        ranks = [[batch_digest(b) for b in make(r)] for r in range(2)]
        ds = make(1)
        it = iter(ds)
        for _ in range(3):
            next(it)
        state, metrics = ds.state_dict(), ds.metrics()
        again = make(1)
        again.load_state_dict(roundtrip(state))
        rest = [batch_digest(b) for b in again]
    assert len(ranks[0]) == len(ranks[1]) > 3, [len(r) for r in ranks]
    assert ranks[1][:3] + rest == ranks[1]
    keys = [k for r in ranks for b in r for k in [b["doc_keys"]]]
    assert len(keys) == len(set(keys))
    return {"ranks": ranks, "save_at": 3, "state": digest(state),
            "metrics": {k: digest(v) for k, v in sorted(metrics.items())}}


def elastic_chain() -> dict[str, Any]:
    """The states of 2 ranks x 2 workers resumed on 1 rank x 3 workers: every document of the
    epoch trained exactly once; the union of the trained document keys and the batches of both
    runs are recorded."""
    from topology_sim import SimRank

    from streampack.plan import elastic
    from streampack.plan.state import table_size

    with workdir() as root:
        docs = make_token_docs(48, seed=13, max_len=120)
        urls = _rel(write_tar_shards("d", docs, 4))
        _fix_mtimes(root)

        def make(rank: int, size: int) -> PackedDataset:
            return PackedDataset(urls, capacity=64, epochs=1, seed=13,
                                 packing=PackOptions(window=8, max_wait=3),
                                 topology=TopologyOptions(dp_rank=rank, dp_size=size, equal_batches="count"), read=READ)

        old = [SimRank(lambda r=r: make(r, 2), 2) for r in range(2)]
        before = [next(rank) for rank in old for _ in range(3)]
        states = [roundtrip(s) for rank in old for s in rank.states()]
        after = list(SimRank(lambda: make(0, 1), 3, load=states))
    packers = [elastic.find_state(s["graph"], "WindowPacker") for s in states if s["graph"] is not None]
    carried = sum(table_size(elastic.WindowPacker.undelivered(p).carry) for p in packers if p is not None)
    assert carried > 0, "the save point must hold samples in packer windows (else the chain proves little)"
    trained = Counter(k for b in before + after for k in b.doc_keys if not k.startswith("<"))
    assert trained and max(trained.values()) == 1, "a document chunk was trained twice"
    whole = {k.split("#")[1].split("/")[0] for k in trained}
    assert whole == {f"{i:08d}" for i in range(len(docs))}, "a document was never trained"
    return {"before": [batch_digest(b) for b in before], "after": [digest(batch_digest(b)) for b in after],
            "trained": digest(sorted(trained)), "states": digest(states)}


MULTI: dict[str, Callable[[], dict[str, Any]]] = {"finite_ranks": finite_ranks, "elastic_chain": elastic_chain}


# ----------------------------------------------------------------------------- the tests
def _golden(name: str) -> dict[str, Any]:
    path = GOLDEN / f"{name}.json"
    assert path.exists(), f"no golden record {path}: run `python tests/golden/test_golden.py --record {name}`"
    return json.loads(path.read_text())


def _compare(name: str, got: dict[str, Any]) -> None:
    want = _golden(name)
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for part in want:
        if got[part] == want[part]:
            continue
        if isinstance(want[part], list):  # name the first batch and its fields that differ
            for i, (g, w) in enumerate(zip(got[part], want[part])):
                if g != w:
                    fields = sorted(k for k in w if g.get(k) != w[k]) if isinstance(w, dict) else "-"
                    pytest.fail(f"{name}: {part}[{i}] differs from the golden record in {fields}")
            pytest.fail(f"{name}: {part} has {len(got[part])} items, the golden record {len(want[part])}")
        pytest.fail(f"{name}: {part} differs from the golden record: {got[part]} != {want[part]}")


@pytest.mark.parametrize("config", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else [])
                                    for c in CONFIGS])
def test_golden_stream(config: Config) -> None:
    _compare(config.name, run_stream(config))


@pytest.mark.parametrize("name", sorted(MULTI))
def test_golden_multi_rank(name: str) -> None:
    _compare(name, MULTI[name]())


def test_digest_is_canonical_over_storage_dtype() -> None:
    ids = torch.tensor([3, 1, 4, 1, 5])
    assert digest(ids.to(torch.int32)) == digest(ids) == digest(torch.tensor([0, 3, 1, 4, 1, 5])[1:])
    assert digest(ids) != digest(ids.view(1, 5)) and digest(ids) != digest(ids.double())
    assert digest(torch.tensor([True, False])) == digest(torch.tensor([1, 0]))


def _dumps(got: dict[str, Any]) -> str:
    """JSON with one line per batch (small files, readable diffs)."""
    def value(v: Any) -> str:
        if not isinstance(v, list):
            return json.dumps(v, sort_keys=True)
        return "[\n" + ",\n".join("  " + value(x) for x in v) + "\n ]"
    return "{\n" + ",\n".join(f" {json.dumps(k)}: {value(got[k])}" for k in sorted(got)) + "\n}\n"


def record(names: list[str]) -> None:
    GOLDEN.mkdir(exist_ok=True)
    runs = {c.name: (lambda c=c: run_stream(c)) for c in CONFIGS} | MULTI
    for name in names or list(runs):
        got = runs[name]()
        (GOLDEN / f"{name}.json").write_text(_dumps(got))
        print(f"recorded {name}")


if __name__ == "__main__":
    if sys.argv[1:2] != ["--record"]:
        sys.exit("usage: python tests/golden/test_golden.py --record [NAME ...]")
    record(sys.argv[2:])
