"""The compact PackedBatch (int32 ids stored; labels and positions derived) against the full batch the loader wrote
before it: one ``[3, T]`` int64 buffer of ids, shifted labels and positions, filled document by document.

:func:`full_layout` is that layout, written from its contract (``docs/batch.md``) and independent of the library's
placement code: documents back to back from each pack's start, each padded to a multiple of ``align``, the pack's
trailing padding joined to its last span. Every batch of a matrix of streams is compared with it field by field:
hand-made documents (plain, uint16, loss masks, explicit labels, a mix, extras, ids equal to ``ignore_index``,
``align`` 8) and the documents the collate node received in the golden streams (text, pre-tokenized blocks through
``pack_slices``, loss masks with CP alignment, stages, media with images), plus the adapters and the CP shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from streampack import pack_batch
from streampack.integrations.megatron import megatron_batch
from streampack.integrations.torchtitan import titan_collate
from streampack.layout.batch import PackedBatch, check_invariants
from streampack.layout.cp import cp_shard
from streampack.layout.slices import pack_slices
from streampack.sample import Sample

HF_IGNORE = -100


def _doc(d: Any) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, dict[str, np.ndarray]]:
    if isinstance(d, Sample):
        return np.asarray(d.tokens), d.labels, d.loss_mask, dict(d.extras)
    if isinstance(d, dict):
        d = dict(d)
        tokens = np.asarray(d.pop("input_ids"))
        d.pop("key", None)
        labels, mask = d.pop("labels", None), d.pop("loss_mask", None)
        return tokens, None if labels is None else np.asarray(labels), None if mask is None else np.asarray(mask), \
            {k: np.asarray(v) for k, v in d.items()}
    return np.asarray(d), None, None, {}


def full_layout(packs: Sequence[Sequence[Any]], *, capacity: int, align: int, pad_id: int,
                ignore_index: int) -> dict[str, Any]:
    """The full int64 batch of ``packs``, written per document as the loader did before the compact batch."""
    total = len(packs) * capacity
    rows = np.empty((3, total), dtype=np.int64)
    ids, labels, positions = rows
    ids.fill(pad_id)
    labels.fill(ignore_index)
    extras: dict[str, np.ndarray] = {}
    for p, pack in enumerate(packs):
        at = p * capacity
        for i, d in enumerate(pack):
            tokens, own, mask, extra = _doc(d)
            n = len(tokens)
            span = (p + 1) * capacity - at if i == len(pack) - 1 else -(-n // align) * align
            target = tokens.astype(np.int64) if own is None else np.where(own == HF_IGNORE, ignore_index, own)
            if mask is not None:
                target = np.where(mask.astype(bool), target, ignore_index)
            ids[at:at + n] = tokens
            labels[at:at + n - 1] = target[1:]
            positions[at:at + span] = np.arange(span)
            for name, value in extra.items():
                out = extras.setdefault(name, np.zeros((total, *value.shape[1:]), dtype=value.dtype))
                out[at:at + n] = value
            at += span
    kept = labels != ignore_index
    starts = np.flatnonzero(positions == 0)
    return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(positions), "num_targets": int(kept.sum()),
            "num_target_docs": int(np.count_nonzero(np.add.reduceat(kept, starts))), "extras": extras}


def assert_equivalent(batch: PackedBatch, want: dict[str, Any]) -> None:
    """Every field a consumer reads equals the full batch's; dtypes are the contract's."""
    assert batch.input_ids.dtype == torch.int32 and torch.equal(batch.input_ids.long(), want["input_ids"])
    for name in ("labels", "position_ids"):
        got = getattr(batch, name)
        assert got.dtype == torch.int64 and torch.equal(got, want[name]), name
    assert (batch.num_targets, batch.num_target_docs) == (want["num_targets"], want["num_target_docs"])
    assert batch.extras.keys() == want["extras"].keys()
    for name, value in want["extras"].items():
        assert torch.equal(batch.extras[name], torch.from_numpy(value)), name
    stored = [t for t in (batch.loss_mask, batch.target_ids) if t is not None]
    assert len(stored) <= 1 and all(t.shape == (batch.total_tokens,) for t in stored)
    check_invariants(batch)
    # the adapters that hand ids and targets on keep int64, equal to the full batch's
    ids = want["input_ids"]
    hf = batch.hf_inputs()
    assert hf.input_ids.dtype == torch.int64 and torch.equal(hf.input_ids[0], ids)
    shifted = torch.cat([torch.tensor([HF_IGNORE]), want["labels"][:-1]])
    assert torch.equal(hf.labels[0], torch.where(shifted == batch.ignore_index, HF_IGNORE, shifted))
    mb = megatron_batch(batch)
    keep = want["labels"] != batch.ignore_index
    assert mb.tokens.dtype == torch.int64 and torch.equal(mb.tokens[0], ids)
    assert torch.equal(mb.labels[0], torch.where(keep, want["labels"], 0))
    assert torch.equal(mb.position_ids[0], want["position_ids"])
    inputs, titan_labels = titan_collate(batch)
    assert inputs["input"].dtype == torch.int64 and torch.equal(inputs["input"][0], ids)
    assert torch.equal(titan_labels[0], torch.where(keep, want["labels"], HF_IGNORE))
    if batch.align % 4 == 0:  # CP over 2 ranks needs spans of 2 * 2
        for rank in range(2):
            shard = cp_shard(batch, 2, rank)
            for name in ("input_ids", "labels", "position_ids"):
                part = getattr(shard, name)
                assert part.dtype == torch.int64 and torch.equal(part, want[name][shard.indices]), name


def _rng_docs(seed: int, n: int, *, dtype: Any = np.int64, vocab: int = 1000, low: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(low, vocab, int(rng.integers(1, 30))).astype(dtype) for _ in range(n)]


def _packs(docs: list[Any], capacity: int, align: int) -> list[list[Any]]:
    packs, room = [[]], capacity
    for d in docs:
        span = -(-len(_doc(d)[0]) // align) * align
        if span > room:
            packs.append([])
            room = capacity
        packs[-1].append(d)
        room -= span
    return packs


def _masked(seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": t, "loss_mask": rng.random(len(t)) < 0.6} for t in _rng_docs(seed, 12)]


def _labelled(seed: int, with_mask: bool) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out = []
    for t in _rng_docs(seed, 12):
        labels = np.where(rng.random(len(t)) < 0.3, HF_IGNORE, rng.integers(0, 1000, len(t)))
        doc = {"input_ids": t, "labels": labels}
        if with_mask:
            doc["loss_mask"] = rng.random(len(t)) < 0.7
        out.append(doc)
    return out


def _mixed(seed: int) -> list[Any]:
    """Plain documents, masked ones and labelled ones in one batch."""
    plain, masked, labelled = _rng_docs(seed, 4), _masked(seed + 1)[:4], _labelled(seed + 2, False)[:4]
    return [d for trio in zip(plain, masked, labelled) for d in trio]


def _extras(seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": t, "pos3d": rng.standard_normal((len(t), 3)).astype(np.float32),
             "kind": rng.integers(0, 4, len(t))} for t in _rng_docs(seed, 10)]


CASES = {  # name -> (documents, capacity, align, pad_id, ignore_index)
    "plain": (lambda: _rng_docs(1, 16), 48, 1, 0, -100),
    "plain_align8": (lambda: _rng_docs(2, 16), 64, 8, 0, -100),
    "uint16": (lambda: _rng_docs(3, 16, dtype=np.uint16, vocab=65536), 48, 1, 0, -100),
    "lists": (lambda: [t.tolist() for t in _rng_docs(4, 12)], 40, 2, 3, -100),
    "samples": (lambda: [Sample(key=str(i), tokens=t) for i, t in enumerate(_rng_docs(5, 14))], 48, 4, 0, -100),
    "loss_mask_cp": (lambda: _masked(6), 48, 4, 7, -100),
    "labels": (lambda: _labelled(7, False), 48, 1, 0, -100),
    "labels_and_mask": (lambda: _labelled(8, True), 64, 8, 0, -1),
    "mixed": (lambda: _mixed(9), 64, 4, 0, -100),
    "extras": (lambda: _extras(10), 48, 2, 0, -100),
    # ids equal to ignore_index (0 is a token and the ignore value), padding with it too
    "ids_equal_ignore": (lambda: _rng_docs(11, 16, vocab=3), 40, 2, 0, 0),
    "negative_ids": (lambda: _rng_docs(12, 16, low=-5, vocab=5), 40, 1, 1, -3),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_compact_batch_equals_the_full_one(name: str) -> None:
    make, capacity, align, pad_id, ignore_index = CASES[name]
    packs = _packs(make(), capacity, align)
    batch = pack_batch(packs, capacity=capacity, align=align, pad_id=pad_id, ignore_index=ignore_index)
    assert_equivalent(batch, full_layout(packs, capacity=capacity, align=align, pad_id=pad_id,
                                         ignore_index=ignore_index))


@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("nonnegative", [True, False])
def test_block_slices_equal_the_full_batch(align: int, nonnegative: bool) -> None:
    """Documents as slices of the buffers a block reader filled (uint16, int32 and int64 blocks)."""
    rng = np.random.default_rng(align)
    blocks = [rng.integers(0, 60_000, 200).astype(dt) for dt in (np.uint16, np.int32, np.int64)]
    docs = [(blocks[i % 3], int(rng.integers(0, 150)), int(rng.integers(1, 40))) for i in range(20)]
    capacity = 64
    packs = _packs([src[a:a + n] for src, a, n in docs], capacity, align)
    sizes = [len(p) for p in packs]
    batch = pack_slices([src for src, _, _ in docs], np.array([a for _, a, _ in docs]),
                        np.array([n for _, _, n in docs]), sizes, tuple(map(str, range(len(docs)))),
                        capacity=capacity, align=align, ids_nonnegative=nonnegative)
    assert_equivalent(batch, full_layout(packs, capacity=capacity, align=align, pad_id=0, ignore_index=-100))


def test_derived_fields_follow_the_batch_to_its_device() -> None:
    packs = _packs(_masked(20), 48, 4)
    batch = pack_batch(packs, capacity=48, align=4)
    want = full_layout(packs, capacity=48, align=4, pad_id=0, ignore_index=-100)
    assert batch.labels is batch.labels  # cached
    devices = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        moved = batch.to(device)
        assert moved.input_ids.dtype == torch.int32 and moved.loss_mask.dtype == torch.bool
        assert moved.labels.device.type == device and moved.position_ids.device.type == device
        if device != "meta":
            assert torch.equal(moved.labels.cpu(), want["labels"])
            assert torch.equal(moved.position_ids.cpu(), want["position_ids"])


def test_ids_past_int32_are_refused() -> None:
    with pytest.raises(ValueError, match="does not fit int32"):
        pack_batch([[np.array([1, 2**31], dtype=np.int64)]], capacity=4)
    with pytest.raises(ValueError, match="does not fit int32"):
        pack_batch([[Sample(key="u", tokens=np.array([2**32 - 1], dtype=np.uint32))]], capacity=4)
    with pytest.raises(ValueError, match="does not fit int32"):
        pack_batch([[{"input_ids": [1, 2], "labels": [2**31, 1]}]], capacity=4)
    with pytest.raises(ValueError, match="pad_id"):
        pack_batch([[[1, 2]]], capacity=4, pad_id=2**31)
    src = np.array([5, 2**33], dtype=np.int64)
    with pytest.raises(ValueError, match="does not fit int32"):
        pack_slices([src], np.array([0]), np.array([2]), [1], ("k",), capacity=4)


# ----------------------------------------------------------------------------- the golden streams' documents
STREAMS = ["tar_tokens", "jsonl_text", "parquet_tokens", "labels_cp_aligned", "stages", "media"]


@pytest.mark.parametrize("stream", STREAMS)
def test_pipeline_batches_equal_the_full_layout_of_what_the_collate_received(stream: str, monkeypatch) -> None:
    from golden.test_golden import CONFIGS, _fix_mtimes, _take, workdir

    import streampack.nodes.collate as collate

    seen: list[tuple[PackedBatch, dict[str, Any]]] = []
    real_batch, real_slices = collate.pack_batch, collate.pack_slices

    def recording_batch(packs: Any, **kw: Any) -> PackedBatch:
        batch = real_batch(packs, **kw)
        seen.append((batch, full_layout(packs, capacity=kw["capacity"], align=kw["align"], pad_id=kw["pad_id"],
                                        ignore_index=kw["ignore_index"])))
        return batch

    def recording_slices(sources: Any, starts: Any, lengths: Any, sizes: Any, keys: Any, **kw: Any) -> PackedBatch:
        batch = real_slices(sources, starts, lengths, sizes, keys, **kw)
        docs = iter([s[a:a + n] for s, a, n in zip(sources, starts, lengths)])
        packs = [[next(docs) for _ in range(k)] for k in sizes]
        seen.append((batch, full_layout(packs, capacity=kw["capacity"], align=kw["align"], pad_id=kw["pad_id"],
                                        ignore_index=kw["ignore_index"])))
        return batch

    monkeypatch.setattr(collate, "pack_batch", recording_batch)
    monkeypatch.setattr(collate, "pack_slices", recording_slices)
    config = next(c for c in CONFIGS if c.name == stream)
    with workdir() as root:
        make = config.build()
        _fix_mtimes(root)
        got = _take(make(), config.batches)
    assert got and len(seen) == len(got)
    for (batch, want), out in zip(seen, got):
        assert out.input_ids is batch.input_ids
        assert_equivalent(out, want)
    if stream == "media":
        assert any(b.vision is not None and b.vision.num_images for b, _ in seen), "no batch had an image"
    if stream == "labels_cp_aligned":
        assert all(b.loss_mask is not None and b.align == 4 for b, _ in seen)


def test_the_streams_take_both_layout_paths(monkeypatch) -> None:
    """Guard against a vacuous matrix: the golden streams above reach ``pack_slices`` and ``pack_batch``."""
    from golden.test_golden import CONFIGS, _fix_mtimes, _take, workdir

    import streampack.nodes.collate as collate

    used: set[str] = set()
    for name in ("pack_batch", "pack_slices"):
        real = getattr(collate, name)
        monkeypatch.setattr(collate, name, lambda *a, _real=real, _name=name, **kw: used.add(_name) or _real(*a, **kw))
    for stream in ("tar_tokens", "jsonl_text"):
        config = next(c for c in CONFIGS if c.name == stream)
        with workdir() as root:
            make = config.build()
            _fix_mtimes(root)
            _take(make(), 2)
    assert used == {"pack_batch", "pack_slices"}
