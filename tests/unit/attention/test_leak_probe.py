"""The user-facing leak probe catches cross-document attention and passes an isolated model."""

from __future__ import annotations

import sys
from pathlib import Path

import helpers_layouts as layouts
import pytest
import torch

from streampack.attention import leak_probe

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from tiny_gpt import TinyGPT, packed_forward  # noqa: E402


def test_probe_passes_packed_attention_and_catches_a_leak():
    torch.manual_seed(0)
    model = TinyGPT(vocab=100, dim=32, layers=2, heads=4, max_len=64).eval()
    batch = layouts.random_batch(7, capacity=32, align=4, num_packs=2)
    assert batch.num_docs >= 3
    for doc in range(batch.num_docs):
        report = leak_probe(lambda b: packed_forward(model, b), batch, vocab_size=100, doc=doc)
        assert not report.leaked and report.max_diff_other_docs == 0.0
        assert report.max_diff_self > 0  # the perturbation reached the model
    # The classic bug: one causal mask over the whole token axis (positions reset, no cu_seqlens).
    leaky = leak_probe(lambda b: model(b.input_ids[None], position_ids=b.position_ids[None])[0],
                       batch, vocab_size=100, doc=0)
    assert leaky.leaked and leaky.max_diff_other_docs > 1e-4


def test_probe_refuses_single_document_batches_and_bad_shapes():
    batch = layouts.random_batch(0, capacity=8, align=1, num_packs=1, p_more=0.0)
    with pytest.raises(ValueError, match="at least 2 documents"):
        leak_probe(lambda b: b.input_ids[:, None].float(), batch, vocab_size=100)
    two = layouts.random_batch(1, capacity=16, align=1, num_packs=2, p_more=0.0)
    with pytest.raises(ValueError, match="must return"):
        leak_probe(lambda b: b.input_ids[None].float(), two, vocab_size=100)
