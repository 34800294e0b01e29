"""The comparison table (markdown) and the report around it: date, machine, versions, command."""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Sequence
from importlib import metadata

from .measure import Result

READING = """\
How to read it: tokens/s counts real tokens handed to the loop per DataLoader worker, from
`iter()` to the end of one epoch (worker start-up included); "vs streampack" divides by
streampack's rate at the same worker count. Fill = real tokens / slots (8 packs x capacity per
batch). Tokens delivered = real tokens of one epoch / the corpus's tokens. Resume: from
`torch.load` of the state saved that far into the epoch to the first batch of a fresh loader; "exact"
compares that batch with the one the uninterrupted run delivered next. Without resume state the
time is a fresh loader skipping the batches already trained on. State bytes: `torch.save` size.
The batches differ in what they carry: streampack's `PackedBatch` is training-ready (input_ids,
shifted labels, position_ids, cu_seqlens and cu_seqlens_padded, doc_keys); the Mosaic, webdataset
and HF adapters deliver input_ids `[8, capacity]` plus cu_seqlens; litdata input_ids only.
"""


def _rate(value: float | None) -> str:
    return "–" if value is None else f"{value / 1e6:.2f} M"


def _ratio(value: float | None, base: float | None) -> str:
    return "–" if value is None or not base else f"{value / base:.2f}×"


def _resume(r: Result) -> str:
    if r.resume_s is None:
        return "–"
    if r.resume_kind == "skip":
        return f"none (skip: {r.resume_s:.2f} s)"
    return f"{r.resume_s:.2f} s"


def _exact(r: Result) -> str:
    return {True: "yes", False: "**no**", None: "–"}[r.resume_exact]


def _state(r: Result) -> str:
    if r.state_bytes is None:
        return "none"
    return f"{r.state_bytes:,}" + ("" if r.weights_only else " (needs weights_only=False)")


def table(results: Sequence[Result], workers: Sequence[int], resume_at: float = 0.8) -> str:
    base = next((r for r in results if r.peer == "streampack" and not r.error), None)
    head = ["loader", "format", "packing"]
    for n in workers:
        head += [f"tokens/s per worker, {n} worker{'s' if n > 1 else ''}", "vs streampack"]
    head += ["fill", "tokens delivered", f"resume at {resume_at:.0%}", "exact", "state bytes", "notes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * (2 * len(workers) + 2) + "---:|---|---:|---|"]
    for r in results:
        if r.error:
            cells = [r.peer, r.fmt, r.packing] + ["–"] * (2 * len(workers) + 5) + [r.error]
        else:
            cells = [r.peer, r.fmt, r.packing]
            for n in workers:
                rate = r.tokens_per_s_per_worker.get(n)
                cells += [_rate(rate), _ratio(rate, base.tokens_per_s_per_worker.get(n) if base else None)]
            cells += [f"{100 * r.fill:.2f}%", f"{100 * r.delivered:.2f}%", _resume(r), _exact(r), _state(r),
                      "; ".join(r.notes)]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def versions(names: Sequence[str]) -> str:
    out = []
    for name in names:
        try:
            out.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            out.append(f"{name} (not installed)")
    return ", ".join(out)


def machine() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{cores} cores ({model}), Python {platform.python_version()}, {platform.system()}"


def document(*, results: Sequence[Result], workers: Sequence[int], corpus: str, command: str,
             distributions: Sequence[str], settings: str, resume_at: float = 0.8) -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"# streampack compared with the loaders people use\n\n"
            f"{stamp} · {machine()}\n\n"
            f"Command: `{command}`\n\n"
            f"Versions: {versions(distributions)}\n\n"
            f"Corpus: {corpus}\n\n"
            f"Settings: {settings}\n\n"
            + table(results, workers, resume_at) + "\n" + READING)
