"""The records a graph is built from: what to read, every setting that shapes the stream,
how to fetch, and where this reader sits.

:class:`StreamConfig` holds every setting that changes the stream (a resume state is
fingerprinted on it); :class:`ReadOptions` the ones that do not; :class:`Sources` what the
user named, expanded once; :class:`Placement` which reader a graph is; :class:`Share` what an
elastic resume hands one new reader.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

import numpy as np

from streampack.io.limits import Limits
from streampack.io.packed_format import Manifest, is_packed_dataset, packed_manifest
from streampack.io.retry import RetryPolicy
from streampack.io.storage import OpenOptions
from streampack.io.urls import ShardList
from streampack.media.options import MediaOptions
from streampack.nodes.sharding import Span
from streampack.packing.cost import CostModel
from streampack.packing.schedule import Balance

EQUAL_BATCHES = ("plan", "sync")
URLs = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Sources:
    """What to read, expanded once: plain shards, a weighted mixture, or offline packs."""

    shards: ShardList | None = None
    mixture: Mapping[str, ShardList] = field(default_factory=dict)
    weights: Mapping[str, float] = field(default_factory=dict)
    """Mixture weights by source name (checked by :class:`~streampack.nodes.mixture.Mixture`)."""
    stop: str = "all"
    """When a finite mixture ends (see :class:`~streampack.nodes.mixture.Mixture`)."""
    packed: Manifest | None = None
    packed_urls: Any = None
    """What the user named for ``packed`` (a directory, its manifest, or some of its shards)."""

    @property
    def digest(self) -> str:
        if self.packed is not None:
            return f"packed:{self.packed.digest}"
        if self.mixture:
            return ";".join(f"{n}={s.digest}" for n, s in sorted(self.mixture.items()))
        assert self.shards is not None
        return self.shards.digest

    @property
    def lists(self) -> list[ShardList]:
        """The URL list of each source, by source index (mixture sources sorted by name)."""
        if self.mixture:
            return [s for _, s in sorted(self.mixture.items())]
        return [self.shards] if self.shards is not None else []


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamConfig:
    """Every setting that changes the stream of batches (a resume state is fingerprinted on
    these; see ``PackedDataset`` for what each means)."""

    capacity: int
    window: int = 1024
    algorithm: str = "bfd"
    packs_per_batch: int = 1
    align: int = 1
    text_key: str = "text"
    tokens_key: str = "input_ids"
    labels_key: str | None = None
    loss_mask_key: str | None = None
    overlong: str = "split"
    seed: int = 0
    shuffle: bool = True
    epochs: int | None = None
    """Epochs per pass (None = infinite)."""
    on_error: str = "raise"
    pad_id: int = 0
    ignore_index: int = -100
    bos_id: int | None = None
    eos_id: int | None = None
    max_wait: int = 8
    slack: int | None = None
    batches_per_epoch: int | None = None
    equal_batches: str = "plan"
    """Finite, several ranks: ``plan`` the quotas from the index, or ``sync`` at run time."""
    vocab_size: int | None = None
    """Token ids (read or tokenized) must be below it; None = below 2**31."""
    limits: Limits = Limits()
    """Bytes per line / member / sample and json depth a reader accepts (they decide which
    samples are kept, so they are part of the fingerprint)."""
    cost_model: CostModel | None = None
    """Estimated compute per batch (``PackedBatch.est_cost``); None = not estimated."""
    balance: Balance | None = None
    """Cost-balanced emission (needs ``cost_model``); None = packs leave in shuffled order."""
    media: MediaOptions | None = None
    """Images of image-text samples (``streampack.media``); None = text only."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadOptions:
    """Settings that do not change the stream: how shards are fetched and how fast."""

    allow_pipe: bool = False
    allow_pickle: bool = False
    cache_dir: str | None = None
    manifest: str | None = None
    """Where the data set's manifest is (``streampack index URLS --out DIR``): what plans finite
    epochs over several readers and elastic resumes. None: built once in ``cache_dir`` for
    local shards; remote shards without one are refused."""
    retries: int | None = None
    retry_budget: float = 120.0
    connect_timeout: float = 10.0
    read_timeout: float = 30.0
    request_deadline: float = 120.0
    allow_redirects: bool = False
    storage_options: Mapping[str, Any] | None = None
    num_threads: int = 1
    tokenize_block: int = 64
    identity: str = "tag"
    """What proves a shard unchanged on resume (:mod:`streampack.io.shard_identity`)."""

    def open_options(self) -> OpenOptions:
        """How the readers fetch shards (validated here: bad values raise ``ValueError``)."""
        return OpenOptions(retry=RetryPolicy(budget=self.retry_budget, retries=self.retries),
                           connect_timeout=self.connect_timeout, read_timeout=self.read_timeout,
                           request_deadline=self.request_deadline, allow_redirects=self.allow_redirects,
                           storage_options=dict(self.storage_options or {}), allow_pipe=self.allow_pipe,
                           identity=self.identity)


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """Which reader this graph is: data-parallel rank and DataLoader worker."""

    dp_rank: int = 0
    dp_size: int = 1
    worker_id: int = 0
    num_workers: int = 1
    """Readers on this rank (``max(DataLoader num_workers, 1)``)."""
    passes: int = 0
    """Finite mode: completed passes before this one (pass ``p`` reads epochs ``[p*N, (p+1)*N)``)."""

    @property
    def global_worker(self) -> int:
        return self.dp_rank * self.num_workers + self.worker_id

    @property
    def global_workers(self) -> int:
        return self.dp_size * self.num_workers


