"""A real client: a tiny random LlamaForCausalLM fed ``batch.hf_inputs()`` behaves as if each
document ran alone (no download: the model is built from a config)."""

from __future__ import annotations

import pytest
import torch

from streampack import pack_batch
from streampack.attention import unpack_per_document

transformers = pytest.importorskip("transformers")


def tiny_llama(impl: str) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        attn_implementation=impl,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def fixture_batch():  # noqa: ANN201
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (5, 9, 3, 7, 1, 12)]
    masked = {"input_ids": docs[3], "loss_mask": [0, 0, 0, 1, 1, 1, 1]}  # prompt not trained
    packs = [[docs[0], docs[1]], [docs[2], masked, docs[4]], [docs[5]]]
    return docs, [1, 1, 1, 3, 1, 1], pack_batch(packs, capacity=24, align=4)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_llama_equals_each_document_alone(impl: str) -> None:
    model = tiny_llama(impl)
    docs, first_trained, batch = fixture_batch()
    inputs = batch.hf_inputs()
    assert inputs.use_cache is False
    with torch.no_grad():
        out = model(**inputs)
        per_doc = unpack_per_document(out.logits, batch)
        loss_sum, n_targets = 0.0, 0
        for doc, start, got in zip(docs, first_trained, per_doc):
            ids = torch.tensor([doc])
            labels = ids.clone()
            labels[0, :start] = -100  # same loss mask as the packed document
            alone = model(input_ids=ids, labels=labels if len(doc) > 1 else None, use_cache=False)
            torch.testing.assert_close(got, alone.logits[0], atol=1e-5, rtol=1e-5)
            n = len(doc) - start
            if n > 0:
                loss_sum += float(alone.loss) * n
                n_targets += n
    assert n_targets == batch.num_targets
    assert torch.isfinite(out.logits).all()
    torch.testing.assert_close(float(out.loss), loss_sum / n_targets, atol=1e-5, rtol=1e-5)


def test_leak_probe_sees_cross_document_attention_without_packing_signal() -> None:
    """Guard against a vacuous pass: the same model given plain ``arange`` positions (what a
    collator that forgets to reset them emits) mixes documents, and the probe notices."""
    model = tiny_llama("sdpa")
    docs, _, batch = fixture_batch()
    T = batch.total_tokens
    with torch.no_grad():
        good = model(**batch.hf_inputs()).logits
        leaky = model(input_ids=batch.input_ids[None], position_ids=torch.arange(T)[None],
                      use_cache=False).logits
    second = slice(int(batch.cu_seqlens_padded[1]), int(batch.cu_seqlens_padded[1]) + len(docs[1]))
    assert not torch.allclose(good[0, second], leaky[0, second], atol=1e-3)


def test_perturbing_one_document_leaves_others_unchanged() -> None:
    model = tiny_llama("sdpa")
    _, _, batch = fixture_batch()
    inputs = batch.hf_inputs().as_dict()
    with torch.no_grad():
        base = model(**inputs).logits[0]
        ids = inputs["input_ids"].clone()
        s, e = int(batch.cu_seqlens_padded[1]), int(batch.cu_seqlens_padded[2])
        ids[0, s:e] = (ids[0, s:e] + 7) % 128
        changed = model(**{**inputs, "input_ids": ids}).logits[0]
    for i, (a, b) in enumerate(zip(unpack_per_document(base, batch),
                                   unpack_per_document(changed, batch))):
        if i == 1:
            assert not torch.allclose(a, b)
        else:
            assert torch.equal(a, b), f"document {i} changed when document 1 did"
