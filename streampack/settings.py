"""The records a graph is built from: :class:`StreamConfig` (every setting), :class:`Sources` (what the
user named, expanded once), :class:`Placement` (which reader) and :class:`Share` (what an elastic
resume hands one new reader); :func:`fingerprint_settings` is what a resume state records of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

import numpy as np

from streampack.io.hf_dataset import is_source_object
from streampack.io.packed_format import Manifest, is_packed_dataset, packed_manifest
from streampack.io.storage import OpenOptions
from streampack.io.urls import ShardList
from streampack.media.options import MediaOptions
from streampack.nodes.collate import BatchLayout
from streampack.options import CostOptions, PackOptions, ReadOptions, TokenizeOptions, TopologyOptions
from streampack.options._check import need_int, need_type
from streampack.options.topology import Placement as Placement  # re-exported: the graph's records are here
from streampack.packing.window_rounds import PackerRules, default_max_wait
from streampack.plan.sharding import Span

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
    """Every setting of a stream: the batch's shape, the order, the epochs and each stage's record. What
    spans records (``capacity`` against ``topology.align``) is checked here, once."""

    capacity: int
    """Tokens per pack; a multiple of ``topology.align``."""
    packs_per_batch: int = 1
    """Packs per batch (``T = packs_per_batch * capacity``)."""
    seed: int = 0
    """Shard permutation per epoch ``(seed, epoch)``, pack order within a window."""
    shuffle: bool = True
    """Shuffle shards per epoch and packs per window (False: file order, for eval)."""
    epochs: int | None = None
    """Epochs per pass; None = infinite."""
    read: ReadOptions = ReadOptions()
    """The readers' record (every source's ShardReader, the mixture, the planner, the manifest)."""
    tokenize: TokenizeOptions = TokenizeOptions()
    """The Tokenize node's record."""
    packing: PackOptions = PackOptions()
    """The OverlongNode's, WindowPacker's and ThdCollate's record."""
    topology: TopologyOptions = TopologyOptions()
    """Alignment and equal batch counts (``PackedDataset`` keeps its resolved rank and size here,
    never the process group)."""
    cost: CostOptions = CostOptions()
    """Cost model and cost-balanced emission."""
    media: MediaOptions | None = None
    """Images of image-text samples (``streampack.media``); None = text only."""

    def __post_init__(self) -> None:
        need_int("StreamConfig", "capacity", self.capacity, 1)
        need_int("StreamConfig", "packs_per_batch", self.packs_per_batch, 1)
        need_int("StreamConfig", "seed", self.seed, 0)
        need_type("StreamConfig", "shuffle", self.shuffle, bool)
        need_int("StreamConfig", "epochs", self.epochs, 1, optional=True)
        for name, kind in (("read", ReadOptions), ("tokenize", TokenizeOptions), ("packing", PackOptions),
                           ("topology", TopologyOptions), ("cost", CostOptions)):
            need_type("StreamConfig", name, getattr(self, name), kind)
        align = self.topology.align
        if self.capacity % align:
            raise ValueError(f"capacity={self.capacity} must be a multiple of {align=} (the per-document "
                             f"alignment: 2*cp_size*tp_size with context parallelism, tp_size with sequence "
                             f"parallelism, combined with align_multiple)")
        if self.topology.batches_per_epoch is not None and self.epochs is None:
            raise ValueError(f"batches_per_epoch={self.topology.batches_per_epoch} needs a finite stream (epochs=N)")

    def batch_layout(self) -> BatchLayout:
        """The collate's record: the batch's shape and padding."""
        return BatchLayout(capacity=self.capacity, packs_per_batch=self.packs_per_batch, align=self.topology.align,
                           pad_id=self.packing.pad_id, ignore_index=self.packing.ignore_index)

    def packer_rules(self, seed: int) -> PackerRules:
        """The window packer's rules, made here only (the node runs them, a plan or cost seed counts with
        them); ``seed``: the packer's own (``graph.build.packer_seed``) or the stream's."""
        pack = self.packing
        return PackerRules(capacity=self.capacity, window=pack.window, algorithm=pack.algorithm,
                           align=self.topology.align, seed=seed, max_wait=pack.max_wait, slack=pack.slack)


