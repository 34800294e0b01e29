"""Issue 13, finding 1: hostile structure becomes a DataError naming the shard (never a bare
RecursionError / ValueError / MemoryError / hang) and obeys on_error, in raise and skip mode."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers_hostile import (
    archive,
    assert_resume_exact,
    check_both_modes,
    header,
    ids,
    member,
    npy_bytes,
    pad,
    read,
    sample,
    samples,
    write_bytes,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streampack.errors import DataError, ErrorCounter, ErrorPolicy
from streampack.io.decode import BAD_LENGTH
from streampack.io.index import build_index
from streampack.io.limits import Limits
from streampack.options import ReadOptions


def raise_and_skip(url, reason: str, key: str | None = None, **kw) -> tuple[list[int], ErrorCounter]:
    """The DataError raised in raise mode (checked), and what skip mode keeps and counts."""
    with pytest.raises(DataError) as info:
        read(url, **kw)
    err = info.value
    assert err.reason == reason and err.url == url and url in str(err), str(err)
    if key is not None:
        assert err.key == key, str(err)
    errors = ErrorCounter()
    return ids(read(url, error_policy=ErrorPolicy("skip", errors), **kw)), errors


# ------------------------------------------------------------------ json nesting
DEEP = b'{"input_ids": [1], "meta": ' + b"[" * 1000 + b"]" * 1000 + b"}\n"  # ~2 KB


def test_deep_jsonl_line_is_json_too_deep(tmp_path) -> None:
    # before: RecursionError, uncaught in both modes, naming no shard
    url = write_bytes(tmp_path / "deep.jsonl", b'{"input_ids": [5]}\n' + DEEP + b'{"input_ids": [6]}\n')
    kept, errors = raise_and_skip(url, "json_too_deep", key="1")
    assert kept == [5, 6] and errors.counts == {"json_too_deep": 1}
    assert build_index(url).lengths.tolist() == [1, BAD_LENGTH, 1]  # the index scan does not recurse either (the reader refuses it)


def test_deep_tar_json_member_is_json_too_deep(tmp_path) -> None:
    url = write_bytes(tmp_path / "deep.tar", archive(*samples(2), member("bad00000.json", DEEP), *samples(2, start=2)))
    kept, errors = raise_and_skip(url, "json_too_deep", key="bad00000")
    assert kept == [1, 2, 3, 4] and errors.counts == {"json_too_deep": 1}


def test_depth_limit_is_exact_and_ignores_brackets_in_strings(tmp_path) -> None:
    # depth 6 (the record is 1), with closing brackets, an escaped quote and a backslash in a string
    shallow = {"input_ids": [1], "x": [[[[[']]]]] " {{{{ \\']]]]]}
    lines = [shallow, {"input_ids": [2], "x": [[[[[[1]]]]]]}]  # depth 7
    url = write_bytes(tmp_path / "d.jsonl", "".join(json.dumps(r) + "\n" for r in lines).encode())
    errors = ErrorCounter()
    kept = ids(read(url, read=ReadOptions(limits=Limits(max_json_depth=6)), error_policy=ErrorPolicy("skip", errors)))
    assert kept == [1] and errors.counts == {"json_too_deep": 1}
    assert ids(read(url, read=ReadOptions(limits=Limits(max_json_depth=7)))) == [1, 2]


def test_deep_json_is_refused_even_under_a_raised_recursion_limit(tmp_path) -> None:
    # catching RecursionError would not be enough: with sys.setrecursionlimit(10**6) a deep
    # line overflows the C stack (a segfault) unless the depth is checked before json.loads
    url = write_bytes(tmp_path / "deeper.jsonl", b'{"a": ' + b"[" * 200_000 + b"]" * 200_000 + b"}\n")
    code = textwrap.dedent(f"""
        import sys
        sys.setrecursionlimit(10**6)
        from streampack.errors import DataError
        from streampack.io.decode import parse_json_object
        try:
            parse_json_object(open({url!r}, "rb").read(), url="u", key="k")
        except DataError as e:
            print(e.reason)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "json_too_deep", out.stderr[-2000:]


