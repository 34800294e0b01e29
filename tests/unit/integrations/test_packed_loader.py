"""PackedLoader: StatefulDataLoader's batches, in its order, through streampack's own worker pipes; exact resume;
errors, dead workers, a killed trainer, an early exit and back-pressure with real processes and real signals."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from node_checks import canon, collect_documents, roundtrip, take, write_token_shards
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from streampack import PackedLoader
from streampack.dataset import PackedDataset
from streampack.errors import DataError
from streampack.options import PackOptions, TopologyOptions
from streampack.plan.state import dataset_states, load_loader_state

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_token_shards(tmp_path_factory.mktemp("packed_loader"), 240, 6, mean=90, seed=5)


def _ds(urls, **kw) -> PackedDataset:
    return PackedDataset(urls, **{"capacity": 256, "packs_per_batch": 2, "seed": 7, "epochs": 1,
                                  "packing": PackOptions(window=24, max_wait=3), **kw})


@pytest.mark.parametrize("num_workers", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_the_batches_and_their_order_are_statefuldataloaders(shards, num_workers):
    """Finite (3 workers: unequal shares, a worker ends first and drops out of the turn) and infinite streams."""
    urls, _ = shards
    for kw, n in (({}, None), ({"epochs": None}, 60)):
        want = [canon(b) for b in take(iter(StatefulDataLoader(_ds(urls, **kw), batch_size=None,
                                                               num_workers=num_workers)), n or 10**6)]
        got = [canon(b) for b in take(iter(PackedLoader(_ds(urls, **kw), num_workers=num_workers)), n or 10**6)]
        assert got == want and len(got) > 20


@pytest.mark.parametrize("every", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_interrupted_runs_resume_exactly(shards, every):
    """Two stops (with ``every=3``: off the snapshot interval): the stream continues as the uninterrupted run; a
    state saved right after a restore continues the same way."""
    urls, _ = shards
    full = [canon(b) for b in PackedLoader(_ds(urls), num_workers=2)]
    out, state, done = [], None, 0
    for stop in (7, 19, len(full)):
        loader = PackedLoader(_ds(urls), num_workers=2, snapshot_every_n_steps=every)
        if state is not None:
            loaded = roundtrip(state)
            load_loader_state(loader, loaded)
            assert loader.state_dict() is loaded  # before iterating: where it will start
        it = iter(loader)
        if state is not None:  # a state saved right after the restore continues the same way
            other = PackedLoader(_ds(urls), num_workers=2, snapshot_every_n_steps=every)
            other.load_state_dict(roundtrip(loader.state_dict()))
            head = take(it, 2)
            assert [canon(b) for b in take(iter(other), 2)] == [canon(b) for b in head]
            out += [canon(b) for b in head]
            done += 2
        out += [canon(b) for b in take(it, stop - done)]
        done = stop
        state = loader.state_dict()
        del it
    assert out == full


def test_states_are_checked_and_feed_an_elastic_resume(shards):
    urls, docs = shards
    loader = PackedLoader(_ds(urls), num_workers=2)
    with pytest.raises(ValueError, match="num_workers=2, the loader now has num_workers=3"):
        load_loader_state(PackedLoader(_ds(urls), num_workers=3), loader.state_dict())
    with pytest.raises(ValueError, match="not a PackedLoader state"):
        PackedLoader(_ds(urls), num_workers=2).load_state_dict(
            StatefulDataLoader(_ds(urls), batch_size=None, num_workers=2).state_dict())
    it = iter(loader)
    consumed = take(it, 7)
    states = dataset_states(roundtrip(loader.state_dict()))
    del it
    assert len(states) == 2
    for rank in range(2):  # two ranks of one worker each now
        ds = _ds(urls, topology=TopologyOptions(dp_rank=rank, dp_size=2, equal_batches="count"))
        ds.load_state_dict(states)
        consumed += list(PackedLoader(ds, num_workers=1))
    assert collect_documents(consumed) == {f"{i:08d}": doc for i, doc in enumerate(docs)}


def test_a_state_off_the_snapshot_interval_is_refused_for_an_elastic_resume(shards):
    urls, _ = shards
    loader = PackedLoader(_ds(urls), num_workers=2, snapshot_every_n_steps=4)
    it = iter(loader)
    take(it, 3)
    stale = dataset_states(roundtrip(loader.state_dict()))
    del it
    with pytest.raises(ValueError, match="batches after its workers' last snapshot"):
        _ds(urls).load_state_dict(stale)


def _corrupt(urls: list[str], tmp_path: Path) -> list[str]:
    """The shards with the second shard's first ``.npy`` member's magic overwritten."""
    bad = tmp_path / "bad.tar"
    data = bytearray(Path(urls[1]).read_bytes())
    at = data.index(b"\x93NUMPY")
    data[at:at + 6] = b"XXXXXX"
    bad.write_bytes(bytes(data))
    return [urls[0], str(bad), *urls[2:]]


def test_a_workers_data_error_reaches_the_loop_as_itself(shards, tmp_path):
    urls, _ = shards
    loader = PackedLoader(_ds(_corrupt(urls, tmp_path)), num_workers=2)
    it = iter(loader)
    with pytest.raises(DataError, match="bad.tar") as info:
        list(it)
    assert "in PackedLoader worker" in "\n".join(getattr(info.value, "__notes__", []))
    assert not any(p.is_alive() for p in it.procs if p is not None)  # joined, not left to the collector


def test_a_killed_worker_is_named_not_waited_for(shards):
    urls, _ = shards
    it = iter(PackedLoader(_ds(urls, epochs=None), num_workers=2, prefetch_factor=1))
    take(it, 3)
    victim = it.procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"worker 1 \(pid {victim.pid}\) exited unexpectedly with signal SIGKILL"):
        take(it, 50)
    assert time.monotonic() - started < 10
    assert not any(p.is_alive() for p in it.procs)


def test_leaving_the_loop_early_ends_the_workers_at_once(shards):
    urls, _ = shards
    it = iter(PackedLoader(_ds(urls, epochs=None), num_workers=2))
    take(it, 2)
    procs = list(it.procs)
    started = time.monotonic()
    del it  # by reference count: the finalizer closes the pipes and joins
    assert not any(p.is_alive() for p in procs)
    assert time.monotonic() - started < 2


class _Counted(IterableDataset):
    """Integers, counting in shared memory how many the worker has made."""

    def __init__(self, made) -> None:
        self.made = made

    def __iter__(self):
        for i in range(100):
            with self.made.get_lock():
                self.made.value += 1
            yield i


def test_a_worker_runs_at_most_prefetch_factor_batches_ahead():
    made = multiprocessing.get_context("fork").Value("i", 0)
    it = iter(PackedLoader(_Counted(made), num_workers=1, prefetch_factor=3))
    assert take(it, 2) == [0, 1]
    time.sleep(0.5)
    assert made.value == 2 + 3 + 1  # two taken, three sent ahead, one made and waiting for a credit
    assert take(it, 98) == list(range(2, 100))
    del it


class _Slow(IterableDataset):
    def __iter__(self):
        time.sleep(30)
        yield 0


@pytest.mark.slow  # waits out the timeout
def test_timeout_names_the_worker():
    it = iter(PackedLoader(_Slow(), num_workers=1, timeout=1))
    with pytest.raises(RuntimeError, match="timed out after 1 s waiting for worker 0"):
        next(it)
    assert not it.procs[0].is_alive()


def test_persistent_workers_iterate_again_as_statefuldataloaders_do(shards):
    """Two epochs of a one-epoch dataset with ``persistent_workers``: the same workers, StatefulDataLoader's
    batches."""
    urls, _ = shards
    want_loader = StatefulDataLoader(_ds(urls), batch_size=None, num_workers=2, persistent_workers=True)
    want = [[canon(b) for b in want_loader] for _ in range(2)]
    loader = PackedLoader(_ds(urls), num_workers=2, persistent_workers=True)
    first = [canon(b) for b in loader]
    pids = [p.pid for p in loader._pool.procs]
    second = [canon(b) for b in loader]
    assert [p.pid for p in loader._pool.procs] == pids
    assert [first, second] == want and len(first) > 20
    loader._pool.close()


def _fails(worker_id: int) -> None:
    raise OSError(f"no scratch space for worker {worker_id}")


def test_a_failing_worker_init_fn_reaches_the_loop(shards):
    """Its ``OSError`` is the data's failure, not a closed pipe: it reaches the loop as itself."""
    urls, _ = shards
    with pytest.raises(OSError, match="no scratch space for worker 0"):
        iter(PackedLoader(_ds(urls), num_workers=2, worker_init_fn=_fails))


