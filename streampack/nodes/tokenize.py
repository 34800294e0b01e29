"""Tokenize stage: ``Sample.text`` -> ``Sample.tokens`` (or, with ``TokenizeOptions.chat``, a chat record ->
tokens and loss mask through :class:`~streampack.chat.encoder.ChatEncoder`), a block of samples at a time.

:class:`TextEncoder` is the one tokenization path (the node, ``streampack pack`` / ``inspect``, a hand-built
``ParallelMapper``), so BOS/EOS, the id checks and the errors are the same everywhere. Blocks of ``block_size`` samples
are encoded together (``encode_batch``), optionally over ``num_threads`` threads, and reassembled in input order. State
= the upstream state at the start of the block, the block's sample count and the offset inside it: a restore re-encodes
one block instead of storing tokens, so ``get_state`` is O(1) and ``block_size`` / ``num_threads`` may change. Ids must
be integers in ``[0, vocab_size)`` (below 2**31 without one: a stray id would fail on the GPU, far from its sample); a
bad result is a :class:`~streampack.errors.DataError` under ``on_error``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from streampack.chat.encoder import ChatEncoder
from streampack.errors import DataError, ErrorPolicy
from streampack.io.limits import id_bound
from streampack.options.tokenize import TokenizeOptions
from streampack.plan.state import record_of, record_text
from streampack.sample import Sample

Encoder = Callable[[list[str]], list[list[int]]]


def make_encoder(tokenizer: Any) -> Encoder:
    """A batch encoder from a ``tokenizers.Tokenizer``, a path to a ``tokenizer.json``, a HF
    fast tokenizer (its ``backend_tokenizer`` is used) or any callable ``str -> list[int]``.
    Special tokens are not added: BOS / EOS come from :class:`TextEncoder`."""
    if isinstance(tokenizer, (str, os.PathLike)):
        if not os.path.isfile(tokenizer):
            raise ValueError(f"tokenizer file {os.fspath(tokenizer)!r} does not exist")
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(os.fspath(tokenizer))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise ValueError(f"cannot load tokenizer {os.fspath(tokenizer)!r}: {e}") from None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        tokenizer = backend
    if hasattr(tokenizer, "encode_batch") and hasattr(tokenizer, "token_to_id"):
        def encode(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
        return encode
    if callable(tokenizer):
        return lambda texts: [tokenizer(t) for t in texts]
    raise TypeError(f"tokenizer must be a tokenizers.Tokenizer, a path to tokenizer.json or a "
                    f"callable str -> list[int], got {type(tokenizer).__name__}")


class TextEncoder:
    """Text samples -> tokenized samples: encode, check the ids, add ``bos_id`` / ``eos_id``. ``encode(block)``
    returns per sample the result, None (empty text) or the :class:`DataError`; called on one sample it
    returns or raises, so it is also a ``ParallelMapper`` ``map_fn``."""

    def __init__(self, tokenizer: Any, options: TokenizeOptions = TokenizeOptions(), *,
                 vocab_size: int | None = None) -> None:
        # the record checked its own values and ReadOptions checked vocab_size; what spans the
        # two (an added id must be in the vocabulary) is checked here, where both arrive
        self.vocab_size = vocab_size
        bound = id_bound(vocab_size)
        for name in ("bos_id", "eos_id"):
            value = getattr(options, name)
            if value is not None and not value < bound:
                raise ValueError(f"TokenizeOptions({name}={value!r}) must be None or a token id in [0, {bound})")
        self._encode = make_encoder(tokenizer)
        self._pre = np.asarray([] if options.bos_id is None else [options.bos_id], dtype=np.int64)
        self._post = np.asarray([] if options.eos_id is None else [options.eos_id], dtype=np.int64)
        self.num_threads = options.num_threads
        self._pool: ThreadPoolExecutor | None = None

    def __call__(self, sample: Sample) -> Sample:
        out = self.encode([sample])[0]
        if isinstance(out, DataError):
            raise out
        if out is None:
            raise DataError("empty_sample", "text encodes to 0 tokens", url=sample.url, key=sample.key, value=sample.text)
        return out

    def encode(self, samples: Sequence[Sample]) -> list[Sample | DataError | None]:
        """Samples that carry tokens pass through; text samples are encoded as one batch."""
        out: list[Sample | DataError | None] = list(samples)
        todo = [i for i, s in enumerate(samples) if s.tokens is None and s.chat is None]
        for i in (i for i, s in enumerate(samples) if s.tokens is None and s.chat is not None):
            out[i] = DataError("chat_record", "a chat record (messages, conversations, prompt/completion) needs "
                               "TokenizeOptions(chat=ChatOptions())", url=samples[i].url, key=samples[i].key,
                               value=sorted(samples[i].chat))
        for i, ids in zip(todo, self._encode_texts([samples[i] for i in todo])):
            if isinstance(ids, DataError):
                out[i] = ids
            else:
                tokens = self._wrap(ids, samples[i])
                out[i] = tokens if isinstance(tokens, DataError) else (
                    replace(samples[i], tokens=tokens, text=None) if tokens.shape[0] else None)
        return out

    def _encode_texts(self, samples: list[Sample]) -> list[Sequence[int] | DataError]:
        if not samples:
            return []
        texts = [s.text or "" for s in samples]
        try:
            lists = self._encode_parallel(texts)
            if len(lists) == len(texts):
                return lists
        except Exception:  # noqa: BLE001 — find the samples that break it, one by one
            pass
        return [self._encode_one(s, t) for s, t in zip(samples, texts)]

    def _encode_one(self, sample: Sample, text: str) -> Sequence[int] | DataError:
        try:
            (ids,) = self._encode([text])
            return ids
        except Exception as e:  # noqa: BLE001 — any tokenizer failure is this sample's error
            return DataError("tokenizer_error", f"the tokenizer raised {e!r}", url=sample.url, key=sample.key, value=text)

    def _encode_parallel(self, texts: list[str]) -> list[Sequence[int]]:
        if self.num_threads == 1 or len(texts) < 2:
            return list(self._encode(texts))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="streampack-tok")
        step = -(-len(texts) // self.num_threads)
        chunks = [texts[i:i + step] for i in range(0, len(texts), step)]
        # map() returns results in submission order: the stream is thread-count independent
        return [ids for part in self._pool.map(self._encode, chunks) for ids in part]

    def _wrap(self, ids: Sequence[int], sample: Sample) -> np.ndarray | DataError:
        try:
            arr = np.asarray(ids)
        except (ValueError, TypeError):
            arr = np.asarray(ids, dtype=object)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            return DataError("bad_dtype", f"the tokenizer returned {arr.dtype}{list(arr.shape)}, want a "
                             f"list of ints", url=sample.url, key=sample.key, value=arr.tolist()[:8])
        if arr.size and int(arr.min()) < 0:
            return DataError("negative_id", "the tokenizer returned a negative token id", url=sample.url,
                             key=sample.key, value=int(arr.min()))
        if arr.size and int(arr.max()) >= id_bound(self.vocab_size):
            limit = f"vocab_size={self.vocab_size}" if self.vocab_size is not None else "2**31"
            return DataError("out_of_vocab_id", f"the tokenizer returned token id {int(arr.max())}, not below {limit}",
                             url=sample.url, key=sample.key, value=int(arr.max()))
        if not arr.size:
            return arr.astype(np.int64)
        return np.concatenate([self._pre, arr.astype(np.int64, copy=False), self._post])

    def close(self) -> None:
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def __del__(self) -> None:
        self.close()


class Tokenize(BaseNode[Sample]):
    """Encode ``text`` samples with a :class:`TextEncoder`, or chat records with a ``ChatEncoder`` (tokenized ones
    pass); an empty result is dropped and counted in ``counters["empty"]`` (an overlong conversation in
    ``"dropped"``, a cut one in ``"truncated"``), a rejected sample goes to ``error_policy`` (default: raise)."""

    SOURCE_KEY = "source"
    OFFSET_KEY = "offset"
    READ_KEY = "read"
    COUNTERS_KEY = "counters"

    def __init__(self, source: BaseNode[Sample], tokenizer: Any, options: TokenizeOptions = TokenizeOptions(), *,
                 error_policy: ErrorPolicy | None = None, vocab_size: int | None = None, max_len: int | None = None,
                 media: Any = None) -> None:
        super().__init__()
        self.source = source
        # chat records: the same node with the chat encoder (max_len and media: its overlong rule's lengths)
        self.encoder: TextEncoder | ChatEncoder = TextEncoder(tokenizer, options, vocab_size=vocab_size) \
            if options.chat is None else ChatEncoder(tokenizer, options.chat, vocab_size=vocab_size, max_len=max_len,
                                                     media=media)
        self._zero = {"tokenized": 0, "empty": 0, **dict.fromkeys(getattr(self.encoder, "COUNTERS", ()), 0)}
        self.block_size = options.block_size
        self._policy = error_policy if error_policy is not None else ErrorPolicy()
        self._block: list[Sample] = []
        self._offset = 0
        self._read = 0  # upstream samples the current block was made from
        self._block_state: dict[str, Any] | None = None
        self.counters = dict(self._zero)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._block, self._offset, self._read = [], 0, 0
        if initial_state is None:
            self.source.reset(None)
            self._block_state = None
            self.counters = dict(self._zero)
            return
        self.source.reset(initial_state[self.SOURCE_KEY])
        self._block_state = initial_state[self.SOURCE_KEY]
        self.counters = record_of(initial_state[self.COUNTERS_KEY])
        # replay exactly the saved block (not `block_size` samples: that setting may differ now)
        read = int(initial_state.get(self.READ_KEY, self.block_size))
        if read:
            self._fill_block(replay=True, limit=read)
        self._offset = initial_state[self.OFFSET_KEY]
        if self._offset > len(self._block):
            raise ValueError(f"Tokenize state offset {self._offset} is past its block of "
                             f"{len(self._block)} samples: the upstream stream changed")

    def next(self) -> Sample:
        while self._offset >= len(self._block):
            self._block_state = self.source.state_dict()
            self._fill_block(replay=False)
            if not self._read:
                raise StopIteration
        sample = self._block[self._offset]
        self._offset += 1
        return sample

    def get_state(self) -> dict[str, Any]:
        if self._block_state is None:
            self._block_state = self.source.state_dict()
        return {self.SOURCE_KEY: self._block_state, self.OFFSET_KEY: self._offset,
                self.READ_KEY: self._read, self.COUNTERS_KEY: record_text(self.counters)}

    def _fill_block(self, *, replay: bool, limit: int | None = None) -> None:
        """Read up to ``limit`` (default ``block_size``) samples and encode them. On a restore
        replay the counters (and the error counts) already include this block."""
        raw: list[Sample] = []
        for _ in range(self.block_size if limit is None else limit):
            try:
                raw.append(next(self.source))
            except StopIteration:
                break
        self._read = len(raw)
        self._block, self._offset = [], 0
        failed: list[DataError] = []
        encoded = self.encoder.encode(raw)
        for name, count in getattr(self.encoder, "events", {}).items():
            self.counters[name] += 0 if replay else count
        for before, out in zip(raw, encoded):
            if isinstance(out, DataError):
                failed.append(out)
            elif out is None:
                self.counters["empty"] += 0 if replay or before.chat is not None else 1  # a chat: dropped
            else:
                self._block.append(out)
                self.counters["tokenized"] += 0 if (replay or before.tokens is not None) else 1
        if failed and not replay:
            # the whole block is built first, so a caller that goes on after a raise loses nothing
            for err in failed[1:]:
                self._policy.errors.record(err)
            self._policy.handle(failed[0])
