"""Run every ``benchmarks/bench_*.py`` module's ``run()`` and write one markdown report.

Each module exposes ``run(...) -> list[dict]`` (one dict per measured row). Arguments come
from ``ARGS[module][quick or full]`` below when listed there (the modules' own ``main()``
defaults for a full run, small sizes for ``--quick``), else ``quick=`` when ``run`` accepts
it, else none. A module that fails is reported with its error and the others still run; the
exit code is 1 if any failed.

``--quick`` is a smoke run: only the modules in :data:`QUICK` (packing speed and fill, the
pipeline end to end, cold start), at small sizes; every other module is named in the report as
skipped: on the shared 2-core box ``streampack bench --quick`` takes ~35 s wall, ~20 s CPU (user +
sys, children included). What each module measures, and its last numbers: ``benchmarks/README.md``.

    python benchmarks/run_all.py --quick --out report.md     (or: streampack bench --quick)
    python benchmarks/run_all.py --skip bench_balance         (the 1,024-rank simulator alone takes ~15 min)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import inspect
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ARGS: dict[str, dict[str, dict[str, Any]]] = {
    "bench_packing": {
        "full": {"sizes": [10_000, 100_000, 1_000_000], "capacity": 4096, "dists": ["lognormal", "uniform"]},
        "quick": {"sizes": [10_000], "capacity": 4096, "dists": ["lognormal"]},
    },
    "bench_pipeline": {"full": {}, "quick": {"docs": 6_000, "shards": 4, "windows": (64, 1024)}},
    "bench_rl": {"full": {}, "quick": {}},
}
QUICK: tuple[str, ...] = ("bench_packing", "bench_pipeline", "bench_cold_start")
"""The modules ``--quick`` runs (the rest take minutes even at their smallest sizes)."""


def discover(directory: Path = HERE) -> list[Path]:
    return sorted(p for p in directory.glob("bench_*.py"))


def load(path: Path) -> Any:
    """Import a benchmark under its own name with its folder on ``sys.path``: a module that
    starts processes (``torch.multiprocessing.spawn`` in bench_state's sync rows) must be
    importable by that name in its children, and a module-level dataclass looks its module up
    in ``sys.modules``."""
    folder = str(path.parent.resolve())
    if folder in sys.path:
        sys.path.remove(folder)
    sys.path.insert(0, folder)
    loaded = sys.modules.get(path.stem)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() != path.resolve():
        del sys.modules[path.stem]  # another folder's module of the same name
    return importlib.import_module(path.stem)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "_no rows_\n"
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def run_module(path: Path, quick: bool) -> tuple[list[dict[str, Any]] | None, str, float]:
    """(rows or None, error text, seconds) of one benchmark module."""
    start = time.perf_counter()
    try:
        fn = load(path).run
        if path.stem in ARGS:
            kwargs = dict(ARGS[path.stem]["quick" if quick else "full"])
        else:
            kwargs = {"quick": quick} if "quick" in inspect.signature(fn).parameters else {}
        rows = list(fn(**kwargs))
        return rows, "", time.perf_counter() - start
    except Exception:  # one broken benchmark must not hide the others' numbers
        return None, traceback.format_exc(limit=6), time.perf_counter() - start


def run_all(*, quick: bool = False, out: str | None = None, paths: list[Path] | None = None,
            echo: bool = True) -> tuple[str, int]:
    """Run the benchmarks; return (markdown report, number of failed modules)."""
    paths = discover() if paths is None else paths
    skipped = [p.stem for p in paths if quick and p.stem not in QUICK]
    paths = [p for p in paths if p.stem not in skipped]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [f"# streampack benchmarks\n\n{stamp} · {'quick' if quick else 'full'} run · "
             f"Python {platform.python_version()} · {platform.machine()} · {_cores()} cores\n"]
    failed = 0
    if not paths:
        parts.append("\n_no benchmarks/bench_*.py modules found_\n")
    for path in paths:
        if echo:
            print(f"running {path.name} ...", file=sys.stderr, flush=True)
        rows, error, seconds = run_module(path, quick)
        parts.append(f"\n## {path.stem}\n\n")
        if rows is None:
            failed += 1
            parts.append(f"**failed** after {seconds:.1f} s:\n\n```\n{error.rstrip()}\n```\n")
        else:
            parts.append(markdown_table(rows) + f"\n_{len(rows)} rows in {seconds:.1f} s_\n")
    if skipped:
        parts.append(f"\n_skipped in a quick run (run without --quick for them): {', '.join(skipped)}_\n")
    report = "".join(parts)
    if out:
        Path(out).write_text(report)
    return report, failed


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI / smoke run)")
    parser.add_argument("--out", default=None, help="also write the markdown report here (default: print it only)")
    parser.add_argument("--skip", default="", help="comma-separated module names to leave out, e.g. bench_balance")
    args = parser.parse_args(argv)
    skip = {name.strip() for name in args.skip.split(",") if name.strip()}
    paths = [p for p in discover() if p.stem not in skip]
    report, failed = run_all(quick=args.quick, out=args.out, paths=paths)
    print(report)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
