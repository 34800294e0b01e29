"""Issue 18, items 11-15 and the wrong port: every http answer is checked, every request bounded.

Against loopback servers that misbehave on purpose (``helpers_faults``): a body is never read
past the range asked for; an object replaced mid-read is an error, never a splice; a ``HEAD``
is bounded by the deadline and budget; ``Retry-After`` is honoured; a redirect loop and a
refused connection fail fast with a one-line error naming the URL.
"""

from __future__ import annotations

import os
import time

import pytest
from helpers_data import closed_port, make_token_docs, write_jsonl_shards
from helpers_faults import Fault, join_prefetch, serve_faulty

from streampack.errors import DataError, ErrorCounter, ErrorPolicy
from streampack.io.retry import IOStats, RetryPolicy
from streampack.io.storage import OpenOptions
from streampack.nodes.reader import ShardReader

DOCS = make_token_docs(400, seed=5, min_len=100, max_len=200)


def fast(budget: float = 5.0, **kw) -> OpenOptions:
    retry = RetryPolicy(budget=budget, backoff=0.01, max_backoff=0.05, **kw.pop("retry", {}))
    return OpenOptions(retry=retry, block_size=kw.pop("block_size", 16 << 10), **kw)


@pytest.fixture
def served(tmp_path):
    (path,) = write_jsonl_shards(tmp_path, DOCS, 1)
    with serve_faulty(tmp_path) as srv:
        yield srv, path, f"{srv.url}/{os.path.basename(path)}"
        join_prefetch()


def read(url: str, opts: OpenOptions, **kw) -> tuple[list[list[int]], IOStats]:
    stats = IOStats()
    reader = ShardReader([url], shuffle=False, epochs=1, open_options=opts, io_stats=stats, **kw)
    return [s.tokens.tolist() for s in reader], stats


def test_an_endless_body_is_never_read_past_the_range(served):
    # finding: an endless body for a 12 KB object added +241 MiB RSS within a 4 s deadline
    srv, _, url = served
    srv.plan.add(Fault("endless"), times=2)
    got, stats = read(url, fast())
    assert got == DOCS and stats.faults == {"long_body": 2}
    assert stats.bytes < os.path.getsize(served[1]) + 4 * (16 << 10) + 2, "at most one byte past each range"
    srv.plan.add(Fault("endless"), times=1000)
    with pytest.raises(DataError, match="unreachable_url.*long_body: body longer than the 16384 bytes asked"):
        read(url, fast(budget=0.3))


def test_an_object_replaced_mid_read_is_refused_not_spliced(served):
    # finding: block 1 came from the old version, block 2 from the new (6,263 old + 4,222 new
    # lines, no error)
    srv, path, url = served
    for if_match in (True, False):  # the server checks If-Match, or only its ETag tells
        srv.if_match = if_match
        reader = ShardReader([url], shuffle=False, epochs=1, open_options=fast(),
                             error_policy=ErrorPolicy("skip", errors := ErrorCounter()))
        head = [next(reader).tokens.tolist() for _ in range(5)]
        data = open(path, "rb").read()
        with open(path + ".new", "wb") as f:  # a new version: the same lines in another order
            f.write(b"".join(reversed(data.splitlines(keepends=True))))
        os.utime(path + ".new", (time.time() + 10, time.time() + 10))
        os.replace(path + ".new", path)  # atomic, as an object store's PUT is
        rest = [s.tokens.tolist() for s in reader]
        assert head + rest == DOCS[:len(head) + len(rest)], "nothing of the new version is delivered"
        assert len(rest) < len(DOCS) - 5 and errors.counts == {"shard_changed": 1}, errors.recent
        assert "object changed while it was read" in errors.recent[0]
        with open(path, "wb") as f:
            f.write(data)


def test_a_head_smaller_than_the_object_does_not_truncate_it(served):
    # finding: a HEAD Content-Length smaller than the object silently truncated a jsonl (the
    # 206 Content-Range total was ignored)
    srv, path, url = served
    srv.plan.add(Fault("head_size", size=os.path.getsize(path) // 2, method="HEAD"), times=1000)
    with pytest.raises(DataError, match=r"shard_changed: .*size \d+ -> \d+ bytes"):
        read(url, fast())


def test_a_head_trickling_its_headers_is_bounded_by_the_deadline(served):
    # finding: headers trickled at 1 B/s kept a reader busy past 120 s with retry_budget=6,
    # request_deadline=4, read_timeout=3 (fs.info had no timeout)
    srv, _, url = served
    srv.plan.add(Fault("slow_headers", interval=0.05, method="HEAD"), times=1000)
    t0 = time.monotonic()
    with pytest.raises(DataError, match="unreachable_url: stat failed.*timeout"):
        read(url, fast(budget=0.5, request_deadline=0.3, read_timeout=0.2))
    assert time.monotonic() - t0 < 0.5 + 0.3 + 1.0


def test_a_body_longer_than_its_content_length_is_retried_not_fatal(served):
    # finding: it became "HTTP 400" and failed the shard at once (5 of 6 runs)
    srv, _, url = served
    srv.plan.add(Fault("long", extra=100), times=3)
    got, stats = read(url, fast())
    assert got == DOCS and stats.gave_up == 0


def test_retry_after_is_honoured_within_the_budget(served):
    srv, _, url = served
    srv.plan.add(Fault("status", status=503, retry_after="0.4", method="*"), times=1)
    t0 = time.monotonic()
    got, stats = read(url, fast())
    assert got == DOCS and time.monotonic() - t0 >= 0.4 and stats.faults == {"HTTP 503": 1}
    srv.plan.add(Fault("status", status=429, retry_after="30", method="*"), times=1)
    t0 = time.monotonic()
    with pytest.raises(DataError, match="server asked to retry after 30 s"):
        read(url, fast(budget=2))
    assert time.monotonic() - t0 < 1.5, "a wait past the budget gives up at once"


def test_a_redirect_loop_fails_at_once_and_names_it(served):
    # finding: retried as transient for 120 s (440 requests)
    srv, _, url = served
    srv.plan.add(Fault("redirect", location="{path}", method="*"), times=10_000)
    t0 = time.monotonic()
    with pytest.raises(DataError, match="unreachable_url: redirect loop"):
        read(url, fast(budget=60))
    assert time.monotonic() - t0 < 5 and len(srv.requests) <= 12


def test_a_wrong_port_fails_in_seconds_with_one_line(tmp_path):
    # finding: connection refused on the first request retried 118 s, then one line carrying
    # aiohttp's ConnectionKey(...) repr
    url = f"http://127.0.0.1:{closed_port()}/shard-000000.jsonl"
    t0 = time.monotonic()
    with pytest.raises(DataError) as info:
        read(url, fast(budget=120, retry={"refused_budget": 0.5}))
    assert time.monotonic() - t0 < 3
    message = str(info.value)
    assert "connection refused by 127.0.0.1" in message and url in message
    assert "\n" not in message and "ConnectionKey" not in message


def test_retry_delay_does_not_overflow_after_many_failures():
    # finding: OverflowError after ~1,025 consecutive failures (retry_budget=inf)
    policy = RetryPolicy(budget=float("inf"), backoff=0.5, max_backoff=15)
    assert all(0 <= policy.delay(n) <= 15 for n in (1, 1024, 1025, 10**6))
