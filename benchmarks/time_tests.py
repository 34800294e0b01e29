"""How long the test suites take: the fast inner loop (the README's command) and the
integration set (``.ci/run``'s second step), each in a fresh pytest process.

Usage: ``python benchmarks/time_tests.py [--slow] [--out FILE]``
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from report import emit  # noqa: E402  (benchmarks/report.py; this folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]


def run(marker: str) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", marker, "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    summary = next((line for line in reversed(proc.stdout.splitlines()) if re.search(r"\d+ passed", line)), "")
    if proc.returncode != 0:
        raise SystemExit(f"pytest -m {marker!r} failed:\n{proc.stdout[-3000:]}")
    return seconds, summary.strip("= ")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slow", action="store_true", help="also time the integration set (-m slow)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = [("`-m \"not slow\"` (fast inner loop)", *run("not slow"))]
    if args.slow:
        rows.append(("`-m slow` (integration set)", *run("slow")))
    lines = [f"Test suite wall time ({os.cpu_count()} cores, Python {sys.version.split()[0]}):", "",
             "| suite | wall time | pytest summary |", "|---|---|---|"]
    lines += [f"| {name} | {seconds:.0f} s | {summary} |" for name, seconds, summary in rows]
    text = "\n".join(lines)
    return emit(text, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
