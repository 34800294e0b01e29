"""The packed loss of chat records equals fine-tuning each conversation alone, on tiny random transformers models
built from configs (nothing downloaded), on CPU: the sum of per-token losses over the supervised tokens of packed
batches equals the sum over the conversations run one by one, where each conversation's own mask is transformers'
``return_assistant_tokens_mask`` (what TRL's ``assistant_only_loss`` uses) or TRL's ``completion_only_loss`` rule
(the completion starts where the ids of the prompt alone and of prompt + completion diverge), written out here
(TRL is not a dependency; ``benchmarks/peers/chat_trl_check.py`` checks the same masks against TRL itself).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers_chat import CHATML, GENERATION, IMAGE_PAD, QWEN2_VL, VOCAB, chat_tokenizer, conversations, write_jsonl

from streampack import PackedDataset
from streampack.options import PackOptions, TokenizeOptions
from streampack.options.tokenize import ChatOptions

transformers = pytest.importorskip("transformers", minversion="5.0")
CAPACITY = 128


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      bos_token_id=82, eos_token_id=89, pad_token_id=89)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def packed_loss(model: torch.nn.Module, ds: PackedDataset) -> tuple[float, int]:
    """Summed loss over the supervised tokens of every batch, and their count."""
    total, targets = 0.0, 0
    with torch.no_grad():
        for batch in ds:
            logits = model(**batch.hf_inputs()).logits[0].float()
            total += float(F.cross_entropy(logits, batch.labels, ignore_index=-100, reduction="sum"))
            targets += batch.num_targets
    return total, targets


def alone_loss(model: torch.nn.Module, docs: list[tuple[list[int], list[int]]], **extra) -> tuple[float, int]:
    """The same sum with each ``(ids, mask)`` run by itself (HF shifts the labels)."""
    total, targets = 0.0, 0
    with torch.no_grad():
        for ids, mask in docs:
            ids_t = torch.tensor(ids)
            labels = torch.where(torch.tensor(mask, dtype=torch.bool), ids_t, -100)
            n = int((labels[1:] != -100).sum())
            total += float(model(input_ids=ids_t[None], labels=labels[None], use_cache=False).loss) * n
            targets += n
    return total, targets


@pytest.mark.parametrize("template", [pytest.param(GENERATION, marks=pytest.mark.slow), CHATML],
                         ids=["generation-markers", "chatml-no-markers"])
def test_packed_chat_loss_equals_each_conversation_alone(tmp_path, template: str) -> None:
    records = conversations(24, seed=21)
    urls = [str(write_jsonl(tmp_path / "chat.jsonl", records))]
    ds = PackedDataset(urls, capacity=CAPACITY, packs_per_batch=2, epochs=1, tokenizer=chat_tokenizer(template),
                       tokenize=TokenizeOptions(chat=ChatOptions()), packing=PackOptions(window=8))
    reference = chat_tokenizer(GENERATION)  # the same rendering, with the markers HF's mask needs
    docs = []
    for r in records:
        out = reference.apply_chat_template(r["messages"], return_dict=True, return_assistant_tokens_mask=True)
        assert len(out["input_ids"]) <= CAPACITY
        docs.append((out["input_ids"], out["assistant_masks"]))
    model = tiny_llama()
    got, want = packed_loss(model, ds), alone_loss(model, docs)
    assert got[1] == want[1] > 200
    assert got[0] == pytest.approx(want[0], rel=1e-5)


@pytest.mark.slow
def test_packed_prompt_completion_loss_follows_trl(tmp_path) -> None:
    rng = np.random.default_rng(22)
    records = [{"prompt": " ".join(f"w{i}" for i in rng.integers(1, 76, int(rng.integers(3, 20)))),
                "completion": " " + " ".join(f"w{i}" for i in rng.integers(1, 76, int(rng.integers(2, 15))))}
               for _ in range(30)]
    urls = [str(write_jsonl(tmp_path / "pairs.jsonl", records))]
    tok = chat_tokenizer(CHATML)
    ds = PackedDataset(urls, capacity=CAPACITY, packs_per_batch=2, epochs=1, tokenizer=tok,
                       tokenize=TokenizeOptions(chat=ChatOptions()), packing=PackOptions(window=8))
    docs = []
    for r in records:  # TRL's rule: EOS appended, the completion starts where the two id lists diverge
        prompt = tok(r["prompt"])["input_ids"]
        ids = tok(r["prompt"] + r["completion"] + tok.eos_token)["input_ids"]
        start = next((i for i, (a, b) in enumerate(zip(prompt, ids)) if a != b), len(prompt))
        docs.append((ids, [0] * start + [1] * (len(ids) - start)))
    model = tiny_llama()
    got, want = packed_loss(model, ds), alone_loss(model, docs)
    assert got[1] == want[1] > 100
    assert got[0] == pytest.approx(want[0], rel=1e-5)


def _png(width: int, height: int, seed: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.slow
def test_packed_llava_chat_on_qwen2_vl_equals_each_conversation_alone(tmp_path) -> None:
    """LLaVA records (``<image>`` in a human turn, images as tar members) rendered with a Qwen2-VL-style template:
    each ``<image>`` becomes ``<|vision_start|><|image_pad|><|vision_end|>``, the media rule expands the pad to the
    image's tokens exactly as the image-text path does, and no image token is supervised."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "examples"))
    from helpers_data import write_tar
    from vlm_pretrain import RULE, tiny_qwen2_vl

    from streampack.media import MediaOptions

    rng = np.random.default_rng(23)
    samples, alone = [], []
    tok = chat_tokenizer(QWEN2_VL)
    for i in range(10):
        k = int(rng.integers(0, 3))
        sizes = [tuple(int(v) for v in rng.integers(8, 40, 2)) for _ in range(k)]
        human = "<image>" * k + " w1 w2 " + " ".join(f"w{int(x)}" for x in rng.integers(1, 76, 4))
        record = {"conversations": [{"from": "human", "value": human},
                                    {"from": "gpt", "value": " ".join(f"w{int(x)}" for x in rng.integers(1, 76, 6))}]}
        members = {"json": json.dumps(record).encode(), **{f"{j}.png": _png(w, h, 10 * i + j)
                                                           for j, (w, h) in enumerate(sizes)}}
        samples.append((f"s{i:03d}", members))
        alone.append((record, [members[f"{j}.png"] for j in range(k)]))
    urls = [write_tar(tmp_path / "llava.tar", samples)]
    media = MediaOptions(rule=RULE, image_token_id=IMAGE_PAD)
    ds = PackedDataset(urls, capacity=256, epochs=1, tokenizer=tok, media=media,
                       tokenize=TokenizeOptions(chat=ChatOptions()), packing=PackOptions(window=4))
    model = tiny_qwen2_vl(0).eval()
    got_total, got_targets, images = 0.0, 0, 0
    with torch.no_grad():
        for batch in ds:
            images += 0 if batch.vision is None else int(batch.vision.image_grid_thw.shape[0])
            logits = model(**batch.hf_inputs()).logits[0].float()
            labels = batch.labels
            assert not bool(((batch.input_ids == IMAGE_PAD) & (labels != -100)).any())
            assert not bool(((torch.roll(batch.input_ids, -1) == IMAGE_PAD) & (labels != -100)).any())
            got_total += float(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
            got_targets += batch.num_targets
    processor = _processor(tok)
    want_total, want_targets = 0.0, 0
    with torch.no_grad():
        for record, pngs in alone:
            total, n = _qwen_alone(model, processor, tok, record, pngs)
            want_total, want_targets = want_total + total, want_targets + n
    assert images > 5 and got_targets == want_targets > 50
    assert got_total == pytest.approx(want_total, rel=1e-5)


def _processor(tok):
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(patch_size=2, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8,
                                 max_pixels=32 * 32)


def _qwen_alone(model, processor, tok, record: dict, pngs: list[bytes]) -> tuple[float, int]:
    """One conversation through the model alone: the HF image processor's pixels and grids, each pad expanded
    to its grid's tokens as Qwen2VLProcessor does, the assistant mask from the rendering's generation span."""
    import io

    from PIL import Image

    messages = [{"role": "user", "content": record["conversations"][0]["value"]},
                {"role": "assistant", "content": record["conversations"][1]["value"]}]
    content = messages[0]["content"]
    parts = [{"type": "image"}] * content.count("<image>") + [{"type": "text", "text": content.replace("<image>", "")}]
    prompt = tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)["input_ids"]
    full = tok.apply_chat_template([{"role": "user", "content": parts}, messages[1]])["input_ids"]
    kw: dict = {}
    ids = list(full)
    if pngs:
        out = processor(images=[Image.open(io.BytesIO(p)).convert("RGB") for p in pngs], return_tensors="pt")
        counts = (out["image_grid_thw"].prod(-1) // 4).tolist()
        expanded, k = [], 0
        for t in ids:
            expanded += [t] * (counts[k] if t == IMAGE_PAD else 1)
            k += t == IMAGE_PAD
        ids = expanded
        kw = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"],
              "mm_token_type_ids": (torch.tensor(ids) == IMAGE_PAD).int()[None]}
    start = len(ids) - (len(full) - len(prompt))  # the assistant turn: everything after the prompt
    ids_t = torch.tensor(ids)
    labels = ids_t.clone()
    labels[:start] = -100
    n = int((labels[1:] != -100).sum())
    loss = model(input_ids=ids_t[None], labels=labels[None], use_cache=False, **kw).loss
    return float(loss) * n, n