FINGERPRINT = {
    "capacity": "capacity", "window": "packing.window", "algorithm": "packing.algorithm",
    "packs_per_batch": "packs_per_batch", "align": "topology.align", "text_key": "read.text_key",
    "tokens_key": "read.tokens_key", "labels_key": "read.labels_key", "loss_mask_key": "read.loss_mask_key",
    "overlong": "packing.overlong", "seed": "seed", "shuffle": "shuffle", "epochs": "epochs",
    "on_error": "read.on_error", "pad_id": "packing.pad_id", "ignore_index": "packing.ignore_index",
    "bos_id": "tokenize.bos_id", "eos_id": "tokenize.eos_id", "max_wait": "packing.max_wait",
    "slack": "packing.slack", "batches_per_epoch": "topology.batches_per_epoch",
    "equal_batches": "topology.equal_batches", "vocab_size": "read.vocab_size", "limits": "read.limits",
    "cost_model": "cost.model", "balance": "cost.balance"}
"""The settings a resume state is fingerprinted on: its name in the state (in the order states store them) ->
where the config keeps it."""


def fingerprint_settings(config: StreamConfig) -> dict[str, Any]:
    """:data:`FINGERPRINT`'s values, records as plain dicts."""

    def value(name: str, path: str) -> Any:
        if name == "max_wait":  # the number the packer waits, as states have always stored it
            return config.packing.max_wait or default_max_wait(config.packing.window)
        if name == "equal_batches":  # "count" yields the batches "plan" does, only counted without a store:
            equal = config.topology.equal_batches  # a state moves between them (a simulation to a launched run)
            return "plan" if equal == "count" else equal
        if name == "limits":  # the reader's own record of them (ShardReader keeps the same one)
            return config.read.limits.recorded(images=config.media is not None)
        return operator.attrgetter(path)(config)

    settings = {name: _plain(value(name, path)) for name, path in FINGERPRINT.items()}
    if settings["balance"] is not None:  # how a fresh run's histogram starts; a resume restores the saved one
        del settings["balance"]["seeded"]
    if config.media is not None:
        settings["media"] = config.media.recorded()
    if config.tokenize.chat is not None:  # how records become tokens and masks (a template by its digest)
        settings["chat"] = config.tokenize.chat.recorded()
    return settings


def _plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value


@dataclass(frozen=True, slots=True, kw_only=True)
class Share:
    """What an elastic resume hands one new reader (see :mod:`streampack.plan.elastic`): its part of
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
    ``plan.quota.LateQuota`` that settles after the reader's first batch."""
    identities: Mapping[int, Any] = field(default_factory=dict)
    """Shard -> the identity (``io.storage.ShardStat``) the old readers recorded: the new reader
    refuses a shard that changed since when it opens it."""


def sources_of(urls: URLs | Mapping[str, Any], *, opts: OpenOptions, mixture_stop: str) -> Sources:
    """Expand what the user named, once: a mixture mapping, a packed directory, or shards."""
    if isinstance(urls, Mapping):
        shards, weights = {}, {}
        for name, value in urls.items():
            weighted = isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Real)
            source, weights[name] = value if weighted else (value, 1.0)
            if not is_source_object(source) and is_packed_dataset(source):
                raise ValueError(f"mixture source {name!r} is a `streampack pack` directory; mixtures "
                                 f"read raw shards only")
            shards[name] = ShardList.of(source, opts=opts)
        if not shards:
            raise ValueError("a mixture needs at least one source")
        by_name = dict(sorted(weights.items(), key=lambda kv: str(kv[0])))  # mapping order never matters
        return Sources(mixture=shards, weights=by_name, stop=mixture_stop)
    if not is_source_object(urls) and is_packed_dataset(urls):
        return Sources(packed=packed_manifest(urls), packed_urls=urls)
    return Sources(shards=ShardList.of(urls, opts=opts))


def tokenizer_id(tokenizer: Any) -> str | None:
    """What identifies a tokenizer in the fingerprint: a changed vocabulary changes every id."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, (str, os.PathLike)):  # the Tokenize node checked that it exists
        with open(tokenizer, "rb") as f:
            return "sha1:" + hashlib.sha1(f.read()).hexdigest()[:16]
    if hasattr(tokenizer, "to_str"):  # tokenizers.Tokenizer: its full serialized definition
        return "sha1:" + hashlib.sha1(tokenizer.to_str().encode()).hexdigest()[:16]
    if hasattr(tokenizer, "backend_tokenizer"):  # a transformers fast tokenizer: its vocabulary and chat template
        text = tokenizer.backend_tokenizer.to_str() + repr(getattr(tokenizer, "chat_template", None))
        return "sha1:" + hashlib.sha1(text.encode()).hexdigest()[:16]
    name = getattr(tokenizer, "__qualname__", type(tokenizer).__qualname__)
    return f"{getattr(tokenizer, '__module__', '')}.{name}"
