"""A chat record's fields -> one :class:`Conversation`: the message list a chat template renders.

Formats: HF / OpenAI ``messages`` (``role`` / ``content``; content a string or content parts), ShareGPT / LLaVA
``conversations`` (``from`` / ``value``: ``human`` -> ``user``, ``gpt`` -> ``assistant``, ...), and ``prompt`` /
``completion`` (two strings: plain text, TRL's non-conversational pair; two message lists: rendered with the
template). A top-level ``system`` string becomes the first message. Each image marker (``<image>``) in a string
becomes an ``{"type": "image"}`` content part, the HF multimodal convention every VLM template renders as the
model's image token(s). A malformed record is a :class:`~streampack.errors.DataError` naming shard, key and the
offending field or role, never the record's text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from streampack.errors import DataError

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "bard": "assistant", "bing": "assistant", "system": "system", "tool": "tool", "observation": "tool",
                  "function_call": "assistant", "function": "tool"}
"""ShareGPT / LLaVA ``from`` values -> the roles chat templates know."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Conversation:
    """What the chat stage renders for one record."""

    messages: tuple[dict[str, Any], ...] = ()
    """``{"role", "content"}`` messages (content a string or content parts)."""
    prompt_turns: int | None = None
    """For a conversational ``prompt`` / ``completion`` record: how many of ``messages`` are the prompt."""
    text_pair: tuple[str, str] | None = None
    """A plain-text ``(prompt, completion)``: tokenized without a template."""
    tools: Any = None
    """The record's ``tools`` (JSON schemas), handed to the template."""


def conversation(chat: Mapping[str, Any], placeholder: str, *, url: str, key: str) -> Conversation:
    """The conversation held by a record's chat fields (``Sample.chat``)."""

    def bad(field: str, why: str) -> DataError:
        return DataError("bad_chat", f"{field} {why}", url=url, key=key, value=field)

    system = chat.get("system")
    if system is not None and not isinstance(system, str):
        raise bad("system", "is not a string")
    head = [{"role": "system", "content": system}] if system else []
    tools = chat.get("tools")
    if "messages" in chat:
        messages = _messages(chat["messages"], "messages", placeholder, bad)
        return Conversation(messages=tuple(head + messages), tools=tools)
    if "conversations" in chat:
        turns = chat["conversations"]
        if not isinstance(turns, list) or not all(isinstance(t, Mapping) for t in turns):
            raise bad("conversations", "is not a list of objects")
        messages = []
        for i, turn in enumerate(turns):
            source = turn.get("from", turn.get("role"))
            role = SHAREGPT_ROLES.get(source) if isinstance(source, str) else None
            if role is None:
                raise DataError("chat_unknown_role", f"conversations[{i}] has role {source!r}, which is none of "
                                f"{sorted(SHAREGPT_ROLES)}", url=url, key=key, value=source)
            messages.append({"role": role, "content": turn.get("value", turn.get("content"))})
        return Conversation(messages=tuple(head + _messages(messages, "conversations", placeholder, bad)),
                            tools=tools)
    prompt, completion = chat.get("prompt"), chat.get("completion")
    if isinstance(prompt, str) and isinstance(completion, str):
        return Conversation(text_pair=(prompt, completion))
    if isinstance(prompt, list) and isinstance(completion, list):
        first = head + _messages(prompt, "prompt", placeholder, bad)
        return Conversation(messages=tuple(first + _messages(completion, "completion", placeholder, bad)),
                            prompt_turns=len(first), tools=tools)
    raise bad("prompt/completion", "must be two strings or two lists of messages")


def _messages(raw: Any, field: str, placeholder: str, bad: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise bad(field, "is not a non-empty list of messages")
    out = []
    for i, message in enumerate(raw):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise bad(f"{field}[{i}]", "is not an object with a string 'role'")
        content = message.get("content")
        if isinstance(content, str) and placeholder in content:
            content = _parts(content, placeholder)
        elif content is not None and not isinstance(content, (str, list)):
            raise bad(f"{field}[{i}].content", "is neither a string nor a list of content parts")
        out.append({**message, "content": content})
    return out


def _parts(text: str, placeholder: str) -> list[dict[str, str]]:
    """``"<image>\\nWhat is it?"`` -> ``[{"type": "image"}, {"type": "text", "text": "\\nWhat is it?"}]``."""
    pieces = text.split(placeholder)
    parts: list[dict[str, str]] = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
    for piece in pieces[1:]:
        parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts
