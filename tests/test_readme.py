"""The README stays honest: its set-up commands, the names it uses, the PackedDataset parameter
table against the real signature, the PackedBatch field table, and the CLI flags it lists.

Cheap by design (imports and signatures only, no data): a README edit or an API rename that
drifts apart fails here, in the default test run.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")

SETUP = [
    'pip install -c constraints.txt "torch==2.13.0" -e . && streampack demo',
    'pip install -c constraints.txt "torch==2.13.0" -e ".[test]" && python -m pytest -m "not slow" -q',
]


def _section(title: str) -> str:
    """The README text from the heading ``## title`` to the next ``## `` heading."""
    start = README.index(f"\n## {title}")
    end = README.find("\n## ", start + 1)
    return README[start:end if end != -1 else len(README)]


def _table_first_cells(section: str) -> list[str]:
    """First-column cells of the markdown tables in ``section`` (header and rule skipped)."""
    cells = []
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells.append(line.split("|")[1].strip())
    return cells


def _code_names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _literal(text: str):
    """A README default cell value (``None``, ``1``, ``"bfd"``, ``-100``) as a Python value."""
    text = text.strip().strip("`")
    if text in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[text]
    if text.startswith('"') and text.endswith('"'):
        return text[1:-1]
    if text == "()":
        return ()
    return int(text)


def test_readme_starts_with_the_two_setup_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, re.DOTALL)
    assert first_block is not None and README.index("```") == first_block.start()
    assert first_block.group(1).strip().splitlines() == SETUP


