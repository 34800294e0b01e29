"""The plain-Python and compiled paths give identical bins, and the cold path stays cold:
window-sized calls and ``import streampack.packing`` load neither numba nor torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streampack.packing as packing
from streampack.packing import _engine, aot
from tests.unit.packing.test_packing_algorithms import check_packing, problems

NAMES = sorted(packing.ALGORITHMS)
PACKAGE_DIR = Path(packing.__file__).parent
ROOT = PACKAGE_DIR.parent.parent


def assert_same(a: packing.PackResult, b: packing.PackResult) -> None:
    assert np.array_equal(a.order, b.order) and np.array_equal(a.offsets, b.offsets)
    assert a.order.dtype == b.order.dtype == a.offsets.dtype == b.offsets.dtype == np.int64


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems(max_n=80), seed=st.integers(0, 2**32 - 1))
def test_both_paths_give_identical_bins(name: str, problem: tuple[np.ndarray, int], seed: int) -> None:
    lengths, capacity = problem
    plain = packing.pack_flat(lengths, capacity, name, seed, backend="python")
    compiled = packing.pack_flat(lengths, capacity, name, seed, backend="numba")
    assert_same(plain, compiled)
    check_packing(plain.bins(), lengths, capacity)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("capacity", [100, 4096, 2**31 + 1])
def test_both_paths_agree_at_window_size(name: str, capacity: int) -> None:
    # thousands of items: many bins, many equal lengths and equal rooms (tie-breaking)
    rng = np.random.default_rng(capacity)
    lengths = np.clip(np.round(rng.lognormal(np.log(capacity / 7), 1.0, 3000)), 1, capacity)
    lengths = lengths.astype(np.int64)
    plain = packing.pack_flat(lengths, capacity, name, 5, backend="python")
    assert_same(plain, packing.pack_flat(lengths, capacity, name, 5, backend="numba"))
    assert plain.num_bins > (1 if capacity < 2**31 else 0)


def spy_on_compiles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the kernels compiled from now on (``aot.compiled`` wrapped)."""
    compiled_kernels: list[str] = []
    real = aot.compiled

    def spy(kernel: Callable[..., Any]) -> Callable[..., Any]:
        compiled_kernels.append(kernel.__name__)
        return real(kernel)

    monkeypatch.setattr(aot, "compiled", spy)
    return compiled_kernels


def test_auto_switches_at_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled_kernels = spy_on_compiles(monkeypatch)
    monkeypatch.setattr(_engine, "THRESHOLD", 40)
    monkeypatch.setattr(_engine, "_LOADED", set())  # as in a process that compiled nothing yet
    monkeypatch.setitem(aot._STATE, "module", None)  # no ahead-of-time build either
    lengths = np.arange(1, 41, dtype=np.int64)
    for name in NAMES:
        compiled_kernels.clear()
        below = packing.pack_flat(lengths[:39], 64, name)
        assert compiled_kernels == [], name
        at = packing.pack_flat(lengths, 64, name)
        assert bool(compiled_kernels) == packing.ALGORITHMS[name].compiles, name
        assert below.num_bins >= 1 and at.order.size == 40
    assert packing.THRESHOLD >= 8192  # every streaming window stays on the plain path


def test_backend_is_validated() -> None:
    with pytest.raises(ValueError, match="backend='gpu' is not one of auto, python, numba"):
        packing.pack([1, 2], 4, backend="gpu")  # type: ignore[arg-type]


def _helper(x: int) -> int:
    return x


def _kernel_with_a_call(x: int) -> int:
    return _helper(x)


def test_kernels_must_be_self_contained() -> None:
    with pytest.raises(TypeError, match="calls Python function '_helper'"):
        aot.compiled(_kernel_with_a_call)


def run_fresh(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter with this tree first on the path; it prints JSON."""
    full_env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=full_env, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


# Until streampack/__init__.py stops importing torch, import the subpackage under an empty
# stand-in parent package, so the check sees only what streampack.packing itself imports.
ISOLATED_IMPORT = """
import json, sys
import numpy as np
import streampack.packing as packing
"""


def test_import_and_window_calls_load_neither_numba_nor_torch() -> None:
    code = ISOLATED_IMPORT + """
after_import = sorted(m for m in sys.modules if m.split(".")[0] in ("numba", "torch"))
rng = np.random.default_rng(0)
for n in (1024, 8192):
    lengths = np.clip(np.round(rng.lognormal(6.0, 1.0, n)), 1, 4096).astype(np.int64)
    for name in packing.ALGORITHMS:
        packing.pack(lengths, 4096, name)
after_calls = sorted(m for m in sys.modules if m.split(".")[0] in ("numba", "torch"))
print(json.dumps({"import": after_import, "calls": after_calls,
                  "file": packing.__file__}))
"""
    result = run_fresh(code)
    assert result["file"] == str(PACKAGE_DIR / "__init__.py")  # this tree, not /work/main
    assert result["import"] == [] and result["calls"] == []


@pytest.mark.slow  # a subprocess / spawned processes: the integration set
def test_compiled_kernels_cache_outside_the_package(tmp_path: Path) -> None:
    code = ISOLATED_IMPORT + """
from streampack.packing import aot
from streampack.packing._common import group_log  # the smallest kernel: quick to compile
kernel = aot.compiled(group_log)
order, offsets = np.zeros(3, dtype=np.int64), np.zeros(3, dtype=np.int64)
kernel(np.arange(3), np.array([1, 0, 1]), order, offsets)
assert order.tolist() == [1, 0, 2] and offsets.tolist() == [0, 1, 3]
print(json.dumps({"hits": sum(kernel.stats.cache_hits.values())}))
"""
    before = sorted(PACKAGE_DIR.rglob("*.nb[ic]"))
    first = run_fresh(code, STREAMPACK_CACHE=str(tmp_path))
    second = run_fresh(code, STREAMPACK_CACHE=str(tmp_path))
    assert (first["hits"], second["hits"]) == (0, 1)  # compiled once, loaded the second time
    assert list((tmp_path / "numba").rglob("*.nbi")), "no index file in the user cache"
    assert sorted(PACKAGE_DIR.rglob("*.nb[ic]")) == before, "wrote into the package"


def test_unwritable_cache_compiles_without_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    numba = pytest.importorskip("numba")
    from streampack.packing._common import group_log

    unwritable = tmp_path / "a-file"
    unwritable.write_text("")  # a cache root that cannot be a directory
    monkeypatch.setenv("STREAMPACK_CACHE", str(unwritable))
    before = sorted(PACKAGE_DIR.rglob("*.nb[ic]"))
    dispatcher = numba.njit(group_log)
    aot._enable_cache(dispatcher, group_log)  # must neither raise nor fall back in-tree
    order, offsets = np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64)
    dispatcher(np.arange(2), np.zeros(2, dtype=np.int64), order, offsets)
    assert offsets.tolist() == [0, 2]
    assert sorted(PACKAGE_DIR.rglob("*.nb[ic]")) == before and unwritable.is_file()