def test_a_batch_size_is_refused(shards):
    urls, _ = shards
    with pytest.raises(ValueError, match="batch_size must be None"):
        PackedLoader(_ds(urls), batch_size=4)


@pytest.mark.slow  # a trainer process of its own
def test_workers_die_with_a_killed_trainer(shards, tmp_path):
    """SIGKILL the training process while its workers wait to send: they go with it (no orphans)."""
    urls, _ = shards
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from streampack import PackedDataset, PackedLoader
        from streampack.options import PackOptions
        ds = PackedDataset({urls!r}, capacity=256, packs_per_batch=2, seed=7, packing=PackOptions(window=24))
        it = iter(PackedLoader(ds, num_workers=2))
        next(it)
        print(" ".join(str(p.pid) for p in it.procs), flush=True)
        time.sleep(60)
    """))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(p) for p in trainer.stdout.readline().split()]
        assert len(pids) == 2
        trainer.kill()
        trainer.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids)
    finally:
        trainer.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_state_saved_after_the_last_batch_resumes_with_the_next_epoch(shards):
    """As StatefulDataLoader: the restored loader's next iteration is a whole new epoch, not an empty one."""
    urls, _ = shards
    results = []
    for make in (lambda ds: StatefulDataLoader(ds, batch_size=None, num_workers=2),
                 lambda ds: PackedLoader(ds, num_workers=2)):
        loader = make(_ds(urls))
        first = [canon(b) for b in loader]
        restored = make(_ds(urls))
        load_loader_state(restored, roundtrip(loader.state_dict()))
        results.append([canon(b) for b in restored])
        assert len(results[-1]) > 20 and results[-1] != first  # the next pass: reshuffled
    assert results[0] == results[1]


