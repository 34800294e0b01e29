"""``pack`` returns ``Bins`` (per-bin views made on access): the same packing as
``pack_flat``, readable like the list it replaced; and ``auto`` keeps using kernels a process
has loaded, at every size, with the same bins."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streampack.packing as packing
from streampack.packing import ALGORITHMS, Bins, _engine, aot, pack, pack_flat
from tests.unit.packing.test_packing_algorithms import check_packing, problems
from tests.unit.packing.test_packing_backends import spy_on_compiles

NAMES = sorted(ALGORITHMS)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems(max_n=80), seed=st.integers(0, 2**32 - 1))
def test_pack_equals_pack_flat(name: str, problem: tuple[np.ndarray, int], seed: int) -> None:
    lengths, capacity = problem
    flat = pack_flat(lengths, capacity, name, seed)
    bins = pack(lengths, capacity, name, seed)
    assert isinstance(bins, Bins) and len(bins) == flat.num_bins
    expected = [flat.order[flat.offsets[b]:flat.offsets[b + 1]] for b in range(flat.num_bins)]
    assert bins == expected and list(bins) == bins
    assert all(np.array_equal(bins[b], expected[b]) for b in range(len(bins)))
    check_packing(bins, lengths, capacity)


def test_bins_read_like_a_list() -> None:
    bins = pack([5, 4, 3, 3, 3], 10, "ffd")
    assert len(bins) == 2 and bool(bins) and [b.tolist() for b in bins] == [[0, 1], [2, 3, 4]]
    assert bins[-1].tolist() == [2, 3, 4] and bins[np.int64(0)].tolist() == [0, 1]
    assert [b.tolist() for b in bins[::-1]] == [[2, 3, 4], [0, 1]] and bins[5:] == []
    assert bins == [np.array([0, 1]), np.array([2, 3, 4])]
    assert [np.array([0, 1]), np.array([2, 3, 4])] == bins  # list == Bins works both ways
    assert bins != [np.array([0, 1])] and bins != [np.array([0, 1]), np.array([2, 3])]
    assert np.concatenate(bins).tolist() == [0, 1, 2, 3, 4]
    assert bins.result.offsets.tolist() == [0, 2, 5] and "Bins([array([0, 1])" in repr(bins)
    with pytest.raises(IndexError, match="bin index 2 out of range for 2 bins"):
        bins[2]
    with pytest.raises(TypeError):
        hash(bins)
    with pytest.raises(TypeError):
        bins[0] = np.array([1])  # type: ignore[index]
    empty = pack([], 4)
    assert empty == [] and not empty and list(empty) == [] and len(empty) == 0


def test_auto_uses_loaded_kernels_below_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a process has loaded an algorithm's kernels, ``auto`` runs them at every size
    (the one-time cost the threshold guards is paid): no cliff below ``THRESHOLD``."""
    compiled_kernels = spy_on_compiles(monkeypatch)
    monkeypatch.setattr(_engine, "_LOADED", set())
    monkeypatch.setitem(aot._STATE, "module", None)  # no ahead-of-time build either
    lengths = np.random.default_rng(1).integers(1, 300, 500)
    for name in NAMES:
        plain = pack_flat(lengths, 512, name)  # a fresh process: the plain path
        assert compiled_kernels == [], name
        forced = pack_flat(lengths, 512, name, backend="numba")
        compiled_kernels.clear()
        again = pack_flat(lengths, 512, name)
        assert bool(compiled_kernels) == ALGORITHMS[name].compiles, name
        assert pack_flat(lengths, 512, name, backend="python").order.size == 500
        for other in (forced, again):
            assert np.array_equal(plain.order, other.order), name
            assert np.array_equal(plain.offsets, other.offsets), name
        compiled_kernels.clear()


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.slow  # timing: best of 5, interleaved, with 2x slack for a shared machine
@pytest.mark.parametrize("name", NAMES)
def test_no_cliff_below_the_threshold(name: str) -> None:
    """Before: in a warm process ffd took 86–96 ms at 65535 items and 6 ms at 1e5."""
    rng = np.random.default_rng(0)
    small, large = (np.clip(np.round(rng.lognormal(5.9, 1.0, n)), 1, 4096).astype(np.int64)
                    for n in (packing.THRESHOLD - 1, 100_000))
    pack_flat(large, 4096, name)  # loads the kernels, as any earlier large call would
    pack_flat(small, 4096, name)
    times = {"small": float("inf"), "large": float("inf")}
    for _ in range(5):
        times["small"] = min(times["small"], _best(lambda: pack_flat(small, 4096, name), 1))
        times["large"] = min(times["large"], _best(lambda: pack_flat(large, 4096, name), 1))
    assert times["small"] <= 2 * times["large"], times


AOT_CHECK = """
import json, sys
import numpy as np
import streampack.packing as packing
from streampack.packing import aot
rng = np.random.default_rng(2)
lengths = np.clip(np.round(rng.lognormal(5.9, 1.0, 3000)), 1, 4096).astype(np.int64)
same = all(np.array_equal(packing.pack_flat(lengths, 4096, name).order,
                          packing.pack_flat(lengths, 4096, name, backend="python").order)
           for name in packing.ALGORITHMS)
print(json.dumps({"built": aot.loaded() is not None, "same": same,
                  "numba": sorted(m for m in sys.modules if m.split(".")[0] == "numba")}))
"""


@pytest.mark.slow  # builds the extension module: ~40-60 s with numba's pycc and a C compiler
def test_ahead_of_time_build_runs_without_numba(tmp_path: Path) -> None:
    from tests.unit.packing.test_packing_backends import ROOT, run_fresh

    env = {"STREAMPACK_CACHE": str(tmp_path)}
    assert run_fresh(AOT_CHECK, **env)["built"] is False  # nothing built: the old paths
    subprocess.run([sys.executable, "-m", "streampack.packing.aot"], check=True, timeout=600,
                   env={**os.environ, **env, "PYTHONPATH": str(ROOT)})
    result = run_fresh(AOT_CHECK, **env)
    assert result == {"built": True, "same": True, "numba": []}


def test_a_broken_build_falls_back_to_the_jit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.machinery

    monkeypatch.setenv("STREAMPACK_CACHE", str(tmp_path))
    monkeypatch.setattr(aot, "_STATE", {})
    assert aot.loaded() is None  # nothing built
    target = aot.build_dir() / f"{aot.module_name()}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"not an extension module")
    monkeypatch.setattr(aot, "_STATE", {})
    assert aot.loaded() is None
    monkeypatch.setattr(_engine, "_LOADED", set())
    assert [b.tolist() for b in pack([5, 4, 3, 3, 3], 10, "ffd")] == [[0, 1], [2, 3, 4]]
