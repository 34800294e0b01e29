"""``streampack index`` / ``streampack pack`` as the ranks of a job, the ranks run one after another in this process
(issue 33: indexing and offline packing on many nodes). Concurrent subprocesses, a SIGKILL and a loopback store:
``tests/integration/test_index_ranks.py``."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from helpers_data import make_token_docs, write_tar_shards

from streampack.cli._data import CliError
from streampack.cli.main import main
from streampack.cli.ranks import JobRank, gather, job_rank, launch_id
from streampack.io.index_cache import read_arrays
from streampack.io.packed_format import read_manifest
from streampack.io.storage import OpenOptions


def _index(urls, out, *extra) -> int:
    return main(["index", *urls, "--out", str(out), "--quiet", "--pool", "threads", "--jobs", "2", *extra])


def _ranks(urls, out, world: int, *extra, order=None) -> list[int]:
    """Every rank of a job of ``world``, rank 0 last (it merges what the others wrote)."""
    return [_index(urls, out, "--rank", str(r), "--world-size", str(world), *extra)
            for r in (order if order is not None else range(world - 1, -1, -1))]


def assert_same_manifest(a: Path, b: Path) -> None:
    """The two manifest files hold the same arrays (the zip's timestamps aside)."""
    left, right = (read_arrays(str(p / "manifest.spm.npz"), OpenOptions()) for p in (a, b))
    assert left is not None and right is not None and left.keys() == right.keys()
    for name in left:
        assert np.array_equal(left[name], right[name]), name


@pytest.fixture
def shards(tmp_path):
    return write_tar_shards(tmp_path / "in", make_token_docs(70, seed=3), 7, fmt="npy")


@pytest.mark.parametrize(("flags", "env", "want"), [
    ((None, None), {}, (0, 1, "one process")),
    ((2, 4), {"RANK": "0", "WORLD_SIZE": "2"}, (2, 4, "--rank")),
    ((None, None), {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "5", "SLURM_NTASKS": "8"}, (1, 2, "torchrun")),
    ((None, None), {"SLURM_PROCID": "5", "SLURM_NTASKS": "8"}, (5, 8, "SLURM")),
])
def test_rank_comes_from_the_flags_then_torchrun_then_slurm(flags, env, want):
    job = job_rank(*flags, environ=env)
    assert (job.rank, job.world_size) == want[:2] and want[2] in job.source


@pytest.mark.parametrize(("flags", "env", "match"), [
    ((1, None), {}, "give both"),
    ((None, None), {"RANK": "1"}, "only RANK is set"),
    ((None, None), {"SLURM_PROCID": "x", "SLURM_NTASKS": "2"}, "must be integers"),
    ((2, 2), {}, "0 <= rank < world size"),
    ((0, 0), {}, "world size >= 1"),
])
def test_a_bad_rank_is_refused_naming_the_values(flags, env, match):
    with pytest.raises(CliError, match=match):
        job_rank(*flags, environ=env)


def test_strided_shares_cover_every_shard_once():
    for n in (0, 1, 7, 64):
        for world in (1, 2, 3, 10):
            got = sorted(i for r in range(world) for i in JobRank(rank=r, world_size=world, source="").share(n))
            assert got == list(range(n))


def test_ranks_merge_to_the_single_process_manifest_at_any_world_size(tmp_path, shards):
    assert _index(shards, tmp_path / "one") == 0
    for world in (3, 2, 10):  # 10 > 7 shards: three ranks have nothing to index
        assert _ranks(shards, tmp_path / "job", world) == [0] * world
        assert_same_manifest(tmp_path / "one", tmp_path / "job")
        os.remove(tmp_path / "job" / "manifest.spm.npz")


def test_rank_0_names_the_ranks_it_waited_for(tmp_path, shards, capsys):
    assert _index(shards, tmp_path / "job", "--rank", "2", "--world-size", "4") == 0
    assert _index(shards, tmp_path / "job", "--rank", "0", "--world-size", "4", "--wait-timeout", "0.3") == 2
    assert "parts of rank(s) 1, 3 of 4" in capsys.readouterr().err
    assert not (tmp_path / "job" / "manifest.spm.npz").exists()


def test_a_rank_started_with_other_arguments_is_refused(tmp_path, shards, capsys):
    job = tmp_path / "job"
    assert _index(shards, job, "--rank", "1", "--world-size", "2", "--max-line-bytes", "1000") == 0
    assert _index(shards, job, "--rank", "0", "--world-size", "2") == 2
    err = capsys.readouterr().err
    assert "rank 1 was started with other arguments than rank 0: its settings are" in err and "1000" in err
    extra = tmp_path / "in" / "extra.tar"
    extra.write_bytes(Path(shards[0]).read_bytes())
    assert _index([*shards, str(extra)], job, "--rank", "1", "--world-size", "2") == 0
    assert _index(shards, job, "--rank", "0", "--world-size", "2") == 2
    assert "its URL list is 8 shard(s)" in capsys.readouterr().err
    assert not (job / "manifest.spm.npz").exists()


def test_a_failed_rank_stops_rank_0_at_once(tmp_path, shards, capsys):
    missing = str(tmp_path / "in" / "missing.tar")
    urls = [shards[0], missing, *shards[1:]]  # position 1: rank 1's share
    assert _index(urls, tmp_path / "job", "--rank", "1", "--world-size", "2") == 1
    assert _index(urls, tmp_path / "job", "--rank", "0", "--world-size", "2", "--wait-timeout", "600") == 2
    assert "rank 1 could not index 1 shard(s)" in capsys.readouterr().err


def test_gather_waits_while_parts_arrive():
    arrived = {0: "a"}
    naps = []

    def nap(s: float) -> None:  # each poll, one more rank's part arrives
        naps.append(s)
        arrived[len(arrived)] = "x"

    assert gather(arrived.get, 4, timeout=60.0, where="d", sleep=nap) == ["a", "x", "x", "x"]
    assert naps == [0.05, 0.1, 0.2]


def _pack(urls, out, *extra) -> int:
    return main(["pack", *urls, "--out", str(out), "--capacity", "256", "--packs-per-shard", "7", "--no-progress",
                 *extra])


def _read_all(out: Path) -> dict[str, list[int]]:
    from streampack import PackedDataset

    docs: dict[str, list[int]] = {}
    for batch in PackedDataset(str(out), capacity=256, packs_per_batch=2, epochs=1, shuffle=False):
        ids = batch.input_ids.tolist()
        cu = batch.cu_seqlens.tolist()
        padded = batch.cu_seqlens_padded.tolist()
        for k, key in enumerate(batch.doc_keys):
            assert key not in docs, f"document {key} read twice"
            docs[key] = ids[padded[k]:padded[k] + cu[k + 1] - cu[k]]
    return docs


def test_pack_ranks_read_back_every_document_once(tmp_path):
    docs = make_token_docs(300, seed=4, max_len=120)
    urls = write_tar_shards(tmp_path / "in", docs, 5, fmt="npy")
    assert _pack(urls, tmp_path / "one") == 0
    for r in (2, 1, 0):
        assert _pack(urls, tmp_path / "job", "--rank", str(r), "--world-size", "3") == 0
    m = read_manifest(tmp_path / "job")
    assert {s.name.rsplit("-", 1)[0] for s in m.shards} == {f"part-rank-{r:05d}-of-00003" for r in range(3)}
    assert [r["documents"] for r in m.extra["ranks"]] == [120, 120, 60]  # shards 0, 3 | 1, 4 | 2: 60 each
    assert all(0.5 < r["fill"] <= 1 for r in m.extra["ranks"]) and m.metrics["num_documents"] == 300
    assert _read_all(tmp_path / "job") == _read_all(tmp_path / "one")  # every document once, tokens equal


def test_a_pack_rank_keeps_its_finished_output_and_repacks_changed_inputs(tmp_path, capsys):
    docs = make_token_docs(200, seed=5, max_len=120)
    urls = write_tar_shards(tmp_path / "in", docs, 4, fmt="npy")
    for r in (1, 0):
        assert _pack(urls, tmp_path / "job", "--rank", str(r), "--world-size", "2") == 0
    mine = sorted((tmp_path / "job").glob("part-rank-00001-*.tar"))
    before = [p.stat().st_mtime_ns for p in mine]
    capsys.readouterr()
    assert _pack(urls, tmp_path / "job", "--rank", "1", "--world-size", "2") == 0
    assert "are there for these inputs: kept" in capsys.readouterr().out
    assert [p.stat().st_mtime_ns for p in mine] == before
    write_tar_shards(tmp_path / "in", make_token_docs(200, seed=6, max_len=120), 4, fmt="npy")  # new contents
    assert _pack(urls, tmp_path / "job", "--rank", "1", "--world-size", "2") == 0
    assert "kept" not in capsys.readouterr().out


def test_a_pack_rank_with_other_settings_is_refused(tmp_path, capsys):
    urls = write_tar_shards(tmp_path / "in", make_token_docs(100, seed=7, max_len=120), 4, fmt="npy")
    assert _pack(urls, tmp_path / "job", "--rank", "1", "--world-size", "2", "--seed", "3") == 0
    assert _pack(urls, tmp_path / "job", "--rank", "0", "--world-size", "2") == 2
    assert "rank 1 was started with other arguments than rank 0 (its settings differ: seed)" in capsys.readouterr().err
    assert not (tmp_path / "job" / "manifest.json").exists()


def test_a_negative_wait_is_refused_before_any_work(tmp_path, shards, capsys):
    assert _index(shards, tmp_path / "job", "--rank", "0", "--world-size", "2", "--wait-timeout", "-1") == 2
    assert "--wait-timeout=-1.0 must be >= 0" in capsys.readouterr().err and not (tmp_path / "job").exists()


def test_pack_ranks_whose_documents_carry_other_fields_are_refused(tmp_path, capsys):
    docs = make_token_docs(40, seed=8, max_len=60)
    with_labels = write_tar_shards(tmp_path / "in", docs[:20], 2, prefix="a", labels=[[1] * len(d) for d in docs[:20]])
    plain = write_tar_shards(tmp_path / "in", docs[20:], 2, prefix="b")
    urls = [with_labels[0], plain[0], with_labels[1], plain[1]]  # rank 0: labels, rank 1: none
    for r in (1, 0):
        assert _pack(urls, tmp_path / "job", "--rank", str(r), "--world-size", "2") == (0 if r else 2)
    err = capsys.readouterr().err
    assert "the ranks wrote packs of different fields" in err and "'labels.npy'" in err and "--labels-key" in err


@pytest.mark.parametrize(("given", "env", "want"), [
    ("mine", {"TORCHELASTIC_RUN_ID": "abc"}, "mine"),
    (None, {"TORCHELASTIC_RUN_ID": "abc", "SLURM_JOB_ID": "7"}, "torchrun:abc"),
    (None, {"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "2"}, "slurm:7.2"),
    (None, {}, ""),
])
def test_the_launch_id_comes_from_the_flag_then_torchrun_then_slurm(given, env, want):
    assert launch_id(given, env) == want


def test_rank_0_merges_no_index_part_an_earlier_launch_left(tmp_path, shards, capsys):
    job = tmp_path / "job"
    for r in (1, 0):
        assert _index(shards, job, "--rank", str(r), "--world-size", "2", "--launch-id", "first") == 0
    os.remove(job / "manifest.spm.npz")
    # the next launch's rank 0 finishes before its rank 1 starts: rank 1's part on disk is the first launch's
    assert _index(shards, job, "--rank", "0", "--world-size", "2", "--launch-id", "second", "--wait-timeout", "0.3") == 2
    assert "parts of rank(s) 1 of 2" in capsys.readouterr().err and not (job / "manifest.spm.npz").exists()
    for r in (1, 0):
        assert _index(shards, job, "--rank", str(r), "--world-size", "2", "--launch-id", "second") == 0
    assert _index(shards, tmp_path / "one") == 0
    assert_same_manifest(tmp_path / "one", job)


def test_rank_0_merges_no_pack_record_an_earlier_launch_left_until_its_rank_checked_it(tmp_path, capsys):
    urls = write_tar_shards(tmp_path / "in", make_token_docs(100, seed=9, max_len=120), 4, fmt="npy")
    job = tmp_path / "job"
    for r in (1, 0):
        assert _pack(urls, job, "--rank", str(r), "--world-size", "2", "--launch-id", "first") == 0
    write_tar_shards(tmp_path / "in", make_token_docs(100, seed=10, max_len=120), 4, fmt="npy")  # new contents
    assert _pack(urls, job, "--rank", "0", "--world-size", "2", "--launch-id", "second", "--wait-timeout", "0.3") == 2
    assert "parts of rank(s) 1 of 2" in capsys.readouterr().err
    assert _pack(urls, job, "--rank", "1", "--world-size", "2", "--launch-id", "second") == 0
    assert "kept" not in capsys.readouterr().out  # rank 1 saw its inputs changed and packed them again
    assert _pack(urls, job, "--rank", "0", "--world-size", "2", "--launch-id", "second") == 0
    assert _pack(urls, tmp_path / "one") == 0
    assert _read_all(job) == _read_all(tmp_path / "one")
