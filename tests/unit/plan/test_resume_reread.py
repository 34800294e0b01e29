"""Restoring a window of carried samples from local shards seeks to them instead of reading
(and decoding) every sample in between."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers_data import write_tar_shards

import streampack.io.tar as tar_io
from streampack import PackedDataset
from streampack.options import PackOptions

pytestmark = pytest.mark.slow  # ~3 s: 60 batches, then a restore


def test_local_restore_reads_few_samples_beyond_the_carried_ones(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    # ~8 KB per sample: the window's leftovers sit tens of samples apart, well under the 1 MiB a
    # remote read-through tolerates, well over what a local seek should read through
    lengths = np.where(rng.random(400) < 0.5, rng.integers(1500, 2000, 400), rng.integers(100, 300, 400))
    docs = [rng.integers(0, 50_000, int(n)).tolist() for n in lengths]
    urls = write_tar_shards(tmp_path, docs, 1)

    def make() -> PackedDataset:
        return PackedDataset(urls, capacity=4096, packing=PackOptions(window=64), epochs=1, seed=0)

    ds = make()
    it = iter(ds)
    for _ in range(60):
        next(it)
    state = ds.state_dict()
    want = next(it)
    decodes = []
    real = tar_io.decode_tar_sample
    monkeypatch.setattr(tar_io, "decode_tar_sample", lambda *a, **k: decodes.append(1) or real(*a, **k))
    fresh = make()
    fresh.load_state_dict(state)
    got = next(iter(fresh))
    assert torch.equal(got.input_ids, want.input_ids)
    # the restore re-reads the window's samples and the first batch reads on; before, the
    # restore read through every sample between two carried ones (the whole prefix here)
    assert len(decodes) < 160  # 103 here; 268 when every gap under 1 MiB was read through
