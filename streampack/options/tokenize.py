"""TokenizeOptions: how text becomes token ids (``PackedDataset(tokenize=...)``), taken whole by
:class:`~streampack.nodes.tokenize.Tokenize`; the tokenizer itself is a runtime argument.
"""

from __future__ import annotations

from dataclasses import dataclass

from streampack.options._check import need_int


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

    def __post_init__(self) -> None:
        need_int("TokenizeOptions", "bos_id", self.bos_id, 0, optional=True)
        need_int("TokenizeOptions", "eos_id", self.eos_id, 0, optional=True)
        need_int("TokenizeOptions", "num_threads", self.num_threads, 1)
        need_int("TokenizeOptions", "block_size", self.block_size, 1)
