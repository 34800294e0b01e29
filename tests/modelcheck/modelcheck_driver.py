"""Model checker: random schedules over the public API, checked against ``modelcheck_model``.

A schedule (one per seed) writes a tiny corpus (tar / jsonl / jsonl.zst / parquet shards of
token id lists, some records empty, corrupt or over a limit), served from disk or over a faulty
loopback HTTP server, and opens ``dp_size`` ranks x ``num_workers`` workers simulated in one
process (``topology_sim.SimRank``). Its steps: take k batches from every rank; save every
reader's state and resume on the same or another topology (elastic: each new reader loads the
list of all states), possibly after a shard is rewritten, truncated or re-staged (same bytes,
new mtime). At the end every rank runs to the end of its finite epochs, and what was trained
is compared with the model. A step may end in a *named refusal* (a ValueError naming the
changed shard: the shard is put back and the run resumes from the same save to the end; or with
``on_error="raise"`` a DataError naming a bad record: the run stops); anything else that differs
is a :class:`Finding`. A failing seed is shrunk (:func:`shrink`, delta debugging over
``modelcheck_schedule.smaller``) and printed as readable steps with a command to rerun it::

    PYTHONPATH=. python tests/modelcheck/modelcheck_driver.py SEED [--slow]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers, also when run as a script

from helpers_faults import Fault, serve_faulty  # noqa: E402
from modelcheck_corpus import (
    Change,
    apply_change,
    change_versions,
    dataset_options,
    fast_retries,
    restore,
    served_manifest,
    shard_name,
    write_shard,
)
from modelcheck_model import (
    Shard,
    Trained,
    batch_epoch,
    batch_problems,
    changed_shard_problems,
    compare,
    expected_units,
    named_refusal,
    unequal_counts,
    unequal_epochs,
)
from modelcheck_schedule import Schedule, Step, corpus_records, schedule_for, shrink
from topology_sim import SimRank

from streampack import PackedDataset
from streampack.errors import DataError
from streampack.nodes.window_packer import WindowPacker
from streampack.options import TopologyOptions
from streampack.plan.cursor import Split
from streampack.plan.elastic import find_state
from streampack.plan.state import table_size

COVERAGE: Counter = Counter()
"""What the schedules checked so far exercised (``test_model_check`` asserts it is not vacuous)."""


class Finding(AssertionError):
    """A difference from the model (``kind`` groups findings while shrinking)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"[{kind}] {message}")
        self.kind, self.message = kind, message