@dataclass(frozen=True, slots=True, kw_only=True)
class Share:
    """What an elastic resume hands one new reader (see :mod:`streampack.elastic`): its part of
    the old readers' unread samples, to read in ``epoch`` before the regular plan resumes."""

    epoch: int
    spans: list[Span] = field(default_factory=list)
    """Byte ranges to read (single source)."""
    carry: Mapping[str, Any] | None = None
    """Carried samples (a ``state.samples_to_table`` table) the packer's window starts with."""
    packs: np.ndarray | None = None
    """Offline packs to read (a ``streampack pack`` directory)."""
    quota: Any = None
    """Batches to yield in ``epoch`` (finite streams with several ranks): an int, or a
    ``nodes.quota.LateQuota`` that settles after the reader's first batch."""
    identities: Mapping[int, Any] = field(default_factory=dict)
    """Shard -> the identity (``io.storage.ShardStat``) the old readers recorded: the new reader
    refuses a shard that changed since when it opens it."""


def cost_model_of(value: CostModel | Mapping[str, Any] | None) -> CostModel | None:
    """``PackedDataset(cost_model=...)``: a :class:`CostModel`, a model shape (the keyword
    arguments of ``CostModel.from_shape``, e.g. ``{"hidden": 4096, "layers": 32, "heads": 32,
    "kv_heads": 8, "ffn": 14336, "vocab": 128256}``), or None."""
    if value is None or isinstance(value, CostModel):
        return value
    if isinstance(value, Mapping):
        try:
            return CostModel.from_shape(**value)
        except TypeError as e:
            raise ValueError(f"cost_model={dict(value)!r} is not a model shape for CostModel.from_shape: {e}") from None
    raise TypeError(f"cost_model must be a CostModel, a mapping of CostModel.from_shape arguments or None, "
                    f"got {type(value).__name__}")


def balance_of(value: str | Balance | None, cost_model: CostModel | None) -> Balance | None:
    """``PackedDataset(balance=...)``: None, ``"cost"`` (default :class:`Balance` options) or a
    :class:`Balance`; any of them but None needs a cost model."""
    if value is None:
        return None
    if isinstance(value, str):
        if value != "cost":
            raise ValueError(f"balance={value!r} must be None, 'cost' or a streampack.packing.Balance")
        value = Balance()
    if not isinstance(value, Balance):
        raise TypeError(f"balance must be None, 'cost' or a Balance, got {type(value).__name__}")
    if cost_model is None:
        raise ValueError("balance='cost' needs cost_model= (a CostModel, or a model shape such as "
                         "{'hidden': 4096, 'layers': 32, 'heads': 32, 'kv_heads': 8, 'ffn': 14336})")
    return value


def sources_of(urls: URLs | Mapping[str, Any], *, opts: OpenOptions, mixture_stop: str) -> Sources:
    """Expand what the user named, once: a mixture mapping, a packed directory, or shards."""
    if isinstance(urls, Mapping):
        shards, weights = {}, {}
        for name, value in urls.items():
            weighted = isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Real)
            source, weights[name] = value if weighted else (value, 1.0)
            if is_packed_dataset(source):
                raise ValueError(f"mixture source {name!r} is a `streampack pack` directory; mixtures "
                                 f"read raw shards only")
            shards[name] = ShardList.of(source, allow_pipe=opts.allow_pipe, opts=opts)
        if not shards:
            raise ValueError("a mixture needs at least one source")
        by_name = dict(sorted(weights.items(), key=lambda kv: str(kv[0])))  # mapping order never matters
        return Sources(mixture=shards, weights=by_name, stop=mixture_stop)
    if is_packed_dataset(urls):
        return Sources(packed=packed_manifest(urls), packed_urls=urls)
    return Sources(shards=ShardList.of(urls, allow_pipe=opts.allow_pipe, opts=opts))


def tokenizer_id(tokenizer: Any) -> str | None:
    """What identifies a tokenizer in the fingerprint: a changed vocabulary changes every id."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, (str, os.PathLike)):  # the Tokenize node checked that it exists
        with open(tokenizer, "rb") as f:
            return "sha1:" + hashlib.sha1(f.read()).hexdigest()[:16]
    if hasattr(tokenizer, "to_str"):  # tokenizers.Tokenizer: its full serialized definition
        return "sha1:" + hashlib.sha1(tokenizer.to_str().encode()).hexdigest()[:16]
    name = getattr(tokenizer, "__qualname__", type(tokenizer).__qualname__)
    return f"{getattr(tokenizer, '__module__', '')}.{name}"
