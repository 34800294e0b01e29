"""Packed losses equal unpacked ones: per-document unpacking, token/sequence means, grad accumulation."""

from __future__ import annotations

import math
import os
import tempfile

import helpers_layouts as layouts
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from streampack import PackedBatch, pack_batch
from streampack.attention import (
    global_num_sequences,
    global_num_targets,
    num_supervised_sequences,
    packed_cross_entropy,
    token_logprobs,
    unpack_padded,
    unpack_per_document,
)

V = 11


def make_docs(seed: int, n: int = 6) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    docs = []
    for i in range(n):
        length = int(torch.randint(1, 9, (1,), generator=g))
        doc = {"input_ids": torch.randint(0, V, (length,), generator=g).tolist()}
        if i % 3 == 1:
            doc["loss_mask"] = (torch.rand(length, generator=g) < 0.6).long().tolist()
        docs.append(doc)
    return docs


def pack_all(docs: list[dict], capacity: int = 24, align: int = 4) -> PackedBatch:
    return layouts.greedy_pack(docs, capacity, align)


def doc_targets(doc: dict) -> torch.Tensor:
    """Unpacked next-token targets of one document (-100 where masked and at its end)."""
    ids = torch.tensor(doc["input_ids"])
    mask = torch.tensor(doc.get("loss_mask", [1] * len(ids))).bool()
    tgt = torch.full_like(ids, -100)
    tgt[:-1] = torch.where(mask[1:], ids[1:], -100)
    return tgt


def logits_for(batch: PackedBatch, seed: int = 0, requires_grad: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch.total_tokens, V, generator=g, dtype=torch.float64,
                       requires_grad=requires_grad)


def test_unpack_per_document_gives_own_lengths() -> None:
    docs = make_docs(0)
    batch = pack_all(docs)
    x = torch.arange(batch.total_tokens)
    parts = unpack_per_document(x, batch)
    assert [len(p) for p in parts] == [len(d["input_ids"]) for d in docs]
    assert [batch.input_ids[p].tolist() for p in parts] == [d["input_ids"] for d in docs]
    logits = logits_for(batch)
    hf_style = unpack_per_document(logits[None], batch)
    assert all(torch.equal(a, b) for a, b in zip(hf_style, unpack_per_document(logits, batch)))
    with pytest.raises(ValueError, match="leading shape"):
        unpack_per_document(logits[:-1], batch)


def test_unpack_padded() -> None:
    docs = make_docs(1)
    batch = pack_all(docs)
    logits = logits_for(batch)
    padded = unpack_padded(logits, batch, padding_value=-7.0)
    lengths = [len(d["input_ids"]) for d in docs]
    assert padded.values.shape == (len(docs), max(lengths), V)
    assert padded.lengths.tolist() == lengths
    for i, part in enumerate(unpack_per_document(logits, batch)):
        assert torch.equal(padded.values[i, :lengths[i]], part)
        assert bool((padded.values[i, lengths[i]:] == -7.0).all())
        assert padded.mask[i].tolist() == [j < lengths[i] for j in range(max(lengths))]


def test_token_logprobs() -> None:
    batch = pack_all(make_docs(2))
    logits = logits_for(batch)
    logits[batch.labels == batch.ignore_index] = float("nan")  # garbage at ignored rows
    lp = token_logprobs(logits, batch.labels, batch.ignore_index)
    keep = batch.labels != batch.ignore_index
    want = torch.log_softmax(logits[keep], -1).gather(-1, batch.labels[keep, None])[:, 0]
    torch.testing.assert_close(lp[keep], want)
    assert bool((lp[~keep] == 0).all()) and torch.isfinite(lp).all()


def test_token_mean_equals_unpacked_and_ignores_nan_padding() -> None:
    docs = make_docs(3)
    batch = pack_all(docs)
    logits = logits_for(batch, requires_grad=True)
    parts = unpack_per_document(logits, batch)
    total = sum(F.cross_entropy(p, doc_targets(d), reduction="sum", ignore_index=-100)
                for p, d in zip(parts, docs))
    n = sum(int((doc_targets(d) != -100).sum()) for d in docs)
    res = packed_cross_entropy(logits, batch, per_token=True)
    assert res.num_targets == n == batch.num_targets and res.denominator == n
    torch.testing.assert_close(res.loss, total / n)
    assert res.per_token.shape == (batch.total_tokens,)
    torch.testing.assert_close(res.per_token.sum(), res.loss_sum)
    # finite garbage at ignored rows gets an exact zero gradient on the common path
    (grad,) = torch.autograd.grad(res.loss, logits)
    ignored = batch.labels == batch.ignore_index
    assert bool((grad[ignored] == 0).all()) and bool((grad[~ignored] != 0).any())
    # NaN at ignored rows (uninitialised kernel output): mask_ignored keeps it out of the
    # value and the gradient of the poisoned tensor itself
    poisoned = torch.where(ignored[:, None], torch.full_like(logits, float("nan")),
                           logits).detach().requires_grad_()
    res = packed_cross_entropy(poisoned, batch, mask_ignored=True)
    torch.testing.assert_close(res.loss, (total / n).detach())
    (grad,) = torch.autograd.grad(res.loss, poisoned)
    assert torch.isfinite(grad).all(), "NaN at padding rows reached the gradient"
    assert packed_cross_entropy(poisoned, batch).per_token is None  # only on request