class Execution:
    """One run of a schedule: the readers, what they trained, and the change to undo."""

    def __init__(self, s: Schedule, directory: str, base_url: str | None, queue: Callable[[tuple[str, ...]], None]):
        self.s, self.queue = s, queue
        records = corpus_records(s.corpus, s.setup.capacity)
        self.paths = [os.path.join(directory, shard_name(i, s.corpus.fmt)) for i in range(len(records))]
        for path, recs in zip(self.paths, records):
            write_shard(path, recs, s.corpus.fmt)
        urls = [p if base_url is None else f"{base_url}/{os.path.basename(p)}" for p in self.paths]
        self.shards = [Shard(url=u, records=tuple(r)) for u, r in zip(urls, records)]
        self.expected = expected_units(self.shards, epochs=range(s.setup.epochs), capacity=s.setup.capacity)
        self.options = dataset_options(s.setup)
        self.trained, self.snapshot = Trained(), Trained()
        self.change: Change | None = None
        self.resumes, self.changed_at = 0, 0
        """Resumes so far, and the one the change was made before: a refusal at a later resume comes
        from states saved over the changed bytes (a change an earlier resume accepted)."""
        self.saved: list[dict[str, Any]] | None = None
        self.topology, self.moved = (s.dp_size, s.num_workers), False
        self.ranks: list[SimRank] = []
        self.at = "the start"
        self.labels: list[list[int | None]] = [[] for _ in range(s.dp_size)] if s.num_workers <= 1 else []
        """Each rank's batches' epochs while the topology never changed and had <= 1 worker per rank."""

    def open(self, dp: int, nw: int, states: list | None, *, elastic: bool) -> list[SimRank]:
        urls, readers = [sh.url for sh in self.shards], max(nw, 1)

        def make(r: int) -> PackedDataset:
            topology = TopologyOptions(dp_rank=r, dp_size=dp, equal_batches="count")  # ranks of one process: no store
            return PackedDataset(urls, topology=topology, **self.options)

        def load(r: int) -> Any:
            return states if states is None or elastic else (lambda w: states[r * readers + w])

        return [SimRank(lambda r=r: make(r), nw, load=load(r)) for r in range(dp)]

    def sink(self, batch: Any, rank: int) -> None:
        if self.labels:
            self.labels[rank].append(batch_epoch(batch))
        problems = batch_problems(batch, capacity=self.s.setup.capacity, packs_per_batch=self.s.setup.packs_per_batch)
        if problems:
            raise Finding("batch-contract", "; ".join(problems))
        self.trained.add(batch)

    def take(self, k: int) -> None:
        for _ in range(k):
            got = [next(rk, None) for rk in self.ranks]
            if any(b is None for b in got):
                if not all(b is None for b in got):
                    raise Finding("unequal-batches", f"some ranks ended, others did not: {[b is None for b in got]}")
                return
            for r, b in enumerate(got):
                self.sink(b, r)

    def drain(self) -> None:
        counts = []
        for r, rk in enumerate(self.ranks):
            counts.append(0)
            for b in rk:
                self.sink(b, r)
                counts[-1] += 1
        if (problem := unequal_counts(counts)) is not None:
            raise Finding("unequal-batches", f"{problem} at the end of the run on {self.topology}")
        if (problem := unequal_epochs(self.labels)) is not None:
            raise Finding("unequal-batches", problem)

    def resume(self, step: Step) -> None:
        self.saved = [st for rk in self.ranks for st in rk.states()]
        note_save(self.saved, step, (step.dp_size, step.num_workers) != self.topology)
        self.snapshot = self.trained.copy()
        if step.change:
            self.change = apply_change(step.change, step.shard, self.paths[step.shard], self.shards, self.s.corpus.fmt)
            self.changed_at = self.resumes + 1
        self.queue(step.faults)
        self.moved |= (step.dp_size, step.num_workers) != self.topology
        if self.moved or step.num_workers > 1:
            self.labels = []
        self.topology = (step.dp_size, step.num_workers)
        self.resumes += 1
        self.ranks = self.open(step.dp_size, step.num_workers, self.saved, elastic=step.elastic)

    def redo_after_refusal(self) -> None:
        """Put the refused shard back and resume again from the same saved states. When those
        states were saved over the changed bytes (an earlier resume accepted the change), the
        shard is still judged as changed: its epochs may each hold either version, never a splice."""
        assert self.change is not None and self.saved is not None
        restore(self.change)
        self.trained, self.labels = self.snapshot.copy(), []
        if self.changed_at == self.resumes:
            self.change = None
        self.ranks = self.open(*self.topology, self.saved, elastic=True)

    def explain(self, exc: BaseException) -> str:
        """'refused' (undo the change and resume again), 'stopped' (on_error='raise'), or a Finding."""
        bad = {(sh.url, r.key) for sh in self.shards for r in sh.records if r.bad}
        if self.s.setup.on_error == "raise" and isinstance(exc, DataError) and (exc.url, exc.key) in bad:
            COVERAGE["DataErrors naming a bad record (on_error='raise')"] += 1
            return "stopped"
        if self.change is not None and named_refusal(exc, [self.shards[self.change.index].url]):
            if self.change.kind == "restage" and not self.s.setup.http:
                raise Finding("refused-restage", f"refused a re-staged shard with the same bytes: {exc}")
            said_changed = "changed since" in str(exc)  # else: its new bytes cannot be planned (corrupt, no lengths)
            if said_changed and not (isinstance(exc, DataError) and exc.reason == "shard_changed" and " -> " in str(exc)):
                raise Finding("unclear-refusal", f"a {self.change.kind} shard was refused, but not with a "
                              f"DataError('shard_changed') naming its old and new identity: {type(exc).__name__}: {exc}")
            COVERAGE[f"named refusals of a {self.change.kind} shard"] += 1
            return "refused"
        where = traceback.extract_tb(exc.__traceback__)[-1]
        at = f"{os.path.basename(where.filename)}:{where.lineno}"
        raise Finding(f"crash at {at}", f"during {self.at}: {type(exc).__name__}: {exc}")

    def check_end(self, complete: bool) -> None:
        changed = "" if self.change is None else self.shards[self.change.index].url
        diff = compare(self.expected, self.trained, complete=complete, changed=changed)
        if not diff.ok:
            raise Finding(f"exactly-once: {diff.worst}", diff.describe())
        if self.change is not None and complete:
            versions = change_versions(self.change, self.shards[self.change.index], epochs=self.s.setup.epochs,
                                       capacity=self.s.setup.capacity)
            problems = changed_shard_problems(self.trained, changed, versions, range(self.s.setup.epochs))
            if problems:
                raise Finding("silent-change", f"{self.change.kind} of shard {self.change.index} was not refused, "
                              f"and " + "; ".join(problems))
        if complete and self.s.setup.on_error == "skip" and not self.moved and self.change is None:
            self.check_skipped()

    def check_skipped(self) -> None:
        """Skipped samples are exactly the bad ones, counted once per epoch they were read in."""
        want = sum(r.bad != "" for sh in self.shards for r in sh.records) * self.s.setup.epochs
        got = sum(ds.metrics().get("errors", {}).get("total", 0) for rk in self.ranks for ds in rk.readers)
        COVERAGE["skip counts checked"] += want > 0
        if got != want:
            raise Finding("skip-count", f"the readers counted {got} skipped samples, the corpus has {want} bad reads")