@pytest.mark.slow  # two spawned interpreters import torch
def test_spawned_workers_give_the_forked_workers_batches(shards):
    """``multiprocessing_context="spawn"`` (Hugging Face's ``dataloader_multiprocessing_context``): the dataset and
    the pipe ends travel pickled; the batches are the forked workers'."""
    urls, _ = shards
    spawned = [canon(b) for b in PackedLoader(_ds(urls), num_workers=2, multiprocessing_context="spawn")]
    assert spawned == [canon(b) for b in PackedLoader(_ds(urls), num_workers=2)] and len(spawned) > 20


def test_an_iterator_the_loader_replaced_says_so(shards):
    """A loader's new iteration ends the workers of the one before (one pool per loader): the old iterator's next
    batch is a clear error, not a closed-pipe ``OSError``."""
    urls, _ = shards
    loader = PackedLoader(_ds(urls), num_workers=2)
    old = iter(loader)
    next(old)
    new = iter(loader)
    with pytest.raises(RuntimeError, match="its loader started another iteration"):
        next(old)
    assert next(new) is not None
    loader.close()


class _Pickled:
    """Part of a state: writes a line to ``log`` each time it is pickled (in the worker, when its state is sent)."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __reduce__(self):
        with open(self.log, "a") as f:
            f.write("sent\n")
        return (_Pickled, (self.log,))


class _Stated(IterableDataset):
    """Ints, with a state (how many it gave) that says when it is sent."""

    def __init__(self, log: str, n: int = 40) -> None:
        self.log, self.n, self.at = log, n, 0

    def __iter__(self):
        while self.at < self.n:
            self.at += 1
            yield self.at - 1

    def state_dict(self):
        return {"at": self.at, "probe": _Pickled(self.log)}

    def load_state_dict(self, state):
        self.at = state["at"]


def test_a_worker_sends_its_state_when_asked_not_with_every_batch(tmp_path):
    """A snapshot after every batch (the default) went out with every batch: ~0.2-0.5 ms of CPU a batch in both
    processes for a PackedDataset's state, about an in-process 32 k-token batch. Now the worker keeps its last states
    and sends one when ``state_dict()`` asks (and at the start and the end of its data)."""
    log = tmp_path / "sent.log"
    loader = PackedLoader(_Stated(str(log)), num_workers=1)
    it = iter(loader)
    assert take(it, 30) == list(range(30))
    sent_while_iterating = log.read_text().count("sent")
    state = loader.state_dict()
    assert sent_while_iterating == 1  # the start's
    assert log.read_text().count("sent") == 2 and state["workers"][0]["dataset_state"]["at"] == 30
    assert state["workers"][0]["since"] == 0
    restored = PackedLoader(_Stated(str(log)), num_workers=1)
    restored.load_state_dict(state)
    assert list(restored) == list(range(30, 40))
    del it


@pytest.mark.parametrize("num_workers", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_the_state_some_batches_back_resumes_where_those_batches_left_off(shards, num_workers):
    """``state_dict_before(k)``: what ``state_dict()`` said k batches earlier (the Lightning integration asks for the
    batch it trains, one behind the one it fetched); with 3 workers over the end of the data, where a worker has
    dropped out of the turn."""
    urls, _ = shards
    full = [canon(b) for b in PackedLoader(_ds(urls), num_workers=num_workers)]
    cases = ((9, 1), (9, 4), (len(full) - 1, 2), (len(full), 1), (len(full), 3))
    for at, back in cases if num_workers == 3 else cases[::4]:
        loader = PackedLoader(_ds(urls), num_workers=num_workers)
        it = iter(loader)
        take(it, at)
        state = roundtrip(loader.state_dict_before(back))
        if at == len(full):
            with pytest.raises(StopIteration):
                next(it)
        restored = PackedLoader(_ds(urls), num_workers=num_workers)
        restored.load_state_dict(state)
        assert [canon(b) for b in restored] == full[at - back:], (at, back)
        del it
    loader = PackedLoader(_ds(urls), num_workers=num_workers)
    it = iter(loader)
    take(it, 12)
    with pytest.raises(ValueError, match="no state 9 batches back"):
        loader.state_dict_before(9)
    with pytest.raises(ValueError, match="needs workers"):
        PackedLoader(_ds(urls), num_workers=0).state_dict_before(1)
    del it


def test_states_taken_from_another_thread_leave_the_batches_whole(shards):
    """``state_dict()`` reads the workers' pipes now: a checkpoint thread asking while the loop takes batches waits
    for the loop's ``next()`` instead of reading the same pipe (a message cut in two, a batch lost)."""
    import threading

    urls, _ = shards
    full = [canon(b) for b in PackedLoader(_ds(urls), num_workers=2)]
    loader = PackedLoader(_ds(urls), num_workers=2, persistent_workers=True)
    it = iter(loader)
    states, stop = [], threading.Event()

    def checkpoints() -> None:
        while not stop.is_set():
            states.append(loader.state_dict())

    thread = threading.Thread(target=checkpoints)
    thread.start()
    try:
        got = [canon(b) for b in it]
    finally:
        stop.set()
        thread.join()
    assert got == full and len(states) > 5
    assert all(w["since"] == 0 for s in states for w in s["workers"])
    loader.close()


class _Stalls(_Stated):
    """Five ints, then a read that hangs (a store retrying for minutes)."""

    def __iter__(self):
        while self.at < 5:
            self.at += 1
            yield self.at - 1
        time.sleep(60)
        yield -1


def test_a_state_is_answered_while_the_worker_waits_on_its_data(tmp_path):
    """A checkpoint (a preemption's grace period) asks for the state while a worker's main thread is stuck in a slow
    read: its answering thread replies at once, where a worker answering between batches held it for the read."""
    loader = PackedLoader(_Stalls(str(tmp_path / "sent.log")), num_workers=1)
    it = iter(loader)
    assert take(it, 5) == list(range(5))
    time.sleep(0.2)  # the worker is inside the hanging read now
    began = time.monotonic()
    state = loader.state_dict()
    assert time.monotonic() - began < 5 and state["workers"][0]["dataset_state"]["at"] == 5
    assert state["workers"][0]["since"] == 0
    loader.close()
