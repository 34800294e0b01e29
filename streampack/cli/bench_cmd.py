"""``streampack bench``: run ``benchmarks/run_all.py`` and write its markdown report.

The benchmarks are not part of the installed package; they are found next to the package
source (``<repo>/benchmarks``), so this works from a checkout or an editable install only.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from streampack.cli._data import CliError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="smoke run: packing, pipeline and cold start at small sizes (under a minute on 2 cores)")
    p.add_argument("--out", default="benchmark-report.md", help="markdown report path (default %(default)s)")
    p.set_defaults(run=run)


def find_runner() -> Path:
    import streampack

    path = Path(streampack.__file__).resolve().parent.parent / "benchmarks" / "run_all.py"
    if not path.is_file():
        raise CliError(f"benchmarks not found at {path.parent}: `streampack bench` needs a source "
                       "checkout (pip install -e .), not a regular install")
    return path


def run(args: argparse.Namespace) -> int:
    path = find_runner()
    spec = importlib.util.spec_from_file_location("streampack_benchmarks_run_all", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report, failed = module.run_all(quick=args.quick, out=args.out)
    print(report)
    print(f"report written to {args.out}" + (f"; {failed} benchmark(s) failed" if failed else ""), file=sys.stderr)
    return 1 if failed else 0
