"""The synthetic demo corpus: deterministic bytes, long-tail lengths, readable by ShardReader."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from streampack.cli.corpus import (
    document_lengths,
    make_document,
    make_vocabulary,
    write_demo_corpus,
    zipf_cdf,
)


def _digest(paths: list[str]) -> list[str]:
    return [hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths]


@pytest.mark.slow  # ~3 s: writes the demo corpus twice
def test_same_seed_gives_identical_bytes(tmp_path):
    a = write_demo_corpus(tmp_path / "a", num_shards=2, docs_per_shard=20, seed=7)
    b = write_demo_corpus(tmp_path / "b", num_shards=2, docs_per_shard=20, seed=7)
    c = write_demo_corpus(tmp_path / "c", num_shards=2, docs_per_shard=20, seed=8)
    assert [Path(p).name for p in a] == ["corpus-000000.tar", "corpus-000001.tar"]
    assert _digest(a) == _digest(b)
    assert _digest(a) != _digest(c)


def test_lengths_are_long_tailed():
    lengths = document_lengths(20_000, np.random.default_rng(0))
    assert 380 < lengths.mean() < 480  # ~430 words ~ 600 BPE tokens
    assert np.median(lengths) < 0.7 * lengths.mean()  # skewed: most documents are short
    assert (lengths > 2900).mean() > 0.005  # a tail past a 4096-token capacity


def test_documents_have_sentences_and_zipfian_words():
    vocab = make_vocabulary(500, seed=0)
    assert len(set(vocab.tolist())) == 500
    rng = np.random.default_rng(0)
    text = make_document(300, vocab, zipf_cdf(500), rng)
    words = text.split()
    assert len(words) == 300
    assert text[0].isupper() and text.rstrip()[-1] in ".?!"
    counts = np.unique([w.strip(".,?!").lower() for w in words], return_counts=True)[1]
    assert counts.max() > 10 * np.median(counts)  # a few words dominate


def test_shards_read_back_as_text_samples(tmp_path):
    from streampack.nodes.reader import ShardReader

    paths = write_demo_corpus(tmp_path, num_shards=2, docs_per_shard=5, seed=0)
    reader = ShardReader(paths, shuffle=False, epochs=1)
    samples = list(reader)
    assert len(samples) == 10
    assert all(s.text and s.tokens is None for s in samples)
