"""The chat stage: masks equal transformers' ``return_assistant_tokens_mask`` where a template has generation
markers and are found from the rendering where it has none; templates that rewrite earlier turns or cannot place a
role are refused, naming shard, key and role and never the content; ShareGPT and prompt/completion records; the
overlong rule; the node's exact resume and counters."""

from __future__ import annotations

import numpy as np
import pytest
from helpers_chat import CHATML, GENERATION, LLAMA3, REASONING, USER_ASSISTANT, chat_tokenizer, conversations, words
from node_checks import ListSource, check_save_load, drain

from streampack.chat import ChatEncoder
from streampack.errors import DataError
from streampack.nodes.tokenize import Tokenize
from streampack.options import TokenizeOptions
from streampack.options.tokenize import ChatOptions
from streampack.sample import Sample

pytest.importorskip("transformers", minversion="5.0")


def _chat(record: dict, key: str = "k0") -> Sample:
    return Sample(key=key, url="shard-0.jsonl", chat=record)


def _one(encoder: ChatEncoder, record: dict) -> Sample:
    out = encoder.encode([_chat(record)])[0]
    assert isinstance(out, Sample), out
    return out


def _marked(tok, sample: Sample) -> str:
    return " ".join(f"[{t}]" if m else t for t, m in zip(tok.convert_ids_to_tokens(sample.tokens.tolist()),
                                                          sample.loss_mask))


def test_mask_equals_return_assistant_tokens_mask_with_and_without_markers() -> None:
    """Generation markers: HF's own mask. The same template without markers (ChatML renders the same text): the
    mask found from the rendering is the same, on 40 random conversations."""
    marked, plain = chat_tokenizer(GENERATION), chat_tokenizer(CHATML)
    records = conversations(40, seed=3)
    got_marked = ChatEncoder(marked, ChatOptions()).encode([_chat(r) for r in records])
    got_plain = ChatEncoder(plain, ChatOptions()).encode([_chat(r) for r in records])
    supervised = 0
    for record, a, b in zip(records, got_marked, got_plain):
        want = marked.apply_chat_template(record["messages"], return_dict=True, return_assistant_tokens_mask=True)
        assert a.tokens.tolist() == want["input_ids"] == b.tokens.tolist()
        assert a.loss_mask.astype(int).tolist() == want["assistant_masks"] == b.loss_mask.astype(int).tolist()
        supervised += int(a.loss_mask.sum())
    assert supervised > 100  # the guard: the masks were not empty


def test_turn_selection_and_end_of_turn() -> None:
    """axolotl's chat_template strategy tests, adapted: ``roles_to_train`` (every assistant turn, the last only,
    the user's turns) and ``train_on_eos`` (the end-of-turn token trained with its turn, or not)."""
    tok = chat_tokenizer(LLAMA3)
    record = {"messages": [{"role": "system", "content": "w9"}, {"role": "user", "content": "w1 w2"},
                           {"role": "assistant", "content": "w3 w4"}, {"role": "user", "content": "w5"},
                           {"role": "assistant", "content": "w6"}]}
    head = "<|begin_of_text|> <|start_header_id|> system <|end_header_id|> w9 <|eot_id|> <|start_header_id|> user " \
           "<|end_header_id|> w1 w2 <|eot_id|> <|start_header_id|> assistant <|end_header_id|>"
    every = _marked(tok, _one(ChatEncoder(tok, ChatOptions()), record))
    assert every == (f"{head} [w3] [w4] [<|eot_id|>] <|start_header_id|> user <|end_header_id|> w5 <|eot_id|> "
                     f"<|start_header_id|> assistant <|end_header_id|> [w6] [<|eot_id|>]")
    last = _marked(tok, _one(ChatEncoder(tok, ChatOptions(train_on="last")), record))
    assert last == every.replace("[w3] [w4] [<|eot_id|>]", "w3 w4 <|eot_id|>")
    no_eot = _marked(tok, _one(ChatEncoder(tok, ChatOptions(train_on_eot=False)), record))
    assert no_eot == every.replace("[<|eot_id|>]", "<|eot_id|>")
    users = _marked(tok, _one(ChatEncoder(tok, ChatOptions(train_on=("user",))), record))
    assert "[<|start_header_id|>] [user] [<|end_header_id|>] [w1] [w2] [<|eot_id|>]" in users
    assert "[w3]" not in users


def _reasoning_record() -> dict:
    return {"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "<think> w2 </think> w3"},
                         {"role": "user", "content": "w4"}, {"role": "assistant", "content": "<think> w5 </think> w6"}]}


