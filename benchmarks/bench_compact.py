"""The compact PackedBatch against the tree before it: host bytes a token, layout CPU per batch, derivation cost.

One corpus of generated documents (lognormal lengths, mean 600, clipped to [16, 4096]; ids uniform below 50,000)
is packed greedily into batches of 8 x 4096 tokens. Each tree (this checkout and ``--baseline DIR``, an older
checkout) is measured in its own fresh child process, the children taking turns round by round; every number is
the best of its rounds (CPU time of the child, ``time.process_time``). Per tree:

- bytes a token: the batch's distinct tensor storages (ids, labels and positions where they are stored, the
  int32 offsets, a loss mask) over ``T``: what the loader writes, a worker hands over, ``pin_memory`` copies and
  ``to(device)`` sends;
- layout ms per batch: ``pack_slices`` (documents as int32 slices of the buffers a block reader filled: the
  pre-tokenized tar / parquet path) and ``pack_batch`` (int64 Samples: the tokenized-text path), each also with a
  loss mask on every document (``pack_batch`` only);
- derive ms per batch (this tree): ``labels`` + ``position_ids`` of a fresh batch on the CPU (on a GPU they run
  where the batch is; ``bench_gpu.py`` times them there).

``--workers``: where the CPU of a 2-worker epoch goes (this tree, the tar shards of ``peers/corpus.py`` read by
``PackedDataset`` under ``StatefulDataLoader``): the CPU of the process and its joined workers for an epoch of two
corpus sizes, in-process, with 2 workers, and with 2 workers taking no per-step snapshot
(``snapshot_every_n_steps`` past the epoch); the difference of the two sizes gives the CPU per batch with the fixed
costs (start-up, worker fork, first window) taken out, and of it the training process's own (the rest: the workers).

``--sending``: what of a worker's CPU is the sending (the 16 M-token corpus, one worker, each mode in a fresh
process, the modes taking turns ``--rounds`` times, least CPU kept): the epoch in-process; in a worker that drops
every batch (yielding one ``int`` at the end); in a worker that yields an ``int`` for each batch (torch's worker
loop, queues and feeder thread with nothing to carry); in a worker that yields each batch; and, for what a loader of
streampack's own could save, in a forked process outside torch's DataLoader that drops every batch, sends one byte
for each (a message and a wake-up, nothing carried), copies each one's storages into a shared-memory slot and sends
the slot's reference (the bytes carried, none of the batch's fields), or sends each one in transfer form over a pipe
from its main thread (no index queue, no feeder thread); of the last, the training process's CPU unpickling each
batch as it arrives, against the last one unpickled again 64 times back to back. The worker's CPU is
``RUSAGE_CHILDREN`` once it is joined, the training process's its own. ``--batch-packs`` sets the packs a batch.

``--constants``: where an in-process epoch's CPU goes (this tree, or each of ``--baseline``'s and this one's, taking
turns): the peers' 16 M-token tar corpus, the least CPU of 5 epochs in a row in a fresh process and of ``--rounds``
such processes; the epochs sampled by py-spy (when installed; else timed by cProfile) give each code's share, shown
as µs a batch, µs a document and ns a token of that epoch. (A fit of ``fixed + a x batches + b x documents + c x
tokens`` over five settings that move the counts apart was tried: on the shared 2-core box its misfit was 7-12% and
its token term came out negative, so the split is by code instead.)

    PYTHONPATH=. python benchmarks/bench_compact.py --baseline /path/to/older/checkout --rounds 3
    PYTHONPATH=. python benchmarks/bench_compact.py --workers [--batch-packs 8,32]
    PYTHONPATH=. python benchmarks/bench_compact.py --sending --rounds 5 [--batch-packs 8,32]
    PYTHONPATH=. python benchmarks/bench_compact.py --constants --rounds 3 [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
CAPACITY, PACKS = 4096, 8


def corpus(tokens: int, seed: int = 0) -> tuple[list[list[list[tuple[int, int]]]], np.ndarray]:
    """Batches (lists of packs of documents ``(start, length)`` in one int32 block, greedily filled) and the block."""
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(np.clip(rng.lognormal(np.log(600) - 0.5, 1.0), 16, CAPACITY)))
    block = rng.integers(0, 50_000, sum(lengths)).astype(np.int32)
    packs, room, at = [[]], CAPACITY, 0
    for n in lengths:
        if n > room:
            packs.append([])
            room = CAPACITY
        packs[-1].append((at, n))
        room -= n
        at += n
    batches = [packs[i:i + PACKS] for i in range(0, len(packs) - PACKS + 1, PACKS)]
    return batches, block


def _storage_bytes(batch: Any) -> int:
    import torch

    seen: dict[int, int] = {}
    tensors = [getattr(batch, f) for f in batch.__dataclass_fields__]
    tensors += list(batch.extras.values())
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _best(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def child(tokens: int, repeats: int) -> dict[str, Any]:
    """This process's tree: its numbers over the corpus's batches."""
    from streampack.layout.batch import pack_batch
    from streampack.layout.slices import pack_slices
    from streampack.sample import Sample

    batches, block = corpus(tokens)
    slices = []
    for packs in batches:
        docs = [d for p in packs for d in p]
        slices.append(([block] * len(docs), np.array([a for a, _ in docs]), np.array([n for _, n in docs]),
                       [len(p) for p in packs], tuple(f"k{i}" for i in range(len(docs)))))
    samples = [[[Sample(key=f"k{i}", url="/d/s.tar", tokens=block[a:a + n].astype(np.int64))
                 for i, (a, n) in enumerate(p)] for p in packs] for packs in batches]
    rng = np.random.default_rng(1)
    masked = [[[s.evolve(loss_mask=rng.random(len(s)) < 0.8) for s in p] for p in packs] for packs in samples]
    n = len(batches)

    def run_slices() -> None:
        for a in slices:
            pack_slices(*a, capacity=CAPACITY, ids_nonnegative=True)

    def run_samples(which: list) -> Any:
        return lambda: [pack_batch(packs, capacity=CAPACITY) for packs in which]

    out: dict[str, Any] = {"batches": n, "tokens_per_batch": PACKS * CAPACITY}
    one = pack_slices(*slices[0], capacity=CAPACITY, ids_nonnegative=True)
    out["bytes_per_token"] = _storage_bytes(one) / one.total_tokens
    masked_one = pack_batch(masked[0], capacity=CAPACITY)
    out["bytes_per_token_mask"] = _storage_bytes(masked_one) / masked_one.total_tokens
    out["pack_slices_ms"] = 1e3 * _best(run_slices, repeats) / n
    out["pack_batch_ms"] = 1e3 * _best(run_samples(samples), repeats) / n
    out["pack_batch_mask_ms"] = 1e3 * _best(run_samples(masked), repeats) / n
    built = [pack_slices(*a, capacity=CAPACITY, ids_nonnegative=True) for a in slices]
    if not hasattr(type(built[0]), "_derive"):  # a tree that stores labels and positions
        out["derive_ms"] = 0.0
    else:
        from streampack.layout.derive import derive

        def run_derive() -> None:
            for b in built:
                derive(b.input_ids, b.cu_seqlens, b.cu_seqlens_padded, b.loss_mask, b.target_ids, b.ignore_index)

        run_derive()  # torch's first calls of each op set up kernels: not a per-batch cost
        out["derive_ms"] = 1e3 * _best(run_derive, repeats) / n
    return out


def child_epoch(tokens: int, workers: int, snapshot_every: int, directory: str, mean: float = 600.0,
                packs_per_batch: int = 0, profile: bool = False, repeats: int = 1,
                loader: str = "StatefulDataLoader") -> dict[str, Any]:
    """One epoch of the peers' tar corpus in this fresh process: CPU of the process and its joined workers
    (``packs_per_batch`` 0: the peers' 8; ``profile``: also each code's share of the epoch under cProfile;
    ``repeats``: the least CPU of that many epochs in a row; ``loader``: ``StatefulDataLoader`` or
    ``PackedLoader``)."""
    import gc
    import resource

    sys.path.insert(0, str(HERE))
    from peers.corpus import Corpus, CorpusSpec
    from peers.streampack_peer import PACKS_PER_BATCH, StreampackPeer
    from torchdata.stateful_dataloader import StatefulDataLoader

    from streampack import PackedDataset, PackedLoader
    from streampack.options import PackOptions

    make = {"StatefulDataLoader": StatefulDataLoader, "PackedLoader": PackedLoader}[loader]

    def cpu() -> float:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    def own() -> float:
        return time.process_time()

    peer = StreampackPeer(capacity=CAPACITY)
    peer.prepare(Corpus(CorpusSpec(tokens=tokens, mean=mean), directory))
    gc.collect()

    def epoch() -> dict[str, Any]:
        start, start_own = cpu(), own()
        ds = PackedDataset(peer.urls, capacity=CAPACITY, epochs=1, seed=0,
                           packs_per_batch=packs_per_batch or PACKS_PER_BATCH, packing=PackOptions(window=peer.window))
        kw = {"prefetch_factor": 8, "snapshot_every_n_steps": snapshot_every} if workers else {}
        real = batches = docs = 0
        for batch in make(ds, batch_size=None, num_workers=workers, **kw):
            real += batch.num_tokens
            batches += 1
            docs += batch.num_docs
        # workers joined by now; "main": this process alone (the training process)
        return {"cpu": cpu() - start, "main": own() - start_own, "tokens": real, "batches": batches, "docs": docs}

    if not profile:
        runs = [epoch() for _ in range(max(repeats, 1))]
        return {**min(runs, key=lambda r: r["cpu"]), **(_reading(peer.urls) if repeats > 1 else {})}
    import cProfile
    import pstats

    epoch()  # the first epoch pays the imports and the first calls: not a share of an epoch
    prof = cProfile.Profile()
    prof.enable()
    out = epoch()
    prof.disable()
    return {**out, "shares": _shares(pstats.Stats(prof))}


def _reading(urls: list[str]) -> dict[str, float]:
    """The parts of reading a tar shard as blocks, each timed alone over every shard (least of 5 passes): the read
    from the page cache into a reused buffer (ns a token), the id check (ns a token), and the whole parse with its
    checks (``parse_tar``, µs a document)."""
    from streampack.io.decode import DecodeOptions
    from streampack.io.tar_block import parse_tar
    from streampack.io.tar_columns import ids_in_range

    data = [Path(u).read_bytes() for u in urls]
    spare = bytearray(max(len(d) for d in data))
    decode = DecodeOptions()
    blocks = [parse_tar(d, base=0, first=0, end=None, final=True, url=u, decode=decode)[0] for d, u in zip(data, urls)]
    tokens = sum(int(b.lengths.sum()) for b in blocks)
    docs = sum(len(b) for b in blocks)

    def read() -> None:
        for u in urls:
            with open(u, "rb") as f:
                f.readinto(spare)

    def check() -> None:
        for b in blocks:
            ids_in_range(b.tokens, b.starts, b.lengths, 50_000)

    def parse() -> None:
        for d, u in zip(data, urls):
            parse_tar(d, base=0, first=0, end=None, final=True, url=u, decode=decode)

    return {"read_ns_token": 1e9 * _best(read, 5) / tokens, "check_ns_token": 1e9 * _best(check, 5) / tokens,
            "parse_us_doc": 1e6 * _best(parse, 5) / docs}


CODE = {  # the code each share is, by the streampack file the time is spent in
    "reading the tar blocks (io/, nodes/block_reader.py: read, header walk, column checks, keys)": (
        "streampack/io/", "streampack/nodes/block_reader.py"),
    "the documents' rows and the window packer's rounds (plan/rows.py, nodes/window_packer.py, packing/)": (
        "streampack/packing/", "streampack/nodes/window_packer.py", "streampack/plan/", "streampack/nodes/overlong.py"),
    "the layout (layout/)": ("streampack/layout/",),
    "the collate and its per-batch stats (nodes/collate.py, logs.py)": ("streampack/nodes/collate.py",
                                                                       "streampack/logs.py"),
}


def _code(path: str) -> str:
    return next((k for k, parts in CODE.items() if any(part in path for part in parts)), REST)


REST = "the DataLoader, torch and the rest"


def _shares(stats: Any) -> dict[str, float]:
    """cProfile's view: each code's own time (``tottime``) over the epoch; numpy, torch and builtins count for the
    streampack file that called them (through their heaviest caller)."""
    table = stats.stats

    def home(func: tuple, seen: frozenset = frozenset()) -> str:
        if "streampack/" in func[0] or func in seen:
            return func[0]
        callers = table[func][4] if func in table else {}
        if not callers:
            return func[0]
        heaviest = max(callers, key=lambda c: callers[c][3])  # the caller that spent the most time in it
        return home(heaviest, seen | {func})

    own = dict.fromkeys([*CODE, REST], 0.0)
    for func, (_, _, tottime, _, _) in table.items():
        own[_code(home(func))] += tottime
    total = sum(own.values())
    return {k: v / total for k, v in own.items()}


def _sampled_shares(root: str, directory: str) -> dict[str, float] | None:
    """py-spy's view (when it is installed): samples of the reference epochs, each counted for the innermost
    streampack file on its stack. cProfile's per-call overhead inflates the many small calls of reading and packing
    against the layout's few large ones; sampling does not."""
    spy = shutil.which("py-spy")
    if spy is None:
        return None
    tokens, mean, ppb = REFERENCE
    with tempfile.NamedTemporaryFile(suffix=".txt") as raw:
        cmd = [spy, "record", "-r", "1000", "-f", "raw", "-o", raw.name, "--", sys.executable,
               str(Path(__file__).resolve()), "--child-epoch", str(tokens), "0", "1", directory, "--mean", str(mean),
               "--packs-per-batch", str(ppb), "--epochs", "3"]
        if subprocess.run(cmd, capture_output=True, env={**os.environ, "PYTHONPATH": root}).returncode:
            return None
        counts = dict.fromkeys([*CODE, REST], 0)
        for line in Path(raw.name).read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            frames = stack.split(";")
            if not any("child_epoch.<locals>.epoch (" in f for f in frames):
                continue
            inner = next((f for f in reversed(frames) if "streampack/" in f), "")
            counts[_code(inner)] += int(n)
    total = sum(counts.values()) or 1
    return {k: v / total for k, v in counts.items()}


