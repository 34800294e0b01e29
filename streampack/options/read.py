"""ReadOptions: what the readers read from a shard and how they fetch it (``PackedDataset(read=...)``).

The fields that decide which samples are kept (the keys, ``on_error``, ``vocab_size``, ``limits``, ``mixture_stop``) are
part of a resume state's fingerprint; those that only decide how bytes arrive (retries, timeouts, caching) are not.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from streampack.errors import ErrorCounter, ErrorPolicy
from streampack.io.decode import DecodeOptions
from streampack.io.limits import Limits, check_vocab_size
from streampack.io.retry import RetryPolicy
from streampack.io.storage import OpenOptions
from streampack.io.token_array import TOKEN_DTYPES
from streampack.options._check import need_choice, need_type

MEGATRON_SAMPLES: tuple[str, ...] = ("document", "sequence")
"""What one sample of a Megatron-core indexed data set is."""
MIXTURE_STOPS: tuple[str, ...] = ("all", "first", "cycle")
"""When a finite mixture ends (:class:`~streampack.nodes.mixture.Mixture` maps them to torchdata's rules)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadOptions:
    """What the readers read and how (every value checked here, at construction)."""

    text_key: str = "text"
    """json field (parquet column) of the text; tar samples may also hold a ``.txt`` member."""
    tokens_key: str = "input_ids"
    """json field (parquet column) of the token list; or a ``<tokens_key>.npy`` / ``npy`` tar member."""
    labels_key: str | None = None
    """json field / parquet column (or ``labels.npy`` member) with a sample's own unshifted labels."""
    loss_mask_key: str | None = None
    """json field / parquet column (or ``loss_mask.npy`` member) with a 0/1 per-token loss mask."""
    on_error: str = "raise"
    """``raise``: bad input is a ``DataError`` naming shard, key and value; ``skip``: exactly the
    bad sample is dropped and counted. Covers reading, decoding and tokenizing."""
    vocab_size: int | None = None
    """Token ids (read or tokenized) and labels must be below it; None = below 2**31."""
    eos_id: int | None = None
    """Flat token arrays (``.npy`` / ``.bin``, docs/token_arrays.md): a document ends at (and keeps) this id; None:
    documents are read from the offsets file beside the array."""
    megatron_sample: str = "document"
    """Megatron-core indexed data sets (docs/megatron.md): a sample per Megatron ``document`` (its sequences joined) or
    per ``sequence``."""
    token_dtype: str | None = None
    """Flat token arrays without a numpy header (a raw ``.bin``, or a memmap named ``.npy`` as OLMo / Dolma write
    them): the ids' dtype, one of :data:`~streampack.io.token_array.TOKEN_DTYPES`; a header's dtype must agree."""
    limits: Limits = Limits()
    """Bytes per line / member / sample and json depth one sample may make a reader hold (None,
    as the flat ``limits=`` keyword took it: the defaults)."""
    mixture_stop: str = "all"
    """When a finite mixture ends: ``all``, ``first`` or ``cycle``."""
    manifest: str | None = None
    """Where the data set's manifest is (``streampack index URLS --out DIR``): what plans finite
    epochs over several readers and elastic resumes. None: built once in ``cache_dir`` for
    local shards; remote shards without one are refused."""
    cache_dir: str | None = None
    """Where shard indexes are cached (default ``$STREAMPACK_CACHE/index``); a path or a URL."""
    identity: str = "tag"
    """What proves a shard unchanged on resume (:mod:`streampack.io.shard_identity`):
    ``tag``, ``size``, ``digest`` or ``off``."""
    allow_pipe: bool = False
    """Accept ``pipe:`` URLs (runs a shell command)."""
    allow_pickle: bool = False
    """Unpickle ``.pyd`` / ``.pickle`` / ``.pkl`` tar members (arbitrary code execution)."""
    retries: int | None = None
    """At most this many retries per failing read; None: only ``retry_budget`` bounds them."""
    retry_budget: float = 120.0
    """Seconds a failing read keeps retrying (jittered exponential backoff) before a ``DataError``."""
    connect_timeout: float = 10.0
    """Seconds to connect."""
    read_timeout: float = 30.0
    """Seconds without a byte arriving."""
    request_deadline: float = 120.0
    """Seconds for one whole request (a read block)."""
    allow_redirects: bool = False
    """Follow http(s) redirects to another host (same-host redirects are always followed)."""
    storage_options: Mapping[str, Any] | None = None
    """fsspec options, flat or per protocol: ``{"s3": {"anon": True}, "hf": {"token": ...}}``."""

    def __post_init__(self) -> None:
        need_type("ReadOptions", "text_key", self.text_key, str)
        need_type("ReadOptions", "tokens_key", self.tokens_key, str)
        need_type("ReadOptions", "labels_key", self.labels_key, str, optional=True)
        need_type("ReadOptions", "loss_mask_key", self.loss_mask_key, str, optional=True)
        try:
            ErrorPolicy(self.on_error)  # the one check of an on_error value
        except ValueError as e:
            raise ValueError(str(e).replace("ErrorPolicy(", "ReadOptions(", 1)) from None
        need_choice("ReadOptions", "megatron_sample", self.megatron_sample, MEGATRON_SAMPLES)
        need_choice("ReadOptions", "token_dtype", self.token_dtype, (None, *TOKEN_DTYPES))
        need_choice("ReadOptions", "mixture_stop", self.mixture_stop, MIXTURE_STOPS)
        if self.limits is None:
            object.__setattr__(self, "limits", Limits())
        need_type("ReadOptions", "limits", self.limits, Limits)
        for name in ("manifest", "cache_dir"):
            need_type("ReadOptions", name, getattr(self, name), (str, os.PathLike), optional=True)
        for name in ("allow_pipe", "allow_pickle", "allow_redirects"):
            need_type("ReadOptions", name, getattr(self, name), bool)
        try:
            check_vocab_size(self.vocab_size)
            self.open_options()  # retries, timeouts, identity and storage options, checked by their records
        except (TypeError, ValueError) as e:
            raise type(e)(f"ReadOptions: {e}") from None
        need_type("ReadOptions", "eos_id", self.eos_id, int, optional=True)
        if self.eos_id is not None and not 0 <= self.eos_id < (self.vocab_size or 2**31):
            raise ValueError(f"ReadOptions: eos_id={self.eos_id} must be in [0, vocab_size={self.vocab_size}) "
                             f"(below 2**31 without a vocab_size)")

    def open_options(self) -> OpenOptions:
        """How the readers fetch shards."""
        return OpenOptions(retry=RetryPolicy(budget=self.retry_budget, retries=self.retries),
                           connect_timeout=self.connect_timeout, read_timeout=self.read_timeout,
                           request_deadline=self.request_deadline, allow_redirects=self.allow_redirects,
                           storage_options=dict(self.storage_options or {}), allow_pipe=self.allow_pipe,
                           identity=self.identity)

    def error_policy(self, errors: ErrorCounter | None = None) -> ErrorPolicy:
        """The policy every node of one reader's graph takes (they count into ``errors``)."""
        return ErrorPolicy(self.on_error, errors)

    def decode(self) -> DecodeOptions:
        """Which fields of a record hold what, and the bounds on them (what a reader decodes with)."""
        return DecodeOptions(tokens_key=self.tokens_key, text_key=self.text_key, labels_key=self.labels_key,
                             loss_mask_key=self.loss_mask_key, allow_pickle=self.allow_pickle,
                             vocab_size=self.vocab_size, limits=self.limits, eos_id=self.eos_id,
                             token_dtype=self.token_dtype, megatron_sample=self.megatron_sample)

    def recorded_fields(self) -> list[str | int | None]:
        """The fields a resume state must match (which record fields are read, where a token array's documents end,
        what a Megatron sample is); those two are listed only when not the default, so streams that read neither
        record what they did."""
        fields: list[str | int | None] = [self.tokens_key, self.text_key, self.labels_key, self.loss_mask_key]
        if self.eos_id is not None or self.token_dtype is not None:
            fields += [self.eos_id, self.token_dtype]
        if self.megatron_sample != "document":
            fields.append(f"megatron_sample={self.megatron_sample}")
        return fields
