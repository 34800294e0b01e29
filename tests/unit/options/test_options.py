"""The front: PackedDataset's few parameters and the per-stage option records
(streampack.options); a flat keyword of earlier versions is Python's own TypeError."""

from __future__ import annotations

import dataclasses
import inspect
import json
import random
from pathlib import Path

import pytest

from streampack.dataset import PackedDataset
from streampack.io.limits import Limits
from streampack.options import (
    RECORDS,
    CostOptions,
    PackOptions,
    ReadOptions,
    TokenizeOptions,
    TopologyOptions,
)
from streampack.packing.schedule import Balance
from streampack.settings import FINGERPRINT, StreamConfig, fingerprint_settings

OLD_SIGNATURE = (  # PackedDataset.__init__ before the records
    "urls capacity window algorithm packs_per_batch tokenizer text_key tokens_key overlong cp_size tp_size seed "
    "shuffle epochs dp_rank dp_size dp_group on_error pad_id ignore_index bos_id eos_id stages num_threads "
    "tokenize_block max_wait slack batches_per_epoch equal_batches labels_key loss_mask_key sequence_parallel "
    "align_multiple allow_pipe allow_pickle cache_dir manifest retries retry_budget connect_timeout read_timeout "
    "request_deadline allow_redirects storage_options pin_memory mixture_stop vocab_size limits cost_model balance "
    "identity").split()
SHAPE = {"hidden": 64, "layers": 2, "heads": 4, "ffn": 128}


@pytest.fixture
def shards(tmp_path):
    """Three small jsonl shards of pre-tokenized samples."""
    rng = random.Random(11)
    urls = []
    for i in range(3):
        lines = [json.dumps({"ids": [rng.randrange(1, 1000) for _ in range(rng.randrange(3, 130))]}) for _ in range(40)]
        urls.append(str(tmp_path / f"shard_{i}.jsonl"))
        Path(urls[-1]).write_text("\n".join(lines) + "\n")
    return urls


def test_signature_is_small():
    params = inspect.signature(PackedDataset).parameters
    assert len(params) <= 15, list(params)
    assert set(RECORDS) <= set(params)
    assert all(p.kind is p.KEYWORD_ONLY for name, p in params.items() if name != "urls")  # no catch-all


FLAT = [k for k in OLD_SIGNATURE if k not in inspect.signature(PackedDataset).parameters]
"""The keywords of earlier versions that are record fields now."""


def test_every_old_keyword_is_a_parameter_or_a_record_field():
    params = set(inspect.signature(PackedDataset).parameters)
    assert len(OLD_SIGNATURE) == len(set(OLD_SIGNATURE)) == 51 and len(FLAT) == 43
    added = {"media"}  # parameters that came after the records (no flat form to keep)
    assert set(OLD_SIGNATURE) - set(FLAT) == params - set(RECORDS) - added  # nothing lost, nothing new
    fields = {f.name for kind in RECORDS.values() for f in dataclasses.fields(kind)}
    renamed = {"tokenize_block": "block_size", "cost_model": "model"}
    assert {renamed.get(k, k) for k in FLAT} <= fields