def _parameter_tables() -> dict[str, dict[str, str]]:
    """The PackedDataset section's parameter tables: ``"PackedDataset"`` (its own parameters),
    then one per option record (``#### `read=ReadOptions(...)` ...``), name -> default cell."""
    tables: dict[str, dict[str, str]] = {}
    current = "PackedDataset"
    for line in _section("PackedDataset").splitlines():
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
    assert set(table) == set(defaults), (f"README's {where} table lists {sorted(set(table) - set(defaults))} "
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
            assert _literal(cell) == default, f"{where}.{name}: README says {cell}, code has {default!r}"


def test_packed_dataset_tables_match_the_signature_and_the_records():
    """One table for PackedDataset's own parameters, one per option record, in the order of
    ``streampack.options.RECORDS``; every default as in the code."""
    from streampack import PackedDataset
    from streampack.options import RECORDS

    tables = _parameter_tables()
    assert list(tables) == ["PackedDataset", *(kind.__name__ for kind in RECORDS.values())]
    params = inspect.signature(PackedDataset).parameters
    _check_defaults(tables["PackedDataset"], {n: p.default for n, p in params.items() if n != "shortcuts"},
                    "PackedDataset")
    for param, kind in RECORDS.items():
        assert f"#### `{param}={kind.__name__}(...)`" in README
        _check_defaults(tables[kind.__name__], {f.name: f.default for f in dataclasses.fields(kind)}, kind.__name__)


def test_algorithm_names_in_the_readme_are_the_registry():
    from streampack.packing import ALGORITHMS

    row = next(line for line in README.splitlines() if line.startswith("| `algorithm`"))
    listed = set(_code_names(row.split("|")[3])) - {"streampack.packing.ALGORITHMS"}
    assert listed == set(ALGORITHMS)
    table = _table_first_cells(_section("Packing algorithms"))
    assert {c.strip("`") for c in table if c.startswith("`")} == set(ALGORITHMS)


def test_packed_batch_table_matches_the_dataclass():
    from streampack import PackedBatch

    fields = {f.name for f in dataclasses.fields(PackedBatch)}
    documented = set()
    for cell in _table_first_cells(_section("PackedBatch")):
        documented.update(_code_names(cell))
    assert documented == fields
    props = re.search(r"Properties: (.*?)\. Methods: (.*?)adapters", _section("PackedBatch"), re.DOTALL)
    assert props is not None
    for name in _code_names(props.group(1)) + ["num_docs"]:
        assert hasattr(PackedBatch, name), name
    for name in ("to", "pin_memory", "flash_attn_kwargs", "te_kwargs", "packed_seq_params", "hf_inputs"):
        assert callable(getattr(PackedBatch, name)), name


# Every public name the README's snippets and prose use, by module.
NAMES = {
    "streampack": ["PackedDataset", "PackedBatch", "Sample", "pack_batch", "check_invariants", "cp_shard",
                   "cp_unshard", "plan_dynamic_batches", "plan_packed_microbatches", "restore_order"],
    "streampack.attention": ["flex_block_mask", "sdpa_packed", "ssm_kwargs", "global_num_targets",
                             "global_num_sequences", "packed_cross_entropy", "leak_probe", "cp_rank_inputs",
                             "unpack_per_document", "unpack_padded", "token_logprobs"],
    "streampack.rl": ["apply_dynamic_plan", "apply_packed_plan", "MicroBatchPlan"],
    "streampack.packing": ["pack", "pack_flat", "PackResult", "THRESHOLD", "CostModel", "ALGORITHMS",
                           "karmarkar_karp", "packing_metrics", "PackingMetrics", "MetricsAccumulator", "Balance"],
    "streampack.plan.state": ["dataset_states", "load_loader_state"],
    "streampack.nodes.stages": ["NodeStage"],
    "streampack.errors": ["DataError"],
}


@pytest.mark.parametrize("module", sorted(NAMES))
def test_names_used_in_the_readme_import(module):
    mod = importlib.import_module(module)
    for name in NAMES[module]:
        assert hasattr(mod, name), f"{module}.{name}"


def test_every_dotted_name_in_the_readme_resolves():
    """``streampack.x.y`` written anywhere in the README is a real module or attribute."""
    for dotted in sorted(set(re.findall(r"`(streampack(?:\.[A-Za-z_]\w*)+)", README))):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        for attr in parts[cut:]:
            assert hasattr(obj, attr), dotted
            obj = getattr(obj, attr)


INTEGRATION_MODULES = {"lightning", "megatron", "torchtitan", "accelerate", "tensorboard", "triton"}
"""What the ``integration`` extra installs (pyproject.toml): the fast loop runs on the ``test``
extra alone, so the trainer snippets' imports are checked in ``.ci/run``'s second step."""


def test_snippet_imports_run():
    missing = []
    for block in re.findall(r"```python\n(.*?)```", README, re.DOTALL):
        for line in block.splitlines():
            if line.startswith("from streampack") and " import " in line:
                try:
                    exec(line.split("#")[0], {})  # noqa: S102 - the README's own import lines
                except ModuleNotFoundError as e:
                    if (e.name or "").split(".")[0] not in INTEGRATION_MODULES:
                        raise
                    missing.append(f"{line} (needs {e.name})")
    if missing:  # every other line ran; these need the integration extra
        pytest.skip("needs the integration extra: " + "; ".join(missing))


def test_signatures_written_in_the_readme():
    import streampack
    from streampack import packing, rl

    def keywords(fn) -> set[str]:
        return set(inspect.signature(fn).parameters)

    assert {"packs", "capacity", "align", "pad_id", "ignore_index"} <= keywords(streampack.pack_batch)
    assert {"lengths", "capacity", "algorithm", "seed"} <= keywords(packing.pack)
    assert {"seq_lens", "dp_size", "max_tokens_per_microbatch", "sequence_length_round", "pp_size",
            "chunk_size", "convention", "allow_overlong"} == keywords(rl.plan_dynamic_batches)
    assert {"seq_lens", "dp_size", "max_tokens_per_microbatch", "min_num_microbatches", "algorithm",
            "align", "cost_model"} == keywords(rl.plan_packed_microbatches)
    from streampack.attention import packed_cross_entropy

    assert {"reduction", "num_targets"} <= keywords(packed_cross_entropy)


def test_cli_flags_in_the_readme_exist():
    from streampack.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    section = _section("The `streampack` command")
    rows = [line for line in section.splitlines() if line.startswith("| `streampack ")]
    assert {r.split("`")[1].split()[1] for r in rows} == set(sub.choices)
    for row in rows:
        command = row.split("`")[1].split()[1]
        options = {o for a in sub.choices[command]._actions for o in a.option_strings}
        for flag in re.findall(r"(--[a-z][a-z-]*)", row):
            assert flag in options, f"streampack {command} {flag}"


def test_metrics_keys_named_in_the_readme(tmp_path):
    """``metrics()["overlong"]``, ``["errors"]``, ``["batches"]["fillers"]`` exist."""
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers_data import make_token_docs, write_tar_shards

    from streampack import PackedDataset
    from streampack.options import PackOptions, TopologyOptions

    urls = write_tar_shards(tmp_path, make_token_docs(20, max_len=30), 2)
    ds = PackedDataset(urls, capacity=32, epochs=1, packing=PackOptions(window=8),
                       topology=TopologyOptions(dp_rank=0, dp_size=2, batches_per_epoch=40))
    batches = list(ds)
    metrics = ds.metrics()
    for key in re.findall(r'metrics\(\)\["(\w+)"\]', README):
        assert key in metrics, key
    assert {"packing", "overlong", "errors", "tokenize", "stages", "batches"} <= set(metrics)
    assert len(batches) == 40 and metrics["batches"]["fillers"] > 0
    filler = batches[-1]
    assert filler.doc_keys == ("<filler>",) and filler.num_targets == 0