REFERENCE = (16_000_000, 600.0, 8)
"""The epoch whose CPU is split: tokens, mean document length, packs per batch (the peers' corpus and batches)."""
REPEATS = 5
"""Epochs in a row in each child, the least CPU kept: within one process the spread is a few percent, across
fresh processes on a shared box far more."""


def constants(trees: dict[str, str], rounds: int, directory: str) -> dict[str, dict[str, Any]]:
    """Per tree: the least CPU of ``rounds`` fresh processes' reference epochs (each the least of :data:`REPEATS`),
    and each code's share of it."""
    best: dict[str, dict[str, Any]] = {}
    for r in range(rounds):
        for tree, root in (list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]):
            got = _epoch_child(root, *REFERENCE, directory)
            if tree not in best or got["cpu"] < best[tree]["cpu"]:
                best[tree] = got
    out = {}
    for tree, root in trees.items():
        shares = _sampled_shares(root, directory)
        out[tree] = {**best[tree], "sampled": shares is not None,
                     "shares": shares or _epoch_child(root, *REFERENCE, directory, profile=True)["shares"]}
    return out


def _epoch_child(root: str, tokens: int, mean: float, ppb: int, directory: str, profile: bool = False) -> dict:
    return _child(root, "--child-epoch", tokens, 0, 1, directory, "--mean", mean, "--packs-per-batch", ppb,
                  "--epochs", REPEATS, *(["--profile"] if profile else []))


