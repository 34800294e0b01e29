"""Tables of ``profile_workers.py``: epoch CPU, per-process phases, fixed vs per-batch cost, resume."""

from __future__ import annotations

from typing import Any


def _best(runs: list[dict[str, Any]], key: Any) -> dict[str, Any] | None:
    ok = [r for r in runs if "error" not in r]
    return min(ok, key=key) if ok else None


def _total(r: dict[str, Any]) -> float:
    return r["main"] + r["kids"]


def epoch_table(epochs: dict[tuple, list[dict[str, Any]]], fmts: list[str], sizes: list[float],
                variants: list[str]) -> str:
    lines = ["| shards | tokens | variant | CPU-s w0 | CPU-s w2 (main + workers) | w2 CPU / w0 CPU | tok/s w0 | "
             "tok/s w2 | first batch w2 |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for fmt in fmts:
        for tokens in sizes:
            for variant in variants:
                r0, r2 = (_best(epochs.get((fmt, tokens, variant, w), []), _total) for w in (0, 2))
                if r0 is None or r2 is None:
                    lines.append(f"| {fmt} | {tokens / 1e6:.0f} M | {variant} | failed | | | | | |")
                    continue
                fastest = [_best(epochs[(fmt, tokens, variant, w)], lambda r: r["wall"]) for w in (0, 2)]
                lines.append(
                    f"| {fmt} | {tokens / 1e6:.0f} M | {variant} | {_total(r0):.2f} | {_total(r2):.2f} "
                    f"({r2['main']:.2f} + {r2['kids']:.2f}) | {_total(r2) / _total(r0):.2f}× | "
                    f"{r0['tokens'] / fastest[0]['wall'] / 1e6:.2f} M | {r2['tokens'] / fastest[1]['wall'] / 1e6:.2f} M | "
                    f"{min(r['first'] for r in epochs[(fmt, tokens, variant, 2)] if 'error' not in r):.2f} s |")
    return "\n".join(lines)


def phase_table(epochs: dict[tuple, list[dict[str, Any]]], fmts: list[str], sizes: list[float],
                variants: list[str]) -> str:
    """Per process and phase, the best 2-worker run of each case (worker columns: both workers summed)."""
    head = ("| shards | tokens | variant | main: build ds | main: iter() | main ms/batch | main: teardown | "
            "workers: fork to init | init to 1st batch | workers ms/batch (all threads) | "
            "of which feeder thread ms/batch | page faults per worker | fixed extra CPU-s | extra ms/batch |")
    lines = [head, "|---|---:|---|" + "---:|" * 11]
    for fmt in fmts:
        for variant in variants:
            fit = _fixed_per_batch([(_best(epochs.get((fmt, t, variant, 0), []), _total),
                                     _best(epochs.get((fmt, t, variant, 2), []), _total)) for t in sizes])
            for tokens in sizes:
                r = _best(epochs.get((fmt, tokens, variant, 2), []), _total)
                if r is None or not r["workers"]:
                    continue
                ws, n = r["workers"], r["batches"]
                s = {k: sum(w.get(k, 0.0) for w in ws) for k in ("init", "first_batch", "last_batch")}
                feeder = sum(w["threads"]["other"] for w in ws)
                lines.append(
                    f"| {fmt} | {tokens / 1e6:.0f} M | {variant} | {r['construct']:.3f} | {r['iter']:.3f} | "
                    f"{1e3 * r['loop'] / n:.2f} | {r['teardown']:.3f} | {s['init']:.3f} | "
                    f"{s['first_batch'] - s['init']:.3f} | "
                    f"{1e3 * (s['last_batch'] - s['first_batch']) / n:.2f} | {1e3 * feeder / n:.2f} | "
                    f"{sum(w['minflt'] for w in ws) // len(ws):,} | {fit[0]:.2f} | {fit[1]:.2f} |")
    return "\n".join(lines)


def _fixed_per_batch(pairs: list[tuple[dict[str, Any] | None, dict[str, Any] | None]]) -> tuple[float, float]:
    """Extra CPU of the 2-worker epoch over the in-process one, fitted as ``fixed + per_batch x
    batches`` through the smallest and largest corpus (seconds, milliseconds)."""
    points = [(r2["batches"], _total(r2) - _total(r0)) for r0, r2 in pairs if r0 and r2]
    if len(points) < 2 or points[-1][0] == points[0][0]:
        return (float("nan"), float("nan"))
    (n0, e0), (n1, e1) = points[0], points[-1]
    per_batch = (e1 - e0) / (n1 - n0)
    return (e0 - per_batch * n0, 1e3 * per_batch)


def resume_table(resumes: dict[tuple, list[dict[str, Any]]], fmts: list[str], variants: list[str]) -> str:
    lines = ["| shards | variant | resume w0 | resume w2 | w2: of which until the workers' acks | exact |",
             "|---|---|---:|---:|---:|---|"]
    for fmt in fmts:
        for variant in variants:
            r0, r2 = (_best(resumes.get((fmt, variant, w), []), lambda r: r["resume"]) for w in (0, 2))
            if r0 is None or r2 is None:
                continue
            exact = all(r.get("exact") for w in (0, 2) for r in resumes[(fmt, variant, w)] if "error" not in r)
            lines.append(f"| {fmt} | {variant} | {r0['resume']:.2f} s | {r2['resume']:.2f} s | {r2['acked']:.2f} s | "
                         f"{'yes' if exact else '**no**'} |")
    return "\n".join(lines)
