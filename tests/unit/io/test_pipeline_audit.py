"""Regression tests from an audit of the streaming pipeline (each names the bug it pins down)."""

from __future__ import annotations

import io
from collections import Counter

import numpy as np
import pytest
from helpers_data import make_token_docs, tar_members, write_jsonl_shards, write_tar
from node_checks import ListSource, drain, make_samples

from streampack.errors import DataError, ErrorCounter, ErrorPolicy
from streampack.io import open as open_mod
from streampack.io.retry import RetryPolicy
from streampack.io.storage import OpenOptions
from streampack.nodes.reader import ShardReader
from streampack.nodes.tokenize import Tokenize
from streampack.options import TokenizeOptions
from streampack.options.topology import Placement
from streampack.sample import Sample


def _id_shards(directory, sizes: list[int]) -> tuple[list[str], int]:
    """Tar shards of the given sample counts; sample ``i`` has tokens ``[i, 1]``."""
    urls, i = [], 0
    for s, n in enumerate(sizes):
        samples = [(f"{i + k:08d}", tar_members([i + k, 1], fmt="npy")) for k in range(n)]
        urls.append(write_tar(directory / f"s{s:03d}.tar", samples))
        i += n
    return urls, i


# ------------------------------------------------------------------ jsonl.gz damage / retries
def _damaged_gz(tmp_path) -> tuple[list[str], list[list[int]]]:
    docs = make_token_docs(300, seed=2, max_len=60)
    urls = write_jsonl_shards(tmp_path, docs, 2, gz=True)
    data = bytearray(open(urls[0], "rb").read())
    mid = len(data) // 2
    data[mid:mid + 6] = b"\xff\x00\xff\x00\xaa\x55"  # bad deflate data: zlib.error, not OSError
    open(urls[0], "wb").write(bytes(data))
    return urls, docs


def test_damaged_gzip_is_a_data_error_naming_the_shard(tmp_path) -> None:
    # bug: zlib.error escaped the reader bare (no shard URL) and on_error="skip" did not skip it
    urls, docs = _damaged_gz(tmp_path)
    with pytest.raises(DataError, match=r"corrupt_shard: cannot decompress after uncompressed byte \d+.*"
                                        r"shard-000000\.jsonl\.gz.*key='\d+'"):
        list(ShardReader(urls, shuffle=False, epochs=1))
    errors = ErrorCounter()
    got = [s.tokens.tolist() for s in ShardReader(urls, shuffle=False, epochs=1, error_policy=ErrorPolicy("skip",
                                                                                                          errors))]
    assert errors.counts == {"corrupt_shard": 1}
    assert got[-150:] == docs[150:]  # the second shard is read whole
    assert got[:-150] == docs[:len(got) - 150] and len(got) < 300  # a prefix of the damaged one


@pytest.mark.parametrize("gz", [False, True])
def test_jsonl_read_failure_is_retried_not_corrupt(tmp_path, monkeypatch, gz: bool) -> None:
    # bug: any OSError while reading a jsonl shard (a dropped connection) became corrupt_shard
    # at once, losing the rest of the shard, where tar shards reopen at the recorded offset
    docs = make_token_docs(4000, seed=12, min_len=40, max_len=40)  # several 256 KiB local reads
    (url,) = write_jsonl_shards(tmp_path, docs, 1, gz=gz)
    opens: list[int] = []
    limit = (open(url, "rb").seek(0, 2)) // 2

    class Flaky(io.FileIO):
        def read(self, n: int = -1) -> bytes:
            if len(opens) <= 2 and self.tell() > limit:  # the first two opens drop mid-shard
                raise ConnectionResetError("peer went away")
            return super().read(n)

        def readline(self, n: int = -1) -> bytes:
            if len(opens) <= 2 and self.tell() > limit:
                raise ConnectionResetError("peer went away")
            return super().readline(n)

    def open_local(path):
        opens.append(1)
        return Flaky(path, "rb")

    monkeypatch.setattr(open_mod, "_open_local", open_local)
    retry = OpenOptions(retry=RetryPolicy(retries=2, backoff=0.01))
    assert [s.tokens.tolist() for s in ShardReader([url], epochs=1, open_options=retry)] == docs
    assert len(opens) == 3


# ------------------------------------------------------------------ infinite mode, empty shards
def test_infinite_mode_passes_over_an_epoch_with_only_empty_shards(tmp_path) -> None:
    # bug: with S == G, the worker that drew the empty shard in some epoch raised "got no
    # samples" and stopped training, although other epochs give it data
    urls, n = _id_shards(tmp_path, [4, 0, 6, 5])
    seen: Counter[int] = Counter()
    for g in range(4):
        reader = ShardReader(urls, seed=1, place=Placement(dp_rank=g, dp_size=4))
        seen.update(int(next(reader).tokens[0]) for _ in range(60))
        assert reader.epoch > 3
    assert set(seen) == set(range(n))


