"""Every ``benchmarks/bench_*.py`` is runnable by ``benchmarks/run_all.py`` (``streampack
bench``): it imports and exposes ``run()``. Before: ``bench_gpu.py`` had no ``run`` and
``bench_state.py`` built its planning input with a removed ``ShardIndex`` signature, so the
full report carried two failures that no test saw."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from run_all import discover, load  # noqa: E402


@pytest.mark.parametrize("path", discover(BENCHMARKS), ids=lambda p: p.stem)
def test_benchmark_module_exposes_run(path: Path) -> None:
    fn = getattr(load(path), "run", None)
    assert callable(fn), f"{path.name} has no run(): run_all would report it as failed"
    assert "quick" in inspect.signature(fn).parameters or path.stem in ("bench_packing", "bench_pipeline", "bench_rl")


def test_state_planning_rows_build() -> None:
    rows = load(BENCHMARKS / "bench_state.py").plan_rows(2_000, (2,))
    assert rows[0]["batches"] > 0 and rows[0]["fillers"] >= rows[0]["fewest_possible"] >= 0


def test_packing_criteria_name_the_failing_cells() -> None:
    """bench_packing_scaling prints each criterion of issue 21 item 5 as PASS / FAIL: a cliff
    (a larger input faster), a slow ``pack()`` and an algorithm over the reference are caught."""
    bench = load(BENCHMARKS / "bench_packing_scaling.py")
    row = {"pack_ms": 2.0, "ref_ms": 4.0}
    rows = [{**row, "algorithm": "bfd", "n": n, "flat_ms": t} for n, t in ((10_000, 1.0), (100_000, 3.0))]
    fills = [{"dist": "lognormal", "window": 256, "gap_points": 0.05}]
    assert all(ok for _, ok, _ in bench.criteria(rows, fills))
    rows[1]["flat_ms"] = 0.5  # the cliff of the issue: more items, less time
    rows[0]["pack_ms"] = 5.0
    rows.append({**row, "algorithm": "kk", "n": 10_000, "flat_ms": 9.0})
    found = {name: (ok, detail) for name, ok, detail in bench.criteria(rows, fills + [{**fills[0], "gap_points": 0.2}])}
    assert found["larger never faster than smaller (warm compiled)"] == (False, "bfd: 100,000 0.5 < 10,000 1")
    assert not found["pack() within 1.2x pack_flat"][0] and "bfd@10,000" in found["pack() within 1.2x pack_flat"][1]
    assert found["every algorithm <= the plain compiled BFD (1e4-1e6)"][1] == "kk@10,000: 2.25x"
    assert not found["online fill at window 256 within 0.1 point of offline bfd"][0]
