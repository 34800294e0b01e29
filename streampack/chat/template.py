"""The chat template's side of the chat stage: the tokenizer it renders with, the renderings of a conversation's
prefixes (what a template refuses named, never the record's text), the ``{% generation %}`` spans of a template
that has markers, and where a rendering parts from the whole conversation's in whole tokens. Rendering is
transformers' own (``render_jinja_template``, what ``apply_chat_template`` runs, with the tokenizer's special
tokens).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from streampack.chat.records import Conversation
from streampack.errors import DataError
from streampack.sample import Sample

GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def chat_tokenizer(tokenizer: Any, template: str | None) -> Any:
    """A HF fast tokenizer with a chat template: the one given, or a ``tokenizers.Tokenizer`` / ``tokenizer.json``
    wrapped (then ``template`` is required)."""
    if isinstance(tokenizer, (str, os.PathLike)) or type(tokenizer).__module__.startswith("tokenizers"):
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer) if not isinstance(
            tokenizer, (str, os.PathLike)) else PreTrainedTokenizerFast(tokenizer_file=os.fspath(tokenizer))
    if not hasattr(tokenizer, "apply_chat_template"):
        raise TypeError(f"chat= needs a transformers tokenizer (or a tokenizers.Tokenizer with ChatOptions("
                        f"template=...)), got {type(tokenizer).__name__}")
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(f"chat= needs a fast tokenizer (character offsets locate the turns), got "
                        f"{type(tokenizer).__name__}")
    if template is None and tokenizer.chat_template is None:
        raise ValueError("the tokenizer has no chat_template: pass ChatOptions(template=...)")
    return tokenizer


@dataclass(slots=True, kw_only=True)
class Rendered:
    """One conversation on its way to tokens: its text, supervised character spans and the character ends of the
    supervised turns (where a cut may end it), then its ids and mask."""

    text: str
    spans: list[tuple[int, int]] = field(default_factory=list)
    cuts: list[int] = field(default_factory=list)
    ids: np.ndarray | None = None
    mask: np.ndarray | None = None
    cut_tokens: list[int] = field(default_factory=list)

    def tokenized(self, ids: Sequence[int], offsets: Sequence[tuple[int, int]]) -> None:
        """Every token overlapping a supervised span is supervised (``return_assistant_tokens_mask``'s rule)."""
        self.ids = np.asarray(ids, np.int64)
        at = np.fromiter(chain.from_iterable(offsets), np.int64, count=2 * len(offsets)).reshape(-1, 2)
        self.mask = np.zeros(self.ids.shape[0], dtype=bool)
        for a, b in self.spans:
            self.mask |= (at[:, 1] > a) & (at[:, 0] < b)
        self.cut_tokens = [int(np.searchsorted(at[:, 0], c)) for c in self.cuts]


class Template:
    """A tokenizer and its chat template (``template``, or the tokenizer's own), rendering conversations."""

    def __init__(self, tokenizer: Any, template: str | None) -> None:
        self.tokenizer = chat_tokenizer(tokenizer, template)
        self.text = self.tokenizer.get_chat_template(template)
        self.markers = GENERATION.search(self.text) is not None
        """Whether the template marks the assistant's spans itself."""

    def render_all(self, prefixes: list[list[dict[str, Any]]], conv: Conversation, sample: Sample, *,
                   generation: bool = False, partial: bool = False) -> list[Any]:
        """The renderings of ``prefixes``; with ``partial`` one the template refuses is None (but the last)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        def render(batch: list[list[dict[str, Any]]]) -> list[str]:
            return render_jinja_template(conversations=batch, tools=conv.tools, chat_template=self.text,
                                         add_generation_prompt=generation, **self.tokenizer.special_tokens_map)[0]

        if not prefixes:
            return []
        try:
            return render(prefixes)
        except Exception as e:  # noqa: BLE001 — jinja's raise_exception and any template failure
            error = e
        out: list[Any] = [None] * len(prefixes)
        if partial:
            for k, prefix in enumerate(prefixes):
                try:
                    out[k] = render([prefix])[0]
                except Exception as e:  # noqa: BLE001
                    error = e
        if out[-1] is None:
            roles = tuple(m["role"] for m in prefixes[-1])
            raise DataError("chat_template_error", f"the chat template refused the conversation: "
                            f"{type(error).__name__}: {str(error)[:160]}", url=sample.url, key=sample.key,
                            value=roles) from None
        return out

    def marked(self, conv: Conversation, sample: Sample) -> dict[int, tuple[int, int]]:
        """Assistant turn -> its ``{% generation %}`` span (what ``return_assistant_tokens_mask`` marks)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        _, (spans,) = render_jinja_template(conversations=[list(conv.messages)], tools=conv.tools,
                                            chat_template=self.text, return_assistant_tokens_mask=True,
                                            **self.tokenizer.special_tokens_map)
        turns = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
        if len(spans) != len(turns):
            raise DataError("chat_template_error", f"the chat template marks {len(spans)} generation spans for "
                            f"{len(turns)} assistant turns", url=sample.url, key=sample.key, value=len(spans))
        return dict(zip(turns, map(tuple, spans)))

    def parting(self, prefix: str, full: str) -> int:
        """How much of ``full`` the rendering ``prefix`` is: all of it when a prefix, else up to where the two part
        in whole tokens (``</s>`` and ``<|user|>`` share a ``<``, no token)."""
        if full.startswith(prefix):
            return len(prefix)
        mine, whole = self.tokenizer.backend_tokenizer.encode_batch([prefix, full], add_special_tokens=False)
        k = common_prefix(mine.ids, whole.ids)
        return whole.offsets[k - 1][1] if k else 0


def message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else "".join(
        p.get("text", "") for p in content or () if isinstance(p, dict))


def renders_content(full: str, start: int, end: int, message: dict[str, Any]) -> bool:
    """Whether the message's text is rendered whole in ``full[start:end]`` (a turn that parts from the whole
    rendering only after its content: the template writes something only after a conversation's last turn)."""
    text = message_text(message).strip()
    return bool(text) and full.find(text, start, end) >= 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n
