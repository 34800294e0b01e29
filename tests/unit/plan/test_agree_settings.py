"""Ranks that disagree, or do not arrive (issue 29 items 5-7): the settings every rank must share are
agreed once through the job's c10d store (TCPStore, FileStore or an in-process HashStore), a
missing rank fails after ``TopologyOptions.agree_timeout_s`` naming who did not arrive, and a finite
multi-rank plan never falls back to every reader counting every reader behind the user's back.

Ranks are real processes (forked, gloo on loopback) or threads on a real store."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch.distributed as dist
from node_checks import collect_documents, write_token_shards
from topology_sim import in_threads
from torch.distributed import FileStore, HashStore, TCPStore

from streampack.dataset import PackedDataset
from streampack.io.manifest import Manifest
from streampack.options import PackOptions, ReadOptions, TopologyOptions
from streampack.plan.agree import Agreement, agree_counts

CAP, SHARDS = 256, 12


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("agree_settings")
    urls, docs = write_token_shards(root / "shards", 120, SHARDS, mean=40, seed=4, max_len=2 * CAP)
    PackedDataset(urls, capacity=CAP, epochs=1, read=ReadOptions(cache_dir=str(root / "cache")),  # the manifest
                  topology=TopologyOptions(dp_rank=0, dp_size=2, equal_batches="count"))
    return urls, docs, str(root / "cache")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _store(kind: str, tmp_path) -> tuple[object, Callable[..., Agreement]]:
    """A real store of ``kind`` and a maker of agreements through it."""
    if kind == "tcp":
        server = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
        return server, lambda n, t=30.0: Agreement(host="127.0.0.1", port=server.port, prefix="s", dp_size=n,
                                                   timeout_s=t)
    if kind == "file":
        path = str(tmp_path / "store")
        server = FileStore(path, -1)
        return server, lambda n, t=30.0: Agreement(path=path, prefix="s", dp_size=n, timeout_s=t)
    server = HashStore()
    return server, lambda n, t=30.0: Agreement.in_process(server, prefix="s", dp_size=n, timeout_s=t)


@pytest.mark.parametrize("kind", ["tcp", "file", "hash"])
def test_settings_are_agreed_on_every_kind_of_store(kind, tmp_path) -> None:
    from streampack.plan.agree import agree_settings

    server, make = _store(kind, tmp_path)
    same = {"seed": 0, "shuffle": True, "window": 64, "sources": "ab12"}
    assert in_threads(lambda r: agree_settings(make(3), dp_rank=r, settings=same), 3) == [None] * 3
    # a round of counts through the same store (FileStore / HashStore: no TCPStore needed)
    got = in_threads(lambda r: agree_counts(make(3), key="e0", dp_rank=r, worker_id=0, num_workers=1, count=r), 3)
    assert [g.target for g in got] == [2, 2, 2]
    del server


def test_a_difference_fails_every_rank_naming_the_setting_and_both_values(tmp_path) -> None:
    from streampack.plan.agree import agree_settings

    server, make = _store("tcp", tmp_path)
    a = make(3)
    settings = [{"seed": 0, "shuffle": True, "epochs": 1}, {"seed": 0, "shuffle": True, "epochs": 1},
                {"seed": 1, "shuffle": False, "epochs": 1}]
    got = in_threads(lambda r: agree_settings(a, dp_rank=r, settings=settings[r]), 3)
    assert all(isinstance(g, ValueError) for g in got), got
    msg = str(got[0])
    assert all(str(g) == msg for g in got), "every rank raises the same error"
    # whichever rank's settings won (arrival order): both values of both settings are named
    assert re.search(r"dp_rank=[01] has seed=0, shuffle=True", msg), msg
    assert "dp_rank=2 has seed=1, shuffle=False" in msg, msg
    assert "epochs" not in msg  # only what differs
    del server


def _rank(rank: int, init: str, urls: list[str], cache: str, seed: int, queue, iterate: bool) -> None:
    """One rank of a two-process gloo job: builds the dataset and (``iterate``) reads its epoch."""
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=60))
        loads: list[int] = []
        real = Manifest.load_index

        def load(manifest, shard, *args, **kwargs):
            loads.append(shard)
            return real(manifest, shard, *args, **kwargs)

        Manifest.load_index = load
        ds = PackedDataset(urls, capacity=CAP, packing=PackOptions(window=16), epochs=1, seed=seed,
                           read=ReadOptions(cache_dir=cache), packs_per_batch=2)
        out: dict = {"rank": rank, "agreement": repr(ds._agreement)}
        if iterate:
            batches = list(ds)
            ds.state_dict()  # where the fallback counted every reader
            out.update(batches=len(batches), docs=sorted(collect_documents(batches)), loads=sorted(set(loads)))
        dist.barrier()
        dist.destroy_process_group()
        queue.put(out)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        queue.put({"rank": rank, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]})


def _job(init: str, data, seeds: tuple[int, int], iterate: bool = False) -> dict[int, dict]:
    urls, _, cache = data
    ctx = mp.get_context("fork")  # ~1 s a job, against ~5 s spawned
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, init, urls, cache, seeds[r], queue, iterate)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in procs:
            row = queue.get(timeout=120)
            got[row["rank"]] = row
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return got


@pytest.mark.slow  # ~5 s: two gloo ranks building datasets (the fast set keeps the test above)
def test_ranks_built_with_different_seeds_fail_on_every_rank(data) -> None:
    """Finding: rank 0 on seed=0 and rank 1 on seed=1 got equal step counts and no error, while 68
    samples were never trained and 78 twice. Rank 0 hosts the TCPStore here (``tcp://``): it
    raising must not turn rank 1's error into a lost connection."""
    got = _job(f"tcp://127.0.0.1:{_free_port()}", data, (0, 1))
    for r in range(2):
        assert got[r].get("error", "").startswith("ValueError"), got[r]
        assert "dp_rank=0 has seed=0" in got[r]["error"] and "dp_rank=1 has seed=1" in got[r]["error"], got[r]


def test_file_init_agrees_through_the_filestore_without_reading_every_index(data, tmp_path) -> None:
    """Finding: with ``file://`` init there was no agreement: every reader read every shard's index
    at its first state_dict() (O(data set) per reader)."""
    got = _job(f"file://{tmp_path / 'init'}", data, (0, 0), iterate=True)
    assert all("error" not in got[r] for r in range(2)), got
    assert all("path=" in got[r]["agreement"] for r in range(2)), got
    assert got[0]["batches"] == got[1]["batches"]
    for r in range(2):  # its own share and the boundary shards, never all of them
        assert len(got[r]["loads"]) < SHARDS, got[r]["loads"]
    _, docs, _ = data
    assert not set(got[0]["docs"]) & set(got[1]["docs"])  # every document once
    assert sorted(got[0]["docs"] + got[1]["docs"]) == [f"{i:08d}" for i in range(len(docs))]


def _absent_rank(init: str, queue) -> None:
    """Rank 1 of the job: joins torch.distributed (and the agreement's nonce) but never builds the
    dataset, as a rank that crashed in between or builds another one."""
    dist.init_process_group("gloo", init_method=init, rank=1, world_size=2, timeout=timedelta(seconds=60))
    Agreement.from_dist(None, 1, 2)
    queue.get(timeout=60)  # alive (rank 0 hosts the store) until the test has rank 0's error


@pytest.mark.slow  # ~6 s: a gloo group and the 1.5 s wait
def test_the_timeout_is_a_setting_and_names_the_ranks_that_did_not_arrive(data) -> None:
    """Finding: the wait was ``Agreement.timeout_s = 1800``, unreachable from any option. Here
    rank 1 never builds its dataset: rank 0 fails after the configured 1.5 s, naming it."""
    urls, _, cache = data
    with pytest.raises(ValueError, match="agree_timeout_s"):
        TopologyOptions(agree_timeout_s=0)
    init = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    absent = ctx.Process(target=_absent_rank, args=(init, queue))
    absent.start()
    try:
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=2, timeout=timedelta(seconds=60))
        start = time.monotonic()
        with pytest.raises(TimeoutError) as e:
            PackedDataset(urls, capacity=CAP, epochs=1, read=ReadOptions(cache_dir=cache),
                          topology=TopologyOptions(agree_timeout_s=1.5))
        assert time.monotonic() - start < 30
        msg = str(e.value)
        assert "waited 1.5s" in msg and "1 of 2 ranks arrived, not dp_rank 1" in msg and "agree_timeout_s" in msg
    finally:
        queue.put("done")
        absent.join(30)
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_launch_without_torch_distributed_is_refused_up_front(data, monkeypatch) -> None:
    """Finding: launched without torch.distributed, each reader of a finite multi-rank run read every
    shard's index at its first state_dict() (~100 s at 2,000 shards), silently."""
    urls, _, cache = data
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"init_process_group\(\).*batches_per_epoch.*sync_batches"):
        PackedDataset(urls, capacity=CAP, epochs=1, read=ReadOptions(cache_dir=cache))
    PackedDataset(urls, capacity=CAP, epochs=1, read=ReadOptions(cache_dir=cache),  # the remedies pass
                  topology=TopologyOptions(batches_per_epoch=4))
    PackedDataset(urls, capacity=CAP, epochs=1, read=ReadOptions(cache_dir=cache),
                  topology=TopologyOptions(equal_batches="sync"))