def constants_table(out: dict[str, dict[str, Any]]) -> str:
    """Each code's CPU in a batch and per document of the reference epoch (its share of the epoch's CPU)."""
    names = list(out)
    ref = out[names[0]]
    how = ("py-spy samples, each counted for the innermost streampack file on its stack" if ref["sampled"]
           else "own time under cProfile, which inflates the many small calls")
    lines = [f"reference epoch: {ref['tokens']:,} tokens, {ref['docs']:,} documents, {ref['batches']} batches of "
             f"{REFERENCE[2]} x {CAPACITY}; least CPU of {REPEATS} epochs a process; shares from {how}\n",
             "| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    lines.append("| tokens / CPU-s | " + " | ".join(f"{o['tokens'] / o['cpu'] / 1e6:.1f} M" for o in out.values()) + " |")
    lines.append("| µs a batch, all | " + " | ".join(f"{1e6 * o['cpu'] / o['batches']:.0f}" for o in out.values())
                 + " |")
    lines.append("| of reading, alone: the read into a reused buffer / the id check / the whole parse | " + " | ".join(
        f"{o['read_ns_token']:.2f} ns / {o['check_ns_token']:.2f} ns a token, {o['parse_us_doc']:.2f} µs a document"
        for o in out.values()) + " |")
    for code in ref["shares"]:
        cells = [f"{100 * o['shares'][code]:.0f}%: {1e6 * o['shares'][code] * o['cpu'] / o['batches']:.0f} µs a batch, "
                 f"{1e6 * o['shares'][code] * o['cpu'] / o['docs']:.2f} a document, "
                 f"{1e9 * o['shares'][code] * o['cpu'] / o['tokens']:.2f} ns a token" for o in out.values()]
        lines.append(f"| {code} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def workers_breakdown(sizes: tuple[int, int], rounds: int, directory: str, packs: tuple[int, ...] = (PACKS,)) -> str:
    cases = {"in-process": (0, 1, "StatefulDataLoader"), "2 workers": (2, 1, "StatefulDataLoader"),
             "2 workers, no per-step snapshot": (2, 1 << 40, "StatefulDataLoader"),
             "PackedLoader, 2 workers": (2, 1, "PackedLoader"),
             "PackedLoader, 2 workers, no per-step snapshot": (2, 1 << 40, "PackedLoader")}
    best: dict[tuple[str, int, int], dict[str, Any]] = {}
    for _ in range(rounds):
        for ppb in packs:
            for name, (workers, every, loader) in cases.items():
                for tokens in sizes:
                    got = _child(str(HERE.parent), "--child-epoch", tokens, workers, every, directory,
                                 "--packs-per-batch", ppb, "--loader", loader)
                    if (name, ppb, tokens) not in best or got["cpu"] < best[name, ppb, tokens]["cpu"]:
                        best[name, ppb, tokens] = got
    small, large = sizes
    lines = ["| tokens a batch | epoch | CPU-s, small | CPU-s, large | tokens / CPU-s, large | marginal ms a batch | "
             "of which the training process | marginal CPU a token / in-process |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for ppb in packs:
        marginal = {}
        for name in cases:
            a, b = best[name, ppb, small], best[name, ppb, large]
            marginal[name] = (b["cpu"] - a["cpu"]) / (b["tokens"] - a["tokens"])
            per_batch = 1e3 * (b["cpu"] - a["cpu"]) / (b["batches"] - a["batches"])
            main = 1e3 * (b["main"] - a["main"]) / (b["batches"] - a["batches"])
            lines.append(f"| {ppb * CAPACITY:,} | {name} | {a['cpu']:.3f} | {b['cpu']:.3f} | "
                         f"{b['tokens'] / b['cpu'] / 1e6:.1f} M | {per_batch:.3f} | {main:.3f} | "
                         f"{marginal[name] / marginal['in-process']:.2f}× |")
    return "\n".join(lines)


SENDING = {"in-process": "the epoch in the training process",
           "worker, nothing sent": "a worker drops every batch",
           "worker, an int a batch": "a worker yields an int for each batch",
           "worker, the batches": "a worker yields each batch",
           "own process, nothing sent": "a forked process, no DataLoader, drops every batch",
           "own process, a byte a batch": "a forked process sends one byte for each batch (a message and a wake-up)",
           "own process, the slots": "a forked process copies each batch's storages into a slot and sends the slot's "
                                     "reference (the batch's bytes carried, none of its fields)",
           "own process, the batches": "a forked process sends each batch over a pipe from its main thread",
           "PackedLoader": "PackedLoader's worker sends each batch (the loader the integrations build)"}


WARM_LOADS = 64
"""Times the last message is unpickled again, back to back, for the warm cost of a batch's unpickling."""


def _own_process(dataset: Any, send: str, conn: Any) -> None:
    """A worker outside torch's DataLoader: for each batch of ``dataset``, the batch in transfer form
    (``ForkingPickler``, as torch's queue pickles it; ``send`` "batches"), the reference of a slot its storages were
    copied into ("slots"), one byte ("byte") or nothing written to ``conn`` by this thread, then an empty message; it
    exits once the training process has answered, so the slots it sent stay readable until then."""
    import dataclasses
    from multiprocessing.reduction import ForkingPickler

    import torch

    from streampack.layout import transfer

    for batch in dataset:
        if send == "batches":
            conn.send_bytes(ForkingPickler.dumps(batch))
        elif send == "byte":
            conn.send_bytes(b"\x01")
        elif send == "slots":
            tensors = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors
                        if isinstance(t, torch.Tensor)}
            slot, _ = transfer._into_slot(list(storages.values()))
            conn.send_bytes(ForkingPickler.dumps(slot))
    conn.send_bytes(b"")
    conn.recv_bytes()


def child_sending(mode: str, tokens: int, directory: str, packs_per_batch: int = PACKS) -> dict[str, Any]:
    """One epoch of the peers' tar corpus in this fresh process as ``mode`` (a key of :data:`SENDING`) runs it."""
    import gc
    import resource

    from torch.utils.data import IterableDataset

    sys.path.insert(0, str(HERE))
    from peers.corpus import Corpus, CorpusSpec
    from peers.streampack_peer import StreampackPeer
    from torchdata.stateful_dataloader import StatefulDataLoader

    from streampack import PackedDataset, PackedLoader
    from streampack.layout import shm_receive
    from streampack.options import PackOptions

    class Yields(IterableDataset):
        def __init__(self, dataset: Any, what: str) -> None:
            self.dataset, self.what = dataset, what

        def __iter__(self) -> Any:
            for i, batch in enumerate(self.dataset):
                if self.what == "worker, the batches":
                    yield batch
                elif self.what == "worker, an int a batch":
                    yield i
            yield -1

    peer = StreampackPeer(capacity=CAPACITY)
    peer.prepare(Corpus(CorpusSpec(tokens=tokens), directory))
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF)
    ds = PackedDataset(peer.urls, capacity=CAPACITY, epochs=1, seed=0, packs_per_batch=packs_per_batch,
                       packing=PackOptions(window=peer.window))
    items = 0
    loads = {"arriving": 0.0, "warm": 0.0}  # seconds a batch's unpickling, as it arrives and warm
    warm_cpu = 0.0  # the warm unpickling's CPU: a measurement, not the epoch's
    if mode == "in-process":
        for _ in ds:
            items += 1
    elif mode == "PackedLoader":
        loader = PackedLoader(ds, num_workers=1, snapshot_every_n_steps=1 << 40)
        for _ in loader:
            items += 1
        items += 1  # the end, as the DataLoader modes count their last item
        del loader
    elif mode.startswith("own process"):
        import multiprocessing
        from multiprocessing.reduction import ForkingPickler

        context = multiprocessing.get_context("fork")
        here, there = context.Pipe()
        send = {"own process, the batches": "batches", "own process, a byte a batch": "byte",
                "own process, the slots": "slots"}.get(mode, "")
        worker = context.Process(target=_own_process, args=(ds, send, there))
        worker.start()
        there.close()
        last = b""
        try:
            while data := here.recv_bytes():
                if send == "batches":
                    started = time.thread_time()
                    ForkingPickler.loads(data)
                    loads["arriving"] += time.thread_time() - started
                    last = data
                elif send == "slots":
                    shm_receive.attach(ForkingPickler.loads(data))  # mapped, then freed: the slot goes back
                items += 1
            if last:  # the last batch again, back to back (its slot is the worker's until it exits)
                loads["arriving"] /= items
                started = time.thread_time()
                for _ in range(WARM_LOADS):
                    ForkingPickler.loads(last)
                warm_cpu = time.thread_time() - started
                loads["warm"] = warm_cpu / WARM_LOADS
        finally:
            here.send_bytes(b"")
        worker.join()
        items += 1  # the end, as the DataLoader modes count their last item
    else:
        loader = StatefulDataLoader(Yields(ds, mode), batch_size=None, num_workers=1, snapshot_every_n_steps=1 << 40)
        for _ in loader:
            items += 1
        del loader
        gc.collect()  # joins the worker: its CPU lands in RUSAGE_CHILDREN
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    main = me.ru_utime + me.ru_stime - before.ru_utime - before.ru_stime
    return {"main": main - warm_cpu, "worker": kids.ru_utime + kids.ru_stime, "items": items,
            "loads_arriving": loads["arriving"], "loads_warm": loads["warm"]}


def sending_breakdown(tokens: int, rounds: int, directory: str, packs_per_batch: int) -> str:
    best: dict[str, dict[str, Any]] = {}
    for _ in range(rounds):
        for mode in SENDING:
            got = _child(str(HERE.parent), "--child-sending", mode, tokens, directory, packs_per_batch)
            if mode not in best or got["main"] + got["worker"] < best[mode]["main"] + best[mode]["worker"]:
                best[mode] = got
    batches = best["in-process"]["items"]
    lines = ["| epoch | CPU-s, the worker | CPU-s, the training process | ms a batch, all | against in-process | "
             "ms a batch over its process dropping them |",
             "|---|---:|---:|---:|---:|---:|"]
    base = best["in-process"]["main"]

    def cpu(mode: str) -> float:
        return best[mode]["main"] + best[mode]["worker"]

    for mode, what in SENDING.items():
        b = best[mode]
        dropping = {"worker": "worker, nothing sent", "own process": "own process, nothing sent",
                    "PackedLoader": "own process, nothing sent"}.get(mode.split(",")[0])
        over = "—" if dropping in (None, mode) else f"{1e3 * (cpu(mode) - cpu(dropping)) / batches:.3f}"
        lines.append(f"| {what} | {b['worker']:.3f} | {b['main']:.3f} | {1e3 * cpu(mode) / batches:.3f} | "
                     f"{cpu(mode) / base:.2f}× | {over} |")
    sent = best["own process, the batches"]
    lines.append(f"\nUnpickling a batch in the training process (\"own process, the batches\", CPU of its thread): "
                 f"{1e6 * sent['loads_arriving']:.1f} µs as each arrives from the worker, "
                 f"{1e6 * sent['loads_warm']:.1f} µs for the last one again, {WARM_LOADS} times back to back.")
    return "\n".join(lines)


def _spawn(root: str, tokens: int, repeats: int) -> dict[str, Any]:
    return _child(root, "--child", "--tokens", tokens, "--repeats", repeats, cwd=root, OMP_NUM_THREADS="1")


def _child(root: str, *args: Any, cwd: str | None = None, **env: str) -> dict[str, Any]:
    """This script run with ``args`` in a fresh process that imports streampack from ``root``: the JSON record its
    last line prints."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *map(str, args)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=cwd,
                         env={**os.environ, "PYTHONPATH": root, **env})
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(baseline: str | None, tokens: int, rounds: int, repeats: int) -> dict[str, dict[str, Any]]:
    trees = {"this tree": str(HERE.parent)} | ({"baseline": baseline} if baseline else {})
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for r in range(rounds):
        order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
        for name, root in order:
            runs[name].append(_spawn(root, tokens, repeats))
    best = {}
    for name, rows in runs.items():
        keys = rows[0].keys()
        best[name] = {k: (min(r[k] for r in rows) if k.endswith("_ms") else rows[0][k]) for k in keys}
    return best


def table(best: dict[str, dict[str, Any]]) -> str:
    names = list(best)
    lines = ["| | " + " | ".join(names) + (" | this / baseline |" if len(names) == 2 else " |"),
             "|---|" + "---:|" * (len(names) + (len(names) == 2))]
    labels = {"bytes_per_token": "host bytes a token", "bytes_per_token_mask": "host bytes a token, with a loss mask",
              "pack_slices_ms": "pack_slices, ms a batch (blocks)", "pack_batch_ms": "pack_batch, ms a batch (Samples)",
              "pack_batch_mask_ms": "pack_batch with loss masks, ms a batch",
              "derive_ms": "derive labels + positions on the CPU, ms a batch"}
    for key, label in labels.items():
        vals = [best[n][key] for n in names]
        cells = [f"{v:.3f}" if key.endswith("_ms") else f"{v:.2f}" for v in vals]
        ratio = f" | {vals[0] / vals[1]:.2f}" if len(vals) == 2 and vals[1] else (" | —" if len(vals) == 2 else "")
        lines.append(f"| {label} | " + " | ".join(cells) + ratio + " |")
    return "\n".join(lines)


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Rows for ``benchmarks/run_all.py`` (this tree only)."""
    return [{"tree": "this", **child(300_000 if quick else 2_000_000, 2 if quick else 3)}]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=None, help="an older checkout, measured interleaved")
    parser.add_argument("--tokens", type=int, default=2_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="passes over the batches in each child (best kept)")
    parser.add_argument("--workers", action="store_true", help="where the CPU of a 2-worker epoch goes")
    parser.add_argument("--sizes", default="4e6,16e6", help="with --workers: the two corpus sizes, tokens")
    parser.add_argument("--batch-packs", default=str(PACKS),
                        help="with --workers: packs of 4,096 tokens a batch, one or more (8,32: 32 k and 128 k tokens)")
    parser.add_argument("--dir", default=None, help="with --workers: keep the written corpora here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--constants", action="store_true", help="µs a batch, a document and a token, in-process")
    parser.add_argument("--sending", action="store_true", help="what of a worker's CPU is the sending")
    parser.add_argument("--child-sending", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--child-epoch", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--mean", type=float, default=600.0, help=argparse.SUPPRESS)
    parser.add_argument("--packs-per-batch", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--loader", default="StatefulDataLoader", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.tokens, args.repeats)))
        return 0
    if args.child_epoch:
        tokens, workers, every, directory = args.child_epoch
        print(json.dumps(child_epoch(int(tokens), int(workers), int(every), directory, args.mean, args.packs_per_batch,
                                     args.profile, args.epochs, args.loader)))
        return 0
    if args.constants:
        trees = {"this tree": str(HERE.parent)} | ({"baseline": args.baseline} if args.baseline else {})
        with tempfile.TemporaryDirectory() as tmp:
            print(constants_table(constants(trees, args.rounds, args.dir or tmp)))
        return 0
    if args.child_sending:
        mode, tokens, directory, packs_per_batch = args.child_sending
        print(json.dumps(child_sending(mode, int(tokens), directory, int(packs_per_batch))))
        return 0
    if args.sending:
        with tempfile.TemporaryDirectory() as tmp:
            for packs in (int(x) for x in args.batch_packs.split(",")):
                print(f"{packs * CAPACITY:,} tokens a batch\n")
                print(sending_breakdown(16_000_000, args.rounds, args.dir or tmp, packs), end="\n\n")
        return 0
    if args.workers:
        small, large = (int(float(x)) for x in args.sizes.split(","))
        with tempfile.TemporaryDirectory() as tmp:
            packs = tuple(int(x) for x in args.batch_packs.split(","))
            print(workers_breakdown((small, large), args.rounds, args.dir or tmp, packs))
        return 0
    best = compare(args.baseline, args.tokens, args.rounds, args.repeats)
    print(f"{best[next(iter(best))]['batches']} batches of {PACKS} x {CAPACITY} tokens, best of {args.rounds} "
          f"interleaved rounds x {args.repeats} passes, CPU time\n")
    print(table(best))
    return 0


if __name__ == "__main__":
    sys.exit(main())