def test_a_template_that_rewrites_earlier_turns_is_refused_or_trained_on_the_last_turn() -> None:
    tok = chat_tokenizer(REASONING)
    record = _reasoning_record()
    err = ChatEncoder(tok, ChatOptions()).encode([_chat(record)])[0]
    assert isinstance(err, DataError) and err.reason == "chat_template_rewrites"
    assert "shard-0.jsonl" in str(err) and "'k0'" in str(err) and "w3" not in str(err)
    last = _one(ChatEncoder(tok, ChatOptions(train_on="last")), record)
    want = tok.apply_chat_template(record["messages"])["input_ids"]
    assert last.tokens.tolist() == want
    # the past reasoning is gone from the rendering, the last turn's is trained
    assert _marked(tok, last).endswith("assistant w3 <|im_end|> <|im_start|> user w4 <|im_end|> <|im_start|> "
                                       "assistant [<think>] [w5] [</think>] [w6] [<|im_end|>]")


def test_roles_the_template_cannot_place_are_refused_naming_the_role() -> None:
    record = {"messages": [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w1"},
                           {"role": "assistant", "content": "w2"}]}
    err = ChatEncoder(chat_tokenizer(USER_ASSISTANT), ChatOptions()).encode([_chat(record)])[0]
    assert isinstance(err, DataError) and err.reason == "chat_role_unplaced" and err.value == "system"
    tool = {"messages": [{"role": "user", "content": "w1"}, {"role": "tool", "content": "w5 w6"},
                         {"role": "assistant", "content": "w2"}]}
    err = ChatEncoder(chat_tokenizer(LLAMA3), ChatOptions()).encode([_chat(tool)])[0]
    assert isinstance(err, DataError) and err.reason == "chat_template_error"
    assert "roles must be system, user or assistant" in str(err) and "w5" not in str(err)
    assert err.url == "shard-0.jsonl" and err.key == "k0"


def test_sharegpt_records_and_unknown_roles() -> None:
    tok = chat_tokenizer(CHATML)
    encoder = ChatEncoder(tok, ChatOptions())
    share = {"system": "w9", "conversations": [{"from": "human", "value": "w1"}, {"from": "gpt", "value": "w2"}]}
    same = {"messages": [{"role": "system", "content": "w9"}, {"role": "user", "content": "w1"},
                         {"role": "assistant", "content": "w2"}]}
    a, b = _one(encoder, share), _one(encoder, same)
    assert a.tokens.tolist() == b.tokens.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
    err = encoder.encode([_chat({"conversations": [{"from": "narrator", "value": "w1 w2"}]})])[0]
    assert isinstance(err, DataError) and err.reason == "chat_unknown_role" and err.value == "narrator"
    err = encoder.encode([_chat({"messages": [{"content": "w1"}]})])[0]
    assert isinstance(err, DataError) and err.reason == "bad_chat"


def test_prompt_completion_follows_trl() -> None:
    """Strings: tokenized as text with EOS appended, loss from where the prompt's ids end (or on everything);
    message lists: rendered, loss on the completion's turns."""
    tok = chat_tokenizer(CHATML)
    pair = {"prompt": "w1 w2 w3", "completion": " w4 w5"}
    only = _one(ChatEncoder(tok, ChatOptions()), pair)
    assert _marked(tok, only) == "w1 w2 w3 [w4] [w5] [<|endoftext|>]"
    assert _one(ChatEncoder(tok, ChatOptions(completion_only=False)), pair).loss_mask.all()
    chat = {"prompt": [{"role": "user", "content": "w1"}], "completion": [{"role": "assistant", "content": "w2"}]}
    got = _one(ChatEncoder(tok, ChatOptions()), chat)
    assert _marked(tok, got) == "<|im_start|> user w1 <|im_end|> <|im_start|> assistant [w2] [<|im_end|>]"


def test_overlong_conversations_keep_whole_turns_or_are_dropped() -> None:
    tok = chat_tokenizer(CHATML)
    record = {"messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4"},
                           {"role": "user", "content": "w5 w6 w7"}, {"role": "assistant", "content": "w8 w9 w10"}]}
    n = len(tok.apply_chat_template(record["messages"])["input_ids"])  # 18: 8 for the first exchange
    turns = ChatEncoder(tok, ChatOptions(), max_len=n - 1)
    cut = _one(turns, record)
    assert _marked(tok, cut) == "<|im_start|> user w1 w2 <|im_end|> <|im_start|> assistant [w3] [w4] [<|im_end|>]"
    assert turns.events == {"truncated": 1, "dropped": 0}
    assert turns.encode([_chat(record)] * 2) and turns.events == {"truncated": 2, "dropped": 0}
    tiny = ChatEncoder(tok, ChatOptions(), max_len=5)
    assert tiny.encode([_chat(record)]) == [None] and tiny.events == {"truncated": 0, "dropped": 1}
    drop = ChatEncoder(tok, ChatOptions(overlong="drop"), max_len=n - 1)
    assert drop.encode([_chat(record)]) == [None] and drop.events["dropped"] == 1
    whole = _one(ChatEncoder(tok, ChatOptions(overlong="policy"), max_len=n - 1), record)
    assert len(whole.tokens) == n


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="train_on='first'"):
        ChatOptions(train_on="first")
    with pytest.raises(ValueError, match="overlong='split'"):
        ChatOptions(overlong="split")
    with pytest.raises(ValueError, match="leave both None"):
        TokenizeOptions(chat=ChatOptions(), eos_id=3)
    with pytest.raises(ValueError, match="no chat_template"):
        ChatEncoder(chat_tokenizer(None), ChatOptions())


