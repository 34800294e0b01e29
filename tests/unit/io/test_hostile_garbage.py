"""Issue 13, finding 4: garbage is refused with a clear DataError (or a counted skip): token ids
past the vocabulary, zero-byte compressed shards, repeated keys, conflicting token fields."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers_hostile import (
    archive,
    check_both_modes,
    ids,
    json_sample,
    member,
    npy_bytes,
    read,
    sample,
    samples,
    skip,
    write_bytes,
)
from node_checks import ListSource

from streampack.errors import DataError, ErrorCounter, ErrorPolicy
from streampack.nodes.reader import ShardReader
from streampack.nodes.tokenize import TextEncoder, Tokenize
from streampack.options import ReadOptions, TokenizeOptions
from streampack.sample import Sample


# ------------------------------------------------------------------ vocabulary bound
def _jsonl(tmp_path, rows) -> str:
    return write_bytes(tmp_path / "ids.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())


@pytest.mark.parametrize("bad_id", [2**31, 2**40])
def test_ids_past_int32_are_refused_without_a_vocab_size(tmp_path, bad_id: int) -> None:
    # before: ids of 2^31 and 2^40 went into batches (and later indexed past any embedding)
    url = _jsonl(tmp_path, [{"input_ids": [1, 2]}, {"input_ids": [3, bad_id]}, {"input_ids": [4]}])
    with pytest.raises(DataError, match=rf"out_of_vocab_id: token id {bad_id} is not below 2\*\*31") as info:
        read(url)
    assert info.value.key == "1" and info.value.url == url
    assert skip(url) == ([1, 4], {"out_of_vocab_id": 1})


def test_vocab_size_bounds_ids_and_labels_in_every_format(tmp_path) -> None:
    url = _jsonl(tmp_path, [{"input_ids": [1, 999]}, {"input_ids": [2, 1000]},
                            {"input_ids": [3, 5], "labels": [-100, 1000]}, {"input_ids": [4]}])
    assert skip(url, read=ReadOptions(vocab_size=1000, labels_key="labels")) == ([1, 4], {"out_of_vocab_id": 2})
    assert ids(read(url, read=ReadOptions(vocab_size=1001, labels_key="labels"))) == [1, 2, 3, 4]
    tar = write_bytes(tmp_path / "ids.tar", archive(
        sample("00000000", [1, 999]), sample("00000001", np.array([2, 1000], dtype=np.uint16)),
        sample("00000002", [3, 5], **{"labels.npy": npy_bytes(np.array([-100, 4000]))}), sample("00000003", [4])))
    assert skip(tar, read=ReadOptions(vocab_size=1000)) == ([1, 4], {"out_of_vocab_id": 2})
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = str(tmp_path / "ids.parquet")
    pq.write_table(pa.table({"input_ids": [[1, 999], [2, 1000], [3, 2**40], [4]]}), parquet)
    assert skip(parquet, read=ReadOptions(vocab_size=1000)) == ([1, 4], {"out_of_vocab_id": 2})
    with pytest.raises(ValueError, match="vocab_size"):
        ShardReader(url, read=ReadOptions(vocab_size=0))


def test_vocab_size_bounds_tokenizer_output() -> None:
    samples_ = [Sample(key="a", url="mem", text="w1 w2"), Sample(key="b", url="mem", text="w3"),
                Sample(key="c", url="mem", text="w4")]
    tok = {"w1 w2": [5, 6], "w3": [5, 50_000], "w4": [7]}.__getitem__
    errors = ErrorCounter()
    node = Tokenize(ListSource(samples_), tok, vocab_size=32_000, error_policy=ErrorPolicy("skip", errors))
    assert [s.key for s in node] == ["a", "c"] and errors.counts == {"out_of_vocab_id": 1}
    with pytest.raises(DataError, match=r"out_of_vocab_id: the tokenizer returned token id 50000.*key='b'"):
        list(Tokenize(ListSource(samples_), tok, vocab_size=32_000))
    with pytest.raises(DataError, match="out_of_vocab_id"):  # past int32 without a vocab_size
        TextEncoder(lambda t: [2**40])(samples_[0])
    with pytest.raises(ValueError, match="eos_id=32000"):
        TextEncoder(tok, TokenizeOptions(eos_id=32_000), vocab_size=32_000)


# ------------------------------------------------------------------ zero-byte shards
@pytest.mark.parametrize("name", ["empty.jsonl.gz", "empty.jsonl.zst", "empty.tar"])
def test_zero_byte_shard_is_a_clear_error(tmp_path, name: str) -> None:
    # before: a 0-byte .jsonl.gz (or .zst) read as empty while a 0-byte .tar was an error; all
    # are failed writes (a gzip of nothing is 20 bytes, a zstd frame 9, an empty tar 1024)
    url = write_bytes(tmp_path / name, b"")
    good = write_bytes(tmp_path / "good.jsonl", b'{"input_ids": [1]}\n')
    with pytest.raises(DataError, match=r"corrupt_shard: 0-byte file is not a") as info:
        read([url, good])
    assert info.value.url == url
    assert skip([url, good]) == ([1], {"corrupt_shard": 1})


def test_valid_empty_shards_read_as_empty(tmp_path) -> None:
    import gzip

    import zstandard

    urls = [write_bytes(tmp_path / "e.jsonl.gz", gzip.compress(b"")), write_bytes(tmp_path / "e.tar", bytes(1024)),
            write_bytes(tmp_path / "e.jsonl.zst", zstandard.ZstdCompressor().compress(b"")),
            write_bytes(tmp_path / "e.jsonl", b""), write_bytes(tmp_path / "g.jsonl", b'{"input_ids": [1]}\n')]
    assert skip(urls) == ([1], {})


# ------------------------------------------------------------------ repeated keys
def test_repeated_key_is_an_error(tmp_path) -> None:
    # before: a, b, a gave two documents with the same doc_key
    url = write_bytes(tmp_path / "rep.tar", archive(
        sample("a", [1]), sample("b", [2]), sample("a", [3]), sample("c", [4]), sample("b", [5])))
    with pytest.raises(DataError, match="repeated_key") as info:
        read(url)
    assert info.value.key == "a" and info.value.url == url
    assert skip(url) == ([1, 2, 4], {"repeated_key": 2})


def test_repeated_key_far_apart(tmp_path) -> None:
    url = write_bytes(tmp_path / "far.tar", archive(*samples(300), sample("00000007", [0]), *samples(3, start=300)))
    assert skip(url) == (list(range(1, 304)), {"repeated_key": 1})


def test_key_set_is_exact_past_its_merges() -> None:
    from streampack.io.keys import KeySet

    keys, seen = KeySet(), set()
    rng = np.random.default_rng(0)
    for k in rng.integers(0, 30_000, 40_000).tolist():  # several merges into the sorted array
        assert keys.add(str(k)) == (str(k) not in seen)
        seen.add(str(k))
    assert len(keys) == len(seen)


def test_split_members_of_one_key_are_still_one_sample_or_an_error(tmp_path) -> None:
    # a.npy, b.npy, a.labels.npy: "a" comes back for a member of its own
    url = write_bytes(tmp_path / "split.tar", archive(
        sample("a", [1, 2]), sample("b", [2]), member("a.labels.npy", npy_bytes(np.array([1, 2])))))
    assert skip(url) == ([1, 2], {"repeated_key": 1})


# ------------------------------------------------------------------ conflicting fields
@pytest.mark.parametrize("members, what", [
    ({"npy": [1, 2], "json": {"input_ids": [1, 2]}}, "tokens"),   # before: npy silently won
    ({"npy": [1, 2], "input_ids.npy": [1, 2]}, "tokens"),
    ({"txt": "hi", "json": {"text": "hi"}}, "text"),
    ({"npy": [1, 2], "labels.npy": [1, 2], "json": {"labels": [1, 2]}}, "labels"),
])
def test_conflicting_fields_are_an_error(tmp_path, members: dict, what: str) -> None:
    raw = {}
    for field, value in members.items():
        raw[field] = npy_bytes(np.array(value)) if field.endswith("npy") else (
            json.dumps(value).encode() if field == "json" else value.encode())
    bad = b"".join(member(f"bad00000.{f}", data) for f, data in raw.items())
    url = write_bytes(tmp_path / "c.tar", archive(*samples(2), bad, *samples(1, start=2)))
    with pytest.raises(DataError, match=rf"conflicting_fields: {what} given by 2 members") as info:
        read(url, read=ReadOptions(labels_key="labels"))
    assert info.value.key == "bad00000"
    assert skip(url, read=ReadOptions(labels_key="labels")) == ([1, 2, 3], {"conflicting_fields": 1})


def test_tokens_still_win_over_text(tmp_path) -> None:
    # documented, not a conflict: a record may carry its text beside its ids
    url = write_bytes(tmp_path / "t.tar", archive(json_sample("00000000", {"input_ids": [5, 6], "text": "five six"}),
                                                 sample("00000001", [7], txt=b"seven")))
    assert [s.tokens.tolist() for s in read(url)] == [[5, 6], [7]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_garbage_through_the_loader(tmp_path, num_workers: int) -> None:
    # per-sample garbage (repeated keys are checked per reader: see test_repeated_key_*)
    both = sample("00000001", [2], json=json.dumps({"input_ids": [2]}).encode())
    tar = write_bytes(tmp_path / "c.tar", archive(sample("00000000", [1]), both, sample("00000002", [3])))
    ids_ = _jsonl(tmp_path, [{"input_ids": [1, 2]}, {"input_ids": [5, 2**40]}, {"input_ids": [3]}])
    keys = [f"{tar}#00000000", f"{tar}#00000002", f"{ids_}#0", f"{ids_}#2"]
    check_both_modes([tar, ids_], num_workers=num_workers, raises={("conflicting_fields", tar), ("out_of_vocab_id", ids_)},
                     kept=keys, counts={"conflicting_fields": 1, "out_of_vocab_id": 1})
