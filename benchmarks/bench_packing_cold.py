"""Cold start of the packers: compile and cache-load times, and window-sized calls.

    PYTHONPATH=. python benchmarks/bench_packing_cold.py

Three tables (lognormal lengths, mean 600, sigma 1, clipped to [1, 4096]; C = 4096):
- a fresh process: ``import streampack.packing`` (under a stand-in parent package, so
  ``streampack/__init__``'s torch import is not counted), then a first ``pack`` of 1024
  items, and which heavy modules got loaded;
- per algorithm that compiles, a fresh process's first large-path call (``backend="numba"``,
  numba import included) with an empty cache directory, then again with the cache filled;
- window sizes 1024 and 8192 in a warm process: plain-Python path vs compiled path (best
  of 20 / 5; compile excluded). ``pack`` with ``backend="auto"`` takes the Python one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from streampack.packing import ALGORITHMS, pack_flat

ROOT = Path(__file__).resolve().parent.parent
ISOLATED = """
import importlib.util, json, sys, time, types
start = time.perf_counter()
spec = importlib.util.find_spec("streampack")
parent = types.ModuleType("streampack")
parent.__path__ = list(spec.submodule_search_locations)
sys.modules["streampack"] = parent
import numpy as np
t_numpy = time.perf_counter()
import streampack.packing as packing
t_import = time.perf_counter()
lengths = np.clip(np.round(np.random.default_rng(0).lognormal(5.9, 1.0, {n})), 1, 4096).astype(np.int64)
t0 = time.perf_counter()
packing.pack_flat(lengths, 4096, "{name}", backend="{backend}")
t_call = time.perf_counter()
print(json.dumps({{"numpy_s": t_numpy - start, "import_s": t_import - t_numpy,
                  "call_s": t_call - t0, "heavy": sorted({{m.split(".")[0] for m in sys.modules}}
                                                         & {{"numba", "torch", "llvmlite"}})}}))
"""


def fresh(name: str, backend: str, n: int, cache: str) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "STREAMPACK_CACHE": cache}
    code = ISOLATED.format(name=name, backend=backend, n=n)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def cold_rows(capacity: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        first = fresh("bfd", "auto", 1024, cache)
        rows.append({"table": "fresh process", "what": "import streampack.packing",
                     "seconds": first["import_s"], "loaded": ", ".join(first["heavy"]) or "none"})
        rows.append({"table": "fresh process", "what": "first pack(1024 items), bfd",
                     "seconds": first["call_s"], "loaded": ", ".join(first["heavy"]) or "none"})
        numba_only = subprocess.run([sys.executable, "-c", "import time; t = time.perf_counter(); "
                                     "import numba; print(time.perf_counter() - t)"],
                                    capture_output=True, text=True, check=True)
        rows.append({"table": "fresh process", "what": "import numba",
                     "seconds": float(numba_only.stdout), "loaded": "numba, llvmlite"})
    for name, packer in ALGORITHMS.items():
        if not packer.compiles:
            continue
        with tempfile.TemporaryDirectory() as cache:
            cold = fresh(name, "numba", 1024, cache)
            warm = fresh(name, "numba", 1024, cache)
        rows.append({"table": "compile", "algorithm": name, "compile_s": cold["call_s"],
                     "cached_load_s": warm["call_s"]})
    return rows


def window_rows(capacity: int, repeats: dict[int, int] | None = None) -> list[dict]:
    repeats = repeats or {1024: 20, 8192: 5}
    rows = []
    rng = np.random.default_rng(0)
    for n, reps in repeats.items():
        raw = rng.lognormal(np.log(600.0) - 0.5, 1.0, n)
        lengths = np.clip(np.round(raw), 1, capacity).astype(np.int64)
        for name, packer in ALGORITHMS.items():
            times = {}
            for backend in ("python", "numba"):
                pack_flat(lengths, capacity, name, backend=backend)  # warm-up / compile
                best = float("inf")
                for _ in range(reps):
                    start = time.perf_counter()
                    pack_flat(lengths, capacity, name, backend=backend)
                    best = min(best, time.perf_counter() - start)
                times[backend] = best
            rows.append({"table": "window", "n": n, "algorithm": name,
                         "python_ms": times["python"] * 1e3,
                         "compiled_ms": times["numba"] * 1e3 if packer.compiles else None})
    return rows


def run(quick: bool = False) -> list[dict]:
    """Rows of all three tables (``quick``: window sizes only, no fresh processes)."""
    return window_rows(4096, {1024: 5} if quick else None) + ([] if quick else cold_rows(4096))


def report(capacity: int = 4096) -> str:
    rows = cold_rows(capacity)
    lines = ["| fresh process | seconds | heavy modules loaded |", "|---|---:|---|"]
    lines += [f"| {r['what']} | {r['seconds']:.3f} | {r['loaded']} |"
              for r in rows if r["table"] == "fresh process"]
    lines += ["", "| algorithm | first compiled call, empty cache (s) | same, cache filled (s) |",
              "|---|---:|---:|"]
    lines += [f"| {r['algorithm']} | {r['compile_s']:.2f} | {r['cached_load_s']:.2f} |"
              for r in rows if r["table"] == "compile"]
    lines += ["", "| n | algorithm | plain Python (ms) | compiled (ms) |", "|---:|---|---:|---:|"]
    for r in window_rows(capacity):
        compiled = "same code" if r["compiled_ms"] is None else f"{r['compiled_ms']:.2f}"
        lines.append(f"| {r['n']} | {r['algorithm']} | {r['python_ms']:.2f} | {compiled} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(report())