@pytest.mark.parametrize(("make", "kind", "message"), [
    (lambda: ReadOptions(on_error="ignore"), ValueError, r"ReadOptions\(on_error='ignore'\): must be one of"),
    (lambda: ReadOptions(tokens_key=3), TypeError, r"ReadOptions\(tokens_key=3\): must be a str"),
    (lambda: ReadOptions(vocab_size=0), ValueError, r"ReadOptions: vocab_size=0 must be None or an int"),
    (lambda: ReadOptions(retry_budget=-1), ValueError, r"ReadOptions: need budget >= 0"),
    (lambda: ReadOptions(read_timeout=0), ValueError, r"ReadOptions: read_timeout=0 must be a number > 0"),
    (lambda: ReadOptions(identity="mtime"), ValueError, r"ReadOptions: identity='mtime' must be one of"),
    (lambda: ReadOptions(mixture_stop="never"), ValueError, r"ReadOptions\(mixture_stop='never'\)"),
    (lambda: ReadOptions(limits={"max_line_bytes": 1}), TypeError, r"ReadOptions\(limits=.*must be a Limits"),
    (lambda: TokenizeOptions(num_threads=0), ValueError, r"TokenizeOptions\(num_threads=0\): must be an int >= 1"),
    (lambda: TokenizeOptions(eos_id=-1), ValueError, r"TokenizeOptions\(eos_id=-1\): must be None or an int"),
    (lambda: TokenizeOptions(block_size=0), ValueError, r"TokenizeOptions\(block_size=0\)"),
    (lambda: PackOptions(window=0), ValueError, r"PackOptions\(window=0\): must be an int >= 1"),
    (lambda: PackOptions(algorithm="best"), ValueError, r"PackOptions\(algorithm='best'\): unknown packing"),
    (lambda: PackOptions(overlong="wrap"), ValueError, r"PackOptions\(overlong='wrap'\): must be one of"),
    (lambda: PackOptions(max_wait=0), ValueError, r"PackOptions\(max_wait=0\)"),
    (lambda: PackOptions(slack=-1), ValueError, r"PackOptions\(slack=-1\): must be None or an int >= 0"),
    (lambda: TopologyOptions(equal_batches="guess"), ValueError, r"TopologyOptions\(equal_batches='guess'\)"),
    (lambda: TopologyOptions(batches_per_epoch=0), ValueError, r"TopologyOptions\(batches_per_epoch=0\)"),
    (lambda: TopologyOptions(dp_rank=2, dp_size=2), ValueError, r"TopologyOptions: need 0 <= dp_rank < dp_size"),
    (lambda: TopologyOptions(cp_size=0), ValueError, r"TopologyOptions: cp_size=0 must be a positive int"),
    (lambda: TopologyOptions(align_multiple=0), ValueError, r"TopologyOptions: align_multiple=0 must be"),
    (lambda: CostOptions(balance="cost"), ValueError, r"CostOptions\(balance='cost'\) needs model="),
    (lambda: CostOptions(model={"hidden": 64}), ValueError, r"CostOptions\(model=\{'hidden': 64\}\): not a model"),
    (lambda: CostOptions(model=3), TypeError, r"CostOptions\(model=...\): must be a CostModel"),
    (lambda: CostOptions(model=SHAPE, balance="fast"), ValueError, r"CostOptions\(balance='fast'\)"),
    (lambda: StreamConfig(capacity=102, topology=TopologyOptions(cp_size=2)), ValueError,
     r"capacity=102 must be a multiple of align=4"),
    (lambda: StreamConfig(capacity=64, epochs=0), ValueError, r"StreamConfig\(epochs=0\): must be None or an int"),
    (lambda: StreamConfig(capacity=64, topology=TopologyOptions(batches_per_epoch=4)), ValueError,
     r"batches_per_epoch=4 needs a finite stream"),
])
def test_each_record_checks_its_own_values(make, kind, message):
    with pytest.raises(kind, match=message):
        make()


def test_records_hold_what_they_were_given_as_the_nodes_take_it():
    assert ReadOptions(limits=None).limits == Limits()  # the flat keyword's old default spelling
    cost = CostOptions(model=SHAPE, balance="cost")
    assert cost.balance == Balance() and cost.model.linear > 0  # converted once, here
    assert TopologyOptions(cp_size=2, tp_size=2).align == 8
    assert TopologyOptions(tp_size=2, sequence_parallel=False, align_multiple=16).align == 16
    assert ReadOptions(tokens_key="ids", vocab_size=9).decode().tokens_key == "ids"


@pytest.mark.parametrize("keyword", FLAT)
def test_a_flat_keyword_is_refused(shards, keyword):
    """No shortcut onto a record field remains (refused before any shard is opened)."""
    with pytest.raises(TypeError, match=rf"__init__\(\) got an unexpected keyword argument '{keyword}'$"):
        PackedDataset(shards, capacity=64, **{keyword: 8})


