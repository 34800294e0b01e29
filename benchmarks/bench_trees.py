"""Before and after a refactor: the same benchmark, in one run, on two trees of streampack.

Given two revisions (default: :data:`BEFORE` against the working tree this script lives in),
each one that is not the working tree is written out with ``git archive`` into a temporary
directory; every measurement then runs in a fresh ``python -P`` child whose ``PYTHONPATH`` is that
tree alone (``-P``: the script's folder is not put first), and the child checks that its
``streampack`` came from there. The two trees run back to back per case, in an order that flips
with the case and the repeat, ``--repeats`` times; each child makes ``--passes`` epochs (more
for short ones) and keeps the best (a busy spell on a shared machine only ever slows a pass
down). The table gives each metric's median per tree, and the median and range of the per-repeat ratios AFTER / BEFORE
(two runs seconds apart, so a slow spell of the machine hits both): read a ratio against the
range that the same command gives for two identical trees (``--before HEAD``).

The data is built once, by this script's tree, and both trees read the same files:

- ``text``: the demo corpus (``streampack.cli.corpus``, as ``bench_first_batch.py`` and
  ``bench_cold_start.py`` build it): text tar shards through its byte-level BPE tokenizer;
- ``tar`` / ``parquet``: the pre-tokenized corpus of ``bench_loaders.py`` (``peers/corpus.py``:
  lognormal lengths, mean 600, 16 shards), as webdataset tar and as parquet.

Every case is ``PackedDataset(urls, capacity=4096, epochs=1, packs_per_batch=8,
packing=PackOptions(window=1024))`` under torchdata's ``StatefulDataLoader`` (the README's
loop), built only from names both trees export at top level. Per case and tree:

- tokens per CPU-second (the best pass): real tokens (filler packs excluded) over the CPU of
  the process from the dataset's construction to the last batch, plus its DataLoader workers'
  (joined);
- fill: real tokens / slots (the trees must agree: same stream, same packs);
- peak RSS of the process (``VmHWM``) and of its largest worker;
- first batch: construction to the first batch of the child's first pass, wall and
  (in-process) CPU: what a new process waits for;
- resume: a fresh process loads the state saved after 80% of the epoch's documents, builds the
  loader and takes its first batch (wall, and in-process CPU), then does it again ``--passes - 1``
  times (the best of those: the restore's own work, without the first one's lazy imports);
  every such batch must be the one the uninterrupted run delivered.

Each tree has its own ``STREAMPACK_CACHE``, filled by one untimed warm-up child (shard indexes,
bytecode), so no timed run builds a cache the other tree then reads.

    python benchmarks/bench_trees.py --json /tmp/trees.json      # BEFORE against this working tree
    python benchmarks/bench_trees.py --before HEAD                # the noise: two identical trees
    python benchmarks/bench_trees.py --before main --after HEAD --repeats 9 --cases "tar w0,tar w2"
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import io
import json
import os
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BEFORE = "1da6a37"
"""The default BEFORE revision: the tree before issue 30 consolidated the packing chain."""
CAPACITY, WINDOW, PACKS_PER_BATCH = 4096, 1024, 8
RESUME_AT = 0.8
WARM_CPU_S = 2.0
"""CPU-seconds of warm passes a child makes at least: the 0.3 s epoch of tar in-process runs ~7
times (its warm passes took 0.26-0.45 s of CPU in one child on the loaded 2-core box)."""
FILLER_KEY = "<filler>"
"""``doc_keys`` entry of a pack that only completes an epoch's last batch (PackedDataset's docs)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One measured configuration."""

    name: str
    data: str
    """``text``, ``tar`` or ``parquet``: which of the built data sets it reads."""
    workers: int
    """DataLoader workers (0: in-process)."""
    resume: bool
    """Also time a resume from a state saved mid-epoch."""


CASES = (Case(name="text w0", data="text", workers=0, resume=True),
         Case(name="tar w0", data="tar", workers=0, resume=True),
         Case(name="parquet w0", data="parquet", workers=0, resume=False),
         Case(name="tar w2", data="tar", workers=2, resume=True))


@dataclass(frozen=True, slots=True, kw_only=True)
class Tree:
    """One side of the comparison."""

    label: str
    """``before`` or ``after``."""
    rev: str
    """As asked (a revision, or ``working tree``)."""
    commit: str
    root: str
    """The directory whose ``streampack/`` the children import."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Metric:
    key: str
    label: str
    higher_is_better: bool


