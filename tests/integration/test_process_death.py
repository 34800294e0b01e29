"""Issue 29 items 10, 11, 19: processes that die. A SIGKILLed training process takes its
DataLoader workers with it; a killed worker surfaces as torch's worker error and leaves nothing
mapped; a kill leaves no ``resource_tracker`` complaint and a run prints no dependency noise."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from node_checks import write_token_shards
from torchdata.stateful_dataloader import StatefulDataLoader

from streampack.dataset import PackedDataset
from streampack.layout import transfer
from streampack.options import PackOptions

_CHILD = "STREAMPACK_TEST_ISOLATED"


def isolated(test):  # noqa: ANN001, ANN201
    """Run ``test`` in a fresh pytest process: these tests kill processes that torch's SIGCHLD
    handler (installed by any earlier DataLoader of the test process) or an earlier test's shared
    memory slots would otherwise see, so in a shared process their outcome depends on test order."""
    import functools

    @functools.wraps(test)
    def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if os.environ.get(_CHILD):
            return test(*args, **kwargs)
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q",
                               "--timeout", "120", f"{__file__}::{test.__name__}"],
                              env={**os.environ, _CHILD: "1"}, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return run


# streams PackedBatches through 2 workers, prints their pids after the first batch, keeps reading
_TRAIN = """
import json, sys
from torchdata.stateful_dataloader import StatefulDataLoader
from streampack.dataset import PackedDataset
from streampack.options import PackOptions
urls, capacity = json.loads(sys.argv[1]), int(sys.argv[2])
ds = PackedDataset(urls, capacity=capacity, packs_per_batch=2, seed=1, packing=PackOptions(window=16))
it = iter(StatefulDataLoader(ds, batch_size=None, num_workers=2))
next(it)
print(json.dumps([w.pid for w in it._workers]), flush=True)
for _ in it:
    pass
