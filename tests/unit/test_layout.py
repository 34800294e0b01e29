"""The package's shape: folders in data-flow order, no import cycles, cheap imports."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "streampack"


def _imports() -> dict[str, set[str]]:
    """module -> streampack modules it imports (module- and function-level, any depth)."""
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rsplit(".", 1)[0] if "." in t else ""
                if t and t != mod and not (mods[t].name == "__init__.py" and mod.startswith(t + ".")):
                    edges[mod].add(t)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), package re-exports
    (``__init__`` modules) left out as the shared checker does."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    inits = {m for m in edges if (PACKAGE.parent / m.replace(".", "/") / "__init__.py").exists()}

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v] - inits:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    assert _cycles(_imports()) == []


def test_cycle_check_can_fail() -> None:
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]


# What each folder may import (besides itself and the leaves: errors / logs / sample, and of plan/ the
# state envelope and the topology): bytes and formats know nothing of nodes, nodes nothing of
# consumers, and the pure packing library nothing of the rest. plan/ is who reads what: the nodes
# read their plans from it (sharding, epoch plans, quotas, document rows, the fast path's replay),
# and its resume modules (elastic, reshard, replay) rebuild nodes' states, so plan and nodes meet.
ALLOWED = {
    "io": set(),
    "packing": set(),
    "layout": set(),
    # media: the image spans a split must not cut; options: the records the nodes take
    "chat": {"io", "options", "media"},  # chat records rendered and masked: the chat stage's encoder
    "nodes": {"io", "packing", "layout", "plan", "media", "options", "chat"},
    "plan": {"io", "packing", "layout", "nodes", "graph", "settings"},
    "options": {"io", "packing", "layout"},  # the per-stage records: they know nothing of the nodes that take them
    "attention": {"layout"},
    "rl": {"packing", "layout"},
    "integrations": {"io", "nodes", "layout", "attention", "packing", "rl", "graph", "dataset", "options", "plan"},
    "cli": {"io", "nodes", "layout", "attention", "packing", "rl", "graph", "dataset", "integrations", "options",
            "plan", "chat"},
}
LEAVES = {"errors", "logs", "sample", "plan.state", "plan.topology"}


def test_folders_import_only_upstream() -> None:
    bad = []
    for mod, targets in _imports().items():
        folder = mod.split(".")[1] if mod.count(".") else ""
        if folder not in ALLOWED:
            continue
        for t in targets:
            other = t.split(".")[1] if t.count(".") else ""
            leaf = ".".join(t.split(".")[1:3])
            if other and other != folder and other not in LEAVES and leaf not in LEAVES and other not in ALLOWED[folder]:
                bad.append(f"{mod} -> {t}")
    assert bad == []


def test_top_level_and_nodes_show_the_flow() -> None:
    """At most 8 modules at the top (the front and what every floor uses); ``nodes/`` holds only
    ``torchdata.nodes.BaseNode`` stages, one per file."""
    import importlib

    from torchdata.nodes import BaseNode

    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top
    for path in sorted((PACKAGE / "nodes").glob("*.py")):
        if path.name == "__init__.py":
            continue
        module = importlib.import_module(f"streampack.nodes.{path.stem}")
        stages = [v for v in vars(module).values()
                  if isinstance(v, type) and issubclass(v, BaseNode) and v.__module__ == module.__name__]
        assert stages, f"{path.name} defines no BaseNode stage"


def test_one_chain_one_node_of_each_kind_and_no_switch() -> None:
    """One chain: every stage has one node class (a faster way to do a job is how that node does it,
    not a twin), and no environment variable chooses a code path: the ones read name a place or a
    threshold."""
    import importlib

    from torchdata.nodes import BaseNode

    stages = sorted(v.__name__ for path in (PACKAGE / "nodes").glob("*.py") if path.name != "__init__.py"
                    for v in vars(importlib.import_module(f"streampack.nodes.{path.stem}")).values()
                    if isinstance(v, type) and issubclass(v, BaseNode) and v.__module__.endswith(f".{path.stem}"))
    public = [s for s in stages if not s.startswith("_")]  # a private helper node (the mixture's counter) aside
    assert public == ["BlockReader", "EpochLoop", "MapSamples", "Mixture", "OverlongNode", "PackedShardReader",
                      "ShardReader", "ThdCollate", "Tokenize", "WindowPacker"], public
    source = "".join(path.read_text() for path in PACKAGE.rglob("*.py"))
    read = set(re.findall(r"\b(STREAMPACK_[A-Z0-9_]+)\b", source))
    assert read == {"STREAMPACK_CACHE", "STREAMPACK_S3_ENDPOINT", "STREAMPACK_SLOW_BATCH_SECONDS"}, read


@pytest.mark.parametrize("module", ["streampack", "streampack.packing", "streampack.io.urls", "streampack.rl.plan"])
def test_light_imports_do_not_load_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", f"import {module} loads torch"


DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
MARKDOWN = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.md)\b")
SCRIPT = re.compile(r"\b((?:benchmarks|examples|tests)/[\w/]+\.py)\b")
ROOT = PACKAGE.parent


def _prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every docstring (module, class, function, attribute) and comment of a module."""
    found = [(node.lineno, node.value.value) for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
             and isinstance(node.value.value, str)]
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return found + [(tok.start[0], tok.string) for tok in tokens if tok.type == tokenize.COMMENT]