def test_infinite_mode_still_refuses_a_worker_that_can_never_get_data(tmp_path) -> None:
    # 3 shards of 2 samples cut into 4 parts each: part 3 is empty in every shard
    urls, _ = _id_shards(tmp_path, [2, 2, 2])
    reader = ShardReader(urls, seed=0, place=Placement(worker_id=11, num_workers=12))
    with pytest.raises(ValueError, match="no samples.*none from any shard"):
        next(reader)
    (tmp_path / "e").mkdir()
    with_empty, _ = _id_shards(tmp_path / "e", [3, 0, 3])
    assert int(next(ShardReader(with_empty, shuffle=False, place=Placement(worker_id=2, num_workers=3))).tokens[0]) == 3
    with pytest.raises(ValueError, match="no samples"):  # the same empty shard every epoch: at once
        next(ShardReader(with_empty, shuffle=False, place=Placement(worker_id=1, num_workers=3)))


def test_every_sample_once_per_epoch_odd_topologies(tmp_path) -> None:
    cases = [([7, 3, 11, 5, 2], 2, 3), ([9], 1, 4), ([3], 2, 4), ([1, 100, 2, 50], 2, 3), ([4, 0, 6], 2, 3)]
    for c, (sizes, dp, nw) in enumerate(cases):
        (tmp_path / str(c)).mkdir()
        urls, n = _id_shards(tmp_path / str(c), sizes)
        for epoch in range(2):
            seen: Counter[int] = Counter()
            for r in range(dp):
                for w in range(nw):
                    reader = ShardReader(urls, seed=5, epochs=epoch + 1, 
                                         place=Placement(dp_rank=r, dp_size=dp, worker_id=w, num_workers=nw))
                    reader.reset({**reader.state_dict(), "epoch": epoch})
                    seen.update(int(s.tokens[0]) for s in reader)
            assert seen == Counter(range(n)), f"{sizes=} {dp=} {nw=} {epoch=}"


# ------------------------------------------------------------------ tokenize stage
def _tok(text: str) -> list[int]:
    return [int(w[1:]) + 1 for w in text.split()]


def test_tokenize_restore_with_another_block_size_or_thread_count() -> None:
    # bug: the restore replayed `block_size` samples, so a state saved with block 64 at offset
    # 50 and restored with block 10 silently re-emitted samples 10..49
    samples = make_samples(np.random.default_rng(1).integers(1, 40, 200), text=True)
    full = drain(Tokenize(ListSource(samples), _tok, TokenizeOptions(block_size=64)))
    for k in (0, 1, 50, 64, 65, 130, 200):
        node = Tokenize(ListSource(samples), _tok, TokenizeOptions(block_size=64, num_threads=2))
        head = drain(node, k) if k else []
        state = node.state_dict()
        for block_size in (1, 10, 100):
            other = Tokenize(ListSource(samples), _tok, TokenizeOptions(block_size=block_size, num_threads=3))
            other.reset(state)
            assert head + drain(other) == full, f"saved at {k}, restored with {block_size=}"


@pytest.mark.parametrize("tokenizer, pattern", [
    (lambda t: [5] if t == "w1 w2" else [5, -1], r"negative_id: .*shard='mem', key='b', value=-1"),
    (lambda t: t.split(), r"bad_dtype: .*shard='mem', key='a'"),
    (lambda t: [1 // 0], r"tokenizer_error: .*ZeroDivisionError.*shard='mem', key='a', value='w1 w2'"),
])
def test_bad_tokenizer_output_names_the_sample(tokenizer, pattern) -> None:
    # bug: negative ids went into batches silently; other failures named no sample
    samples = [Sample(key="a", url="mem", text="w1 w2"), Sample(key="b", url="mem", text="w3")]
    with pytest.raises(DataError, match=pattern):
        list(Tokenize(ListSource(samples), tokenizer, TokenizeOptions(num_threads=2)))


# ------------------------------------------------------------------ metrics across a resume
def test_skip_counts_survive_a_resume(tmp_path) -> None:
    # bug: the error counter was rebuilt empty on restore (only errors met while replaying the
    # current round came back), so `metrics()["errors"]` under-counted skipped samples
    from streampack.dataset import PackedDataset
    from streampack.options import PackOptions, ReadOptions

    docs = make_token_docs(60, seed=2, max_len=30)
    docs[5], docs[33], docs[50] = [], [-3], []
    urls = write_jsonl_shards(tmp_path, docs, 3)

    def make() -> PackedDataset:
        return PackedDataset(urls, capacity=64, epochs=1, seed=1, read=ReadOptions(on_error="skip"),
                             packing=PackOptions(window=4, max_wait=2))

    full = make()
    n = sum(1 for _ in full)
    want = full.metrics()
    assert want["errors"]["counts"] == {"empty_sample": 2, "negative_id": 1}
    for k in range(0, n, 4):
        ds = make()
        it = iter(ds)
        for _ in range(k):
            next(it)
        other = make()
        other.load_state_dict(ds.state_dict())
        assert len(list(other)) == n - k
        assert other.metrics() == want, f"metrics differ after a resume at batch {k}"
