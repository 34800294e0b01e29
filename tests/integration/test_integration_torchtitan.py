"""torchtitan's data convention and real components on packed batches.

What runs where (torchtitan 0.2.2): ``import torchtitan`` needs ``triton`` (its package import
loads MoE kernels), which installs on a CPU machine from PyPI; its ``varlen`` attention is
CUDA-only and its ``flex`` attention has no backward on CPU ("FlexAttention does not support
backward on CPU"). So on CPU: the collate convention, torchtitan's ``ParallelAwareDataloader``
resume, torchtitan's own EOS-derived masks against ours, and a forward pass of torchtitan's
Llama3 with flex attention; on a GPU also a training step with ``attn_type="varlen"``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers_data import make_token_docs, write_tar_shards

from streampack import PackedDataset, pack_batch
from streampack.integrations.torchtitan import (
    MAX_KEY,
    SPANS_KEY,
    post_dataloading_process,
    titan_collate,
)
from streampack.options import PackOptions, TopologyOptions
from tests.integration.test_examples import EXAMPLES, run

EOS = 2


def trainer_like(attn_type: str, cp: bool = False) -> SimpleNamespace:
    return SimpleNamespace(model_args=SimpleNamespace(attn_type=attn_type),
                           parallel_dims=SimpleNamespace(cp_enabled=cp))


def test_collate_gives_torchtitans_input_dict_and_shifted_labels() -> None:
    batch = pack_batch([[[5, 6, 7], [8, 9]], [[3] * 4]], capacity=6, align=1, ignore_index=-1)
    inputs, labels = titan_collate(batch)
    assert inputs["input"].shape == inputs["positions"].shape == labels.shape == (1, 12)
    assert torch.equal(inputs["positions"][0], batch.position_ids)
    assert labels[0].tolist() == [6, 7, -100, 9, -100, -100, 3, 3, 3, -100, -100, -100]
    assert inputs[SPANS_KEY] is batch.varlen_cu_seqlens and inputs[MAX_KEY] == batch.varlen_max_seqlen
    with pytest.raises(ValueError, match="attends across"):
        post_dataloading_process(trainer_like("sdpa"), inputs, labels)
    with pytest.raises(NotImplementedError, match="context parallelism"):
        post_dataloading_process(trainer_like("varlen", cp=True), inputs, labels)


titan = pytest.mark.slow  # importing torchtitan takes ~10 s on this machine


def _titan():  # noqa: ANN202
    return pytest.importorskip("torchtitan.models.attention", reason="torchtitan needs triton to import")


@titan
def test_eos_derived_masks_merge_split_chunks_and_misplace_padding() -> None:
    """torchtitan's own create_varlen_metadata_for_document: right for EOS-terminated documents
    without padding between them, wrong for split chunks (no EOS) and alignment padding."""
    attention = _titan()
    plain = pack_batch([[[5, 6, EOS], [7, EOS], [8, 9, 4, EOS]]], capacity=10)
    theirs = attention.create_varlen_metadata_for_document(plain.input_ids[None], EOS)
    assert torch.equal(theirs.cu_seq_q, plain.varlen_cu_seqlens)  # [0, 3, 5, 9, 10]
    chunks = pack_batch([[[5, 6, 7], [8, 9, EOS], [4, EOS]]], capacity=8)  # a sample split in two
    theirs = attention.create_varlen_metadata_for_document(chunks.input_ids[None], EOS)
    assert theirs.cu_seq_q.tolist() == [0, 6, 8] and chunks.varlen_cu_seqlens.tolist() == [0, 3, 6, 8]
    aligned = pack_batch([[[5, EOS], [7, 8, 9, EOS]]], capacity=8, align=4)  # 5 EOS P P | 7 8 9 EOS
    theirs = attention.create_varlen_metadata_for_document(aligned.input_ids[None], EOS)
    assert theirs.cu_seq_q.tolist() == [0, 2, 8]  # the padding [2, 4) opens the next document
    assert aligned.varlen_cu_seqlens.tolist() == [0, 4, 8]


@titan
def test_torchtitans_dataloader_resumes_exactly(tmp_path: Path) -> None:
    _titan()
    from streampack.integrations.torchtitan import titan_dataloader

    urls = write_tar_shards(tmp_path, make_token_docs(200, max_len=40, seed=3), 4)

    def loader():  # noqa: ANN202
        return titan_dataloader(PackedDataset(urls, capacity=64, packing=PackOptions(window=8)), dp_rank=0,
                                dp_world_size=1, num_workers=2)

    full = [inputs["input"] for (inputs, _), _ in zip(loader(), range(10))]
    first = loader()
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict()
    assert set(state) == {"dp_rank_0", "world_size"}  # torchtitan's checkpoint layout
    resumed = loader()
    resumed.load_state_dict(state)
    again = [inputs["input"] for (inputs, _), _ in zip(resumed, range(6))]
    assert all(torch.equal(a, b) for a, b in zip(full[4:], again))


def tiny_llama3(attn_type: str):  # noqa: ANN201
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    # torchtitan's varlen wrapper passes no enable_gqa (torch 2.11's kernel has none): equal heads
    args = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=4 if attn_type == "varlen" else 2,
                                vocab_size=128,
                                multiple_of=16, max_seq_len=64, attn_type=attn_type,
                                attn_mask_type="block_causal")
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


def _docs() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 9, 3, 7, 1, 12)]


@titan
def test_torchtitan_llama3_flex_forward_equals_each_document_alone() -> None:
    """torchtitan's real model, masks from the carried spans (not EOS), positions per document:
    every document's logits equal the document run alone (CPU compiles flex: ~15 s)."""
    _titan()
    docs = _docs()
    batch = pack_batch([docs[:2], docs[2:5], docs[5:]], capacity=16, align=2)
    model = tiny_llama3("flex").eval()
    inputs, labels, extra_inputs, extra_kwargs = post_dataloading_process(
        trainer_like("flex"), *titan_collate(batch))
    with torch.no_grad():
        packed = model(inputs, **extra_inputs, **extra_kwargs)[0]
        for doc, start in zip(docs, batch.cu_seqlens_padded[:-1].tolist()):
            alone_batch = pack_batch([[doc]], capacity=16)
            a_inputs, _, a_extra, a_kwargs = post_dataloading_process(
                trainer_like("flex"), *titan_collate(alone_batch))
            alone = model(a_inputs, **a_extra, **a_kwargs)[0][:len(doc)]
            torch.testing.assert_close(packed[start:start + len(doc)], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_torchtitan_llama3_varlen_training_step_on_a_gpu() -> None:
    _titan()
    from torchtitan.components.loss import cross_entropy_loss

    docs = _docs()
    batch = pack_batch([docs[:2], docs[2:5], docs[5:]], capacity=16, align=1).to("cuda")
    model = tiny_llama3("varlen").cuda()
    inputs, labels, extra_inputs, extra_kwargs = post_dataloading_process(
        trainer_like("varlen"), *titan_collate(batch))
    loss = cross_entropy_loss(model(inputs, **extra_inputs, **extra_kwargs), labels) / batch.num_targets
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters()
                                        if p.grad is not None)


