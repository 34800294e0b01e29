"""How long the README's test install takes on a fresh machine, and whether pip backtracks.

Makes a new venv and runs the README's install line in it (``pip install -c constraints.txt
"torch==2.13.0" -e ".[test]"``, or ``--extras test,integration``), with pip's cache off unless
``--cache``, and reports wall and CPU seconds, the packages pip collected and whether it printed
its backtracking notice ("This is taking longer than usual"). ``--no-constraints`` drops the
``-c constraints.txt`` to show what a resolution without the lock does. Needs the package index.

Usage: ``python benchmarks/time_install.py [--extras test] [--cache] [--no-constraints] [--dry-run]``
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def time_install(extras: str, *, cache: bool, constraints: bool, dry_run: bool) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="time-install-") as work:
        venv = Path(work) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        cmd = [str(venv / "bin" / "pip"), "install", *(["-c", "constraints.txt"] if constraints else []),
               "torch==2.13.0", "-e", f".[{extras}]", *([] if cache else ["--no-cache-dir"]),
               *(["--dry-run", "--ignore-installed"] if dry_run else [])]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = proc.stdout + proc.stderr
    return {"extras": extras, "constraints": constraints, "cache": cache, "dry_run": dry_run,
            "exit": proc.returncode, "wall_s": round(wall, 1),
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
            "collected": out.count("Collecting "),
            "backtracked": "taking longer than usual" in out or "ResolutionImpossible" in out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--extras", default="test")
    p.add_argument("--cache", action="store_true", help="keep pip's cache (default: --no-cache-dir)")
    p.add_argument("--no-constraints", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="resolve only (pip install --dry-run)")
    a = p.parse_args()
    print(time_install(a.extras, cache=a.cache, constraints=not a.no_constraints, dry_run=a.dry_run))


if __name__ == "__main__":
    main()
