"""A packed image-text batch gives the same logits and loss as each document alone, on tiny
randomly initialised transformers VLMs built from configs (no download), on CPU.

Pinned to transformers 5.x (checked on 5.24.0). What packed input each model accepts on CPU,
read from that version's source:

* **Qwen2-VL** (``Qwen2VLForConditionalGeneration``). The vision tower takes every image's
  patches flattened, ``[Σ t·h·w, C·tp·p·p]`` with ``image_grid_thw``, and on CPU (sdpa/eager)
  splits attention per frame from ``grid_thw`` itself (``VisionAttention.forward``, the
  non-flash branch) -- so images of several documents never attend to each other; on a GPU with
  flash attention the same spans are ``vision_cu_seqlens`` (``tests/unit/attention/test_vlm_gpu_varlen.py``).
  The language model takes ``position_ids`` ``[4, 1, T]``: row 0 the text positions, from which
  ``create_causal_mask`` rebuilds the per-document causal mask (``find_packed_sequence_indices``:
  a new document wherever the position does not grow by 1) when ``attention_mask`` is None and
  there is no cache (``use_cache=False``); rows 1-3 the mRoPE positions, here from
  :func:`~streampack.layout.vision.mrope_position_ids` restarted per document.
* **LLaVA** (``LlavaForConditionalGeneration``, tiny CLIP + tiny Llama). Images are a batch
  ``[n_images, 3, H, W]`` through CLIP, each image on its own; the Llama text model detects
  packing from ``[1, T]`` ``position_ids`` the same way (``use_cache=False``, no mask).

The reference, each document alone, is the model's own unpacked path: no ``position_ids``
(Qwen2-VL computes mRoPE itself from ``mm_token_type_ids`` via ``get_rope_index``).
Rotary embeddings are relative, so logits cannot see a constant offset of a whole document's
positions: that the positions *restart* per document is proven by equality with
``get_rope_index`` in ``tests/unit/layout/test_vision_layout.py``; here a wrong in-document rule (h and w
swapped) or documents attending to each other (text positions not restarted) both fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from streampack import pack_batch
from streampack.layout.vision import mrope_position_ids

transformers = pytest.importorskip("transformers", minversion="5.0")

IMAGE, VOCAB, MERGE, CHANNELS = 90, 96, 2, 24  # 24 = 3 channels · temporal patch 2 · patch 2²
CAPACITY, ALIGN = 160, 8


@dataclass(frozen=True, slots=True, kw_only=True)
class Doc:
    """One image-text document: ids with placeholders, each image's grid and pixels."""

    ids: torch.Tensor
    grids: torch.Tensor
    """int64 ``[k, 3]`` (Qwen2-VL) or ``[k, 0]`` (fixed-size encoder)."""
    pixels: list[torch.Tensor]

    def labels(self) -> torch.Tensor:
        return torch.where(self.ids == IMAGE, -100, self.ids)


def tiny_qwen2_vl() -> torch.nn.Module:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config={"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "patch_size": 2,
                       "temporal_patch_size": 2, "spatial_merge_size": MERGE, "in_channels": 3},
        image_token_id=IMAGE, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93)
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(config).eval()


