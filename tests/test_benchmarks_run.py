"""Every ``benchmarks/bench_*.py`` is runnable by ``benchmarks/run_all.py`` (``streampack
bench``): it imports and exposes ``run()``. Before: ``bench_gpu.py`` had no ``run`` and
``bench_state.py`` built its planning input with a removed ``ShardIndex`` signature, so the
full report carried two failures that no test saw."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
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
