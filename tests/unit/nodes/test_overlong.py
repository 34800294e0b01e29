"""Overlong-sample policy at lengths cap-1, cap, cap+1 and 2*cap+1 (torchtune#1689/#1697)."""

from __future__ import annotations

import numpy as np
import pytest

from streampack import OverlongCounters, Sample, apply_overlong

CAP = 8


def sample(n: int) -> Sample:
    return Sample(key="s", url="u.tar", tokens=np.arange(1, n + 1),
                  loss_mask=np.ones(n, dtype=bool), extras={"x": np.zeros((n, 2))})


@pytest.mark.parametrize("policy", ["split", "truncate", "drop", "error"])
@pytest.mark.parametrize("n", [CAP - 1, CAP])
def test_fitting_samples_pass_untouched(policy, n):
    c = OverlongCounters()
    s = sample(n)
    assert apply_overlong(s, CAP, policy, c) == [s]
    assert c == OverlongCounters()


@pytest.mark.parametrize("n", [CAP + 1, 2 * CAP + 1])
def test_split_keeps_every_token_in_capacity_sized_chunks(n):
    c = OverlongCounters()
    chunks = apply_overlong(sample(n), CAP, "split", c)
    assert np.concatenate([ch.tokens for ch in chunks]).tolist() == list(range(1, n + 1))
    assert all(len(ch) <= CAP for ch in chunks)
    assert [ch.key for ch in chunks] == [f"s/{i}" for i in range(len(chunks))]
    assert all(len(ch.loss_mask) == len(ch) == ch.extras["x"].shape[0] for ch in chunks)
    assert (c.samples_split, c.tokens_split, c.chunks_created) == (1, n, -(-n // CAP))


def test_truncate_drop_and_error_count_what_they_do():
    c = OverlongCounters()
    (t,) = apply_overlong(sample(2 * CAP + 1), CAP, "truncate", c)
    assert t.tokens.tolist() == list(range(1, CAP + 1))
    assert apply_overlong(sample(CAP + 1), CAP, "drop", c) == []
    assert c.as_dict() == dict(samples_split=0, tokens_split=0, chunks_created=0,
                               samples_truncated=1, tokens_truncated=CAP + 1,
                               samples_dropped=1, tokens_dropped=CAP + 1, media_overlong=0)
    with pytest.raises(ValueError, match=r"'u.tar#s' has 9 tokens, more than the capacity 8"):
        apply_overlong(sample(CAP + 1), CAP, "error", c)
    with pytest.raises(ValueError, match="overlong='cut'"):
        apply_overlong(sample(1), CAP, "cut", c)
