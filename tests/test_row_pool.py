"""The pool of batch row buffers (``streampack.layout.row_pool``): a buffer is reused only after
every tensor viewing it is gone, so a fresh process stops faulting in a new buffer per batch."""

from __future__ import annotations

import gc

import numpy as np
import torch

from streampack.layout import row_pool
from streampack.layout.slices import pack_slices

CAPACITY = 64


def _batch(seed: int):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1000, 4 * CAPACITY).astype(np.int32)
    lengths = [20, 30, 10, 40, 24]  # packs of [20, 30, 10] and [40, 24]
    starts = np.cumsum([0] + lengths[:-1]).tolist()
    keys = tuple(f"s#{i}" for i in range(len(lengths)))
    batch = pack_slices([ids] * len(lengths), starts, lengths, [3, 2], keys, capacity=CAPACITY, ids_nonnegative=True)
    return batch, ids


def test_a_freed_batch_buffer_is_handed_out_again() -> None:
    total = 2 * CAPACITY
    first, _ = _batch(0)
    address = first.input_ids.data_ptr()
    del first
    gc.collect()
    assert row_pool.free_count(total) >= 1
    second, ids = _batch(1)
    assert second.input_ids.data_ptr() == address
    assert second.input_ids[:60].tolist() == ids[:60].tolist()  # laid out afresh, nothing stale


def test_a_buffer_stays_out_of_the_pool_while_any_view_of_it_lives() -> None:
    first, first_ids = _batch(2)
    held = first.labels[5:9]  # a view of the middle row keeps the whole buffer
    want = held.tolist()
    start, end = first.input_ids.data_ptr(), first.position_ids.data_ptr() + first.position_ids.numel() * 8
    del first
    gc.collect()
    others = [_batch(seed)[0] for seed in range(3, 9)]
    for other in others:
        assert not start <= other.input_ids.data_ptr() < end
    assert held.tolist() == want == first_ids[6:10].tolist()


def test_free_buffers_are_bounded_per_size() -> None:
    total = 1 << 20  # 24 MiB a buffer: only the minimum of two is kept
    made = [row_pool.rows(total) for _ in range(4)]
    del made
    gc.collect()
    assert row_pool.free_count(total) == 2
    assert row_pool.rows(total).shape == (3, total) and row_pool.rows(total).dtype == torch.int64
