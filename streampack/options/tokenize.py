"""TokenizeOptions: how text becomes token ids (``PackedDataset(tokenize=...)``), taken whole by
:class:`~streampack.nodes.tokenize.Tokenize`; the tokenizer itself is a runtime argument. :class:`ChatOptions`
(its ``chat`` field) turns the stage into the chat stage (:mod:`streampack.chat`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from streampack.options._check import need_choice, need_int, need_type

CHAT_OVERLONG: tuple[str, ...] = ("turns", "drop", "policy")
"""What a rendered conversation longer than ``capacity`` becomes (see :attr:`ChatOptions.overlong`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatOptions:
    """Chat records (``messages``, ``conversations``, ``prompt`` / ``completion``) rendered with the tokenizer's chat
    template and supervised on what the assistant says (:mod:`streampack.chat`)."""

    template: str | None = None
    """A jinja chat template; None: the tokenizer's own ``chat_template``."""
    train_on: str | tuple[str, ...] = "assistant"
    """Which turns are supervised: ``"assistant"`` (every assistant turn), ``"last"`` (the final assistant turn
    only) or a tuple of role names (``("assistant", "tool")``)."""
    train_on_eot: bool = True
    """Supervise what the template writes after a supervised turn's content (its end-of-turn token, e.g.
    ``<|im_end|>``, so the model learns to stop)."""
    completion_only: bool = True
    """``prompt`` / ``completion`` records: loss on the completion only (TRL's ``completion_only_loss``); False:
    on every token."""
    overlong: str = "turns"
    """A conversation longer than ``capacity``: ``"turns"`` keeps its longest head that ends with a whole
    supervised turn (every kept assistant turn keeps its whole prompt) and drops it when none fits; ``"drop"``
    drops it; ``"policy"`` hands it whole to ``PackOptions.overlong`` (``split`` trains later pieces without
    their prompt). Counted in the stage's ``truncated`` / ``dropped`` counters."""
    image_placeholder: str = "<image>"
    """The image marker in LLaVA / ShareGPT text (``"<image>\\n..."``), turned into an image content part that
    the template renders as the model's image token(s)."""

    def __post_init__(self) -> None:
        need_type("ChatOptions", "template", self.template, str, optional=True)
        if isinstance(self.train_on, str):
            need_choice("ChatOptions", "train_on", self.train_on, ("assistant", "last"))
        elif not (isinstance(self.train_on, tuple) and self.train_on
                  and all(isinstance(r, str) and r for r in self.train_on)):
            raise ValueError(f"ChatOptions(train_on={self.train_on!r}): must be 'assistant', 'last' or a "
                             f"non-empty tuple of role names")
        for name in ("train_on_eot", "completion_only"):
            need_type("ChatOptions", name, getattr(self, name), bool)
        need_choice("ChatOptions", "overlong", self.overlong, CHAT_OVERLONG)
        need_type("ChatOptions", "image_placeholder", self.image_placeholder, str)
        if not self.image_placeholder:
            raise ValueError("ChatOptions(image_placeholder=''): must be a non-empty string")

    def recorded(self) -> dict[str, Any]:
        """What a resume state's fingerprint records: the fields, a template by its sha1."""
        out = {f: getattr(self, f) for f in self.__slots__}
        if self.template is not None:
            out["template"] = "sha1:" + hashlib.sha1(self.template.encode()).hexdigest()[:16]
        out["train_on"] = list(self.train_on) if isinstance(self.train_on, tuple) else self.train_on
        return out

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles whose turns are supervised."""
        return ("assistant",) if isinstance(self.train_on, str) else self.train_on


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenizeOptions:
    """Ids around each text, and how the encoding is batched (order and determinism do not
    depend on ``num_threads`` or ``block_size``)."""

    bos_id: int | None = None
    """Id added before each tokenized text (checked against ``vocab_size`` by the node)."""
    eos_id: int | None = None
    """Id added after each tokenized text."""
    num_threads: int = 1
    """Tokenizer threads."""
    block_size: int = 64
    """Texts batch-encoded together."""
    chat: ChatOptions | None = None
    """Render chat records with the tokenizer's chat template (a HF fast tokenizer) and build their loss mask;
    None: text only. ``bos_id`` / ``eos_id`` are then the template's business and must be None, and a block is
    encoded by the fast tokenizer's own batch call (``num_threads`` is not used)."""

    def __post_init__(self) -> None:
        need_int("TokenizeOptions", "bos_id", self.bos_id, 0, optional=True)
        need_int("TokenizeOptions", "eos_id", self.eos_id, 0, optional=True)
        need_int("TokenizeOptions", "num_threads", self.num_threads, 1)
        need_int("TokenizeOptions", "block_size", self.block_size, 1)
        need_type("TokenizeOptions", "chat", self.chat, ChatOptions, optional=True)
        if self.chat is not None and (self.bos_id is not None or self.eos_id is not None):
            raise ValueError(f"TokenizeOptions(bos_id={self.bos_id!r}, eos_id={self.eos_id!r}) with chat=: the "
                             f"chat template writes a conversation's special tokens; leave both None")
