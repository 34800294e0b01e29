"""Every code block of the README, ``docs/*.md`` and ``benchmarks/README.md`` runs, and the
reference tables say what the code does.

Python blocks run page by page, in order, in one fresh namespace per page (a page's blocks may
build on each other: each such page says so) and in a fresh temporary directory. A block that
cannot run on a CPU machine (CUDA, a model download, several ranks) is marked in the markdown
with ``<!-- no-run: REASON -->`` on the line before it, and is only compiled. A page whose blocks
train is marked ``<!-- test: slow -->`` and runs in the ``-m slow`` set. A block that imports a
package of the ``integration`` extra is skipped (naming it) where that extra is not installed:
``.ci/run`` runs this file again after installing it.

The README's two set-up commands are checked against ``.ci/run`` and ``pyproject.toml``; the
option, ``PackedBatch`` and CLI tables against the code, so a rename that the docs miss fails here.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [p for p in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md")
         if p.exists()]
README = (ROOT / "README.md").read_text(encoding="utf-8")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))

SETUP = [
    'pip install -c constraints.txt "torch==2.13.0" -e . && streampack demo',
    'pip install -c constraints.txt "torch==2.13.0" -e ".[test]" && python -m pytest -m "not slow" -q',
]
INTEGRATION_MODULES = {"lightning", "megatron", "torchtitan", "accelerate", "tensorboard", "triton"}
"""What the ``integration`` extra installs: the fast loop runs on the ``test`` extra alone."""

FENCE = re.compile(r"^```(\w*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
NO_RUN = re.compile(r"<!--\s*no-run:\s*(.*?)\s*-->\s*$")


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
    page: str
    line: int
    lang: str
    code: str
    no_run: str | None
    """Why the block is only compiled (the marker's text), or None when it runs."""


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = NO_RUN.search(before)
        out.append(Block(str(page.relative_to(ROOT)), text.count("\n", 0, m.start()) + 1, m.group(1),
                         m.group(2), marker.group(1) if marker else None))
    return out


def _page_param(page: Path):
    slow = "<!-- test: slow -->" in page.read_text(encoding="utf-8")
    return pytest.param(page, id=str(page.relative_to(ROOT)), marks=[pytest.mark.slow] if slow else [])


# --- the pages and their blocks -------------------------------------------------------------


def test_the_pages_exist_and_the_index_lists_them():
    assert (ROOT / "benchmarks" / "README.md").exists()
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    for page in (ROOT / "docs").glob("*.md"):
        if page.name != "README.md":
            assert f"({page.name})" in index, f"docs/README.md does not list {page.name}"
            assert f"(docs/{page.name})" in README, f"README.md does not link docs/{page.name}"


def test_readme_is_a_front_page():
    """At most 300 lines, and no measurement diary: no dates, no before/after comparisons."""
    assert len(README.splitlines()) <= 300
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", README), "a dated number on the front page"
    for word in (" was ", "before this", "(before", "now ~"):
        assert word not in README, f"a was/before comparison on the front page: {word!r}"


def test_readme_starts_with_the_two_setup_commands():
    """Exactly two commands, nothing between them, before any other block; the second is the
    string ``.ci/run`` greps for, the first installs the package and runs its demo."""
    first = FENCE.search(README)
    assert first is not None and first.group(1) == "bash"
    assert first.group(2).strip().splitlines() == SETUP
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    install = re.search(r"install_command='(.*)'", ci).group(1)
    test = re.search(r"test_command='(.*)'", ci).group(1)
    assert f"{install} && {test}" == SETUP[1]
    assert 'grep -qF "$install_command && $test_command" README.md' in ci
    assert "test" in PYPROJECT["project"]["optional-dependencies"]
    assert PYPROJECT["project"]["scripts"]["streampack"] == "streampack.cli.main:main"
    from streampack.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert "demo" in sub.choices


def test_no_run_blocks_say_why():
    marked = [b for page in PAGES for b in blocks(page) if b.no_run is not None]
    for b in marked:
        assert b.lang == "python" and len(b.no_run) > 10, f"{b.page}:{b.line}: no-run needs a reason"


@pytest.mark.parametrize("page", [_page_param(p) for p in PAGES if any(b.lang == "python" for b in blocks(p))])
def test_python_blocks_run(page: Path, tmp_path, monkeypatch, request):
    todo = [b for b in blocks(page) if b.lang == "python"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STREAMPACK_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(ROOT))
    namespace: dict = {"__name__": "__docs__"}
    request.addfinalizer(namespace.clear)
    for b in todo:
        code = compile(b.code, f"{b.page}:{b.line}", "exec")
        if b.no_run is not None:
            continue
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
                exec(code, namespace)  # noqa: S102 - the page's own example
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] in INTEGRATION_MODULES:
                pytest.skip(f"{b.page}:{b.line} needs the integration extra ({e.name})")
            raise


