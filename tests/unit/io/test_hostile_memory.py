"""Issue 13, finding 2: memory follows a user-set limit, not the declared or decompressed size.

Each limit is checked while streaming (tracemalloc proves nothing over the limit is held); the
RSS of a real decompression bomb and a huge-line shard is checked in ``test_memory.py``.
"""

from __future__ import annotations

import gzip
import json
import tracemalloc

import numpy as np
import pytest
from helpers_hostile import (
    archive,
    check_both_modes,
    ids,
    npy_bytes,
    read,
    sample,
    samples,
    write_bytes,
)

from streampack.errors import DataError, ErrorCounter, ErrorPolicy
from streampack.io.decode import BAD_LENGTH
from streampack.io.index import build_index
from streampack.io.limits import Limits
from streampack.options import ReadOptions

KiB, MiB = 1 << 10, 1 << 20


def _line(i: int, pad: int = 0) -> bytes:
    return json.dumps({"input_ids": [i, 7], "pad": "x" * pad}).encode() + b"\n"


@pytest.mark.parametrize("gz", [False, True])
def test_line_over_max_line_bytes(tmp_path, gz: bool) -> None:
    limit = 4 * KiB
    at_limit = _line(2, limit - len(_line(2)) + 1)  # exactly `limit` bytes before its newline
    assert len(at_limit) == limit + 1
    data = _line(1) + _line(9, 3 * limit) + at_limit + _line(3)
    url = write_bytes(tmp_path / ("s.jsonl.gz" if gz else "s.jsonl"), gzip.compress(data) if gz else data)
    with pytest.raises(DataError, match="line_too_long") as info:
        read(url, read=ReadOptions(limits=Limits(max_line_bytes=limit)))
    assert info.value.key == "1" and info.value.url == url
    errors = ErrorCounter()
    assert ids(read(url, read=ReadOptions(limits=Limits(max_line_bytes=limit)),
                    error_policy=ErrorPolicy("skip", errors))) == [1, 2, 3]
    assert errors.counts == {"line_too_long": 1}
    assert errors.skipped_bytes == {"line_too_long": len(_line(9, 3 * limit))}
    assert ids(read(url, read=ReadOptions(limits=Limits(max_line_bytes=4 * limit)))) == [1, 9, 2, 3]