def _use_in_child(agreement: Agreement, queue) -> None:
    try:
        agree_counts(agreement, key="e0", dp_rank=0, worker_id=0, num_workers=1, count=1)
        queue.put("no error")
    except ValueError as e:
        queue.put(str(e))


def test_an_in_process_store_is_refused_in_another_process() -> None:
    store = HashStore()
    a = Agreement.in_process(store, prefix="p", dp_size=1, timeout_s=30)
    assert agree_counts(a, key="e0", dp_rank=0, worker_id=0, num_workers=1, count=3).target == 3
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_use_in_child, args=(a, queue))
    child.start()
    said = queue.get(timeout=60)
    child.join(30)
    assert "reachable only in the process that made it" in said and "FileStore" in said, said
    assert os.getpid() != child.pid


def test_a_late_model_parallel_peer_that_differs_is_refused_at_once(tmp_path) -> None:
    """Peers share a dp_rank: equal ones pass, and one arriving after the ranks agreed with other
    settings fails itself at once (the others already hold their answer)."""
    from streampack.plan.agree import agree_settings

    server, make = _store("tcp", tmp_path)
    a = make(2, 120.0)
    same = {"seed": 0}
    assert in_threads(lambda i: agree_settings(a, dp_rank=i // 2, settings=same), 4) == [None] * 4
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"model-parallel peer.*seed=3 here, seed=0 there"):
        agree_settings(a, dp_rank=1, settings={"seed": 3})
    assert time.monotonic() - start < 60  # not the 120 s timeout: nobody else is waited for
    del server