def test_the_hf_recipe_installs_what_it_reports_to():
    """A recipe that reports to TensorBoard must get it from the extra the HF integration names
    (``pip install "streampack[hf]"``): HF's Trainer refuses ``report_to=["tensorboard"]``
    without it."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    sources = [*PAGES, *sorted((ROOT / "examples").glob("*.py"))]
    recipes = [p.name for p in sources if re.search(r"report_to=\[?[\"']tensorboard", p.read_text(encoding="utf-8"))]
    assert recipes, "no recipe reports to tensorboard: the guard below would pass vacuously"
    assert any(r.startswith("tensorboard") for r in extras["hf"]), f"{recipes} need tensorboard; the hf extra lacks it"


# --- the reference tables against the code --------------------------------------------------

def _page(name: str) -> str:
    return (ROOT / "docs" / name).read_text(encoding="utf-8")


def _section(text: str, title: str) -> str:
    """``text`` from the heading ``## title`` (or ``# title``) to the next ``## `` heading."""
    start = re.search(rf"^#+ {re.escape(title)}\s*$", text, re.MULTILINE).start()
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def _table_first_cells(section: str) -> list[str]:
    return [line.split("|")[1].strip() for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("|---")]


def _code_names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _literal(text: str):
    text = text.strip().strip("`")
    if text in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[text]
    if text.startswith('"') and text.endswith('"'):
        return text[1:-1]
    if text == "()":
        return ()
    return int(text)


def _dataset() -> str:
    return _page("dataset.md")


def _parameter_tables() -> dict[str, dict[str, str]]:
    """docs/dataset.md's tables: ``"PackedDataset"`` (its own parameters), then one per option
    record (``#### `read=ReadOptions(...)` ...``), name -> default cell."""
    tables: dict[str, dict[str, str]] = {}
    current = "PackedDataset"
    text = _dataset()
    for line in text[:text.index("\n## ", text.index("| parameter |"))].splitlines():
        heading = re.match(r"#### `\w+=(\w+)\(\.\.\.\)`", line)
        if heading:
            current = heading.group(1)
        if not line.startswith("| `"):
            continue
        name_cell, default_cell = (c.strip() for c in line.split("|")[1:3])
        names = _code_names(name_cell)
        defaults = [d.strip() for d in default_cell.split(" / " if " / " in default_cell else ",")]
        for i, name in enumerate(names):
            tables.setdefault(current, {})[name] = defaults[i] if len(defaults) == len(names) else defaults[0]
    return tables


def _check_defaults(table: dict[str, str], defaults: dict[str, object], where: str) -> None:
    assert set(table) == set(defaults), (f"docs/dataset.md's {where} table lists {sorted(set(table) - set(defaults))} "
                                         f"that do not exist; misses {sorted(set(defaults) - set(table))}")
    for name, cell in table.items():
        default = defaults[name]
        if cell == "—":
            assert default is inspect.Parameter.empty, name
        elif name == "slack":
            assert default is None and "capacity // 256" in cell  # None means capacity // 256
        elif dataclasses.is_dataclass(default):
            assert cell.strip("`") == f"{type(default).__name__}()" and default == type(default)(), name
        else:
            assert _literal(cell) == default, f"{where}.{name}: the docs say {cell}, the code has {default!r}"