def note_save(states: list[dict[str, Any]], step: Step, moved: bool) -> None:
    """Count what a save point holds (split documents pending, samples in windows, epochs)."""
    graphs = [st["graph"] for st in states if st["graph"] is not None]
    overlong = [find_state(g, "OverlongNode") for g in graphs]
    packers = [find_state(g, "WindowPacker") for g in graphs]
    COVERAGE["saves"] += 1
    COVERAGE["saves mid split document"] += any(o is not None and Split.from_state(o["pending"]) is not None
                                                for o in overlong)
    COVERAGE["saves with samples in packer windows"] += any(
        p is not None and table_size(WindowPacker.undelivered(p).carry) > 0 for p in packers)
    COVERAGE["saves with readers in different epochs"] += len({int(g["epoch"]) for g in graphs if "epoch" in g}) > 1
    COVERAGE["elastic resumes onto another topology"] += moved
    if step.change:
        COVERAGE[f"changes: {step.change}"] += 1


def execute(s: Schedule, directory: str, base_url: str | None = None,
            queue: Callable[[tuple[str, ...]], None] = lambda faults: None) -> None:
    """Run ``s``; raise a Finding where it differs from the model."""
    run = Execution(s, directory, base_url, queue)
    if base_url is not None:
        manifest = served_manifest([sh.url for sh in run.shards], directory, run.options)
        run.options["read"] = dataclasses.replace(run.options["read"], manifest=manifest)
    queue(s.faults)
    try:
        run.ranks = run.open(s.dp_size, s.num_workers, None, elastic=False)
        for i, step in enumerate(s.steps, 1):
            run.at = f"step {i}"
            try:
                run.take(step.batches) if not step.dp_size else run.resume(step)
                run.check_end(complete=False)  # nothing twice or foreign so far
            except Finding as f:
                raise Finding(f.kind, f"at step {i}: {f.message}") from None
        run.at = "the final run to the end"
        run.drain()
    except Finding:
        raise
    except Exception as exc:  # noqa: BLE001 - every exception is judged by the model
        if run.explain(exc) == "stopped":
            run.check_end(complete=False)
            return
        try:
            run.redo_after_refusal()  # loading the states again may itself refuse
            run.drain()
        except Finding:
            raise
        except Exception as again:  # noqa: BLE001
            run.explain(again)  # nothing is left to refuse: 'stopped' by a bad record, or a Finding
            run.check_end(complete=False)
            return
    run.check_end(complete=True)


def check(s: Schedule) -> Finding | None:
    """The Finding of one schedule (in a fresh directory), or None when it matches the model."""
    COVERAGE[f"schedules: {s.corpus.fmt}{' over HTTP' if s.setup.http else ''}"] += 1
    with tempfile.TemporaryDirectory(prefix="modelcheck-") as directory, fast_retries():
        try:
            if not s.setup.http:
                execute(s, directory)
                return None
            with serve_faulty(directory) as server:
                def queue(faults: tuple[str, ...]) -> None:
                    for kind in faults:
                        server.plan.add(Fault("status", status=503) if kind == "503" else Fault(kind, fraction=0.4))
                execute(s, directory, server.url, queue)
        except Finding as f:
            return f
    return None


def report(seed: int, *, slow: bool = False, shrink_seconds: float = 20.0) -> str | None:
    """None when the schedule of ``seed`` matches the model, else a reproduction (shrunk for up
    to ``shrink_seconds``; 0 prints the schedule as drawn, and the rerun command shrinks it)."""
    s = schedule_for(seed, slow=slow)
    finding = check(s)
    if finding is None:
        return None
    small, small_finding = shrink(s, finding, check, seconds=shrink_seconds) if shrink_seconds > 0 else (s, finding)
    flag = " --slow" if slow else ""
    title = "minimal schedule (shrunk):" if shrink_seconds > 0 else "schedule (not shrunk; the rerun shrinks it):"
    rerun = f"rerun: PYTHONPATH=. python tests/modelcheck/modelcheck_driver.py {seed}{flag}"
    return "\n".join([f"model check seed {seed}{flag}: {finding}", "", title, small.describe(),
                       f"finding: {small_finding}", "", rerun])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run model-checker schedules (tests/modelcheck/modelcheck_driver.py)")
    parser.add_argument("seeds", type=int, nargs="+")
    parser.add_argument("--slow", action="store_true", help="the slow set's schedules")
    parser.add_argument("--show", action="store_true", help="print each schedule before running it")
    args = parser.parse_args(argv)
    failed = 0
    for seed in args.seeds:
        if args.show:
            print(schedule_for(seed, slow=args.slow).describe())
        text = report(seed, slow=args.slow)
        failed += text is not None
        print(text or f"seed {seed}: ok")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
