"""The module paths the data-flow layout removed (``streampack.pipeline.*``, ``streampack.batch``,
``streampack.overlong``; commit a22b0fd) and the ``round_before_budget`` argument (commit
69558e6) broke every downstream import and call. They are deprecated aliases now: the old
import works, warns once naming the new path, and gives the current objects themselves."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

from streampack.rl import plan_dynamic_batches

OLD = {  # old module -> one name it held and the module that holds it now
    "streampack.batch": ("PackedBatch", "streampack.layout.batch"),
    "streampack.overlong": ("apply_overlong", "streampack.nodes.overlong"),
    "streampack.pipeline.collate": ("ThdCollate", "streampack.nodes.collate"),
    "streampack.pipeline.errors": ("DataError", "streampack.errors"),
    "streampack.pipeline.jsonl_source": ("iter_jsonl_items", "streampack.io.jsonl"),
    "streampack.pipeline.mixture": ("check_weights", "streampack.nodes.mixture"),
    "streampack.pipeline.overlong_node": ("OverlongNode", "streampack.nodes.overlong"),
    "streampack.pipeline.packed_source": ("PackedShardReader", "streampack.nodes.packed_reader"),
    "streampack.pipeline.packed_writer": ("write_packed_dataset", "streampack.io.packed_writer"),
    "streampack.pipeline.s3": ("ENDPOINT_ENV", "streampack.io.storage"),
    "streampack.pipeline.shard_index": ("ShardIndex", "streampack.io.index"),
    "streampack.pipeline.sharding": ("resolve_topology", "streampack.topology"),
    "streampack.pipeline.source": ("ShardReader", "streampack.nodes.reader"),
    "streampack.pipeline.stages": ("MapSamples", "streampack.nodes.stages"),
    "streampack.pipeline.tar_source": ("iter_tar_items", "streampack.io.tar"),
    "streampack.pipeline.tokenize": ("Tokenize", "streampack.nodes.tokenize"),
    "streampack.pipeline.urls": ("expand_urls", "streampack.io.urls"),
    "streampack.pipeline.window_packer": ("WindowPacker", "streampack.nodes.window_packer"),
}


def _fresh_import(name: str) -> tuple[object, list[warnings.WarningMessage]]:
    sys.modules.pop(name, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    return module, [w for w in caught if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize("old", sorted(OLD))
def test_old_module_paths_import_warn_once_and_give_the_current_objects(old: str) -> None:
    name, new = OLD[old]
    module, caught = _fresh_import(old)
    assert len(caught) == 1, [str(w.message) for w in caught]
    said = str(caught[0].message)
    assert old in said and f"-> {new}" in said and name in said
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
    for each in module.__all__:  # every old name that has a successor resolves to it
        assert getattr(module, each) is not None, each


def test_the_old_import_statement_works_and_the_warning_points_at_the_importer() -> None:
    sys.modules.pop("streampack.batch", None)
    with pytest.warns(DeprecationWarning, match=r"streampack\.batch is deprecated.*streampack\.layout\.batch") as got:
        from streampack.batch import PackedBatch, pack_batch  # noqa: F401
    from streampack.layout.batch import PackedBatch as Current

    assert PackedBatch is Current and got[0].filename == __file__
    namespace: dict[str, object] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        exec("from streampack.pipeline.urls import *", namespace)  # noqa: S102
    assert {"expand_urls", "OpenOptions", "open_shard"} <= set(namespace)


def test_removed_names_say_what_replaced_them() -> None:
    module, _ = _fresh_import("streampack.pipeline.mixture")
    with pytest.raises(AttributeError, match=r"MixtureNode was removed: replaced by streampack\.nodes\.mixture\.Mixture"):
        module.MixtureNode  # noqa: B018
    module, _ = _fresh_import("streampack.pipeline.s3")
    with pytest.raises(AttributeError, match="fsspec"):
        module.open_object  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        module.nothing  # noqa: B018


def test_round_before_budget_is_a_deprecated_convention() -> None:
    lens = [2, 4, 7, 6, 3, 4, 9, 1]
    kw = dict(dp_size=2, max_tokens_per_microbatch=20, sequence_length_round=2)
    for flag, convention in ((True, "balanced"), (False, "roll")):
        with pytest.warns(DeprecationWarning, match=f"pass convention='{convention}'"):
            old = plan_dynamic_batches(lens, round_before_budget=flag, **kw)
        new = plan_dynamic_batches(lens, convention=convention, **kw)
        assert old.padded_lengths == new.padded_lengths
        assert [[m.tolist() for m in rank] for rank in old.microbatches] == \
            [[m.tolist() for m in rank] for rank in new.microbatches]
    with pytest.raises(ValueError, match="round_before_budget=True means convention='balanced'"):
        plan_dynamic_batches(lens, round_before_budget=True, convention="roll", **kw)
