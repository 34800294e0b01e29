"""The `streampack` command: demo, inspect, pack, bench, help and one-line errors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers_data import make_token_docs, write_jsonl_shards, write_tar_shards

from streampack.cli.main import main
from streampack.cli.render import _cells, pack_layout, short_list

TINY_DEMO = ["demo", "--num-shards", "2", "--docs-per-shard", "50", "--batches", "3", "--capacity", "1024",
             "--window", "64", "--no-progress"]
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("demo-cache")


def _env() -> dict[str, str]:
    env = dict(os.environ, NO_COLOR="1", PYTHONPATH=str(REPO))
    return env


def test_demo_in_process(demo_cache, capsys):
    assert main([*TINY_DEMO, "--cache-dir", str(demo_cache)]) == 0
    out = capsys.readouterr().out
    assert "written now" in out
    for needle in ("Fill", "streampack (bfd, window 64)", "pad to max (1024)", "pad per batch",
                   "tokens/s", "Documents per pack", "cu_seqlens        = [0,", "cu_seqlens_padded = [0,"):
        assert needle in out, needle
    assert "█" in out or "#" in out
    cache = next(demo_cache.glob("corpus-*"))
    assert (cache / "tokenizer.json").is_file() and len(list(cache.glob("*.tar"))) == 2
    # a second run reuses corpus and tokenizer; alignment shows up as cu_seqlens_padded
    assert main([*TINY_DEMO, "--cache-dir", str(demo_cache), "--cp-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "reused" in out and "cp_size=2" in out


@pytest.mark.slow  # a fresh interpreter per run: integration
@pytest.mark.parametrize("how", ["module", "script"])
def test_demo_subprocess(demo_cache, how):
    if how == "script":
        script = shutil.which("streampack")
        if script is None:
            pytest.skip("console script not installed (pip install -e .)")
        cmd = [script]
    else:
        cmd = [sys.executable, "-m", "streampack"]
    proc = subprocess.run([*cmd, *TINY_DEMO, "--cache-dir", str(demo_cache)], capture_output=True, text=True,
                          env=_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Fill" in proc.stdout and "cu_seqlens_padded" in proc.stdout
    assert "\033[" not in proc.stdout  # no colour when not a tty


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("demo", "inspect", "pack", "bench"):
        assert name in out


def test_inspect_prints_stats_and_writes_png(tmp_path, capsys):
    paths = write_tar_shards(tmp_path, make_token_docs(300, seed=0, max_len=400), 2)
    png = tmp_path / "hist.png"
    rc = main(["inspect", *paths, "--capacity", "256", "--algorithms", "bfd,greedy", "--windows", "16,64",
               "--plot", str(png), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "samples: 300" in out and "p99" in out and "over capacity 256" in out
    assert "bfd" in out and "greedy" in out and "W=16" in out and "W=64" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inspect_text_without_tokenizer_says_so(tmp_path, capsys):
    paths = write_jsonl_shards(tmp_path, ["one two three", "four five"], 1)
    assert main(["inspect", *paths, "--capacity", "8", "--windows", "", "--algorithms", "bfd", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "whitespace words" in out and "mean 2.5" in out


@pytest.mark.parametrize("argv,message", [
    (["inspect", "/nonexistent/shard-000.tar", "--capacity", "64"], "nonexistent"),
    (["inspect", "{tar}", "--capacity", "64", "--algorithms", "nope"], "unknown algorithm"),
    (["pack", "{tar}", "--out", "{tmp}/o", "--capacity", "102", "--cp-size", "2"], "capacity=102 must be a multiple of align=4"),
    (["pack", "{tar}", "--out", "{tmp}/o", "--capacity", "64", "--tokenizer", "{tmp}/missing.json"], "no such file"),
    (["demo", "--cache-dir", "{tmp}/c", "--capacity", "0"], "--capacity=0"),
    (["inspect", "{tar}", "--capacity", "64", "--plot", "{tmp}/no/such/dir/h.png"], "no such directory"),
    (["inspect", "{tar}", "--capacity", "64", "--windows", "8,x"], "comma-separated integers"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, message):
    tar = write_tar_shards(tmp_path / "in", make_token_docs(10), 1)[0]
    argv = [a.format(tar=tar, tmp=tmp_path) for a in argv]
    assert main([*argv, "--no-progress"] if argv[0] != "bench" else argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("streampack: error: ") and message in err[0], err


@pytest.mark.slow  # a subprocess / spawned processes: the integration set
def test_bad_input_subprocess_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "streampack", "inspect", str(tmp_path / "missing.tar"),
                           "--capacity", "64"], capture_output=True, text=True, env=_env(), timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("streampack: error:")


def test_debug_shows_the_exception(tmp_path):
    with pytest.raises(Exception):
        main(["inspect", str(tmp_path / "missing.tar"), "--capacity", "64", "--debug"])


def test_bench_runs_every_module_and_reports_failures(tmp_path, monkeypatch, capsys):
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    shutil.copy(REPO / "benchmarks" / "run_all.py", bench / "run_all.py")
    (bench / "bench_ok.py").write_text("def run(quick=False):\n    return [{'n': 1, 'quick': quick, 'x': 0.5}]\n")
    (bench / "bench_bad.py").write_text("def run():\n    raise RuntimeError('boom')\n")
    from streampack.cli import bench_cmd

    monkeypatch.setattr(bench_cmd, "find_runner", lambda: bench / "run_all.py")
    report = tmp_path / "r.md"
    assert main(["bench", "--out", str(report)]) == 1
    text = report.read_text()
    assert "## bench_ok" in text and "| n | quick | x |" in text and "| 1 | False | 0.5 |" in text
    assert "## bench_bad" in text and "**failed**" in text and "boom" in text


def test_bench_quick_runs_only_the_quick_modules(tmp_path, monkeypatch):
    # before: --quick ran all 13 modules (6 min on 2 cores against "about 30 s" promised)
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    shutil.copy(REPO / "benchmarks" / "run_all.py", bench / "run_all.py")
    (bench / "bench_pipeline.py").write_text("def run(**kw):\n    return [{'ran': 1}]\n")
    (bench / "bench_slow.py").write_text("def run(quick=False):\n    raise RuntimeError('must not run')\n")
    from streampack.cli import bench_cmd

    monkeypatch.setattr(bench_cmd, "find_runner", lambda: bench / "run_all.py")
    report = tmp_path / "r.md"
    assert main(["bench", "--quick", "--out", str(report)]) == 0
    text = report.read_text()
    assert "## bench_pipeline" in text and "| 1 |" in text and "## bench_slow" not in text
    assert "_skipped in a quick run (run without --quick for them): bench_slow_" in text


def test_bench_locates_the_source_tree():
    from streampack.cli.bench_cmd import find_runner

    assert find_runner() == REPO / "benchmarks" / "run_all.py"


def test_layout_picture_marks_documents_and_padding():
    bar = pack_layout([0, 3, 5], [0, 4, 8], width=8)
    assert bar == "███·▓▓··"
    assert len(pack_layout([0, 1, 4000], [0, 8, 4096], width=40)) == 40
    assert _cells([1, 0, 999], 10)[0] == 1  # a tiny document stays visible
    assert short_list(range(100), limit=6).startswith("[0, 1, 2, ... (94 more)")


def test_subcommand_help_is_plain_text(capsys):
    for name in ("demo", "inspect", "pack", "bench"):
        with pytest.raises(SystemExit) as exc:
            main([name, "--help"])
        assert exc.value.code == 0
        out = capsys.readouterr().out
        assert "``" not in out and f"streampack {name}" in out
        assert "--no-progress" not in out or "progress bars" in out


def test_split_lengths_keep_stream_order():
    import numpy as np

    from streampack.cli.inspect_cmd import split_lengths

    got = split_lengths(np.array([3, 10, 4, 8, 1]), 4).tolist()
    assert got == [3, 4, 4, 2, 4, 4, 4, 1]  # chunks sit where their sample was, as OverlongNode emits


def test_inspect_text_with_tokenizer_and_mixed_order(tmp_path, capsys):
    import numpy as np

    from streampack.cli._data import sample_lengths
    from streampack.cli.corpus import train_demo_tokenizer, write_demo_corpus
    from streampack.sample import Sample

    shards = write_demo_corpus(tmp_path / "c", num_shards=1, docs_per_shard=40, vocab_size=500)
    tok = train_demo_tokenizer(shards, tmp_path / "tokenizer.json", vocab_size=400)
    jsonl = write_jsonl_shards(tmp_path / "j", ["one two three", "four five"] * 3, 1)
    for urls in (shards, jsonl):
        assert main(["inspect", *urls, "--capacity", "512", "--tokenizer", tok, "--windows", "8",
                     "--algorithms", "bfd", "--no-progress"]) == 0
        out = capsys.readouterr().out
        assert "length (tokens)" in out and "whitespace words" not in out and "W=8" in out
    # token and text samples mixed: lengths stay in stream order (the window simulation needs it)
    samples = [Sample(key="a", tokens=np.zeros(7, np.int64)), Sample(key="b", text="x y"),
               Sample(key="c", tokens=np.zeros(5, np.int64))]
    from node_checks import ListSource

    from streampack.nodes.tokenize import Tokenize
    from streampack.options import TokenizeOptions

    node = Tokenize(ListSource(samples), lambda text: [1] * len(text.split()), TokenizeOptions(block_size=8))
    node.reset(None)
    lengths, unit = sample_lengths(iter(node))
    assert lengths.tolist() == [7, 2, 5] and unit == "tokens"


def test_pack_align_multiple_is_read_back(tmp_path):
    from streampack import PackedDataset
    from streampack.options import TopologyOptions

    tar = write_tar_shards(tmp_path / "in", make_token_docs(40, max_len=50), 2)
    out = tmp_path / "packed"
    assert main(["pack", *tar, "--out", str(out), "--capacity", "128", "--align-multiple", "16",
                 "--no-progress"]) == 0
    batch = next(iter(PackedDataset(str(out), capacity=128, topology=TopologyOptions(align_multiple=16))))
    assert batch.align == 16 and all(int(x) % 16 == 0 for x in batch.cu_seqlens_padded)


def test_demo_checks_flags_before_writing_the_corpus(tmp_path, capsys):
    for flags, message in ((["--algorithm", "nope"], "--algorithm='nope'"),
                           (["--capacity", "1000", "--cp-size", "3"], "capacity=1000 must be a multiple of align=6")):
        assert main(["demo", "--cache-dir", str(tmp_path / "c"), *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "c").exists()


def _closed_port() -> int:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_url_is_one_line(tmp_path, capsys):
    port = _closed_port()
    assert main(["inspect", f"http://127.0.0.1:{port}/shard.tar", "--capacity", "64", "--retries", "0"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("streampack: error:") and f":{port}/shard.tar" in lines[0], lines
    assert main(["pack", "x.tar", "--out", str(tmp_path / "o"), "--capacity", "64", "--retries", "-1"]) == 2


@pytest.mark.slow  # a subprocess (~3.5 s): only there does a stray log record reach stderr (pytest captures logs)
def test_unreachable_url_is_one_line_without_progress_debris():
    port = _closed_port()
    proc = subprocess.run([sys.executable, "-m", "streampack", "inspect", f"http://127.0.0.1:{port}/shard.tar",
                           "--capacity", "64", "--retries", "0"], capture_output=True, text=True, env=_env(),
                          timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("streampack: error:") and f":{port}/shard.tar" in lines[0], lines


def test_packed_output_is_not_read_as_documents(tmp_path, capsys):
    tar = write_tar_shards(tmp_path / "in", make_token_docs(30), 1)
    assert main(["pack", *tar, "--out", str(tmp_path / "p"), "--capacity", "64", "--no-progress"]) == 0
    capsys.readouterr()
    for argv in (["inspect", str(tmp_path / "p"), "--capacity", "64"],
                 ["pack", str(tmp_path / "p" / "packed-000000.tar"), "--out", str(tmp_path / "q"), "--capacity", "64"]):
        assert main([*argv, "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "output of `streampack pack`" in err[0], err


@pytest.mark.slow  # a subprocess / spawned processes: the integration set
def test_closed_pipe_is_quiet(tmp_path):
    tar = write_tar_shards(tmp_path, make_token_docs(30), 1)[0]
    proc = subprocess.run(f"'{sys.executable}' -m streampack inspect '{tar}' --capacity 64 --windows '' "
                          f"--algorithms bfd | head -c 10", shell=True, capture_output=True, text=True,
                          env=_env(), timeout=60)
    assert proc.stdout == "samples: 3" and proc.stderr == "", proc.stderr


def test_pack_and_inspect_take_the_vocabulary_bound_and_reader_limits(tmp_path, capsys):
    # before: neither command had --vocab-size or the reader limits, so the offline path
    # accepted ids PackedDataset(vocab_size=...) rejects
    import json

    docs = make_token_docs(40, vocab=100)
    urls = write_jsonl_shards(tmp_path / "in", docs, 1)
    bad = sum(1 for d in docs if max(d) >= 95)
    assert 0 < bad < len(docs)
    out = tmp_path / "p"
    assert main(["pack", *urls, "--out", str(out), "--capacity", "64", "--vocab-size", "95",
                 "--on-error", "skip", "--no-progress"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["errors"]["counts"] == {"out_of_vocab_id": bad}
    assert main(["pack", *urls, "--out", str(tmp_path / "q"), "--capacity", "64", "--vocab-size", "95",
                 "--no-progress"]) == 2
    assert "out_of_vocab_id" in capsys.readouterr().err
    assert main(["inspect", *urls, "--capacity", "64", "--max-line-bytes", "20", "--no-progress"]) == 2
    assert "line_too_long" in capsys.readouterr().err
    assert main(["inspect", *urls, "--capacity", "64", "--max-json-depth", "0"]) == 2
    assert "--max-json-depth=0 must be an int >= 1" in capsys.readouterr().err


_START_UP = """
import sys, time
t = time.perf_counter()
from streampack.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("SECONDS", time.perf_counter() - t, "HEAVY", sorted({"torch", "torchdata", "numba", "numpy"} & set(sys.modules)),
      file=sys.stderr)
"""


@pytest.mark.parametrize("argv, exit_text", [
    (["--version"], "streampack 0."),
    (["--help"], "usage: streampack"),
    (["bogus"], "invalid choice: 'bogus'"),
    ([], "the following arguments are required: COMMAND"),
])
def test_version_help_and_usage_errors_start_fast(argv, exit_text):
    # before: --version imported every subcommand (torch, torchdata): 4.7 s cold, 3.4 s warm
    proc = subprocess.run([sys.executable, "-c", _START_UP, *argv], capture_output=True, text=True, env=_env(),
                          timeout=60)
    assert exit_text in proc.stdout + proc.stderr
    seconds, heavy = proc.stderr.split("SECONDS ")[1].split(" HEAVY ")
    assert heavy.strip() == "[]", heavy  # no torch, torchdata, numba, not even numpy
    assert float(seconds) < 2.0  # in-process time after the interpreter started: ~0.05 s here


def test_a_subcommand_imports_only_its_own_module():
    proc = subprocess.run([sys.executable, "-c", _START_UP, "inspect", "--help"], capture_output=True, text=True,
                          env=_env(), timeout=60)
    assert "usage: streampack inspect" in proc.stdout
    assert "HEAVY ['numpy']" in proc.stderr  # torch / torchdata wait for `run`


def test_pack_overlong_choices_match_the_node():
    from streampack.cli.pack_cmd import OVERLONG_POLICIES
    from streampack.options.packing import OVERLONG_POLICIES as RECORD_POLICIES

    assert OVERLONG_POLICIES == RECORD_POLICIES


def test_brace_typo_fails_before_reading(tmp_path, capsys):
    # before: `pack` / `inspect` read every listed shard up to the missing one, then failed
    write_jsonl_shards(tmp_path, make_token_docs(8), 2)
    assert main(["inspect", str(tmp_path / "shard-{000000..000003}.jsonl"), "--capacity", "64", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("streampack: error: 2 of 4 shards do not exist: ") and "shard-000003.jsonl" in err


@pytest.mark.parametrize("algorithm", ["bfd", "greedy", "kk"])
def test_inspect_windowed_fill_is_what_the_window_packer_reaches(algorithm):
    """`inspect` counts the window's packs on lengths alone; the node itself must reach the same fill."""
    from torchdata.nodes import IterableWrapper

    from streampack.cli.inspect_cmd import windowed_fill
    from streampack.graph import StreamConfig
    from streampack.nodes.window_packer import WindowPacker, fill
    from streampack.options import PackOptions
    from streampack.sample import Sample

    lengths = np.clip(np.random.default_rng(3).lognormal(np.log(40), 1.0, 1500).astype(np.int64), 1, 256)
    config = StreamConfig(capacity=256, packing=PackOptions(window=64, algorithm=algorithm))
    samples = (Sample(key=str(i), tokens=np.zeros(n, dtype=np.int64)) for i, n in enumerate(lengths.tolist()))
    node = WindowPacker(IterableWrapper(samples), rules=config.packer_rules(5))
    node.reset(None)
    for _ in node:
        pass
    assert windowed_fill(lengths, 256, 64, algorithm, seed=5) == fill(node.metrics)
