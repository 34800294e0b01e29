"""Packing metrics against hand-computed values."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from streampack.packing import MetricsAccumulator, PackingMetrics, packing_metrics


def test_single_batch_by_hand() -> None:
    lengths = np.array([5, 4, 3, 3, 3, 2])
    bins = [np.array([0, 1]), np.array([2, 3, 4]), np.array([5])]  # loads 9, 9, 2
    m = packing_metrics(lengths, bins, 10)
    assert (m.num_bins, m.num_documents, m.num_tokens, m.capacity) == (3, 6, 20, 10)
    assert m.fill == pytest.approx(20 / 30)
    assert m.waste == pytest.approx(10 / 30)
    mean = 20 / 3
    std = math.sqrt(((9 - mean) ** 2 * 2 + (2 - mean) ** 2) / 3)
    assert m.balance_cv == pytest.approx(std / mean)
    assert m.efficiency == pytest.approx(2 / 3)  # ceil(20 / 10) = 2 bins would do
    assert m.docs_per_bin == pytest.approx(2.0)


def test_record_is_frozen_and_slotted() -> None:
    m = packing_metrics([1], [np.array([0])], 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.fill = 1.0  # type: ignore[misc]
    assert not hasattr(m, "__dict__")
    assert isinstance(m, PackingMetrics)


def test_empty_is_well_defined() -> None:
    m = packing_metrics([], [], 8)
    assert (m.num_bins, m.num_tokens, m.capacity, m.fill, m.waste) == (0, 0, 8, 0.0, 0.0)
    assert (m.balance_cv, m.efficiency, m.docs_per_bin) == (0.0, 0.0, 0.0)
    assert MetricsAccumulator().result().num_bins == 0


def test_accumulator_matches_one_batch() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 64, 500)
    bins = [np.arange(i, min(i + 7, 500)) for i in range(0, 500, 7)]
    whole = packing_metrics(lengths, bins, 64 * 7)
    acc = MetricsAccumulator()
    for start in range(0, len(bins), 10):  # the same packs, streamed in chunks
        acc.update_bins(lengths, bins[start:start + 10], 64 * 7)
    streamed = acc.result()
    for field in dataclasses.fields(PackingMetrics):
        assert getattr(streamed, field.name) == pytest.approx(getattr(whole, field.name)), field.name


def test_accumulator_update_by_loads() -> None:
    acc = MetricsAccumulator()
    acc.update(np.array([8, 4]), np.array([2, 1]), 8)
    acc.update(np.array([6]), 3, 8)  # documents may be given as a total
    m = acc.result()
    assert (m.num_bins, m.num_documents, m.num_tokens) == (3, 6, 18)
    assert m.fill == pytest.approx(18 / 24)
    assert m.efficiency == pytest.approx(3 / 3)
    with pytest.raises(ValueError, match="capacity=16 differs"):
        acc.update(np.array([1]), 1, 16)
    with pytest.raises(ValueError, match="bin_loads"):
        acc.update(np.array([9]), 1, 8)
