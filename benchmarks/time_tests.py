"""How long the test suites take: the fast inner loop (the README's command) cold and warm, and
optionally the integration set (``.ci/run``'s second step), each in a fresh pytest process.

Usage: ``python benchmarks/time_tests.py [--slow] [--runs N] [--workers N] [--out FILE]``

*Cold* is a fresh clone on a fresh machine: empty numba kernel cache (``$STREAMPACK_CACHE``)
and matplotlib font cache (``$MPLCONFIGDIR``), each a new temporary directory, and no bytecode
of the repository (its ``__pycache__`` folders are deleted; the installed packages keep theirs,
as pip compiled them). *Warm* reruns with those caches as the cold run left them. ``--slow`` then times ``-m slow`` with the same
warm caches (as ``.ci/run`` runs it, after the fast loop). Each row gives wall time and the CPU
time of pytest and everything it started (user + sys; the workers, DataLoader workers and
subprocesses), and the 1-minute load average before and after: on a shared box the wall time
says as much about the neighbours as about the tests, so compare rows taken side by side.
``--workers 0`` runs each suite in one process (pyproject's ``-n 2`` overridden), as before
pytest-xdist: ``--workers 0,2`` times both, interleaved.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from report import emit  # noqa: E402  (benchmarks/report.py; this folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
CACHE_VARIABLES = ("STREAMPACK_CACHE", "MPLCONFIGDIR")


@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    suite: str
    wall: float
    """Seconds from start to exit."""
    cpu: float
    """User + sys seconds of pytest and every process it waited for."""
    load: tuple[float, float]
    """The 1-minute load average before and after."""
    summary: str
    """pytest's last line (counts and its own time)."""


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def forget_bytecode() -> None:
    """The repository's bytecode, not that of a virtual environment kept inside it."""
    for top in ("streampack", "tests", "benchmarks", "examples"):
        for folder in (ROOT / top).rglob("__pycache__"):
            shutil.rmtree(folder, ignore_errors=True)


def run(suite: str, marker: str, caches: dict[str, str], workers: str) -> Timing:
    env = {**os.environ, **caches}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a fresh clone writes its bytecode on the first run
    load, cpu, start = os.getloadavg()[0], _children_cpu(), time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", marker, "-q", "-p", "no:cacheprovider",
                           *(["-n", workers] if workers else [])], cwd=ROOT, env=env, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
    summary = next((line for line in reversed(proc.stdout.splitlines()) if re.search(r"\d+ passed", line)), "")
    if proc.returncode != 0:
        raise SystemExit(f"pytest -m {marker!r} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    return Timing(suite=suite, wall=wall, cpu=cpu, load=(load, os.getloadavg()[0]), summary=summary.strip("= "))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slow", action="store_true", help="also time the integration set (-m slow)")
    parser.add_argument("--runs", type=int, default=1, help="cold + warm pairs of the fast loop")
    parser.add_argument("--workers", default="", help="pytest-xdist workers, comma-separated (default: pyproject's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for i in range(args.runs):
        for workers in args.workers.split(","):
            name = f" -n {workers}" if workers else ""
            with tempfile.TemporaryDirectory(prefix="time-tests-") as tmp:
                caches = {var: os.path.join(tmp, var.lower()) for var in CACHE_VARIABLES}
                forget_bytecode()
                rows.append(run(f'`-m "not slow"{name}`, cold', "not slow", caches, workers))
                rows.append(run(f'`-m "not slow"{name}`, warm', "not slow", caches, workers))
                if args.slow and i == args.runs - 1:
                    rows.append(run(f"`-m slow{name}`, warm", "slow", caches, workers))
    lines = [f"Test suite times ({os.cpu_count()} cores, Python {sys.version.split()[0]}, "
             f"{time.strftime('%Y-%m-%d %H:%M')}):", "",
             "| suite | wall | CPU (user + sys) | load before → after | pytest summary |", "|---|---|---|---|---|"]
    lines += [f"| {r.suite} | {r.wall:.0f} s | {r.cpu:.0f} s | {r.load[0]:.1f} → {r.load[1]:.1f} | {r.summary} |"
              for r in rows]
    return emit("\n".join(lines), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