def test_sequence_mean() -> None:
    docs = make_docs(4, n=9)
    batch = pack_all(docs)
    logits = logits_for(batch)
    res = packed_cross_entropy(logits, batch, reduction="sequence")
    means = []
    for p, d in zip(unpack_per_document(logits, batch), docs):
        t = doc_targets(d)
        if bool((t != -100).any()):
            means.append(F.cross_entropy(p, t, ignore_index=-100))
    assert res.num_sequences == len(means) == num_supervised_sequences(batch)
    torch.testing.assert_close(res.loss, torch.stack(means).mean())


def test_fully_masked_batch_reports_no_targets() -> None:
    docs = [{"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}, {"input_ids": [4]}]
    batch = pack_batch([docs], capacity=8, align=2)
    assert batch.num_targets == 0
    logits = logits_for(batch, requires_grad=True)
    for reduction in ("token", "sequence"):
        res = packed_cross_entropy(logits, batch, reduction=reduction)
        assert res.loss is None and res.num_targets == 0 and not res.has_targets
    # inside a step that does have targets elsewhere, it contributes an exact, connected 0
    res = packed_cross_entropy(logits, batch, num_targets=5)
    assert res.loss is not None and float(res.loss.detach()) == 0.0
    res.loss.backward()
    assert bool((logits.grad == 0).all())


def test_two_micro_batches_equal_unpacked_token_mean() -> None:
    docs = make_docs(5, n=10)
    micro = [pack_all(docs[:3]), pack_all(docs[3:])]  # deliberately unequal target counts
    weight = torch.randn(V, V, dtype=torch.float64, generator=torch.Generator().manual_seed(9),
                         requires_grad=True)
    n = global_num_targets(micro)
    assert n == sum(b.num_targets for b in micro) == global_num_targets([b.num_targets for b in micro])
    step = 0.0
    for b in micro:
        feats = F.one_hot(b.input_ids.long(), V).double()
        step = step + packed_cross_entropy(feats @ weight, b, num_targets=n).loss
    (g_packed,) = torch.autograd.grad(step, weight)
    # unpacked: every document alone, one token mean over all of them
    total = 0.0
    for d in docs:
        feats = F.one_hot(torch.tensor(d["input_ids"]), V).double()
        total = total + F.cross_entropy(feats @ weight, doc_targets(d), reduction="sum")
    ref = total / sum(int((doc_targets(d) != -100).sum()) for d in docs)
    (g_ref,) = torch.autograd.grad(ref, weight)
    torch.testing.assert_close(step, ref)
    torch.testing.assert_close(g_packed, g_ref)
    # the naive alternative (mean of micro-batch means) is measurably different here
    naive = sum(packed_cross_entropy(F.one_hot(b.input_ids.long(), V).double() @ weight, b).loss
                for b in micro) / 2
    assert not math.isclose(float(naive.detach()), float(ref.detach()), rel_tol=1e-3)
    assert global_num_sequences(micro) == sum(num_supervised_sequences(b) for b in micro)


def test_bad_arguments() -> None:
    batch = pack_all(make_docs(6))
    logits = logits_for(batch)
    with pytest.raises(ValueError, match="reduction"):
        packed_cross_entropy(logits, batch, reduction="mean")
    with pytest.raises(ValueError, match="num_sequences"):
        packed_cross_entropy(logits, batch, num_sequences=3)
    with pytest.raises(ValueError, match="num_targets"):
        packed_cross_entropy(logits, batch, num_targets=3, reduction="sequence")


def _dist_worker(rank: int, world: int, init_file: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        batches = [pack_all(make_docs(10 + rank, n=3 + rank))]
        results[rank] = (global_num_targets(batches), batches[0].num_targets)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # a subprocess / spawned processes: the integration set
def test_global_num_targets_all_reduces_over_ranks() -> None:
    world = 2
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_dist_worker, args=(world, os.path.join(tmp, "init"), results), nprocs=world)
        got = dict(results)
    local_sum = sum(local for _, local in got.values())
    assert [glob for glob, _ in got.values()] == [local_sum] * world