def _markdown_exists(name: str, module: Path) -> bool:
    """A markdown file named from ``module`` exists, read from the repository root, ``docs/``,
    ``benchmarks/`` or the module's own folder."""
    return any((base / name).is_file() for base in (ROOT, ROOT / "docs", ROOT / "benchmarks", module.parent))


def _prose_problems(path: Path, source: str) -> list[str]:
    where = path.relative_to(ROOT)
    problems = []
    for line, text in _prose(source):
        problems += [f"{where}:{line}: dated entry {m!r} (dated histories go to docs/changelog.md)"
                     for m in DATE.findall(text)]
        problems += [f"{where}:{line}: names {m}, which does not exist"
                     for m in MARKDOWN.findall(text) if not _markdown_exists(m, path)]
        problems += [f"{where}:{line}: names {m}, which does not exist"
                     for m in SCRIPT.findall(text) if not (ROOT / m).is_file()]
    return problems


def test_docstrings_and_comments_carry_no_diaries() -> None:
    """No docstring or comment under ``streampack/`` holds a date (``20YY-MM-DD``: a dated history
    belongs in ``docs/changelog.md``) or names a markdown file or a script that is not in the
    repository (STYLE.md: one measured sentence where the choice is made, with the script that
    gives it)."""
    modules = sorted(PACKAGE.rglob("*.py"))
    sources = {path: path.read_text(encoding="utf-8") for path in modules}
    assert len(modules) > 100 and sum(len(_prose(s)) for s in sources.values()) > 1000  # the guard: prose was found
    problems = [problem for path, source in sources.items() for problem in _prose_problems(path, source)]
    assert not problems, "\n".join(problems)


def test_prose_check_can_fail() -> None:
    """The check finds a date, a missing markdown file and a missing script in a module docstring,
    an attribute docstring and a comment, and accepts the pages and scripts that exist."""
    source = ('"""See docs/batch.md, benchmarks/README.md and benchmarks/bench_state.py."""\n'
              'X = 1\n"""Measured 2026-11-25 (benchmarks/NOTES.md)."""\n'
              'def f():\n    return 1  # per benchmarks/profile_gone.py\n')
    found = _prose_problems(PACKAGE / "packing" / "_probe.py", source)
    assert found == ["streampack/packing/_probe.py:3: dated entry '2026-11-25' (dated histories go to docs/changelog.md)",
                     "streampack/packing/_probe.py:3: names benchmarks/NOTES.md, which does not exist",
                     "streampack/packing/_probe.py:5: names benchmarks/profile_gone.py, which does not exist"], found


def test_benchmark_scripts_write_no_result_file_by_default() -> None:
    """A benchmark prints its report; it writes a file only where ``--out`` says (a result file
    written into ``benchmarks/`` by default goes stale there, as the removed ones did)."""
    outs = {}
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
                    and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "--out"):
                default = next((k.value for k in node.keywords if k.arg == "default"), None)
                outs[path.name] = None if default is None else ast.literal_eval(default)
    assert len(outs) >= 8  # the guard: the scripts' --out options were found
    assert not {name: d for name, d in outs.items() if d is not None}, outs
    peers = (ROOT / "benchmarks" / "bench_peers.py").read_text(encoding="utf-8")
    assert '"PEERS.md"' not in peers