# ------------------------------------------------------------------ pax / GNU headers
@pytest.mark.parametrize("record", [
    b"xx path=foo\n",        # before: bare ValueError: invalid literal for int()
    b"0 path=foo\n",         # before: an infinite loop (a record of length 0)
    b"99 path=foo\n",        # runs past the header
    b"13 pathfoo12\n",       # no '='
    b"14 size=12ab\n",       # a size that is not a number (before: bare ValueError)
    b"11 path=ab\nnospace",  # a second record without a length
    b"12 path=ab\n",         # a length past the end of the header
])
def test_malformed_pax_header_loses_only_the_member_it_describes(tmp_path, record: bytes) -> None:
    bad = member("././@PaxHeader", record, kind=b"x") + sample("00000003", [4, 7])
    url = write_bytes(tmp_path / "pax.tar", archive(*samples(3), bad, *samples(3, start=4)))
    kept, errors = raise_and_skip(url, "corrupt_shard")
    assert kept == [1, 2, 3, 5, 6, 7] and errors.counts == {"corrupt_shard": 1}
    assert assert_resume_exact(url) == kept  # the offsets after the region are the real ones


def test_gnu_long_name_declaring_64_gib(tmp_path) -> None:
    # before: MemoryError (the reader allocated the declared 64 GiB name)
    bad = header("././@LongLink", 64 << 30, kind=b"L") + pad(b"00000003.npy\0") + sample("00000003", [4, 7])
    url = write_bytes(tmp_path / "long.tar", archive(*samples(3), bad, *samples(3, start=4)))
    kept, errors = raise_and_skip(url, "corrupt_shard")
    assert kept == [1, 2, 3, 5, 6, 7] and errors.counts == {"corrupt_shard": 1}
    assert assert_resume_exact(url) == kept


def test_a_valid_long_name_still_works(tmp_path) -> None:
    name = "d" * 150 + "/00000003.npy"
    long = header("././@LongLink", len(name) + 1, kind=b"L") + pad(name.encode() + b"\0")
    data = npy_bytes(np.array([4, 7]))
    url = write_bytes(tmp_path / "ok.tar", archive(*samples(3), long + member("d" * 90 + ".npy", data)))
    out = read(url)
    assert ids(out) == [1, 2, 3, 4] and out[-1].key == "d" * 150 + "/00000003"


@pytest.mark.parametrize("size_field", [b"-0000000001\0", b"0000001_000\0", b"\xff" * 12, b"12345678zz\0\0"])
def test_unparsable_size_field_is_a_corrupt_region(tmp_path, size_field: bytes) -> None:
    bad = header("00000003.npy", 0, size_field=size_field) + pad(npy_bytes(np.array([4, 7])))
    url = write_bytes(tmp_path / "size.tar", archive(*samples(3), bad, *samples(3, start=4)))
    kept, errors = raise_and_skip(url, "corrupt_shard")
    assert kept == [1, 2, 3, 5, 6, 7] and errors.counts == {"corrupt_shard": 1}
    assert assert_resume_exact(url) == kept


# ------------------------------------------------------------------ absurd declared sizes
@pytest.mark.parametrize("declared", [1 << 40, 1 << 50])  # 1 TiB (octal), 1 PiB (GNU base-256)
@pytest.mark.parametrize("field", ["npy", "jpg"])  # a member the decoder reads, one it skips
def test_member_declaring_an_absurd_size(tmp_path, declared: int, field: str) -> None:
    # before: MemoryError. A size past the end of the file is a corrupt header: skipped to
    # the next readable one, so only that member's sample is lost
    bad = member(f"00000003.{field}", b"", declared=declared)
    url = write_bytes(tmp_path / "big.tar", archive(*samples(3), bad, *samples(3, start=4)))
    kept, errors = raise_and_skip(url, "corrupt_shard")
    assert kept == [1, 2, 3, 5, 6, 7] and errors.counts == {"corrupt_shard": 1}
    assert assert_resume_exact(url) == kept


def test_absurd_size_on_a_stream_that_cannot_seek(tmp_path) -> None:
    # the skip is read and dropped in bounded chunks (a pipe, like an HTTP body, cannot seek)
    bad = member("00000003.jpg", b"", declared=1 << 40)
    url = write_bytes(tmp_path / "pipe.tar", archive(*samples(3), bad))
    errors = ErrorCounter()
    out = read(f"pipe:cat {url}", read=ReadOptions(allow_pipe=True), error_policy=ErrorPolicy("skip", errors))
    assert ids(out) == [1, 2, 3] and errors.counts == {"corrupt_shard": 1}


