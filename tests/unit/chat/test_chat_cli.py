"""``streampack inspect --chat``: records rendered with their supervised tokens marked, then the length statistics."""

from __future__ import annotations

from helpers_chat import CHATML, LLAMA3, chat_tokenizer, write_jsonl

from streampack.cli.main import main


def test_inspect_chat_marks_supervised_tokens(tmp_path, capsys) -> None:
    folder = tmp_path / "tok"
    chat_tokenizer(CHATML).save_pretrained(folder)
    record = {"messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4"}]}
    url = str(write_jsonl(tmp_path / "chat.jsonl", [record] * 4))
    assert main(["inspect", url, "--capacity", "64", "--chat", "--tokenizer", str(folder), "--show", "1",
                 "--windows", "", "--algorithms", "bfd", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "#0: 10 tokens, 3 supervised\n<|im_start|> user w1 w2 <|im_end|> <|im_start|> assistant[[w3 w4 <|im_end|>]]" \
        in out
    assert "chat: 4 conversations, 0 cut to whole turns and 0 dropped" in out and "samples: 4" in out


def test_inspect_chat_with_a_template_file_and_the_last_turn(tmp_path, capsys) -> None:
    path = tmp_path / "tokenizer.json"
    chat_tokenizer(None).backend_tokenizer.save(str(path))
    template = tmp_path / "llama3.jinja"
    template.write_text(LLAMA3)
    record = {"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"},
                           {"role": "user", "content": "w3"}, {"role": "assistant", "content": "w4"}]}
    url = str(write_jsonl(tmp_path / "chat.jsonl", [record]))
    assert main(["inspect", url, "--capacity", "64", "--chat", "--tokenizer", str(path), "--chat-template",
                 str(template), "--train-on", "last", "--windows", "", "--algorithms", "bfd", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "assistant <|end_header_id|> w2 <|eot_id|>" in out and "[[w4 <|eot_id|>]]" in out


def test_inspect_chat_needs_a_tokenizer(tmp_path, capsys) -> None:
    url = str(write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "w1"}]}]))
    assert main(["inspect", url, "--capacity", "64", "--chat"]) == 2
    assert "--chat needs --tokenizer" in capsys.readouterr().err
