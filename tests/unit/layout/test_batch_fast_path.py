"""pack_batch lays out plain pre-tokenized Samples without re-checking and copying each one,
and the batch is the one the checked path builds."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import streampack.layout.batch as batch_mod
from streampack.layout.batch import check_invariants, pack_batch
from streampack.sample import Sample


def _packs(dtype: type) -> list[list[Sample]]:
    rng = np.random.default_rng(1)
    return [[Sample(key=f"{p}-{i}", url="/d/s.tar", tokens=rng.integers(0, 30_000, int(rng.integers(1, 900))).astype(dtype))
             for i in range(4)] for p in range(3)]


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16, np.uint32])
@pytest.mark.parametrize("align", [1, 4])
def test_plain_samples_skip_the_checks_and_match_the_checked_layout(monkeypatch, dtype, align):
    packs = _packs(dtype)
    # the same documents as mappings go through normalize + check_doc
    as_maps = [[{"input_ids": d.tokens, "key": d.key} for d in pack] for pack in packs]
    want = pack_batch(as_maps, capacity=4096, align=align)
    calls = []
    real = batch_mod.check_doc
    monkeypatch.setattr(batch_mod, "check_doc", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = pack_batch(packs, capacity=4096, align=align)
    assert not calls, "a plain pre-tokenized Sample was re-checked and copied"
    check_invariants(got, [d.tokens for pack in packs for d in pack])
    for f in dataclasses.fields(got):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), f.name
        elif f.name != "doc_keys":
            assert a == b, f.name
    assert got.doc_keys == tuple(f"/d/s.tar#{d.key}" for pack in packs for d in pack)


def test_samples_that_need_checking_still_get_it():
    bad = Sample(key="f", tokens=np.array([1.5, 2.0]))
    with pytest.raises(ValueError, match="non-integral"):
        pack_batch([[bad]], capacity=8)
    big = Sample(key="u", tokens=np.array([2**63], dtype=np.uint64))
    with pytest.raises(ValueError, match="past int64"):
        pack_batch([[big]], capacity=8)
    masked = Sample(key="m", tokens=np.array([5, 6, 7]), loss_mask=np.array([True, False, True]))
    got = pack_batch([[masked]], capacity=4)
    assert got.labels.tolist() == [-100, 7, -100, -100]
