"""benchmarks/bench_peers.py keeps running: its streampack and webdataset columns on a tiny
corpus (neither needs the peer packages), and the re-stated llm-foundry packer it uses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # a subprocess running four epochs per loader: integration set

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from peers.packers import BinPackCollator, auto_packing_ratio, greedy_packs, pad_packs  # noqa: E402


def _rows(report: str) -> dict[str, list[str]]:
    rows = {}
    for line in report.splitlines():
        if line.startswith("| ") and not line.startswith("| loader"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0]] = cells
    return rows


def test_quick_run_reports_streampack_and_webdataset(tmp_path):
    out = tmp_path / "PEERS.md"
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_peers.py", "--quick", "--tokens", "400000",
         "--peers", "streampack,webdataset", "--out", str(out), "--dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = out.read_text()
    assert "Command: `" in report and "--quick" in report and "cores" in report and "torch 2." in report
    rows = _rows(report)
    assert set(rows) == {"streampack", "webdataset"}, rows
    head = [c.strip() for c in next(l for l in report.splitlines() if l.startswith("| loader")).strip("|").split(" | ")]
    sp, wds = (dict(zip(head, rows[name])) for name in ("streampack", "webdataset"))
    assert sp["exact"] == "yes" and int(sp["state bytes"].replace(",", "")) > 0
    # 400k tokens fill only ~100 packs, so the epoch-end flush and the last batch's filler packs
    # weigh a few points here (the full 30M-token run fills 99.9%)
    assert sp["tokens delivered"] == "100.00%" and float(sp["fill"].rstrip("%")) > 90
    assert sp["vs streampack"] == "1.00×" and sp["tokens/s per worker, 1 worker"].endswith(" M")
    assert wds["state bytes"] == "none" and wds["resume at 80%"].startswith("none (skip: ")
    assert 70 < float(wds["fill"].rstrip("%")) < 95  # next-fit on lognormal lengths


def test_binpack_conserves_tokens_and_keeps_leftover_bins():
    rng = np.random.default_rng(0)
    docs = [np.full(int(n), i) for i, n in enumerate(np.clip(rng.lognormal(6, 1, 400), 1, 512))]
    packer = BinPackCollator(target_batch_size=4, max_seq_len=512)
    out = []
    for start in range(0, len(docs), 24):
        packs = packer.pack(docs[start:start + 24])
        assert len(packs) == 4 and all(sum(map(len, p)) <= 512 for p in packs)
        out += [d for p in packs for d in p]
    left = [d for _, p in packer.leftover for d in p]
    assert left, "a 6x raw batch into 4 bins must leave bins over"
    seen = sorted(int(d[0]) for d in out + left)
    assert seen == list(range(len(docs)))  # every document exactly once, none cut
    assert packer.waste == pytest.approx(sum(map(len, left)) / sum(map(len, docs)))


def test_auto_packing_ratio_stops_before_waste():
    # ratios tried: linspace(1, 1000/100, 20) rounded to 0.1 -> raw batches of int(8 * ratio)
    assert auto_packing_ratio(np.full(10_000, 100), target_batch_size=8, max_seq_len=1000) == 10.0
    # 9 documents of 101 fit a bin: 72 per raw batch (ratio 9.1) fit, 76 (9.5) leave leftovers
    assert auto_packing_ratio(np.full(10_000, 101), target_batch_size=8, max_seq_len=1000) == 9.1


def test_greedy_and_pad_packs():
    docs = [np.arange(n) for n in (3, 4, 2, 5)]
    packs = list(greedy_packs(docs, 7))
    assert [[len(d) for d in p] for p in packs] == [[3, 4], [2, 5]]
    batch = pad_packs(packs, 8)
    assert batch.input_ids.shape == (2, 8) and batch.num_tokens == 14
    assert batch.cu_seqlens.tolist() == [0, 3, 7, 10, 15]


def test_the_token_array_peer_delivers_every_token_of_the_corpus_once(tmp_path):
    """bench_loaders' ``streampack-tokens`` row: the corpus as flat token arrays with offsets files, read whole."""
    from peers.corpus import Corpus, CorpusSpec
    from peers.streampack_peer import StreampackPeer

    from streampack.nodes.collate import FILLER_KEY

    corpus = Corpus(CorpusSpec(tokens=60_000, num_shards=3), str(tmp_path))
    peer = StreampackPeer(capacity=4096, fmt="tokens")
    peer.prepare(corpus)
    assert len(peer.urls) == 3 and all(u.endswith(".npy") for u in peer.urls)
    delivered, docs = 0, []
    for batch in peer.loader(0):
        delivered += peer.count(batch).tokens
        cu, at = batch.cu_seqlens.tolist(), batch.cu_seqlens_padded.tolist()
        docs += [batch.input_ids[at[i]:at[i] + cu[i + 1] - cu[i]].tolist() for i, key in enumerate(batch.doc_keys)
                 if key != FILLER_KEY]
    assert delivered == corpus.num_tokens
    expected = sorted(doc.tolist() for s in range(3) for _, doc in corpus.docs(s))
    assert sorted(docs) == expected


def test_the_sending_breakdowns_child_runs_each_mode(tmp_path):
    """bench_compact.py --sending: each mode's child epoch counts its items and its processes' CPU (the modes that
    send deliver every batch, and the end)."""
    import bench_compact

    for mode in bench_compact.SENDING:
        got = bench_compact.child_sending(mode, 60_000, str(tmp_path))
        want = {"in-process": 5, "worker, nothing sent": 1, "own process, nothing sent": 1}.get(mode)
        assert got["main"] > 0 and (mode == "in-process" or got["worker"] > 0)
        if want == 1:
            assert got["items"] == 1
        elif mode == "in-process":
            batches = got["items"]
        else:
            assert got["items"] == batches + 1
        # the batches' unpickling in the training process, as they arrive and warm (the last one again)
        assert (got["loads_arriving"] > 0 and got["loads_warm"] > 0) == (mode == "own process, the batches")
