"""streampack's chat masks against TRL's own, record by record (run with the peers' environment, where TRL is
installed; TRL is not a streampack dependency).

TRL's ``SFTTrainer`` prepares the same records with ``assistant_only_loss=True`` (a template with
``{% generation %}`` markers: its mask is ``return_assistant_tokens_mask``) and ``completion_only_loss=True``
(``prompt`` / ``completion`` pairs, plain and conversational); the script compares the ids and the mask TRL trains on
with what streampack's chat stage makes (``ChatOptions()`` defaults), on ChatML with and without markers, and prints
one line per case with the count of records that differ (0 everywhere is the claim).

Then TRL's shipped chat templates (``trl/chat_templates``): each model's released template, which has no generation
markers, against its ``*_training.jinja`` twin, which has them. streampack finds the assistant spans from the
rendering of the released template; transformers marks them from the twin's ``{% generation %}`` blocks. Per
template: records whose masks agree; differ only at the edges of a turn (``edges``: the twin also marks the
assistant header, the opener of a thinking block that the generation prompt already gives at inference, or the
newline after the end-of-turn token — each twin's author chose); whose twin renders other text; differ otherwise;
or that streampack refuses (and why), for ``train_on="assistant"`` and ``"last"``, on random conversations tokenized
by a byte-level BPE trained here (no special tokens: ``<|im_end|>`` is several tokens, so every edge shows).

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
    shipped_templates()


def _edges_only(ours: np.ndarray, twin: np.ndarray, pieces: list[str]) -> bool:
    """The masks differ only at the edges of the twin's spans: each of its runs holds one run of ours, with more
    marked before it (the header, a thinking block's opener: what the generation prompt gives at inference) or
    after it (the newline after the end-of-turn token), and ours marks nothing else but whitespace."""
    ours, twin = np.asarray(ours, bool), np.asarray(twin, bool)
    if any(pieces[k].strip() for k in np.flatnonzero(ours & ~twin)):
        return False
    ours = ours & twin
    edges = np.flatnonzero(np.diff(np.concatenate([[0], twin.astype(np.int8), [0]])))
    for start, stop in zip(edges[::2], edges[1::2]):
        inside = np.flatnonzero(ours[start:stop])
        if not inside.size or inside[-1] - inside[0] + 1 != inside.size:
            return False
    return True


def shipped_templates(n: int = 40) -> None:
    from pathlib import Path

    import trl
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from streampack.chat import ChatEncoder
    from streampack.errors import DataError
    from streampack.options.tokenize import ChatOptions
    from streampack.sample import Sample

    rng = np.random.default_rng(2)
    lexicon = ["the", "cat", "sat", "on", "a", "mat", "why", "is", "sky", "blue", "because", "light", "scatters",
               "yes", "no", "maybe", "thanks", "hello", "world", "answer", "question", "think", "about", "it"]

    def text(k: int) -> str:
        return " ".join(lexicon[int(i)] for i in rng.integers(0, len(lexicon), k)).capitalize() + "."

    chats = []
    for _ in range(n):
        messages = [{"role": "system", "content": text(6)}] if rng.random() < 0.3 else []
        for _ in range(int(rng.integers(1, 4))):
            messages += [{"role": "user", "content": text(int(rng.integers(3, 12)))},
                         {"role": "assistant", "content": text(int(rng.integers(3, 12)))}]
        chats.append({"messages": messages})
    folder = Path(trl.__file__).parent / "chat_templates"
    for training in sorted(folder.glob("*_training.jinja")):
        released = folder / training.name.replace("_training", "")
        if not released.exists():
            continue
        ours, theirs = released.read_text(), training.read_text()
        bpe = Tokenizer(models.BPE(unk_token=None))
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        bpe.train_from_iterator([m["content"] for c in chats for m in c["messages"]] + [ours[:4000]],
                                trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                    show_progress=False))
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
        for train_on in ("assistant", "last"):
            encoder = ChatEncoder(tok, ChatOptions(template=ours, train_on=train_on))
            got = encoder.encode([Sample(key=str(i), chat=c) for i, c in enumerate(chats)])
            same = edges = other = differ = 0
            refused: dict[str, int] = {}
            for chat, s in zip(chats, got):
                if isinstance(s, DataError):
                    refused[s.reason] = refused.get(s.reason, 0) + 1
                    continue
                try:
                    want = tok.apply_chat_template(chat["messages"], chat_template=theirs, return_dict=True,
                                                   return_assistant_tokens_mask=True)
                except Exception as e:  # noqa: BLE001 - a template that needs what a plain chat lacks
                    refused[f"hf: {type(e).__name__}"] = refused.get(f"hf: {type(e).__name__}", 0) + 1
                    continue
                mask = np.asarray(want["assistant_masks"], bool)
                if train_on == "last" and mask.any():  # the final marked run only
                    runs = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8)])) == 1)
                    mask[: runs[-1]] = False
                if s.tokens.tolist() != want["input_ids"]:
                    other += 1  # the twin renders other text (qwen3's always writes a thinking block)
                    continue
                if s.loss_mask.tolist() == mask.tolist():
                    same += 1
                elif _edges_only(s.loss_mask, mask, [tok.decode([int(t)]) for t in s.tokens]):
                    edges += 1
                else:
                    differ += 1
            print(f"{released.stem:<24} train_on={train_on:<9} agree {same:>3}  edges {edges:>3}  "
                  f"other text {other:>3}  differ {differ:>3}  refused {refused or 0}")


if __name__ == "__main__":
    main()
