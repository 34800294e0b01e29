"""streampack's chat masks against TRL's own, record by record (run with the peers' environment, where TRL is
installed; TRL is not a streampack dependency).

TRL's ``SFTTrainer`` prepares the same records with ``assistant_only_loss=True`` (a template with
``{% generation %}`` markers: its mask is ``return_assistant_tokens_mask``) and ``completion_only_loss=True``
(``prompt`` / ``completion`` pairs, plain and conversational); the script compares the ids and the mask TRL trains on
with what streampack's chat stage makes (``ChatOptions()`` defaults), on ChatML with and without markers, and prints
one line per case with the count of records that differ (0 everywhere is the claim).

    PYTHONPATH=.:tests /work/venv-peers/bin/python benchmarks/peers/chat_trl_check.py
"""

from __future__ import annotations

import tempfile

import numpy as np


def trl_rows(records: list[dict], tok, **config) -> list[tuple[list[int], list[int]]]:
    """(ids, mask) of each record as TRL's SFTTrainer prepares it."""
    import transformers
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, pad_token_id=89, eos_token_id=89, bos_token_id=82))
    args = SFTConfig(output_dir=tempfile.mkdtemp(), report_to=[], max_length=None, packing=False, use_cpu=True,
                     bf16=False, **config)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(records), processing_class=tok)
    out = []
    for row in trainer.train_dataset:
        # TRL folds its assistant / completion masks into unshifted labels (-100: not trained)
        out.append((row["input_ids"], [int(label != -100) for label in row["labels"]]))
    return out


def streampack_rows(records: list[dict], tok) -> list[tuple[list[int], list[int]]]:
    from streampack.chat import ChatEncoder
    from streampack.options.tokenize import ChatOptions
    from streampack.sample import Sample

    encoded = ChatEncoder(tok, ChatOptions()).encode([Sample(key=str(i), chat=r) for i, r in enumerate(records)])
    return [(s.tokens.tolist(), s.loss_mask.astype(int).tolist()) for s in encoded]


def main() -> None:
    from helpers_chat import CHATML, GENERATION, chat_tokenizer, conversations

    rng = np.random.default_rng(0)

    def words(n: int) -> str:
        return " ".join(f"w{int(i)}" for i in rng.integers(1, 76, n))

    chats = conversations(50, seed=1)
    pairs = [{"prompt": words(int(rng.integers(2, 12))), "completion": " " + words(int(rng.integers(1, 9)))}
             for _ in range(50)]
    chat_pairs = [{"prompt": [{"role": "user", "content": words(5)}],
                   "completion": [{"role": "assistant", "content": words(4)}]} for _ in range(50)]
    cases = [("messages, assistant_only_loss (markers)", chats, GENERATION, GENERATION, {"assistant_only_loss": True}),
             ("messages, ChatML without markers vs TRL with", chats, CHATML, GENERATION,
              {"assistant_only_loss": True}),
             ("prompt/completion strings, completion_only_loss", pairs, CHATML, CHATML, {"completion_only_loss": True}),
             ("prompt/completion messages, completion_only_loss", chat_pairs, CHATML, CHATML,
              {"completion_only_loss": True})]
    for name, records, ours, theirs, config in cases:
        a = streampack_rows(records, chat_tokenizer(ours))
        b = trl_rows(records, chat_tokenizer(theirs), **config)
        differ = sum(x != y for x, y in zip(a, b))
        supervised = sum(sum(m) for _, m in a)
        print(f"{name}: {len(records)} records, {supervised} supervised tokens, {differ} differ from TRL")


if __name__ == "__main__":
    main()