def qwen_doc(gen: torch.Generator, grids: list[tuple[int, int]]) -> Doc:
    parts = [torch.randint(1, 89, (int(torch.randint(1, 6, (), generator=gen)),), generator=gen)]
    for h, w in grids:
        parts += [torch.full((h * w // MERGE**2,), IMAGE),
                  torch.randint(1, 89, (int(torch.randint(1, 9, (), generator=gen)),), generator=gen)]
    grid = torch.tensor([[1, h, w] for h, w in grids], dtype=torch.long).reshape(-1, 3)
    return Doc(ids=torch.cat(parts), grids=grid,
               pixels=[torch.randn(h * w, CHANNELS, generator=gen) for h, w in grids])


def qwen_alone(model: torch.nn.Module, doc: Doc) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[L, V]`` and summed loss of the document by itself (the model's own mRoPE)."""
    kw = {}
    if len(doc.grids):
        kw = {"pixel_values": torch.cat(doc.pixels), "image_grid_thw": doc.grids,
              "mm_token_type_ids": (doc.ids == IMAGE).int()[None]}
    out = model(input_ids=doc.ids[None], labels=doc.labels()[None], use_cache=False, **kw)
    return out.logits[0], out.loss * int((doc.labels()[1:] != -100).sum())


def qwen_packed(model: torch.nn.Module, docs: list[Doc], pixels: list[torch.Tensor] | None = None):
    """One THD pack of ``docs`` laid out by ``pack_batch``, mRoPE by ``mrope_position_ids``."""
    batch = pack_batch([[{"input_ids": d.ids, "labels": d.labels()} for d in docs]], capacity=CAPACITY, align=ALIGN)
    hf = batch.hf_inputs()
    grids = torch.cat([d.grids for d in docs])
    mrope = mrope_position_ids(batch.input_ids, batch.varlen_cu_seqlens, grids, IMAGE, MERGE)
    out = model(input_ids=hf.input_ids, labels=hf.labels, use_cache=False,
                position_ids=torch.cat([hf.position_ids[None], mrope[:, None]]),
                pixel_values=torch.cat(pixels if pixels is not None else [p for d in docs for p in d.pixels]),
                image_grid_thw=grids)
    return batch, out


def per_document(logits: torch.Tensor, batch) -> list[torch.Tensor]:
    starts, lengths = batch.cu_seqlens_padded[:-1].tolist(), batch.doc_lengths.tolist()
    return [logits[s:s + n] for s, n in zip(starts, lengths)]


@pytest.fixture(scope="module")
def qwen() -> torch.nn.Module:
    return tiny_qwen2_vl()


def test_qwen2_vl_packed_equals_each_document_alone(qwen: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(1)
    layouts = [[(4, 6)], [], [(2, 2), (4, 4), (6, 2)], [(8, 4), (2, 4)]]  # 0-3 images per document
    docs = [qwen_doc(gen, g) for g in layouts]
    with torch.no_grad():
        batch, out = qwen_packed(qwen, docs)
        alone = [qwen_alone(qwen, d) for d in docs]
    assert batch.num_targets == sum(int((d.labels()[1:] != -100).sum()) for d in docs)
    for got, (want, _) in zip(per_document(out.logits[0], batch), alone):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    loss_alone = sum(loss for _, loss in alone) / batch.num_targets
    torch.testing.assert_close(out.loss, loss_alone, atol=1e-6, rtol=1e-5)


def test_qwen2_vl_perturbing_one_image_changes_only_its_document(qwen: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(2)
    docs = [qwen_doc(gen, g) for g in ([(4, 4)], [(2, 4), (4, 2)], [(6, 4)])]
    pixels = [p for d in docs for p in d.pixels]
    changed = [p.clone() for p in pixels]
    changed[2] += 1.0  # the second image of the middle document
    with torch.no_grad():
        batch, base = qwen_packed(qwen, docs)
        _, moved = qwen_packed(qwen, docs, changed)
    before, after = per_document(base.logits[0], batch), per_document(moved.logits[0], batch)
    assert torch.equal(before[0], after[0]) and torch.equal(before[2], after[2])
    first = int((docs[1].ids == IMAGE).nonzero()[2])  # its placeholders start after image 1's 2
    assert torch.equal(before[1][:first], after[1][:first])  # causal: tokens before the image
    assert (before[1][first:] - after[1][first:]).abs().amax() > 1e-3


def test_qwen2_vl_pack_without_images_in_the_streams_layout_keeps_documents_apart(qwen: torch.nn.Module) -> None:
    """A pack with no image from a Qwen2-VL stream (``vision_layout``): ``hf_inputs()`` as it
    is gives each document's own logits; with ``[1, T]`` positions the model builds no
    per-document mask (logits off by ~0.4, ``tests/unit/media/test_media_vlm.py``)."""
    from streampack.layout.vision_batch import VisionLayout

    gen = torch.Generator().manual_seed(4)
    docs = [qwen_doc(gen, []) for _ in range(4)]
    layout = VisionLayout(layout="patches", image_token_id=IMAGE, merge_size=MERGE, pixel_shape=(CHANNELS,))
    batch = pack_batch([[{"input_ids": d.ids, "labels": d.labels()} for d in docs]], capacity=CAPACITY, align=ALIGN,
                       vision_layout=layout)
    hf = batch.hf_inputs()
    assert hf.position_ids.shape == (4, 1, batch.total_tokens) and hf.pixel_values is None
    with torch.no_grad():
        out = qwen(**hf)
        alone = [qwen_alone(qwen, d) for d in docs]
    for got, (want, _) in zip(per_document(out.logits[0], batch), alone):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def tiny_llava() -> torch.nn.Module:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=8, patch_size=4, projection_dim=32)
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE,
                         vision_feature_layer=-1, vision_feature_select_strategy="default", image_seq_length=4)
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(config).eval()


def llava_doc(gen: torch.Generator, images: int) -> Doc:
    """4 placeholders per 8x8 image: (8/4)² patches, CLIP's CLS token dropped ("default")."""
    parts = [torch.randint(1, 89, (int(torch.randint(1, 6, (), generator=gen)),), generator=gen)]
    for _ in range(images):
        parts += [torch.full((4,), IMAGE), torch.randint(1, 89, (int(torch.randint(1, 9, (), generator=gen)),),
                                                         generator=gen)]
    return Doc(ids=torch.cat(parts), grids=torch.zeros(images, 0, dtype=torch.long),
               pixels=[torch.randn(1, 3, 8, 8, generator=gen) for _ in range(images)])


def test_llava_packed_equals_each_document_alone_and_images_stay_home() -> None:
    model = tiny_llava()
    gen = torch.Generator().manual_seed(3)
    docs = [llava_doc(gen, k) for k in (1, 0, 3, 2)]
    batch = pack_batch([[{"input_ids": d.ids, "labels": d.labels()} for d in docs]], capacity=CAPACITY, align=ALIGN)
    hf = batch.hf_inputs()

    def packed(pixels: list[torch.Tensor]):
        return model(input_ids=hf.input_ids, labels=hf.labels, position_ids=hf.position_ids,
                     pixel_values=torch.cat(pixels), use_cache=False)

    pixels = [p for d in docs for p in d.pixels]
    with torch.no_grad():
        out = packed(pixels)
        alone = [model(input_ids=d.ids[None], labels=d.labels()[None], use_cache=False,
                       pixel_values=torch.cat(d.pixels) if d.pixels else None) for d in docs]
        changed = [p.clone() for p in pixels]
        changed[0] -= 1.0  # the first document's only image
        moved = packed(changed)
    for got, want in zip(per_document(out.logits[0], batch), alone):
        torch.testing.assert_close(got, want.logits[0], atol=2e-5, rtol=1e-4)
    sums = sum(o.loss * int((d.labels()[1:] != -100).sum()) for o, d in zip(alone, docs))
    torch.testing.assert_close(out.loss, sums / batch.num_targets, atol=1e-6, rtol=1e-5)
    before, after = per_document(out.logits[0], batch), per_document(moved.logits[0], batch)
    assert all(torch.equal(b, a) for b, a in zip(before[1:], after[1:]))
    assert (before[0] - after[0]).abs().amax() > 1e-3