def test_overlong_line_is_never_held(tmp_path) -> None:
    # a 24 MiB line under a 1 MiB limit: the reader holds ~the limit, not the line
    url = write_bytes(tmp_path / "big.jsonl.gz", gzip.compress(_line(1) + _line(9, 24 * MiB) + _line(2), 1))
    tracemalloc.start()
    try:
        errors = ErrorCounter()
        kept = ids(read(url, read=ReadOptions(limits=Limits(max_line_bytes=MiB)), error_policy=ErrorPolicy("skip",
                                                                                                           errors)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert kept == [1, 2] and errors.counts == {"line_too_long": 1}
    assert peak < 6 * MiB, f"peak {peak / MiB:.1f} MiB for a 1 MiB limit"


def test_index_scan_steps_over_an_overlong_line(tmp_path) -> None:
    url = write_bytes(tmp_path / "s.jsonl", _line(1) + _line(9, 8 * KiB) + _line(2))
    index = build_index(url)
    assert index.lengths.tolist() == [2, 2, 2]
    from streampack.io.decode import DecodeOptions

    small = build_index(url, decode=DecodeOptions(limits=Limits(max_line_bytes=KiB)))
    assert small.offsets.tolist() == index.offsets.tolist() and small.lengths.tolist() == [2, BAD_LENGTH, 2]


def test_member_over_max_member_bytes_loses_only_its_sample(tmp_path) -> None:
    big = sample("00000003", np.arange(2000) % 50)  # a 16 KB token member
    url = write_bytes(tmp_path / "m.tar", archive(*samples(3), big, *samples(2, start=4)))
    with pytest.raises(DataError, match="member_too_large") as info:
        read(url, read=ReadOptions(limits=Limits(max_member_bytes=4 * KiB)))
    assert info.value.key == "00000003"
    errors = ErrorCounter()
    kept = ids(read(url, read=ReadOptions(limits=Limits(max_member_bytes=4 * KiB)), error_policy=ErrorPolicy("skip",
                                                                                                             errors)))
    assert kept == [1, 2, 3, 5, 6] and errors.counts == {"member_too_large": 1}
    assert errors.skipped_bytes["member_too_large"] == len(npy_bytes(np.arange(2000) % 50))
    assert len(read(url)) == 6  # the default limit (32 MiB) takes it


def test_sample_over_max_sample_bytes(tmp_path) -> None:
    labels = npy_bytes(np.arange(300) % 5)  # 2.5 KB each
    fat = sample("00000003", np.arange(300) % 5, **{"labels.npy": labels, "json": b'{"meta": 1}'})
    url = write_bytes(tmp_path / "s.tar", archive(*samples(3), fat, *samples(2, start=4)))
    errors = ErrorCounter()
    kept = ids(read(url, read=ReadOptions(limits=Limits(max_sample_bytes=4 * KiB, max_member_bytes=4 * KiB)),
                    error_policy=ErrorPolicy("skip", errors)))
    assert kept == [1, 2, 3, 5, 6] and errors.counts == {"sample_too_large": 1}


def test_members_the_decoder_never_reads_are_not_limited_nor_held(tmp_path) -> None:
    # a 4 MiB image next to the tokens: skipped unread (a seek past it), whatever the member
    # limit; what is held is the reader's 256 KiB read blocks, not the image
    with_image = [sample(f"{i:08d}", [i + 1, 7], jpg=bytes(4 * MiB)) for i in range(4)]
    url = write_bytes(tmp_path / "img.tar", archive(*with_image))
    tracemalloc.start()
    try:
        out = read(url, read=ReadOptions(limits=Limits(max_member_bytes=4 * KiB)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ids(out) == [1, 2, 3, 4] and peak < 2 * MiB, f"peak {peak / MiB:.1f} MiB"


def test_extension_headers_are_capped(tmp_path) -> None:
    # pax headers hold a path and a few attributes: one over 1 MiB is not a real one
    from helpers_hostile import header, pad

    huge_pax = header("././@PaxHeader", 2 * MiB, kind=b"x") + pad(b"x" * (2 * MiB))
    url = write_bytes(tmp_path / "pax.tar", archive(*samples(3), huge_pax, sample("00000003", [4, 7]),
                                                   *samples(3, start=4)))
    errors = ErrorCounter()
    assert ids(read(url, error_policy=ErrorPolicy("skip", errors))) == [1, 2, 3, 5, 6, 7]
    assert errors.counts == {"corrupt_shard": 1}


@pytest.mark.parametrize("bad", [{"max_line_bytes": 0}, {"max_member_bytes": -1}, {"max_sample_bytes": True},
                                 {"max_json_depth": 0}, {"max_json_depth": 501}, {"max_line_bytes": 1.5}])
def test_limits_are_validated(bad) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        Limits(**bad)


def test_dataset_takes_limits_and_fingerprints_them(tmp_path) -> None:
    from streampack.dataset import PackedDataset
    from streampack.options import ReadOptions

    url = write_bytes(tmp_path / "s.jsonl", _line(1) + _line(9, 8 * KiB) + _line(2))
    with pytest.raises(TypeError, match="Limits"):
        PackedDataset(url, capacity=16, read=ReadOptions(limits={"max_line_bytes": 10}))
    ds = PackedDataset(url, capacity=16, epochs=1, read=ReadOptions(on_error="skip", limits=Limits(max_line_bytes=KiB)))
    batches = list(ds)
    assert sum(b.num_docs for b in batches) == 2
    assert ds.metrics()["errors"]["counts"] == {"line_too_long": 1}
    other = PackedDataset(url, capacity=16, epochs=1, read=ReadOptions(on_error="skip"))
    with pytest.raises(ValueError, match="limits"):
        other.load_state_dict(ds.state_dict())


@pytest.mark.parametrize("num_workers", [0, 2])
def test_limits_through_the_loader(tmp_path, num_workers: int) -> None:
    lines = write_bytes(tmp_path / "l.jsonl.gz", gzip.compress(_line(1) + _line(9, 8 * KiB) + _line(2)))
    # token counts alike (the plan balances tokens), one npy member 4288 bytes, over the limit
    parts = [sample(f"{i:08d}", np.arange(500 if i != 2 else 520) % 50) for i in range(5)]
    tar = write_bytes(tmp_path / "m.tar", archive(*parts))
    keys = [f"{lines}#0", f"{lines}#2"] + [f"{tar}#{i:08d}" for i in (0, 1, 3, 4)]
    check_both_modes([lines, tar], num_workers=num_workers, raises={("line_too_long", lines), ("member_too_large", tar)},
                     kept=keys, counts={"line_too_long": 1, "member_too_large": 1}, capacity=1024,
                     read=ReadOptions(limits=Limits(max_line_bytes=4 * KiB, max_member_bytes=4200)))
