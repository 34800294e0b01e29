"""Records per second through the chat stage against the plain text stage, on the same conversations.

The conversations: a system turn half the time, then 1-4 user / assistant exchanges of Zipf-distributed words
(``streampack.cli.corpus``), turn lengths lognormal around 60 words. The tokenizer: a byte-level BPE trained here
(4,096 ids) with ChatML's special tokens, in ``PreTrainedTokenizerFast``. Rows, each over the same records, in
blocks of 64 as the Tokenize node encodes them, one process side by side:

- ``text``: the conversations rendered to strings beforehand, through the text stage (``TextEncoder``);
- ``chat``: the chat stage (``ChatEncoder``), ChatML without generation markers (spans from prefix renderings);
- ``chat_markers``: the chat stage, the same template with ``{% generation %}`` markers;
- ``hf_apply_chat_template``: transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)`` one
  record at a time with the marked template (what TRL's ``assistant_only_loss`` runs), for reference.

Each of ``repeats`` rounds runs every case once, in turn; a case's rate is its best round, in wall seconds and in
CPU seconds of the process (the fair measure on a shared box: the tokenizer's batch call spreads over threads
that other jobs' load slows in wall time).

Run: ``PYTHONPATH=. python benchmarks/bench_chat.py`` (``--quick``: 400 records). The last numbers:
``benchmarks/README.md``, "Chat records".
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from streampack.chat import ChatEncoder
from streampack.cli.corpus import make_document, make_vocabulary, zipf_cdf
from streampack.nodes.tokenize import TextEncoder
from streampack.options import TokenizeOptions
from streampack.options.tokenize import ChatOptions
from streampack.sample import Sample

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MARKED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
          "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
          "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
BLOCK = 64


def records(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    vocab, cdf = make_vocabulary(5_000, seed), zipf_cdf(5_000)

    def turn() -> str:
        return make_document(max(1, int(rng.lognormal(np.log(60), 0.7))), vocab, cdf, rng)

    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": turn()}] if rng.random() < 0.5 else []
        for _ in range(int(rng.integers(1, 5))):
            messages += [{"role": "user", "content": turn()}, {"role": "assistant", "content": turn()}]
        out.append({"messages": messages})
    return out


def tokenizer(texts: list[str], template: str) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=4096, special_tokens=["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", chat_template=template)


def _pass(encode: Any, items: list[Any]) -> tuple[float, float, int]:
    """Wall seconds and CPU seconds (every thread of the process: the tokenizer's batch call runs on several) for
    one pass over ``items`` in blocks, and the tokens it made."""
    wall, cpu, tokens = time.perf_counter(), time.process_time(), 0
    for i in range(0, len(items), BLOCK):
        tokens += encode(items[i:i + BLOCK])
    return time.perf_counter() - wall, time.process_time() - cpu, tokens


def run(n: int = 2_000, repeats: int = 3, quick: bool = False) -> list[dict[str, Any]]:
    n, repeats = (400, 2) if quick else (n, repeats)
    recs = records(n)
    plain = tokenizer([m["content"] for r in recs[:200] for m in r["messages"]], CHATML)
    marked = tokenizer([m["content"] for r in recs[:200] for m in r["messages"]], MARKED)
    texts = [plain.apply_chat_template(r["messages"], tokenize=False) for r in recs]
    text_samples = [Sample(key=str(i), text=t) for i, t in enumerate(texts)]
    chat_samples = [Sample(key=str(i), chat=r) for i, r in enumerate(recs)]
    text = TextEncoder(plain.backend_tokenizer, TokenizeOptions())
    chat, chat_marked = ChatEncoder(plain, ChatOptions()), ChatEncoder(marked, ChatOptions())

    def tokens_of(out: list[Any]) -> int:
        return sum(len(s.tokens) for s in out)

    def hf(block: list[dict[str, Any]]) -> int:
        return sum(len(marked.apply_chat_template(r["messages"], return_dict=True,
                                                  return_assistant_tokens_mask=True)["input_ids"]) for r in block)

    cases = {"text": (lambda b: tokens_of(text.encode(b)), text_samples),
             "chat": (lambda b: tokens_of(chat.encode(b)), chat_samples),
             "chat_markers": (lambda b: tokens_of(chat_marked.encode(b)), chat_samples),
             "hf_apply_chat_template": (hf, recs)}
    wall, cpu = dict.fromkeys(cases, float("inf")), dict.fromkeys(cases, float("inf"))
    made = dict.fromkeys(cases, 0)
    for _ in range(repeats):  # rounds of every case in turn: a loaded box slows all of them alike
        for name, (encode, items) in cases.items():
            seconds, cpu_seconds, made[name] = _pass(encode, items)
            wall[name], cpu[name] = min(wall[name], seconds), min(cpu[name], cpu_seconds)
    rows = []
    for name in cases:
        rows.append({"stage": name, "records": n, "tokens": made[name], "records_per_s": round(n / wall[name]),
                     "records_per_cpu_s": round(n / cpu[name]), "vs_text_wall": round(wall["text"] / wall[name], 3),
                     "vs_text_cpu": round(cpu["text"] / cpu[name], 3)})
    turns = np.mean([len(r["messages"]) for r in recs])
    for row in rows:
        row["turns_per_record"] = round(float(turns), 2)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=2_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    for row in run(args.records, args.repeats, quick=args.quick):
        print(row)


if __name__ == "__main__":
    main()