def test_unknown_keywords_and_wrong_records_are_type_errors(shards):
    with pytest.raises(TypeError, match=r"__init__\(\) got an unexpected keyword argument 'windw'$"):
        PackedDataset(shards, capacity=64, windw=8)  # not a record field: Python's own error
    with pytest.raises(TypeError, match=r"packing= must be a streampack.options.PackOptions, got dict"):
        PackedDataset(shards, capacity=64, packing={"window": 8})


def test_records_make_the_fingerprint(shards):
    ds = PackedDataset(shards, capacity=64, packing=PackOptions(window=8, algorithm="ffd"),
                       tokenize=TokenizeOptions(block_size=7), topology=TopologyOptions(dp_rank=0, dp_size=1),
                       read=ReadOptions(retry_budget=5.0), cost=CostOptions(model=SHAPE, balance="cost"))
    assert ds.fingerprint(0)["balance"] == {k: v for k, v in dataclasses.asdict(Balance()).items() if k != "seeded"}
    assert ds.fingerprint(0)["window"] == 8 and ds.fingerprint(0)["algorithm"] == "ffd"
    assert list(ds.fingerprint(0))[:len(FINGERPRINT)] == list(FINGERPRINT)


def test_the_group_is_resolved_and_not_kept(shards):
    ds = PackedDataset(shards, capacity=64, topology=TopologyOptions(dp_rank=1, dp_size=2, equal_batches="sync"))
    assert (ds.dp_rank, ds.dp_size) == (1, 2)
    assert ds.config.topology.dp_group is None and ds.config.topology.equal_batches == "sync"


def test_fingerprint_names_every_setting_that_shapes_the_stream():
    got = fingerprint_settings(StreamConfig(capacity=64))
    text_limits = {k: v for k, v in dataclasses.asdict(Limits()).items() if k not in ("max_image_pixels", "max_sample_pixels")}
    assert list(got) == list(FINGERPRINT) and got["limits"] == text_limits  # image limits: only with media=
    assert got["align"] == 1 and got["cost_model"] is None and got["balance"] is None


def test_each_node_takes_its_record_as_the_config_made_it(shards):
    """One record in, each node's record out: the packer runs the rules a plan counts with, the
    collate lays out the config's batch, and every node that meets bad input applies the one
    ErrorPolicy of the graph, counting into the graph's counter."""
    from streampack.graph.build import Placement, build_graph, counting_for, packer_seed

    ds = PackedDataset(shards, capacity=64, packs_per_batch=2, seed=5, read=ReadOptions(on_error="skip"),
                       packing=PackOptions(window=8, algorithm="kk", max_wait=3, pad_id=7),
                       topology=TopologyOptions(align_multiple=4))
    place = Placement(worker_id=1, num_workers=2)
    graph = build_graph(ds.config, ds.sources, place)
    nodes = graph.nodes
    rules = nodes["packer"].rules
    assert rules == ds.config.packer_rules(packer_seed(ds.config, place))
    assert (rules.capacity, rules.window, rules.algorithm, rules.align, rules.max_wait) == (64, 8, "kk", 4, 3)
    two_ranks = Placement(dp_size=2)
    assert counting_for(ds.config, two_ranks).rules == ds.config.packer_rules(ds.config.seed)
    assert nodes["collate"].layout == ds.config.batch_layout() and nodes["collate"].pad_id == 7
    policies = {id(nodes["reader"]._policy), id(nodes["overlong"]._policy)}
    assert len(policies) == 1 and nodes["reader"]._policy.on_error == "skip"
    assert nodes["reader"].errors is graph.errors


def test_on_error_is_checked_once_by_the_policy_it_makes():
    from streampack.errors import ErrorPolicy

    with pytest.raises(ValueError, match=r"^ErrorPolicy\(on_error='ignore'\): must be one of \('raise', 'skip'\)$"):
        ErrorPolicy("ignore")
    assert ReadOptions(on_error="skip").error_policy().on_error == "skip"
