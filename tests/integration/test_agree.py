"""Agreement on per-epoch counts through a real TCPStore on loopback: readers as threads, as
spawned processes and (slow) as DataLoader workers of two torchrun ranks."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import torch.distributed as dist
from torch.distributed import TCPStore

from streampack.plan.agree import Agreement, RankCounts, agree_counts


@pytest.fixture()
def store():
    server = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    yield server
    del server


def _agreement(store: TCPStore, dp_size: int, prefix: str = "test", timeout_s: float = 30.0) -> Agreement:
    return Agreement(host="127.0.0.1", port=store.port, prefix=prefix, dp_size=dp_size, timeout_s=timeout_s)


def _run(calls: list[tuple[Agreement, str, int, int, int, int]]) -> list[RankCounts | Exception]:
    """Each call ``(agreement, key, dp_rank, worker_id, num_workers, count)`` in its own thread."""
    out: list[RankCounts | Exception] = [RuntimeError("never returned")] * len(calls)

    def one(i: int) -> None:
        a, key, r, w, nw, c = calls[i]
        try:
            out[i] = agree_counts(a, key=key, dp_rank=r, worker_id=w, num_workers=nw, count=c)
        except Exception as e:  # noqa: BLE001 - handed to the test
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
        time.sleep(0.01)  # this sandbox's loopback stalls 5 s on a burst of concurrent connects
    for t in threads:
        t.join(60)
    return out


def _expected(counts: dict[tuple[int, int], int], dp_size: int, num_workers: int) -> tuple[int, dict[int, tuple]]:
    ranks = {r: tuple(counts[r, w] for w in range(num_workers)) for r in range(dp_size)}
    return max(sum(c) for c in ranks.values()), ranks


@pytest.mark.slow  # ~6 s: 32 threads with staggered connects
def test_threads_agree_on_target_and_rank_counts(store) -> None:
    R, W = 8, 4
    rng = random.Random(3)
    counts = {(r, w): rng.randrange(0, 50) for r in range(R) for w in range(W)}
    target, ranks = _expected(counts, R, W)
    a = _agreement(store, R)
    for key in ("pass0/epoch0", "pass0/epoch1"):  # two rounds on the same connections
        got = _run([(a, key, r, w, W, c) for (r, w), c in counts.items()])
        assert len(got) == R * W and len({g.target for g in got}) == 1, got
        for ((r, _), _), g in zip(counts.items(), got):
            assert g == RankCounts(target=target, workers=ranks[r])
    assert target > 0 and len(set(ranks.values())) > 1  # not vacuous: ranks differ


def _spawned_reader(a: Agreement, dp_rank: int, count: int, queue) -> None:
    try:
        queue.put((dp_rank, agree_counts(a, key="e0", dp_rank=dp_rank, worker_id=0, num_workers=1, count=count)))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        queue.put((dp_rank, repr(e)))


@pytest.mark.slow  # ~5 s: spawned interpreters
def test_spawned_processes_pickle_and_connect(store) -> None:
    a = _agreement(store, 4)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_spawned_reader, args=(a, r, 10 + r, queue)) for r in (2, 3)]
    for p in procs:
        p.start()
    local = _run([(a, "e0", r, 0, 1, 10 + r) for r in (0, 1)])
    remote = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    want = {r: RankCounts(target=13, workers=(10 + r,)) for r in range(4)}
    assert local == [want[0], want[1]] and remote == {2: want[2], 3: want[3]}


def test_model_parallel_duplicates_with_equal_counts(store) -> None:
    R, W, peers = 3, 2, 3
    counts = {(r, w): 5 * r + w for r in range(R) for w in range(W)}
    target, ranks = _expected(counts, R, W)
    a = _agreement(store, R)
    got = _run([(a, "e0", r, w, W, c) for (r, w), c in counts.items() for _ in range(peers)])
    assert got == [RankCounts(target=target, workers=ranks[r]) for (r, _) in counts for _ in range(peers)]
    assert int(store.get("test/e0/a")) == R * W  # each (rank, worker) counted once


def test_model_parallel_peers_that_disagree_are_refused(store) -> None:
    a = _agreement(store, 2, timeout_s=20)
    first = _run([(a, "late", r, 0, 1, 5) for r in range(2)])  # a finished round; then a peer says 7
    assert first == [RankCounts(target=5, workers=(5,))] * 2
    with pytest.raises(ValueError, match=r"count=7.*count=5"):
        agree_counts(a, key="late", dp_rank=1, worker_id=0, num_workers=1, count=7)

    # while the round is open the disagreement fails every waiting reader at once, not by timeout
    waiting: list = []
    t = threading.Thread(target=lambda: waiting.extend(_run([(a, "open", 0, 0, 1, 5)])))
    t.start()
    while not store.check(["test/open/c/0/0"]):
        time.sleep(0.01)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"count=9.*count=5"):
        agree_counts(a, key="open", dp_rank=0, worker_id=0, num_workers=1, count=9)
    t.join(10)
    assert isinstance(waiting[0], ValueError) and "count=9" in str(waiting[0])
    assert time.monotonic() - start < 10


@pytest.mark.slow  # ~5 s: two ranks' loaders with workers
def test_ranks_with_different_num_workers_are_refused(store) -> None:
    a = _agreement(store, 2)
    got = _run([(a, "e0", 0, 0, 1, 4), (a, "e0", 1, 0, 2, 4), (a, "e0", 1, 1, 2, 4)])
    assert all(isinstance(g, ValueError) and "num_workers=1" in str(g) and "num_workers=2" in str(g) for g in got)


@pytest.mark.slow  # ~6 s: waits out the agreement's timeout
def test_missing_reader_times_out_naming_who_arrived(store) -> None:
    """Finding: the wait was a fixed 30 min and the error named how many arrived, not which did not."""
    warm = _agreement(store, 3, prefix="warm")  # this process's 3 clients connected (a connect may stall 5 s
    assert len(_run([(warm, "w", r, 0, 1, 1) for r in range(3)])) == 3  # here), so the readers arrive together
    a = _agreement(store, 2, timeout_s=1.0)  # time is the property here
    start = time.monotonic()
    got = _run([(a, "pass0/epoch3", r, w, 2, 1) for r, w in ((0, 0), (0, 1), (1, 0))])  # (1, 1) never comes
    assert time.monotonic() - start < 30
    for g, (r, w) in zip(got, ((0, 0), (0, 1), (1, 0))):
        assert isinstance(g, TimeoutError), g
        msg = str(g)
        assert "'pass0/epoch3'" in msg and f"dp_rank={r} worker_id={w}" in msg and "3 of 4 readers" in msg
        assert "1 of 2 ranks complete" in msg and "not arrived: dp_rank=1 worker_id=1" in msg, msg
        assert "agree_timeout_s" in msg and "set_epoch" in msg


def test_runs_on_one_store_do_not_mix(store) -> None:
    """A restarted run (new prefix) never reads an old run's result. Finding: this asserted it
    through a 1 s timeout that also bounded connecting, and failed on a loaded box."""
    old, new = _agreement(store, 2, prefix="run-a"), _agreement(store, 2, prefix="run-b")
    assert _run([(old, "e0", r, 0, 1, 3) for r in range(2)]) == [RankCounts(target=3, workers=(3,))] * 2
    lone: list = []
    waiting = threading.Thread(target=lambda: lone.extend(_run([(new, "e0", 0, 0, 1, 8)])))
    waiting.start()
    while not store.check(["run-b/e0/c/0/0"]):
        time.sleep(0.01)
    assert waiting.is_alive() and not store.check(["run-b/e0/done"])  # the old run's done is not this one's
    assert _run([(new, "e0", 1, 0, 1, 5)]) == [RankCounts(target=8, workers=(5,))]
    waiting.join(60)
    assert lone == [RankCounts(target=8, workers=(8,))]
    both = _run([(a, "e1", r, 0, 1, c) for a, c in ((old, 2), (new, 9)) for r in range(2)])
    assert both == [RankCounts(target=2, workers=(2,))] * 2 + [RankCounts(target=9, workers=(9,))] * 2


def test_a_process_connects_once_not_once_per_round(store, monkeypatch) -> None:
    """Finding: each epoch's quota thread made its own client (connecting cost ~10 s on this box
    under load); a process now keeps its connection across rounds and threads."""
    made: list = []
    real = dist.TCPStore

    def counting(*args, **kwargs):
        made.append(args[:2])
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "TCPStore", counting)
    a = _agreement(store, 1, prefix="reuse")
    for epoch in range(3):  # one thread per epoch, as the late quota runs
        assert _run([(a, f"e{epoch}", 0, 0, 1, epoch)]) == [RankCounts(target=epoch, workers=(epoch,))]
    assert made == [("127.0.0.1", store.port)]


def test_record_pickles_and_bad_inputs_are_refused(store) -> None:
    a = _agreement(store, 2)
    assert pickle.loads(pickle.dumps(a)) == a
    for bad in (dict(dp_rank=2, worker_id=0, num_workers=1, count=1),
                dict(dp_rank=0, worker_id=1, num_workers=1, count=1),
                dict(dp_rank=0, worker_id=0, num_workers=1, count=-1)):
        with pytest.raises(ValueError, match=r"dp_rank|worker_id|count=-1"):
            agree_counts(a, key="e0", **bad)
    one = _agreement(store, 1, prefix="one")  # one reader agrees with itself; numpy counts are ints
    assert agree_counts(one, key="e0", dp_rank=0, worker_id=0, num_workers=1, count=np.int64(3)) == RankCounts(
        target=3, workers=(3,))
    with pytest.raises(ValueError, match="port=0"):
        Agreement(host="127.0.0.1", port=0, prefix="p", dp_size=2)
    with pytest.raises(ValueError, match="dp_size=0"):
        Agreement(host="127.0.0.1", port=1, prefix="p", dp_size=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_from_dist_none_without_torch_distributed() -> None:
    assert not dist.is_initialized()
    assert Agreement.from_dist(None, 0, 4) is None


def test_from_dist_with_a_gloo_group(tmp_path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=77))
    try:
        assert Agreement.from_dist(None, 0, 1) is None  # one rank: nothing to agree on
        with pytest.raises(ValueError, match=r"dp_size=2 but the process group .* has 1 rank"):
            Agreement.from_dist(None, 0, 2)  # the other rank would never share this run's nonce
        store = dist.distributed_c10d._get_default_store()
        a = Agreement.of_store(store, prefix="x", dp_size=2)  # under torch's PrefixStore: the TCPStore
        assert a.host == "127.0.0.1" and a.timeout_s == 77  # default: the process group's timeout
        dist.new_group([0])  # another group: the default store is still found under the wrappers
        assert Agreement.of_store(dist.distributed_c10d._get_default_store(), prefix="y", dp_size=2).port == a.port
        assert _run([(a, "e0", r, 0, 1, 6 - r) for r in range(2)]) == [
            RankCounts(target=6, workers=(6,)), RankCounts(target=6, workers=(5,))]
    finally:
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:  # a FileStore serves as well (finding: it was refused, and every reader counted every reader)
        f = Agreement.of_store(dist.distributed_c10d._get_default_store(), prefix="z", dp_size=2, timeout_s=30)
        assert f.path == str(tmp_path / "init") and not f.host
        assert _run([(f, "e0", r, 0, 1, 4 + r) for r in range(2)]) == [
            RankCounts(target=5, workers=(4,)), RankCounts(target=5, workers=(5,))]
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # torchrun: two gloo ranks with two DataLoader workers each
@pytest.mark.distributed
def test_torchrun_dataloader_workers_agree(tmp_path) -> None:
    out = tmp_path / "result.json"
    here = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(here)), here]),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           os.path.join(here, "agree_worker.py"), str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the ranks too, not only torchrun
        _, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    ranks = json.loads(out.read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["prefix"] == ranks[1]["prefix"] and [r["warm"] for r in ranks] == [1, 1]
    rows = [row for r in ranks for row in r["rows"]]
    assert len(rows) == 8 and len({row["pid"] for row in rows}) == 8  # 2 epochs x 2 ranks x 2 fresh workers
    for row in rows:
        assert row["target"] == 4 + 5 and row["workers"] == [row["rank"] * 3 + 1, row["rank"] * 3 + 2]
