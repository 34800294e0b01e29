"""``benchmarks/bench_multimodal.py``: the peer baseline it writes is the packer it claims to be,
and the script runs end to end on a few samples."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_multimodal as bench  # noqa: E402


def test_greedy_buffer_is_first_fit_in_arrival_order_without_carry_over() -> None:
    assert bench.greedy_buffer(np.array([5, 4, 3, 2]), 8, 4) == [[5, 3], [4, 2]]
    # a buffer's bins leave with it: the 3 of the second buffer does not join the first's [5]
    assert bench.greedy_buffer(np.array([5, 5, 3, 3]), 8, 2) == [[5], [5], [3, 3]]
    lengths = np.random.default_rng(0).integers(1, 100, 500)
    packs = bench.greedy_buffer(lengths, 128, 32)
    assert max(sum(p) for p in packs) <= 128
    assert [n for p in packs for n in sorted(p)] != sorted(lengths.tolist())  # not sorted: arrival order
    assert sorted(n for p in packs for n in p) == sorted(lengths.tolist())


def test_rows_count_slots_as_each_packer_pays_them() -> None:
    lengths = np.array([3, 9, 2, 2, 7])
    pad = bench.measure("pad", lambda: bench.pad_to_longest(lengths, 2), None, repeats=1)
    assert (pad.slots, pad.tokens, pad.samples) == (2 * 9 + 2 * 2 + 1 * 7, 23, 5)
    greedy = bench.measure("g", lambda: bench.greedy_buffer(lengths, 10, 5), 10, repeats=1)
    assert (greedy.slots, greedy.tokens) == (10 * 3, 23)  # [3, 2, 2], [9], [7]


@pytest.mark.slow  # the first WindowPacker in a process pays ~10 s of imports and compiling here
def test_window_row_runs_the_real_window_packer() -> None:
    lengths = np.array([3, 9, 2, 2, 7])
    window = bench.measure("w", lambda: bench.streampack_window(lengths, 10, 8), 10, repeats=1)
    assert window.samples == 5 and window.tokens == 23 and window.slots == 10 * 3  # BFD: 9, 7+3, 2+2


@pytest.mark.slow
def test_script_runs_on_a_few_samples(tmp_path: Path) -> None:
    out = tmp_path / "r.md"
    assert bench.main(["--samples", "12", "--shards", "2", "--capacity", "4096", "--buffers", "4",
                       "--no-end-to-end", "--out", str(out)]) == 0
    text = out.read_text()
    assert "header only" in text and "greedy buffer K=4" in text and "streampack WindowPacker" in text