"""
GRACE_S = 2.0
"""A worker must be gone this soon after its parent: the kernel kills it at once; torch's own
watchdog looks every 5 s and only between fetches, and a worker blocked writing the result pipe
never looks."""
_NOISE = ("set_vital", "leaked semaphore", "resource_tracker", "Warning")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    return write_token_shards(tmp_path_factory.mktemp("death"), 480, 4, mean=300, seed=3)[0]


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper has ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def _kill_training(urls: list[str], capacity: int, tmp_path: Path) -> tuple[list[int], str]:
    """SIGKILL a process streaming the dataset mid-run: the workers still running :data:`GRACE_S`
    later, and what the process (and its helpers) wrote to stderr."""
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    err_path = tmp_path / f"stderr-{capacity}-{time.monotonic_ns()}"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, str(script), json.dumps(urls), str(capacity)],
                                stdout=subprocess.PIPE, stderr=err, env={**os.environ, "PYTHONWARNINGS": "default"})
    try:
        line = proc.stdout.readline()
        assert line, err_path.read_text()
        workers = json.loads(line)
        time.sleep(0.3)  # mid-stream: the workers have filled their queues
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    deadline = time.monotonic() + GRACE_S
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    orphans = [p for p in workers if _alive(p)]
    for p in orphans:  # the base code's orphans would stay for good: the test cleans up
        os.kill(p, signal.SIGKILL)
    time.sleep(0.2)  # a resource tracker, had one been started, reports after its parent is gone
    return orphans, err_path.read_text()


@pytest.mark.slow  # real training processes killed: the fast loop's budget is 2 minutes
def test_workers_die_with_a_sigkilled_training_process_and_nothing_complains(shards, tmp_path) -> None:
    # before: both workers outlived the kill (parent pid 1, one thread blocked writing the result
    # pipe), and the pass tracker's named semaphore made resource_tracker report a leak
    kills = [_kill_training(shards, 2048, tmp_path) for _ in range(2)]
    assert [orphans for orphans, _ in kills] == [[], []]
    for _, stderr in kills:
        assert not [line for line in stderr.splitlines() if any(n in line for n in _NOISE)], stderr


@pytest.mark.slow
def test_no_orphaned_worker_in_twenty_kills_at_every_capacity(shards, tmp_path) -> None:
    capacities = [1024 << (i % 8) for i in range(20)]  # 1024 .. 131072
    left = [(c, _kill_training(shards, c, tmp_path)[0]) for c in capacities]
    assert [(c, orphans) for c, orphans in left if orphans] == []


@dataclass
class _Carrier:
    data: torch.Tensor


def _send_then_wait(conn) -> None:  # noqa: ANN001
    wire = transfer.to_wire(_Carrier(torch.arange(1 << 16, dtype=torch.int64)))  # 512 KiB: a ring slot
    assert wire is not None and wire.slot is not None
    conn.send_bytes(pickle.dumps(wire))
    time.sleep(60)


@pytest.mark.slow  # a fresh pytest process each (see isolated)
@isolated
def test_a_batch_from_a_killed_sender_is_a_clear_error() -> None:
    # before: FileNotFoundError: '/proc/<pid>/fd/<n>'
    here, there = multiprocessing.get_context("fork").Pipe()
    sender = multiprocessing.get_context("fork").Process(target=_send_then_wait, args=(there,))
    sender.start()
    wire = pickle.loads(here.recv_bytes())
    sender.kill()
    sender.join()
    with pytest.raises(RuntimeError, match=rf"\(pid {sender.pid}, a DataLoader worker\) exited unexpectedly"):
        transfer.from_wire(wire)


def _memfd_mappings() -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if "streampack-batch" in line]


def _nothing_mapped_soon() -> list[str]:
    gc.collect()
    deadline = time.monotonic() + 3
    while _memfd_mappings() and time.monotonic() < deadline:
        time.sleep(0.02)
    return _memfd_mappings()


def _loader(urls: list[str], epochs: int | None) -> StatefulDataLoader:
    # 5 packs of 4096: the int32 ids (80 KB) are above what travels inside the pickle (transfer.INLINE_BYTES), so
    # batches use the ring
    ds = PackedDataset(urls, capacity=4096, packs_per_batch=5, epochs=epochs, seed=1, packing=PackOptions(window=16))
    return StatefulDataLoader(ds, batch_size=None, num_workers=2)


@pytest.mark.slow  # a fresh pytest process each (see isolated)
@isolated
def test_a_finished_loader_leaves_no_worker_memory_mapped(shards) -> None:
    # before: the training process kept each finished worker's slots mapped (and their memory
    # alive) until a later loader mapped a slot
    loader = _loader(shards[:2], epochs=1)
    it = iter(loader)
    next(it)
    assert _memfd_mappings()
    assert sum(1 for _ in it) > 0  # each batch freed as the next arrives, as a training loop does
    del it, loader
    assert _nothing_mapped_soon() == []


@pytest.mark.slow  # a fresh pytest process each (see isolated)
@isolated
def test_a_killed_worker_is_torchs_worker_error_and_leaves_nothing_mapped(shards) -> None:
    loader = _loader(shards, epochs=None)
    it = iter(loader)
    next(it)
    next(it)
    # torch's SIGCHLD handler raises its own "is killed by signal" asynchronously, wherever the test
    # happens to be (even in pytest's code); without it the error comes from the receive path or
    # torch's watchdog, in next(), as in a training loop that checks its workers between steps
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid\(s\) \d+\) exited unexpectedly|"
                                           r"\(pid \d+, a DataLoader worker\) exited unexpectedly"):
        os.kill(it._workers[0].pid, signal.SIGKILL)
        for _ in range(100):
            next(it)  # freed at once, as a training loop does
    del it, loader
    assert _nothing_mapped_soon() == []


@pytest.mark.slow
def test_the_vlm_example_prints_no_dependency_noise(tmp_path) -> None:
    # before: transformers' bos/eos "must be None or an integer within the vocabulary" lines
    # (the example's config kept Qwen's ids for a 96-token vocabulary) and torchdata's set_vital
    example = Path(__file__).resolve().parents[2] / "examples" / "vlm_pretrain.py"
    proc = subprocess.run([sys.executable, str(example), "--steps", "2", "--preempt-at", "1"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=400, env={**os.environ, "PYTHONWARNINGS": "default"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    noise = [line for line in proc.stderr.splitlines() if any(n in line for n in ("bos_token_id", "eos_token_id",
                                                                                  *_NOISE))]
    assert noise == [], proc.stderr[-3000:]
