"""``streampack index`` and ``streampack pack`` as the concurrent ranks of a job, each a real process given its rank
as torchrun, SLURM or the flags give it; one rank killed with SIGKILL and launched again (issue 33)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_data import RangeRequestHandler, make_token_docs, serve_directory, write_tar_shards

from streampack.io.index_cache import cache_path

ROOT = Path(__file__).resolve().parents[2]


def _launch(args: list[str], rank: int, world: int, how: str, **kw) -> subprocess.Popen:
    """A rank of a job: its rank from torchrun's variables, SLURM's, or the flags."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}
    env["PYTHONPATH"] = str(ROOT)
    if how == "torchrun":
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    elif how == "slurm":
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(world))
    else:
        args = [*args, "--rank", str(rank), "--world-size", str(world)]
    return subprocess.Popen([sys.executable, "-m", "streampack", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def _finish(procs: list[subprocess.Popen]) -> list[str]:
    said = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), said
    return said


def _index_args(urls: list[str], out: Path) -> list[str]:
    return ["index", *urls, "--out", str(out), "--quiet", "--pool", "threads", "--jobs", "1"]


def test_three_processes_write_the_single_process_manifest(tmp_path):
    from tests.unit.cli.test_ranks import assert_same_manifest

    urls = write_tar_shards(tmp_path / "in", make_token_docs(120, seed=8), 12, fmt="npy")
    single = subprocess.run([sys.executable, "-m", "streampack", *_index_args(urls, tmp_path / "one")],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    assert single.returncode == 0, single.stderr
    said = _finish([_launch(_index_args(urls, tmp_path / "job"), r, 3, how)
                    for r, how in enumerate(("torchrun", "slurm", "flags"))])
    assert "rank 0 of 3 (torchrun" in said[0] and "rank 1 of 3 (SLURM" in said[1] and "the 3 parts were there" in said[0]
    assert_same_manifest(tmp_path / "one", tmp_path / "job")


class _SlowHandler(RangeRequestHandler):
    """The loopback store, each response ``delay`` seconds late (so a rank can be killed mid-share); ``asked`` logs
    every request as ``(method, path, Range header or None)``."""

    delay = 0.0
    asked: list[tuple[str, str, str | None]] = []

    def send_head(self):  # type: ignore[no-untyped-def]
        type(self).asked.append((self.command, self.path, self.headers.get("Range")))
        time.sleep(type(self).delay)
        return super().send_head()


@pytest.mark.slow
def test_a_rank_killed_mid_share_resumes_without_reading_its_indexed_shards_again(tmp_path):
    from tests.unit.cli.test_ranks import assert_same_manifest

    paths = write_tar_shards(tmp_path / "in", make_token_docs(240, seed=9), 24, fmt="npy")
    with serve_directory(tmp_path / "in", _SlowHandler) as server:
        urls = server.urls_for(paths)
        _finish([_launch(_index_args(urls, tmp_path / "one"), 0, 1, "flags")])
        _SlowHandler.delay = 0.05  # ~4 requests a shard, one shard at a time: ~0.2 s a shard
        rank0 = _launch(_index_args(urls, tmp_path / "job"), 0, 2, "torchrun")
        rank1 = _launch(_index_args(urls, tmp_path / "job"), 1, 2, "torchrun")
        index_files = [Path(cache_path(u, str(tmp_path / "job" / "shards"))) for u in urls[1::2]]
        deadline = time.monotonic() + 120
        while sum(f.exists() for f in index_files) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        rank1.send_signal(signal.SIGKILL)
        rank1.wait()
        done = {f: f.stat().st_mtime_ns for f in index_files if f.exists()}
        assert 3 <= len(done) < len(index_files), "killed mid-share"
        assert not (tmp_path / "job" / "parts" / "rank-00001-of-00002.spm.npz").exists()
        _SlowHandler.delay = 0.0
        _SlowHandler.asked.clear()
        said = _finish([rank0, _launch(_index_args(urls, tmp_path / "job"), 1, 2, "torchrun")])
        assert "the 2 parts were there" in said[0]
        assert {f: f.stat().st_mtime_ns for f in done} == done, "an indexed shard's index was rebuilt"
        for f, url in zip(index_files, urls[1::2]):
            asked = [(m, r) for m, p, r in _SlowHandler.asked if p == "/" + url.rsplit("/", 1)[1]]
            scanned = len(asked) > 3 or ("GET", None) in asked
            # an indexed shard: a HEAD and the digest's ranged reads, no scan (a GET of the whole shard)
            assert scanned is (f not in done), (url, asked)
        assert_same_manifest(tmp_path / "one", tmp_path / "job")
        os.remove(tmp_path / "job" / "manifest.spm.npz")
        _finish([_launch(_index_args(urls, tmp_path / "job"), r, 3, "slurm") for r in range(3)])
        assert_same_manifest(tmp_path / "one", tmp_path / "job")


@pytest.mark.slow
def test_pack_ranks_as_processes_read_back_every_document_once(tmp_path):
    from tests.unit.cli.test_ranks import _read_all

    docs = make_token_docs(200, seed=10, max_len=120)
    urls = write_tar_shards(tmp_path / "in", docs, 6, fmt="npy")
    said = _finish([_launch(["pack", *urls, "--out", str(tmp_path / "job"), "--capacity", "256", "--no-progress"],
                            r, 2, "torchrun") for r in range(2)])
    assert "from 2 ranks" in said[0]
    got = _read_all(tmp_path / "job")
    assert sorted(got.values()) == sorted(docs)


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_launches_index_as_its_ranks(tmp_path):
    from tests.unit.cli.test_ranks import assert_same_manifest

    urls = write_tar_shards(tmp_path / "in", make_token_docs(60, seed=11), 5, fmt="npy")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for out, launcher in (("one", []), ("job", ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"])):
        done = subprocess.run([sys.executable, *launcher, "-m", "streampack", *_index_args(urls, tmp_path / out)],
                              env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 1 of 2 (torchrun" in done.stdout and "the 2 parts were there" in done.stdout
    assert_same_manifest(tmp_path / "one", tmp_path / "job")
