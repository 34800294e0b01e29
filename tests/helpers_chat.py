"""Chat tokenizers built in the tests (nothing downloaded): a WordLevel vocabulary of ``w1``..``w75`` and role
names, the special tokens of ChatML, Llama-3 and Qwen2-VL at fixed ids below a tiny model's vocabulary, wrapped in
``PreTrainedTokenizerFast``; and chat templates written here (ChatML, Llama-3 style, ChatML with
``{% generation %}`` markers, one that drops past reasoning, a Qwen2-VL-style one with image parts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<think>", "</think>", "<image>", "<|endoftext|>", "<|image_pad|>", "<|video_pad|>",
            "<|vision_start|>", "<|vision_end|>"]
WORDS = 75
VOCAB = 96
IMAGE_PAD = 90
"""``<|image_pad|>``: the tiny Qwen2-VL's ``image_token_id``."""

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
          "{{ raise_exception('roles must be system, user or assistant') }}{% endif %}"
          "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")
GENERATION = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
              "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
              "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
REASONING = ("{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
             "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}"
             "{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' and loop.index0 < ns.last "
             "and '</think>' in m['content'] %}{{ m['content'].split('</think>')[-1] | trim }}"
             "{% else %}{{ m['content'] }}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
USER_ASSISTANT = ("{% for m in messages %}{% if m['role'] in ['user', 'assistant'] %}"
                  "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
"""A template that silently leaves out every role but user and assistant."""
QWEN2_VL = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['content'] is string %}"
            "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
            "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
            "{% endif %}{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\n' }}{% endif %}")


def backend() -> Any:
    """The ``tokenizers.Tokenizer``: ``[UNK]`` 0, role names 1-4, ``w1``..``w75`` 5-79, the specials from 80."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "user": 1, "assistant": 2, "system": 3, "tool": 4,
             **{f"w{i}": 4 + i for i in range(1, WORDS + 1)}}
    vocab.update({t: 80 + i for i, t in enumerate(SPECIALS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok


def chat_tokenizer(template: str | None = CHATML) -> Any:
    """A ``PreTrainedTokenizerFast`` with ``template`` as its ``chat_template``."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=backend(), bos_token="<|begin_of_text|>",
                                   eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token="[UNK]",
                                   chat_template=template)


def words(rng: np.random.Generator, low: int = 1, high: int = 12) -> str:
    return " ".join(f"w{int(i)}" for i in rng.integers(1, WORDS + 1, int(rng.integers(low, high + 1))))


def conversations(n: int, *, seed: int = 0, turns: tuple[int, int] = (1, 4), system: bool = True) -> list[dict]:
    """``n`` random ``{"messages": [...]}`` records: an optional system turn, then user / assistant exchanges."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": words(rng)}] if system and rng.random() < 0.5 else []
        for _ in range(int(rng.integers(turns[0], turns[1] + 1))):
            messages += [{"role": "user", "content": words(rng)}, {"role": "assistant", "content": words(rng)}]
        out.append({"messages": messages})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