METRICS = (Metric(key="tokens_per_cpu_s", label="tokens / CPU-s", higher_is_better=True),
           Metric(key="fill", label="fill", higher_is_better=True),
           Metric(key="rss_main_mib", label="peak RSS, process (MiB)", higher_is_better=False),
           Metric(key="rss_worker_mib", label="peak RSS, largest worker (MiB)", higher_is_better=False),
           Metric(key="first_batch_s", label="first batch, wall (s)", higher_is_better=False),
           Metric(key="first_batch_cpu_s", label="first batch, CPU (s)", higher_is_better=False),
           Metric(key="resume_s", label="resume in a fresh process, wall (s)", higher_is_better=False),
           Metric(key="resume_cpu_s", label="resume in a fresh process, CPU (s)", higher_is_better=False),
           Metric(key="resume_again_s", label="resume again in that process, wall (s)", higher_is_better=False),
           Metric(key="resume_again_cpu_s", label="resume again in that process, CPU (s)", higher_is_better=False))


# ------------------------------------------------------------------ the child (one tree's streampack)
def _cpu_self() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


def _cpu_children() -> float:
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return kids.ru_utime + kids.ru_stime


def _peak_rss_mib() -> float:
    """This process's peak RSS (``VmHWM``; ``ru_maxrss`` would carry the parent's across ``exec``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def _loader(data: dict[str, Any], case: Case, state: Any = None) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    from streampack import PackedDataset, PackOptions, TokenizeOptions

    text = {"tokenizer": data["tokenizer"], "tokenize": TokenizeOptions(eos_id=0)} if case.data == "text" else {}
    ds = PackedDataset(data[case.data], capacity=CAPACITY, epochs=1, seed=0, packs_per_batch=PACKS_PER_BATCH,
                       packing=PackOptions(window=WINDOW), **text)
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=case.workers,
                                prefetch_factor=8 if case.workers else None)
    if state is not None:
        loader.load_state_dict(state)
    return loader


def _digest(batch: Any) -> str:
    return hashlib.sha1(batch.input_ids.numpy().tobytes() + batch.cu_seqlens.numpy().tobytes()).hexdigest()[:16]


@dataclass(frozen=True, slots=True, kw_only=True)
class Epoch:
    """One pass over a case's data in a child process."""

    tokens: int
    """Real tokens delivered (filler packs excluded)."""
    slots: int
    docs: int
    batches: int
    cpu_s: float
    """This process's CPU from the dataset's construction to the last batch (not the teardown's
    full gc walk over torch's objects, ~0.1 s whatever the tree), plus every worker's."""
    first_batch_s: float
    first_batch_cpu_s: float
    stream: tuple[str, ...]
    """Digests of the first batch and (when a state was saved) of the batch after the checkpoint."""


def _epoch(data: dict[str, Any], case: Case, saved: dict[str, Any] | None = None) -> Epoch:
    """One epoch; given ``saved`` (empty), fills it with the state at ``RESUME_AT`` of the documents
    and the batch after it."""
    gc.collect()
    self0, kids0, start = _cpu_self(), _cpu_children(), time.perf_counter()
    loader = _loader(data, case)
    tokens = slots = batches = docs = 0
    first_s = first_cpu = 0.0
    checkpoint_at = int(RESUME_AT * data["docs"][case.data]) if saved is not None else None
    stream: list[str] = []
    for batch in loader:
        if not batches:
            first_s, first_cpu = time.perf_counter() - start, _cpu_self() - self0
            stream.append(_digest(batch))
        fillers = batch.doc_keys.count(FILLER_KEY)
        tokens += batch.num_tokens - fillers * batch.capacity
        slots += batch.input_ids.numel()
        docs += len(batch.doc_keys) - fillers
        batches += 1
        if saved is not None and "state" in saved and "reference" not in saved:
            saved["reference"] = batch.input_ids.clone()
            stream.append(_digest(batch))
        if checkpoint_at is not None and saved is not None and "state" not in saved and docs >= checkpoint_at:
            saved["state"] = loader.state_dict()
    self1 = _cpu_self()
    del loader
    gc.collect()  # joins the workers: their CPU lands in RUSAGE_CHILDREN
    return Epoch(tokens=tokens, slots=slots, docs=docs, batches=batches,
                 cpu_s=(self1 - self0) + (_cpu_children() - kids0), first_batch_s=first_s,
                 first_batch_cpu_s=first_cpu, stream=tuple(stream))


