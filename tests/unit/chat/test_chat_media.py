"""Chat records with images: LLaVA ``<image>`` markers and Qwen2-VL image parts become the template's image token,
the media rule expands it as on the image-text path, image tokens are never supervised, and a conversation cut to
whole turns takes its images after the cut with it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers_chat import IMAGE_PAD, QWEN2_VL, chat_tokenizer
from helpers_data import write_tar
from helpers_media import image_bytes

from streampack import PackedDataset
from streampack.media import DynamicResolution, MediaOptions
from streampack.options import PackOptions, TokenizeOptions
from streampack.options.tokenize import ChatOptions

pytest.importorskip("transformers", minversion="5.0")
RULE = DynamicResolution(patch_size=2, merge_size=2, min_pixels=8 * 8, max_pixels=32 * 32)
MEDIA = MediaOptions(rule=RULE, image_token_id=IMAGE_PAD)


def _documents(ds: PackedDataset) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for b in ds:
        for key, s, n in zip(b.doc_keys, b.cu_seqlens_padded[:-1].tolist(), b.doc_lengths.tolist()):
            out[key.rsplit("#", 1)[-1]] = (b.input_ids[s:s + n].numpy(), b.labels[s:s + n].numpy())
    return out


def test_llava_and_qwen_records_expand_images_by_the_media_rule(tmp_path) -> None:
    sizes = {"a": [(16, 24)], "b": [(8, 8), (32, 16)], "c": []}
    records = {"a": {"conversations": [{"from": "human", "value": "<image>\nw1 w2"}, {"from": "gpt", "value": "w3"}]},
               "b": {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w4"},
                                                                {"type": "image"}]},
                                  {"role": "assistant", "content": "w5 w6"}]},
               "c": {"messages": [{"role": "user", "content": "w7"}, {"role": "assistant", "content": "w8"}]}}
    samples = [(k, {"json": json.dumps(r).encode(), **{f"{j}.png": image_bytes(w, h, seed=j)
                                                         for j, (w, h) in enumerate(sizes[k])}})
               for k, r in records.items()]
    url = write_tar(tmp_path / "chat.tar", samples)
    ds = PackedDataset([url], capacity=128, epochs=1, tokenizer=chat_tokenizer(QWEN2_VL), media=MEDIA,
                       tokenize=TokenizeOptions(chat=ChatOptions()), packing=PackOptions(window=4))
    docs = _documents(ds)
    assert sorted(docs) == ["a", "b", "c"]
    for key, (ids, labels) in docs.items():
        want = sum(RULE.count(w, h) for w, h in sizes[key])
        assert int((ids == IMAGE_PAD).sum()) == want
        assert not np.isin(labels, [IMAGE_PAD]).any()  # no image token is a target
        assert (labels != -100).sum() > 0
    image_run = docs["a"][0].tolist().index(IMAGE_PAD)
    assert docs["a"][0][image_run - 1] == 92 and docs["a"][0][image_run + RULE.count(16, 24)] == 93  # vision markers


def test_a_conversation_cut_to_whole_turns_drops_the_images_after_the_cut(tmp_path) -> None:
    record = {"conversations": [{"from": "human", "value": "w1 w2"}, {"from": "gpt", "value": "w3 w4"},
                                {"from": "human", "value": "<image> w5"}, {"from": "gpt", "value": "w6"}]}
    url = write_tar(tmp_path / "chat.tar", [("k", {"json": json.dumps(record).encode(), "0.png": image_bytes(32, 32)})])
    # 16 tokens of text and one image of 64 tokens: only the first exchange fits in 32
    ds = PackedDataset([url], capacity=32, epochs=1, tokenizer=chat_tokenizer(QWEN2_VL), media=MEDIA,
                       tokenize=TokenizeOptions(chat=ChatOptions()), packing=PackOptions(window=4))
    (ids, labels), = _documents(ds).values()
    assert IMAGE_PAD not in ids.tolist() and len(ids) == 10
    assert ds.metrics()["tokenize"]["truncated"] == 1
    dropped = PackedDataset([url], capacity=32, epochs=1, tokenizer=chat_tokenizer(QWEN2_VL), media=MEDIA,
                            tokenize=TokenizeOptions(chat=ChatOptions(overlong="drop")), packing=PackOptions(window=4))
    assert _documents(dropped) == {} and dropped.metrics()["tokenize"]["dropped"] == 1