@titan
def test_example_torchtitan_loop() -> None:
    _titan()
    out = run([sys.executable, str(EXAMPLES / "torchtitan_loop.py")])
    assert "identical losses after resume: True" in out


def test_titan_dataloader_refuses_a_dp_rank_the_dataset_does_not_read(tmp_path: Path, monkeypatch) -> None:
    """torchtitan keys the loader state by its dp_rank; the data came from the rank the dataset
    resolved (here the RANK/WORLD_SIZE default of 0 of 1): the two silently disagreed. (The
    check runs before torchtitan is imported, so this needs no torchtitan.)"""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    from streampack.integrations.torchtitan import titan_dataloader

    urls = write_tar_shards(tmp_path, make_token_docs(20, max_len=40, seed=3), 2)
    with pytest.raises(ValueError, match=r"dp_rank=1, dp_world_size=2\) but the dataset resolved dp_rank=0, dp_size=1"):
        titan_dataloader(PackedDataset(urls, capacity=64, packing=PackOptions(window=8)), dp_rank=1, dp_world_size=2)
    with pytest.raises(ValueError, match=r"dp_rank=0, dp_world_size=2\) but the dataset resolved dp_rank=0, dp_size=4"):
        titan_dataloader(PackedDataset(urls, capacity=64, packing=PackOptions(window=8),
                                       topology=TopologyOptions(dp_rank=0, dp_size=4)), dp_rank=0,
                         dp_world_size=2)
