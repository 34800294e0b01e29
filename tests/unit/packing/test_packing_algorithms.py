"""Property tests swept over every registered packing algorithm."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streampack.packing import ALGORITHMS, get_algorithm, pack

NAMES = sorted(ALGORITHMS)
# 2^k - 1, 2^k + 1, 8192·m + 1, 1, and a capacity far beyond any dense table
CAPACITIES = st.one_of(
    st.integers(1, 14).map(lambda k: 2**k - 1).filter(lambda c: c >= 1),
    st.integers(0, 14).map(lambda k: 2**k + 1),
    st.integers(1, 64).map(lambda m: 8192 * m + 1),
    st.sampled_from([1, 2, 3, 4096, 2**31 + 1]),
)


@st.composite
def problems(draw: st.DrawFn, max_n: int = 60) -> tuple[np.ndarray, int]:
    capacity = draw(CAPACITIES)
    n = draw(st.integers(0, max_n))
    style = draw(st.sampled_from(["any", "small", "large", "full"]))
    high = {"any": capacity, "small": max(1, capacity // 6), "large": capacity, "full": capacity}
    low = {"any": 1, "small": 1, "large": capacity // 2 + 1, "full": capacity}
    lengths = draw(st.lists(st.integers(low[style], high[style]), min_size=n, max_size=n))
    return np.asarray(lengths, dtype=np.int64), capacity


def check_packing(bins: list[np.ndarray], lengths: np.ndarray, capacity: int) -> None:
    assert all(b.dtype == np.int64 and b.ndim == 1 for b in bins)
    assert all(b.size > 0 for b in bins), "empty bin"
    every = np.concatenate(bins) if bins else np.zeros(0, dtype=np.int64)
    assert np.array_equal(np.sort(every), np.arange(lengths.size)), "not a partition"
    loads = [int(lengths[b].sum()) for b in bins]
    assert max(loads, default=0) <= capacity, f"overfull bin {max(loads)} > {capacity}"
    if bins:
        assert len(bins) >= -(-int(lengths.sum()) // capacity)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems(), seed=st.integers(0, 2**32 - 1))
def test_valid_and_deterministic(name: str, problem: tuple[np.ndarray, int], seed: int) -> None:
    lengths, capacity = problem
    bins = pack(lengths, capacity, name, seed=seed)
    check_packing(bins, lengths, capacity)
    again = pack(lengths.tolist(), capacity, name, seed=seed)
    assert len(again) == len(bins) and all(np.array_equal(a, b) for a, b in zip(again, bins))
    direct = ALGORITHMS[name](lengths, capacity, seed=seed)
    assert all(np.array_equal(a, b) for a, b in zip(direct, bins))


@pytest.mark.parametrize("name", NAMES)
def test_edge_sizes(name: str) -> None:
    assert pack([], 8, name) == []
    assert pack(np.zeros(0, dtype=np.int32), 8, name) == []
    for capacity in (1, 7, 2**31 + 1):
        assert [b.tolist() for b in pack([capacity], capacity, name)] == [[0]]
    bins = pack([3] * 5, 3, name)  # every item equals the capacity
    assert sorted(b.tolist() for b in bins) == [[0], [1], [2], [3], [4]]
    bins = pack(np.ones(10, dtype=np.uint8), 1, name)
    assert len(bins) == 10


@pytest.mark.parametrize("name", NAMES)
def test_rejects_bad_lengths(name: str) -> None:
    with pytest.raises(ValueError, match=r"item 2 has length 9 .*capacity=8"):
        pack([1, 8, 9, 3], 8, name)
    with pytest.raises(ValueError, match=r"item 2 has length 9"):
        ALGORITHMS[name]([1, 8, 9, 3], 8)  # direct calls validate too
    with pytest.raises(ValueError, match=r"lengths\[1\]=0"):
        pack([4, 0, 2], 8, name)
    with pytest.raises(ValueError, match=r"lengths\[0\]=-3"):
        pack([-3, 2], 8, name)
    with pytest.raises(ValueError, match="1-D"):
        pack([[1, 2]], 8, name)
    with pytest.raises(TypeError, match="integers"):
        pack([1.5, 2.0], 8, name)
    with pytest.raises(ValueError, match="capacity=0"):
        pack([1], 0, name)
    with pytest.raises(TypeError, match="capacity"):
        pack([1], 8.0, name)  # type: ignore[arg-type]


def test_unknown_algorithm_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="valid names: bfd, ffd"):
        pack([1, 2], 8, "best_fit")
    with pytest.raises(ValueError, match="'nope'"):
        get_algorithm("nope")
    assert get_algorithm("bfd") is ALGORITHMS["bfd"]


def test_worked_examples() -> None:
    lengths = [5, 4, 3, 3, 3]
    assert [b.tolist() for b in pack(lengths, 10, "ffd")] == [[0, 1], [2, 3, 4]]
    assert [b.tolist() for b in pack(lengths, 10, "bfd")] == [[0, 1], [2, 3, 4]]
    assert [b.tolist() for b in pack(lengths, 10, "greedy")] == [[0, 1], [2, 3, 4]]
    assert [b.tolist() for b in pack([6, 5, 5, 4], 10, "greedy")] == [[0], [1, 2], [3]]
    # best fit picks the fullest bin that holds the item, first fit the leftmost
    assert [b.tolist() for b in pack([7, 6, 3], 10, "ffd")] == [[0, 2], [1]]
    assert [b.tolist() for b in pack([6, 5, 4, 3, 1], 10, "bfd")] == [[0, 2], [1, 3, 4]]
    assert [b.tolist() for b in pack([6, 5, 4, 3, 1], 10, "ffd")] == [[0, 2], [1, 3, 4]]
    assert [b.tolist() for b in pack([7, 5, 3, 2], 10, "bfd")] == [[0, 2], [1, 3]]


def test_mffd_pairs_small_items_into_large_bins() -> None:
    # C = 60: large 40, 35 (> 30); medium none; small 11, 12, 13 (> 10); tiny 2.
    # Backward pass: bin of 35 (room 25) takes smallest 11 then largest fitting (13);
    # bin of 40 (room 20) cannot take the two smallest left (12 + nothing) -> first fit.
    lengths = [40, 35, 11, 12, 13, 2]
    bins = [b.tolist() for b in pack(lengths, 60, "mffd")]
    assert bins == [[0, 3, 5], [1, 2, 4]]


def test_seed_changes_shuffled_packers_only() -> None:
    lengths = np.random.default_rng(1).integers(1, 100, 300)
    for name in NAMES:
        a, b = pack(lengths, 128, name, seed=0), pack(lengths, 128, name, seed=1)
        same = len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
        assert same == (name not in ("ffs", "shuffle_pack")), name


@pytest.mark.parametrize("name", NAMES)
def test_int64_limits(name: str) -> None:
    # kernels count in int64: refuse what would overflow instead of packing it wrongly
    with pytest.raises(ValueError, match=r"capacity=4611686018427387905 must be in 1..2\*\*62"):
        pack([1], 2**62 + 1, name)
    with pytest.raises(ValueError, match=r"sum to at most 2\*\*62"):
        pack([2**61, 2**61, 2], 2**62, name)
    lengths = np.array([2**61, 2**61 - 4, 3], dtype=np.int64)  # sums to 2**62 - 1: allowed
    for backend in ("python", "numba"):
        check_packing(pack(lengths, 2**62, name, backend=backend), lengths, 2**62)
