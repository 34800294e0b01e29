"""``byte_runs``: documents grouped into reads, one search a run."""

import numpy as np

from streampack.io.token_block import byte_runs


def _one_at_a_time(nbytes, readable, cap):
    """The rule, a document at a time: a readable document opens a run that takes the next readable ones while the
    run's bytes stay within ``cap``; an unreadable one is a run alone."""
    i, n, out = 0, len(nbytes), []
    while i < n:
        j, total = i + 1, int(nbytes[i])
        if readable[i]:
            while j < n and total + int(nbytes[j]) <= cap and readable[j]:
                total += int(nbytes[j])
                j += 1
        out.append((i, j))
        i = j
    return out


def test_runs_equal_the_rule_applied_a_document_at_a_time():
    for seed in range(40):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(0, 300))
        nbytes = rng.integers(0, 5000, n) * rng.integers(0, 2, n)  # zero-length documents among them
        readable = rng.random(n) > rng.choice([0.0, 0.05, 0.5])
        cap = int(rng.choice([1, 4000, 20_000, 10**9]))
        assert list(byte_runs(nbytes, readable, cap)) == _one_at_a_time(nbytes, readable, cap), seed


def test_a_document_over_the_cap_is_read_alone():
    assert list(byte_runs(np.array([10, 500, 10, 10]), np.ones(4, bool), 100)) == [(0, 1), (1, 2), (2, 4)]