def test_npy_header_declaring_a_huge_shape_is_bad_npy(tmp_path) -> None:
    # before: np.load allocated the declared 8 TB array first (MemoryError)
    hdr = "{'descr': '<i8', 'fortran_order': False, 'shape': (1000000000000,), }"
    hdr = hdr + " " * (-(len(hdr) + 11) % 64) + "\n"
    bogus = b"\x93NUMPY\x01\x00" + len(hdr).to_bytes(2, "little") + hdr.encode() + bytes(16)
    object_npy = npy_bytes(np.array([1, 2])).replace(b"'<i8'", b"'|O' ")
    # an unclosed header dict: numpy's parser raised a bare tokenize.TokenError (found by fuzzing)
    unclosed = npy_bytes(np.array([1, 2])).replace(b"'shape': (2,), }", b"'shape': (2,  {[")
    for i, data in enumerate([bogus, object_npy, unclosed]):
        url = write_bytes(tmp_path / f"npy{i}.tar", archive(*samples(2), member("bad00000.npy", data), *samples(2, start=2)))
        kept, errors = raise_and_skip(url, "bad_npy", key="bad00000")
        assert kept == [1, 2, 3, 4] and errors.counts == {"bad_npy": 1}


def test_broken_pickle_is_bad_pickle_when_allowed(tmp_path) -> None:
    url = write_bytes(tmp_path / "p.tar", archive(*samples(2), member("bad00000.pyd", b"\x80\x04garbage"), *samples(1, start=2)))
    kept, errors = raise_and_skip(url, "bad_pickle", key="bad00000", read=ReadOptions(allow_pickle=True))
    assert kept == [1, 2, 3] and errors.counts == {"bad_pickle": 1}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_hostile_structure_through_the_loader(tmp_path, num_workers: int) -> None:
    pax = member("././@PaxHeader", b"0 path=x\n", kind=b"x") + sample("00000003", [4, 7])
    tar = write_bytes(tmp_path / "pax.tar", archive(*samples(3), pax, *samples(3, start=4)))
    deep = write_bytes(tmp_path / "deep.jsonl", b'{"input_ids": [5]}\n' + DEEP)
    keys = [f"{tar}#{i:08d}" for i in (0, 1, 2, 4, 5, 6)] + [f"{deep}#0"]
    check_both_modes([tar, deep], num_workers=num_workers, raises={("corrupt_shard", tar), ("json_too_deep", deep)}, kept=keys,
                     counts={"corrupt_shard": 1, "json_too_deep": 1})


# ------------------------------------------------------------------ any damage at all
_FUZZ_BASE = archive(*samples(3), sample("00000003", [1, 2], **{"labels.npy": npy_bytes([1, 2])}),
                     member("././@PaxHeader", b"20 path=00000004.npy\n", kind=b"x") + member("x.npy", npy_bytes([5])),
                     member("00000005.json", b'{"input_ids": [1, 2], "text": "[{"}'), *samples(2, start=6))


_EDITS = st.lists(st.tuples(st.integers(0, len(_FUZZ_BASE) - 1), st.sampled_from(
    [b"\xff", b"\x00", b"7", b"-1\0\0", b"\x80\xff\xff\xff", b"0 a=b\n", b"{'descr'", b"[[[["]),
    st.integers(0, 3)), min_size=1, max_size=5)
_FUZZ = {"deadline": None, "derandomize": True, "suppress_health_check": [HealthCheck.function_scoped_fixture]}


@settings(max_examples=25, **_FUZZ)
@given(edits=_EDITS)
def test_any_damage_is_a_data_error_or_a_counted_skip(tmp_path, edits) -> None:
    # the fuzzer that found numpy's header parser raising a bare tokenize.TokenError
    _check_damage(tmp_path, edits)


@pytest.mark.slow
@settings(max_examples=600, **_FUZZ)
@given(edits=_EDITS)
def test_any_damage_long(tmp_path, edits) -> None:
    _check_damage(tmp_path, edits)


def _check_damage(tmp_path, edits) -> None:
    data = bytearray(_FUZZ_BASE)
    for at, patch, op in edits:
        if op == 0:
            data[at:at + len(patch)] = patch  # overwrite
        elif op == 1:
            del data[at:at + 100 * len(patch)]  # cut a piece out
        elif op == 2:
            data = data[:at]  # truncate
        else:
            data[at:at] = patch  # insert (shifts every later header)
    url = write_bytes(tmp_path / "fuzz.tar", bytes(data))
    errors = ErrorCounter()
    kept = read(url, error_policy=ErrorPolicy("skip", errors))  # never raises
    assert len(kept) + errors.total >= 1 or not data.strip(b"\0")
    try:
        assert len(read(url)) == len(kept)
    except DataError as e:  # raise mode: only DataErrors, naming the shard
        assert e.url == url
    assert assert_resume_exact(url, every=max(1, len(kept) // 2)) == ids(kept)  # offsets stay true