def test_packed_dataset_tables_match_the_signature_and_the_records():
    from streampack import PackedDataset
    from streampack.options import RECORDS

    tables = _parameter_tables()
    assert list(tables) == ["PackedDataset", *(kind.__name__ for kind in RECORDS.values())]
    params = inspect.signature(PackedDataset).parameters
    kinds = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    _check_defaults(tables["PackedDataset"], {n: p.default for n, p in params.items() if p.kind not in kinds},
                    "PackedDataset")
    for param, kind in RECORDS.items():
        assert f"#### `{param}={kind.__name__}(...)`" in _dataset()
        _check_defaults(tables[kind.__name__], {f.name: f.default for f in dataclasses.fields(kind)}, kind.__name__)


def test_readme_options_table_names_real_settings():
    from streampack import PackedDataset
    from streampack.options import RECORDS

    params = inspect.signature(PackedDataset).parameters
    for cell in _table_first_cells(_section(README, "Main options")):
        if not cell.startswith("`"):
            continue  # the header row
        name = _code_names(cell)[0].split("=")[0]
        assert name in params, name
        if name in RECORDS:
            assert cell == f"`{name}={RECORDS[name].__name__}(...)`"


def test_algorithm_names_in_the_docs_are_the_registry():
    from streampack.packing import ALGORITHMS

    row = next(line for line in _dataset().splitlines() if line.startswith("| `algorithm`"))
    assert set(_code_names(row.split("|")[3])) - {"streampack.packing.ALGORITHMS"} == set(ALGORITHMS)
    table = _table_first_cells(_section(_page("algorithms.md"), "Packing algorithms"))
    assert {c.strip("`") for c in table if c.startswith("`")} == set(ALGORITHMS)


def test_packed_batch_table_matches_the_dataclass():
    from streampack import PackedBatch

    section = _section(_page("batch.md"), "PackedBatch")
    fields = {f.name for f in dataclasses.fields(PackedBatch)}
    documented = set()
    for cell in _table_first_cells(section):
        documented.update(_code_names(cell))
    assert documented == fields
    props = re.search(r"Properties: (.*?)\. Methods: (.*?)adapters", section, re.DOTALL)
    assert props is not None
    for name in _code_names(props.group(1)) + ["num_docs"]:
        assert hasattr(PackedBatch, name), name
    for name in ("to", "pin_memory", "flash_attn_kwargs", "te_kwargs", "packed_seq_params", "hf_inputs"):
        assert callable(getattr(PackedBatch, name)), name


@pytest.mark.filterwarnings("ignore:streampack.* is deprecated:DeprecationWarning")
def test_every_dotted_name_in_the_docs_resolves():
    """``streampack.x.y`` written anywhere in the pages is a real module or attribute."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for dotted in sorted(set(re.findall(r"`(streampack(?:\.[A-Za-z_]\w*)+)", text))):
            parts = dotted.split(".")
            for cut in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:cut]))
                    break
                except ImportError:
                    continue
            for attr in parts[cut:]:
                assert hasattr(obj, attr), f"{page.name}: {dotted}"
                obj = getattr(obj, attr)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of ``page``'s headings: lower case, punctuation dropped, spaces to ``-``."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, re.MULTILINE)}


def test_links_between_the_pages_resolve():
    """Every relative link names a file that exists and, with ``#anchor``, a heading in it."""
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#:]*)(?:#([^)]*))?\)", page.read_text(encoding="utf-8")):
            path = (page.parent / target) if target else page
            assert path.exists(), f"{page.relative_to(ROOT)} links {target}, which does not exist"
            if anchor and path.suffix == ".md":
                assert anchor in _anchors(path), f"{page.relative_to(ROOT)} links {target}#{anchor}: no such heading"