def _samples(n: int) -> list[Sample]:
    return [_chat(r, key=str(i)) for i, r in enumerate(conversations(n, seed=5))]


def test_the_node_resumes_exactly_and_counts() -> None:
    samples = _samples(60)
    tok = chat_tokenizer(CHATML)
    make = lambda: Tokenize(ListSource(samples), tok, TokenizeOptions(block_size=7, chat=ChatOptions()),  # noqa: E731
                            max_len=30)
    assert check_save_load(make, offsets=[0, 1, 6, 7, 8, 30]) > 40
    node = make()
    out = drain(node)
    counters = node.counters
    assert counters["truncated"] > 0 and counters["dropped"] > 0 and counters["empty"] == 0
    assert len(out) == counters["tokenized"] == len(samples) - counters["dropped"]


def test_a_chat_record_without_the_chat_stage_is_refused() -> None:
    from streampack.nodes.tokenize import TextEncoder

    err = TextEncoder(chat_tokenizer(CHATML).backend_tokenizer).encode([_chat({"messages": []})])[0]
    assert isinstance(err, DataError) and err.reason == "chat_record"


def test_words_helper_is_in_vocabulary() -> None:
    tok = chat_tokenizer(CHATML)
    assert 0 not in tok(words(np.random.default_rng(0), 50, 50))["input_ids"]


END_EOS = ("{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>' + m['content'] "
           "+ '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant"
           "<|end_header_id|>' }}{% else %}{{ eos_token }}{% endif %}")
"""Phi-3's shape: EOS only after a conversation's last turn (so a prefix's rendering is not a prefix)."""
THINK_PROMPT = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' %}"
                "{{ '<think></think>' }}{% endif %}{{ m['content'] + '<|im_end|>\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>' }}{% endif %}")
"""Nemotron's shape: the generation prompt opens a thinking block the rendered turn closes at once."""
OTHER_PROMPT = ("{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>' + m['content'] "
                "+ '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>' }}{% endif %}")
"""A generation prompt the turns never render: where the answer starts is unknown."""
TWO_TURNS = {"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2 w3"},
                          {"role": "user", "content": "w4"}, {"role": "assistant", "content": "w5"}]}


def test_an_end_of_conversation_eos_is_not_the_next_turn() -> None:
    tok = chat_tokenizer(END_EOS)
    got = _marked(tok, _one(ChatEncoder(tok, ChatOptions()), TWO_TURNS))
    assert got == ("<|start_header_id|> user <|end_header_id|> w1 <|eot_id|> <|start_header_id|> assistant "
                   "<|end_header_id|> [w2] [w3] [<|eot_id|>] <|start_header_id|> user <|end_header_id|> w4 <|eot_id|> "
                   "<|start_header_id|> assistant <|end_header_id|> [w5] [<|eot_id|>] [<|endoftext|>]")


def test_a_generation_prompt_that_opens_a_thinking_block_stays_prompt() -> None:
    tok = chat_tokenizer(THINK_PROMPT)
    got = _marked(tok, _one(ChatEncoder(tok, ChatOptions()), TWO_TURNS))
    assert got.count("assistant <think> [</think>]") == 2 and "[w2] [w3] [<|im_end|>]" in got


def test_a_generation_prompt_the_turns_never_render_is_refused() -> None:
    err = ChatEncoder(chat_tokenizer(OTHER_PROMPT), ChatOptions()).encode([_chat(TWO_TURNS)])[0]
    assert isinstance(err, DataError) and err.reason == "chat_template_rewrites"


def test_a_prefix_the_template_refuses_is_only_needed_where_a_trained_turn_reads_it() -> None:
    """Qwen3.5's template raises on a conversation with no user turn, such as a lone system prefix: the system turn
    is not trained, so the record renders; training the system role needs that prefix and is refused."""
    needs_user = ("{% if not (messages | selectattr('role', 'equalto', 'user') | list) %}"
                  "{{ raise_exception('No user query found in messages.') }}{% endif %}" + CHATML)
    tok = chat_tokenizer(needs_user)
    record = {"messages": [{"role": "system", "content": "w9"}, *TWO_TURNS["messages"]]}
    got = _one(ChatEncoder(tok, ChatOptions()), record)
    assert got.tokens.tolist() == tok.apply_chat_template(record["messages"])["input_ids"] and got.loss_mask.sum() == 5
    err = ChatEncoder(tok, ChatOptions(train_on=("system", "assistant"))).encode([_chat(record)])[0]
    assert isinstance(err, DataError) and err.reason == "chat_template_error" and err.value == 0
