"""Tokenize stage: ``Sample.text`` -> ``Sample.tokens``, a block of samples at a time.

Samples are pulled in blocks of ``block_size`` and encoded together (``encode_batch`` for a
HF ``tokenizers.Tokenizer``), optionally split over ``num_threads`` threads (the Rust
tokenizer releases the GIL). Results are reassembled in input order, so the stream does not
depend on the thread count.

State = the upstream state at the start of the current block + how many upstream samples the
block read + the offset inside the block; restoring re-reads and re-encodes that one block (at
most ``block_size`` samples) instead of storing encoded tokens, which keeps ``get_state`` O(1)
(StatefulDataLoader asks for it after every batch). The replay reads the *saved* block's
sample count, so ``block_size`` / ``num_threads`` may change between save and restore.

Encoded ids are checked (integers, none negative); a bad result, or a tokenizer that raises,
becomes a :class:`~streampack.pipeline.errors.DataError` naming the shard URL and sample key.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from streampack.pipeline.errors import DataError
from streampack.sample import Sample

Encoder = Callable[[list[str]], list[list[int]]]


def make_encoder(tokenizer: Any) -> Encoder:
    """A batch encoder from a ``tokenizers.Tokenizer``, a path to a ``tokenizer.json``, a HF
    fast tokenizer (its ``backend_tokenizer`` is used) or any callable ``str -> list[int]``.
    Special tokens are not added: pass ``bos_id`` / ``eos_id`` to :class:`Tokenize` instead."""
    if isinstance(tokenizer, (str, os.PathLike)):
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(os.fspath(tokenizer))
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


class Tokenize(BaseNode[Sample]):
    """Encode ``text`` samples; samples that already carry tokens pass through unchanged.

    A sample whose text encodes to zero tokens (and no BOS/EOS) is dropped and counted in
    ``counters["empty"]`` (a zero-length document would break packing kernels).
    """

    SOURCE_KEY = "source"
    OFFSET_KEY = "offset"
    READ_KEY = "read"
    COUNTERS_KEY = "counters"

    def __init__(self, source: BaseNode[Sample], tokenizer: Any, *, bos_id: int | None = None,
                 eos_id: int | None = None, block_size: int = 64, num_threads: int = 1) -> None:
        super().__init__()
        if block_size < 1:
            raise ValueError(f"{block_size=} must be >= 1")
        if num_threads < 1:
            raise ValueError(f"{num_threads=} must be >= 1")
        self.source = source
        self.encode = make_encoder(tokenizer)
        self.bos_id, self.eos_id = bos_id, eos_id
        self.block_size, self.num_threads = block_size, num_threads
        self._pool: ThreadPoolExecutor | None = None
        self._block: list[Sample] = []
        self._offset = 0
        self._read = 0  # upstream samples the current block was made from
        self._block_state: dict[str, Any] | None = None
        self.counters = {"tokenized": 0, "empty": 0}

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._block, self._offset, self._read = [], 0, 0
        if initial_state is None:
            self.source.reset(None)
            self._block_state = None
            self.counters = {"tokenized": 0, "empty": 0}
            return
        self.source.reset(initial_state[self.SOURCE_KEY])
        self._block_state = initial_state[self.SOURCE_KEY]
        self.counters = dict(initial_state[self.COUNTERS_KEY])
        # replay exactly the saved block (not `block_size` samples: that setting may differ now)
        read = int(initial_state.get(self.READ_KEY, self.block_size))
        if read:
            self._fill_block(count=False, limit=read)
        self._offset = initial_state[self.OFFSET_KEY]
        if self._offset > len(self._block):
            raise ValueError(f"Tokenize state offset {self._offset} is past its block of "
                             f"{len(self._block)} samples: the upstream stream changed")

    def next(self) -> Sample:
        while self._offset >= len(self._block):
            self._block_state = self.source.state_dict()
            self._fill_block(count=True)
            if not self._block:
                raise StopIteration
        sample = self._block[self._offset]
        self._offset += 1
        return sample

    def get_state(self) -> dict[str, Any]:
        if self._block_state is None:
            self._block_state = self.source.state_dict()
        return {self.SOURCE_KEY: self._block_state, self.OFFSET_KEY: self._offset,
                self.READ_KEY: self._read, self.COUNTERS_KEY: dict(self.counters)}

    def _fill_block(self, *, count: bool, limit: int | None = None) -> None:
        """Read up to ``limit`` (default ``block_size``) samples and encode them; ``count`` is
        False on a restore replay (the restored counters already include this block)."""
        raw: list[Sample] = []
        for _ in range(self.block_size if limit is None else limit):
            try:
                raw.append(next(self.source))
            except StopIteration:
                break
        self._read = len(raw)
        todo = [i for i, s in enumerate(raw) if s.tokens is None]
        ids = self._encode_all([raw[i] for i in todo])
        empty = 0
        for i, tokens in zip(todo, ids):
            if tokens.shape[0] == 0:
                raw[i] = None  # type: ignore[call-overload]
                empty += 1
            else:
                raw[i] = replace(raw[i], tokens=tokens, text=None)
        self._block = [s for s in raw if s is not None]
        self._offset = 0
        if count:
            self.counters["tokenized"] += len(todo) - empty
            self.counters["empty"] += empty

    def _encode_all(self, samples: list[Sample]) -> list[np.ndarray]:
        if not samples:
            return []
        texts = [s.text or "" for s in samples]
        try:
            lists = self._encode_texts(texts)
            if len(lists) != len(texts):
                raise ValueError(f"tokenizer returned {len(lists)} results for {len(texts)} texts")
        except Exception as e:
            # find the sample that breaks it, so the error says where the input came from
            for sample, text in zip(samples, texts):
                try:
                    self.encode([text])
                except Exception as one:
                    raise DataError("tokenizer_error", f"the tokenizer raised {one!r}", url=sample.url,
                                    key=sample.key, value=text) from one
            raise e
        return [self._wrap(ids, sample) for ids, sample in zip(lists, samples)]

    def _encode_texts(self, texts: list[str]) -> list[Sequence[int]]:
        if self.num_threads == 1 or len(texts) < 2:
            return list(self.encode(texts))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="streampack-tok")
        step = -(-len(texts) // self.num_threads)
        chunks = [texts[i:i + step] for i in range(0, len(texts), step)]
        # map() returns results in submission order: the stream is thread-count independent
        return [ids for part in self._pool.map(self.encode, chunks) for ids in part]

    def _wrap(self, ids: Sequence[int], sample: Sample) -> np.ndarray:
        try:
            arr = np.asarray(ids)
        except (ValueError, TypeError):
            arr = np.asarray(ids, dtype=object)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise DataError("bad_dtype", f"the tokenizer returned {arr.dtype}{list(arr.shape)}, want a "
                            f"list of ints", url=sample.url, key=sample.key, value=arr.tolist()[:8])
        if arr.size and int(arr.min()) < 0:
            raise DataError("negative_id", "the tokenizer returned a negative token id", url=sample.url,
                            key=sample.key, value=int(arr.min()))
        pre = [self.bos_id] if self.bos_id is not None else []
        post = [self.eos_id] if self.eos_id is not None else []
        return np.concatenate([np.asarray(pre, dtype=np.int64), arr.astype(np.int64, copy=False),
                               np.asarray(post, dtype=np.int64)])

    def __del__(self) -> None:
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=False)