def child_epoch(data: dict[str, Any], case: Case, scratch: str, passes: int) -> dict[str, Any]:
    """``passes`` epochs in this fresh process, more while the warm ones (all but the first) have
    used less than ``WARM_CPU_S`` (up to ``4 * passes``): the first batch is the first pass's (what
    a new process waits for), the throughput the best warm pass's (a busy spell on a shared
    machine only ever slows a pass down); the first pass saves the state a resume child loads."""
    import torch

    saved: dict[str, Any] | None = {} if case.resume else None
    runs = [_epoch(data, case, saved)]
    while len(runs) < passes or (1 < passes and len(runs) < 4 * passes
                                 and sum(e.cpu_s for e in runs[1:]) < WARM_CPU_S):
        runs.append(_epoch(data, case))
    if saved is not None:
        torch.save(saved, os.path.join(scratch, f"{case.name}.pt"))
    first, best = runs[0], min(runs[1:] or runs, key=lambda e: e.cpu_s)
    return {"tokens": first.tokens, "slots": first.slots, "batches": first.batches, "docs": first.docs,
            "fill": first.tokens / first.slots, "stream": first.stream,
            "tokens_per_cpu_s": best.tokens / best.cpu_s, "cpu_s": [e.cpu_s for e in runs],
            "first_batch_s": first.first_batch_s,
            "first_batch_cpu_s": first.first_batch_cpu_s if not case.workers else None,
            "rss_main_mib": _peak_rss_mib(),
            "rss_worker_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024 if case.workers else None}


def child_resume(data: dict[str, Any], case: Case, scratch: str, passes: int) -> dict[str, Any]:
    """``passes`` restores in this fresh process, each from ``torch.load`` of the saved state to the
    first batch of a new loader: the first is what a restarted job waits for (lazy imports
    included), the best of the others the restore's own work."""
    import torch

    path = os.path.join(scratch, f"{case.name}.pt")
    wall, cpu, exact = [], [], True
    for _ in range(passes):
        gc.collect()
        self0, start = _cpu_self(), time.perf_counter()
        saved = torch.load(path, weights_only=True)
        it = iter(_loader(data, case, saved["state"]))
        first = next(it)
        wall.append(time.perf_counter() - start)
        cpu.append(_cpu_self() - self0)
        exact = exact and bool(torch.equal(first.input_ids, saved["reference"]))
        del it
    in_process = not case.workers  # with workers the batch is their CPU, not this process's
    return {"resume_s": wall[0], "resume_cpu_s": cpu[0] if in_process else None,
            "resume_again_s": min(wall[1:], default=None),
            "resume_again_cpu_s": min(cpu[1:], default=None) if in_process else None, "exact": exact}


def child_main(args: argparse.Namespace) -> int:
    import streampack

    where = Path(streampack.__file__).resolve()
    if Path(args.tree).resolve() not in where.parents:
        raise SystemExit(f"imported streampack from {where}, not from the tree {args.tree}")
    data = json.loads(Path(args.data).read_text())
    if args.child == "warmup":  # fill this tree's cache (shard indexes) and bytecode, untimed
        for case in CASES:
            next(iter(_loader(data, Case(name=case.name, data=case.data, workers=0, resume=False))))
        print(json.dumps({}))
        return 0
    case = next(c for c in CASES if c.name == args.case)
    fn = child_epoch if args.child == "epoch" else child_resume
    print(json.dumps(fn(data, case, args.scratch, int(args.passes))))
    return 0


# ------------------------------------------------------------------ the parent (this script's tree)
@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """How much to measure. The defaults take ~6 minutes on the shared 2-core box."""

    repeats: int = 5
    """Fresh child processes per case and tree (alternating trees). Children differ more than
    passes do (a whole child ran 40% slow on the loaded box): repeats, not passes, buy precision."""
    passes: int = 2
    """Epochs (and restores) in each child, at least: the first is cold, the best warm one counts."""
    tokens: float = 12e6
    """Pre-tokenized corpus (tar and parquet): ~0.5 s of CPU per in-process epoch of tar."""
    text_docs: int = 1500
    """Text documents (~624 tokens each): ~2 s of CPU per epoch, mostly the BPE tokenizer."""
    timeout: float = 600
    """Seconds per child process."""


def build_data(root: Path, s: Settings) -> dict[str, Any]:
    """Every data set, written once (reused from ``root`` when already there); what children read."""
    sys.path[:0] = [str(HERE), str(HERE.parent)]  # peers/ and this tree's streampack build the data
    from peers.corpus import Corpus, CorpusSpec, write_parquet, write_tar

    from streampack.cli.corpus import train_demo_tokenizer, write_demo_corpus

    corpus = Corpus(CorpusSpec(tokens=int(s.tokens), capacity=CAPACITY), str(root))
    per_shard = -(-s.text_docs // 4)
    text_dir = root / f"text-{4 * per_shard}"
    done = text_dir / "DONE"
    if done.exists():
        text = json.loads(done.read_text())
    else:
        urls = write_demo_corpus(text_dir, num_shards=4, docs_per_shard=per_shard)
        text = {"urls": urls, "tokenizer": train_demo_tokenizer(urls[:1], text_dir / "tokenizer.json",
                                                                  sample_bytes=2_000_000)}
        done.write_text(json.dumps(text))
    return {"text": text["urls"], "tokenizer": text["tokenizer"], "tar": write_tar(corpus),
            "parquet": write_parquet(corpus),
            "docs": {"text": 4 * per_shard, "tar": corpus.num_docs, "parquet": corpus.num_docs},
            "describe": {"text": f"demo text corpus, {4 * per_shard:,} documents in 4 tar shards, its BPE "
                                 f"tokenizer (~624 tokens per document)", "pretokenized": corpus.describe()}}


def _git(*args: str) -> str:
    proc = subprocess.run(["git", "-C", str(HERE.parent), *args], capture_output=True, text=True)
    if proc.returncode:
        raise ValueError(f"git {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def materialize(label: str, rev: str | None, scratch: Path) -> Tree:
    """``rev``'s ``streampack/`` written out under ``scratch`` (None: this working tree as it is)."""
    if rev is None:
        dirty = bool(_git("status", "--porcelain", "--", "streampack"))
        return Tree(label=label, rev="working tree", commit=_git("rev-parse", "HEAD") + (" + changes" if dirty else ""),
                    root=str(HERE.parent))
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    root = scratch / f"{label}-{commit[:12]}"
    archive = subprocess.run(["git", "-C", str(HERE.parent), "archive", commit, "streampack"], check=True,
                             capture_output=True).stdout  # the package only: the harness is this script
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    return Tree(label=label, rev=rev, commit=commit, root=str(root))


def spawn(tree: Tree, what: str, case: str, scratch: Path, s: Settings) -> dict[str, Any]:
    """One child: ``python -P`` with this tree alone on ``PYTHONPATH`` and the tree's own cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    env.update(PYTHONPATH=tree.root, STREAMPACK_CACHE=str(scratch / f"cache-{tree.label}"))
    (scratch / tree.label).mkdir(exist_ok=True)
    cmd = [sys.executable, "-P", __file__, "--child", what, "--case", case, "--tree", tree.root,
           "--data", str(scratch / "data.json"), "--scratch", str(scratch / tree.label), "--passes", str(s.passes)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=s.timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{tree.label} tree, {what} {case!r} failed:\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def collect(trees: Sequence[Tree], cases: Sequence[Case], scratch: Path, s: Settings,
            echo: bool = True) -> list[dict[str, Any]]:
    """Every run: ``{"tree", "case", "repeat", ...metrics}``. The two trees run back to back per
    case, in an order that flips with the repeat and the case, so neither tree always runs first
    or always follows the same neighbour."""
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if echo else (lambda text: None)
    for tree in trees:
        say(f"warm-up: {tree.label} ({tree.commit[:12]})")
        spawn(tree, "warmup", "", scratch, s)
    runs: list[dict[str, Any]] = []
    for r in range(s.repeats):
        for i, case in enumerate(cases):
            order = trees if (r + i) % 2 == 0 else trees[::-1]
            say(f"repeat {r + 1}/{s.repeats}: {case.name} ({' then '.join(t.label for t in order)})")
            got = {t.label: {"tree": t.label, "case": case.name, "repeat": r,
                             **spawn(t, "epoch", case.name, scratch, s)} for t in order}
            if case.resume:
                for t in order[::-1]:
                    got[t.label].update(spawn(t, "resume", case.name, scratch, s))
            runs += [got[t.label] for t in trees]
    return runs


def _median(values: Sequence[float]) -> float:
    v = sorted(values)
    return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2


def summarize(runs: Sequence[dict[str, Any]], cases: Sequence[Case]) -> list[dict[str, Any]]:
    """One row per case and metric: each tree's median, and the AFTER / BEFORE ratio of each repeat
    (two runs seconds apart, so a slow spell of the machine hits both) as their median and range."""
    rows = []
    for case in cases:
        mine = [r for r in runs if r["case"] == case.name]
        for m in METRICS:
            by = {t: {r["repeat"]: r[m.key] for r in mine if r["tree"] == t and r.get(m.key) is not None}
                  for t in ("before", "after")}
            paired = [by["after"][k] / by["before"][k] for k in by["before"] if k in by["after"] and by["before"][k]]
            if not paired:
                continue
            rows.append({"case": case.name, "metric": m.key, "label": m.label, "higher_is_better": m.higher_is_better,
                         "before": _median(list(by["before"].values())), "after": _median(list(by["after"].values())),
                         "ratio": _median(paired), "ratio_min": min(paired), "ratio_max": max(paired)})
    return rows


def checks(runs: Sequence[dict[str, Any]], cases: Sequence[Case]) -> dict[str, dict[str, Any]]:
    """Per case: did every run of both trees deliver the same stream (batches, tokens, documents,
    the first batch and the one after the checkpoint), and was every resume exact?"""
    out = {}
    for case in cases:
        mine = [r for r in runs if r["case"] == case.name]
        seen = {json.dumps([r["batches"], r["tokens"], r["docs"], r["stream"]]) for r in mine}
        exact = [r["exact"] for r in mine if "exact" in r]
        out[case.name] = {"same_stream": len(seen) == 1, "resumes_exact": all(exact) if exact else None}
    return out


def _cell(key: str, v: float) -> str:
    if key == "fill":
        return f"{100 * v:.3f}%"
    if key == "tokens_per_cpu_s":
        return f"{v / 1e6:.2f} M"
    return f"{v:.3f}" if key.endswith("_s") else f"{v:.0f}"


def table(rows: Sequence[dict[str, Any]], verdicts: dict[str, dict[str, Any]]) -> str:
    lines = ["| case | metric | BEFORE | AFTER | AFTER / BEFORE | range over repeats | better |",
             "|---|---|---:|---:|---:|---:|---|"]
    lines += [f"| {r['case']} | {r['label']} | {_cell(r['metric'], r['before'])} | {_cell(r['metric'], r['after'])} | "
              f"{r['ratio']:.3f} | {r['ratio_min']:.3f}–{r['ratio_max']:.3f} | "
              f"{'higher' if r['higher_is_better'] else 'lower'} |" for r in rows]
    exact = {None: "no resume timed", True: "every resume exact", False: "**a resume was not exact**"}
    lines += [""] + [f"- {name}: {'the same stream in every run of both trees' if v['same_stream'] else '**the streams differ**'}"
                     f"; {exact[v['resumes_exact']]}" for name, v in verdicts.items()]
    return "\n".join(lines) + "\n"


def compare(before: str | None, after: str | None, s: Settings, cases: Sequence[Case] = CASES,
            data_dir: str | None = None, echo: bool = True) -> dict[str, Any]:
    """The whole comparison: trees, data, interleaved runs, summary (what ``--json`` writes)."""
    with tempfile.TemporaryDirectory(prefix="bench-trees-") as tmp:
        scratch = Path(tmp)
        trees = (materialize("before", before, scratch), materialize("after", after, scratch))
        data_root = Path(data_dir) if data_dir else scratch / "data"
        data_root.mkdir(parents=True, exist_ok=True)
        data = build_data(data_root, s)
        (scratch / "data.json").write_text(json.dumps(data))
        start = time.perf_counter()
        runs = collect(trees, cases, scratch, s, echo)
        seconds = time.perf_counter() - start
    return {"before": asdict(trees[0]), "after": asdict(trees[1]), "settings": asdict(s), "data": data["describe"],
            "dataset": {"capacity": CAPACITY, "window": WINDOW, "packs_per_batch": PACKS_PER_BATCH,
                        "resume_at_docs": RESUME_AT},
            "machine": f"Python {sys.version.split()[0]}, {os.cpu_count()} cores", "seconds": seconds,
            "rows": summarize(runs, cases), "checks": checks(runs, cases), "runs": runs}


def report(result: dict[str, Any]) -> str:
    b, a, s = result["before"], result["after"], result["settings"]
    return (f"BEFORE {b['rev']} ({b['commit'][:12]}) against AFTER {a['rev']} ({a['commit'][:12]}): "
            f"{s['repeats']} repeats, each tree's runs in fresh processes of {s['passes']} passes, alternating; "
            f"{result['machine']}; {result['seconds']:.0f} s.\nData: {result['data']['text']}; "
            f"{result['data']['pretokenized']}.\n\n" + table(result["rows"], result["checks"]))


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Rows for ``benchmarks/run_all.py``: :data:`BEFORE` against this working tree."""
    s = Settings(repeats=1, passes=1, tokens=2e6, text_docs=400) if quick else Settings()
    result = compare(BEFORE, None, s, echo=False)
    return [{k: r[k] for k in ("case", "metric", "before", "after", "ratio", "ratio_min", "ratio_max")}
            for r in result["rows"]]


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    d = Settings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=BEFORE, help=f"git revision (default {BEFORE})")
    parser.add_argument("--after", default=None, help="git revision (default: this working tree, uncommitted changes included)")
    parser.add_argument("--repeats", type=int, default=d.repeats, help=f"child processes per case and tree (default {d.repeats})")
    parser.add_argument("--passes", type=int, default=d.passes, help=f"epochs / restores per child, best counts (default {d.passes})")
    parser.add_argument("--tokens", type=float, default=d.tokens, help=f"pre-tokenized corpus tokens (default {d.tokens:g})")
    parser.add_argument("--text-docs", type=int, default=d.text_docs, help=f"text documents (default {d.text_docs})")
    parser.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated (default: all)")
    parser.add_argument("--dir", default=None, help="keep the data here and reuse it")
    parser.add_argument("--json", default=None, help="write the summary and every run here")
    parser.add_argument("--out", default=None, help="also write the markdown report here")
    parser.add_argument("--timeout", type=float, default=d.timeout, help="seconds per child process")
    for hidden in ("--child", "--case", "--tree", "--data", "--scratch"):  # a child run's
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        return child_main(args)
    names = [x.strip() for x in args.cases.split(",") if x.strip()]
    unknown = set(names) - {c.name for c in CASES}
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; known: {[c.name for c in CASES]}")
    s = Settings(repeats=args.repeats, passes=args.passes, tokens=args.tokens, text_docs=args.text_docs,
                 timeout=args.timeout)
    result = compare(args.before, args.after, s, [c for c in CASES if c.name in names], args.dir)
    text = report(result)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    # a tree that changes the stream or breaks a resume is a finding, not a measurement
    return 1 if any(not v["same_stream"] or v["resumes_exact"] is False for v in result["checks"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
