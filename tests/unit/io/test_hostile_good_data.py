"""Issue 13, finding 3: ``skip`` loses exactly the bad samples — never a good neighbour — and
every skip is counted; the verdicts next to corrupt regions are the same after a resume."""

from __future__ import annotations

import numpy as np
import pytest
from helpers_hostile import (
    archive,
    check_both_modes,
    ids,
    member,
    npy_bytes,
    read,
    sample,
    samples,
    skip,
    write_bytes,
)
from node_checks import roundtrip

from streampack.errors import DataError, ErrorCounter, ErrorPolicy
from streampack.nodes.reader import ShardReader
from streampack.options import ReadOptions
from streampack.options.topology import Placement


def damage_header(data: bytes, offset: int) -> bytes:
    """Flip a byte of the header at ``offset``: its checksum no longer matches."""
    return data[:offset] + bytes([data[offset] ^ 0x55]) + data[offset + 1:]


def offsets_of(parts: list[bytes]) -> list[int]:
    return np.cumsum([0] + [len(p) for p in parts]).tolist()


def test_the_sample_before_an_unreadable_header_is_kept(tmp_path) -> None:
    # before: skip mode dropped sample 2 (complete) with the broken sample 3 and the rest
    parts = samples(8)
    data = damage_header(archive(*parts), offsets_of(parts)[3])
    url = write_bytes(tmp_path / "s.tar", data)
    assert skip(url) == ([1, 2, 3, 5, 6, 7, 8], {"corrupt_shard": 1})
    with pytest.raises(DataError, match=r"corrupt_shard: tar header checksum mismatch; skipped bytes \[3072, 4096\)"):
        read(url)


def _labelled(i: int) -> bytes:
    return sample(f"{i:08d}", [i + 1, 7], **{"labels.npy": npy_bytes(np.array([i + 1, 7]))})


def test_a_sample_that_lost_a_member_is_dropped_and_counted(tmp_path) -> None:
    parts = [_labelled(i) for i in range(8)]
    at = offsets_of(parts)
    # sample 3 loses its labels.npy header: kept without it, it would train on its own tokens
    data = damage_header(archive(*parts), at[3] + 1024)
    kept, counts = skip(write_bytes(tmp_path / "a.tar", data))
    assert kept == [1, 2, 3, 5, 6, 7, 8] and counts == {"incomplete_sample": 1, "corrupt_shard": 1}
    # sample 3 loses its npy header: what follows the region is its labels alone, lost with it
    data = damage_header(archive(*parts), at[3])
    kept, counts = skip(write_bytes(tmp_path / "b.tar", data))
    assert kept == [1, 2, 3, 5, 6, 7, 8] and counts == {"corrupt_shard": 1}


def test_no_intact_sample_to_compare_with_drops_the_neighbour(tmp_path) -> None:
    parts = samples(4)
    data = damage_header(archive(*parts), offsets_of(parts)[3])  # the last sample's header
    assert skip(write_bytes(tmp_path / "s.tar", data)) == ([1, 2], {"incomplete_sample": 1, "corrupt_shard": 1})


def _damaged_shard(tmp_path) -> tuple[str, list[int]]:
    parts = [_labelled(i) for i in range(30)]
    at = offsets_of(parts)
    data = archive(*parts)
    for k, extra in ((4, 1024), (5, 0), (12, 0), (13, 0), (21, 1024), (29, 0)):  # adjacent, far, last
        data = damage_header(data, at[k] + extra)
    url = write_bytes(tmp_path / "d.tar", data)
    kept, _ = skip(url)
    return url, kept


def test_every_skip_is_counted_and_nothing_good_is_lost(tmp_path) -> None:
    url, kept = _damaged_shard(tmp_path)
    errors = ErrorCounter()
    assert ids(read(url, error_policy=ErrorPolicy("skip", errors))) == kept
    # lost: the six damaged samples, and 28 (id 29), whose only intact neighbour-to-be is gone
    assert set(kept).isdisjoint({5, 6, 13, 14, 22, 29, 30}) and len(kept) == 30 - 7
    # regions: 4-5 (one: 5's npy header follows 4's broken labels header), 12, 13, 21, 29;
    # incomplete: 4 and 21 (before a region, missing labels) and 28 (nothing intact after it)
    assert errors.counts == {"corrupt_shard": 5, "incomplete_sample": 3}
    assert errors.skipped_bytes["corrupt_shard"] > 0


def test_verdicts_near_corrupt_regions_are_resume_exact(tmp_path) -> None:
    # the samples next to a region are judged by the intact sample *after* them, so a reader
    # resumed at any item boundary makes the same verdicts as one that never stopped
    url, kept = _damaged_shard(tmp_path)
    assert len(kept) == 23  # read past all five regions (else this would hold vacuously)
    for k in range(len(kept) + 1):
        reader = ShardReader(url, shuffle=False, epochs=1, error_policy=ErrorPolicy("skip"))
        head = [next(reader) for _ in range(k)]
        resumed = ShardReader(url, shuffle=False, epochs=1, error_policy=ErrorPolicy("skip"))
        resumed.reset(roundtrip(reader.state_dict()))
        assert ids(head) + ids(resumed) == kept, f"resumed after {k} samples"


