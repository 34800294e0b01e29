"""``pack_flat`` / ``PackResult``: the flat form of every packing, and its helpers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from streampack.packing import ALGORITHMS, pack, pack_flat


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_flat_result_is_the_same_packing(name: str) -> None:
    lengths = np.random.default_rng(3).integers(1, 500, 700)
    flat = pack_flat(lengths, 512, name, seed=4)
    bins = pack(lengths, 512, name, seed=4)
    assert flat.num_bins == len(bins) and flat.offsets[0] == 0 and flat.offsets[-1] == 700
    assert all(np.array_equal(a, b) for a, b in zip(flat.bins(), bins))
    assert np.all(np.diff(flat.offsets) > 0)  # no empty bin
    assert np.array_equal(flat.loads(lengths), [lengths[b].sum() for b in bins])
    assert flat.loads(lengths).max() <= 512


def test_record_by_hand() -> None:
    result = pack_flat([5, 4, 3, 3, 3], 10, "ffd")
    assert (result.order.tolist(), result.offsets.tolist()) == ([0, 1, 2, 3, 4], [0, 2, 5])
    assert result.sizes().tolist() == [2, 3]
    assert result.loads(np.array([5, 4, 3, 3, 3])).tolist() == [9, 9]
    assert result.bin_sums(np.array([1.0, 2.0, 3.0, 4.0, 5.0])).tolist() == [3.0, 12.0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.order = np.zeros(0)  # type: ignore[misc]
    assert not hasattr(result, "__dict__")


def test_empty_packing() -> None:
    empty = pack_flat([], 8)
    assert (empty.num_bins, empty.order.size, empty.offsets.tolist()) == (0, 0, [0])
    assert empty.bins() == [] and empty.loads(np.zeros(0)).size == 0
