"""The README's hand-built torchdata graph (examples/hand_built_graph.py) equals PackedDataset
batch for batch and resumes exactly through ``torchdata.nodes.Loader.state_dict()``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from streampack.cli.corpus import train_demo_tokenizer, write_demo_corpus

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "hand_built_graph.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("hand_built_graph", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("hand_built")
    urls = write_demo_corpus(root / "corpus", num_shards=2, docs_per_shard=60, vocab_size=600)
    return urls, str(train_demo_tokenizer(urls, root / "tokenizer.json", vocab_size=400))


@pytest.mark.parametrize("save_at", [1, 4])
def test_both_ways_equal_packed_dataset_and_resume_exactly(example, corpus, save_at):
    urls, tokenizer = corpus
    assert example.check(urls, tokenizer, steps=7, save_at=save_at) == {"by_hand": True, "with_builder": True}


def test_the_check_can_fail(example, corpus, monkeypatch):
    urls, tokenizer = corpus
    original = example.by_hand
    monkeypatch.setattr(example, "by_hand", lambda u, t: original(u[::-1], t))  # other shard list: other stream
    assert example.check(urls, tokenizer, steps=3, save_at=1) == {"by_hand": False, "with_builder": True}