def test_signatures_written_in_the_docs():
    import streampack
    from streampack import packing, rl

    def keywords(fn) -> set[str]:
        return set(inspect.signature(fn).parameters)

    assert {"packs", "capacity", "align", "pad_id", "ignore_index"} <= keywords(streampack.pack_batch)
    assert {"lengths", "capacity", "algorithm", "seed"} <= keywords(packing.pack)
    assert {"seq_lens", "dp_size", "max_tokens_per_microbatch", "sequence_length_round", "pp_size",
            "chunk_size", "convention", "allow_overlong"} <= keywords(rl.plan_dynamic_batches)
    assert {"seq_lens", "dp_size", "max_tokens_per_microbatch", "min_num_microbatches", "algorithm",
            "align", "cost_model"} == keywords(rl.plan_packed_microbatches)
    from streampack.attention import packed_cross_entropy

    assert {"reduction", "num_targets"} <= keywords(packed_cross_entropy)


def test_cli_flags_in_the_docs_exist():
    from streampack.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    rows = [line for line in _page("cli.md").splitlines() if line.startswith("| `streampack ")]
    assert {r.split("`")[1].split()[1] for r in rows} == set(sub.choices)
    for row in rows:
        command = row.split("`")[1].split()[1]
        options = {o for a in sub.choices[command]._actions for o in a.option_strings}
        for flag in re.findall(r"(--[a-z][a-z-]*)", row):
            assert flag in options, f"streampack {command} {flag}"


def test_metrics_keys_named_in_the_docs(tmp_path):
    """``metrics()["overlong"]``, ``["errors"]``, ``["batches"]["fillers"]`` exist."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers_data import make_token_docs, write_tar_shards

    from streampack import PackedDataset
    from streampack.options import PackOptions, TopologyOptions

    urls = write_tar_shards(tmp_path, make_token_docs(20, max_len=30), 2)
    ds = PackedDataset(urls, capacity=32, epochs=1, packing=PackOptions(window=8),
                       topology=TopologyOptions(dp_rank=0, dp_size=2, batches_per_epoch=40))
    batches = list(ds)
    metrics = ds.metrics()
    for page in PAGES:
        for key in re.findall(r'metrics\(\)\["(\w+)"\]', page.read_text(encoding="utf-8")):
            assert key in metrics, f"{page.name}: {key}"
    assert len(batches) == 40 and metrics["batches"]["fillers"] > 0
    assert batches[-1].doc_keys == ("<filler>",) and batches[-1].num_targets == 0


def test_scripts_the_docs_name_exist():
    """``python benchmarks/x.py``, ``examples/y.py``, ``tests/z.py`` named on a page are files."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for path in set(re.findall(r"\b((?:benchmarks|examples|tests)/[\w/]+\.py)\b", text)):
            assert (ROOT / path).exists(), f"{page.relative_to(ROOT)} names {path}, which does not exist"


def test_benchmarks_readme_covers_the_suite():
    """Every module ``run_all.py`` runs is listed with its command; nothing else is a benchmark
    script (the timing helpers build virtual environments and are named as such)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from run_all import discover

    text = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    suite = {p.name for p in discover(ROOT / "benchmarks")}
    assert len(suite) > 10  # the guard: discovery found the suite
    for name in suite:
        assert re.search(rf"^\| `{name}` \|", text, re.MULTILINE), f"benchmarks/README.md does not list {name}"
    helpers = {"run_all.py", "report.py", "rss_child.py", "time_install.py", "time_tests.py"}
    extra = {p.name for p in (ROOT / "benchmarks").glob("*.py")} - suite - helpers
    assert not extra, f"scripts outside the suite: {sorted(extra)} (wire them into run_all or remove them)"