def test_raise_mode_continues_after_each_error_without_losing_a_sample(tmp_path) -> None:
    url, kept = _damaged_shard(tmp_path)
    reader, got, raised = ShardReader(url, shuffle=False, epochs=1), [], 0
    while True:
        try:
            got.append(next(reader))
        except DataError:
            raised += 1
        except StopIteration:
            break
    assert ids(got) == kept and raised == 8


def test_split_between_workers_reads_every_intact_sample_once(tmp_path) -> None:
    parts = samples(12)
    data = damage_header(archive(*parts), offsets_of(parts)[4])
    url = write_bytes(tmp_path / "s.tar", data)
    read = ReadOptions(cache_dir=str(tmp_path / "c"))
    per_worker = [ids(ShardReader(url, shuffle=False, epochs=1, place=Placement(worker_id=w, num_workers=2), read=read,
                                  error_policy=ErrorPolicy("skip"))) for w in range(2)]
    assert sorted(per_worker[0] + per_worker[1]) == [1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12]


def test_a_bad_sample_between_good_ones_costs_only_itself(tmp_path) -> None:
    bad = [member("bad00000.npy", b"\x93NUMPY garbage"), member("bad00001.json", b"{not json"),
           sample("bad00002", [-1]), member("bad00003.txt", b"\xff\xfe")]
    parts = samples(2) + [p for j, b in enumerate(bad) for p in (b, *samples(1, start=10 + j))]
    url = write_bytes(tmp_path / "s.tar", archive(*parts))
    kept, counts = skip(url)
    assert kept == [1, 2, 11, 12, 13, 14] and counts == {"bad_npy": 1, "bad_json": 1, "negative_id": 1, "bad_utf8": 1}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_good_neighbours_kept_through_the_loader(tmp_path, num_workers: int) -> None:
    parts = samples(6)
    damaged = write_bytes(tmp_path / "d.tar", damage_header(archive(*parts), offsets_of(parts)[2]))
    bad_line = write_bytes(tmp_path / "l.jsonl", b'{"input_ids": [1]}\n{"input_ids": [1, -1]}\n{"input_ids": [2]}\n')
    keys = [f"{damaged}#{i:08d}" for i in (0, 1, 3, 4, 5)] + [f"{bad_line}#0", f"{bad_line}#2"]
    check_both_modes([damaged, bad_line], num_workers=num_workers, raises={("corrupt_shard", damaged), ("negative_id", bad_line)},
                     kept=keys,
                     counts={"corrupt_shard": 1, "negative_id": 1})


def test_a_corrupt_region_before_every_sample_is_read_once_when_split(tmp_path) -> None:
    # the index gives the region its own entry, so the part that starts the shard meets it
    parts = samples(8)
    url = write_bytes(tmp_path / "s.tar", damage_header(archive(*parts), 0))
    errors = ErrorCounter()
    read = ReadOptions(cache_dir=str(tmp_path / "c"))
    per_worker = [ids(ShardReader(url, shuffle=False, epochs=1, place=Placement(worker_id=w, num_workers=2), read=read,
                                  error_policy=ErrorPolicy("skip", errors))) for w in range(2)]
    assert sorted(per_worker[0] + per_worker[1]) == [2, 3, 4, 5, 6, 7, 8]
    assert errors.counts == {"corrupt_shard": 1}


def test_long_runs_of_damage_are_judged_alike_after_any_resume(tmp_path) -> None:
    # every other sample loses its labels header for 30 samples: the ones between keep their
    # fields, but only those with an intact sample within 16 units after them can show it
    parts = [_labelled(i) for i in range(50)]
    at = offsets_of(parts)
    data = archive(*parts)
    for k in range(10, 40, 2):
        data = damage_header(data, at[k] + 1024)
    url = write_bytes(tmp_path / "long.tar", data)
    kept, counts = skip(url)
    assert 11 + 1 not in kept and 39 + 1 in kept and counts["corrupt_shard"] == 15
    for k in range(0, len(kept) + 1, 3):
        reader = ShardReader(url, shuffle=False, epochs=1, error_policy=ErrorPolicy("skip"))
        head = [next(reader) for _ in range(k)]
        resumed = ShardReader(url, shuffle=False, epochs=1, error_policy=ErrorPolicy("skip"))
        resumed.reset(roundtrip(reader.state_dict()))
        assert ids(head) + ids(resumed) == kept, f"resumed after {k} samples"


@pytest.mark.parametrize("num_workers", [2, 3])
def test_split_readers_judge_like_one_reader(tmp_path, num_workers: int) -> None:
    # damage next to every part boundary (12 samples: boundaries at 4, 6, 8): the reader before
    # it looks past its end, the one after it starts at the region (the index puts it there)
    parts = [_labelled(i) for i in range(12)]
    at = offsets_of(parts)
    for k in range(3, 9):
        for member_at in (0, 1024):  # the npy header, or the labels.npy header
            url = write_bytes(tmp_path / f"d{k}-{member_at}.tar", damage_header(archive(*parts), at[k] + member_at))
            one, one_counts = skip(url)
            errors = ErrorCounter()
            split = sum((ids(ShardReader(url, shuffle=False, epochs=1,
                                         place=Placement(worker_id=w, num_workers=num_workers),
                                         read=ReadOptions(cache_dir=str(tmp_path / f"c{k}-{member_at}")),
                                         error_policy=ErrorPolicy("skip", errors)))
                         for w in range(num_workers)), [])
            assert sorted(split) == one and errors.counts == one_counts, f"damage at sample {k} (+{member_at})"
