"""RL micro-batching on a long-tail rollout: padded tokens, micro-batches, rank balance.

Naive = every sequence padded to the batch max (rounded), strided over ranks in rollout
order, a fixed micro-batch size of ``budget // padded_max`` sequences. Dynamic = sorted,
padded ``[b, L]`` micro-batches under a hard ``b * L <= budget`` cap. Packed = one THD pack
per micro-batch, Karmarkar-Karp to ranks, then KK or FFD to micro-batches (each sequence
aligned to ``round``). "padded tokens" counts what the GPUs compute; packed counts packed
lengths; "fixed-shape tokens" what packs padded to the budget compute (``fixed_shape=True``).
"micro-batch size / budget" shows how evenly micro-batches are filled (KK vs FFD); every method
stays within the budget (ROLL's convention too: its code is a hard cap with one list of
micro-batch boundaries shared by every rank).
"balance" is max / mean real tokens per rank; "compute balance" the same over padded tokens.

    python benchmarks/bench_rl.py --out bench_rl.md
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import numpy as np

from streampack.rl import plan_dynamic_batches, plan_packed_microbatches


def rollout_lengths(n: int, max_len: int, seed: int) -> np.ndarray:
    """Lognormal lengths (median ~2k) clipped to ``max_len``: a long tail like agentic RL."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(2000), 1.0, size=n), 16, max_len).astype(np.int64)


def naive(lens: np.ndarray, dp: int, budget: int, rnd: int) -> dict[str, Any]:
    width = math.ceil(int(lens.max()) / rnd) * rnd
    mbs = max(1, budget // width)
    shards = [lens[r::dp] for r in range(dp)]
    counts = [math.ceil(s.size / mbs) for s in shards]
    real = np.array([int(s.sum()) for s in shards])
    padded = np.array([s.size * width for s in shards])
    return {"num_microbatches": max(counts), "padded_tokens": int(padded.sum()),
            "fixed_shape_tokens": int(padded.sum()), "min_fill": mbs * width / budget,
            "max_fill": mbs * width / budget,
            "balance": float(real.max() / real.mean()),
            "compute_balance": float(padded.max() / padded.mean())}


def summarize(plan: Any) -> dict[str, Any]:
    padded = plan.padded_tokens_per_rank
    sizes = [s for rank in plan.padded_sizes for s in rank]
    fixed = (plan.dp_size * plan.num_microbatches
             * (plan.max_tokens_per_microbatch // plan.align * plan.align))
    return {"num_microbatches": plan.num_microbatches, "padded_tokens": plan.padded_tokens,
            "fixed_shape_tokens": fixed if plan.kind == "packed" else plan.padded_tokens,
            "min_fill": min(sizes) / plan.max_tokens_per_microbatch,
            "max_fill": max(sizes) / plan.max_tokens_per_microbatch,
            "balance": plan.balance, "compute_balance": float(padded.max() / padded.mean())}


def run(n: int = 1024, max_len: int = 16384, dp_size: int = 8, budget: int = 16384,
        rnd: int = 128, seed: int = 0) -> list[dict[str, Any]]:
    """One row per method (dicts with the table's columns)."""
    lens = rollout_lengths(n, max_len, seed)
    methods = {
        "naive (pad to batch max)": lambda: naive(lens, dp_size, budget, rnd),
        "dynamic batching": lambda: summarize(plan_dynamic_batches(
            lens, dp_size=dp_size, max_tokens_per_microbatch=budget, sequence_length_round=rnd)),
        "dynamic, ROLL's convention (shared boundaries)": lambda: summarize(plan_dynamic_batches(
            lens, dp_size=dp_size, max_tokens_per_microbatch=budget, sequence_length_round=rnd,
            convention="roll")),
        "packed + KK": lambda: summarize(plan_packed_microbatches(
            lens, dp_size=dp_size, max_tokens_per_microbatch=budget, align=rnd)),
        "packed + FFD": lambda: summarize(plan_packed_microbatches(
            lens, dp_size=dp_size, max_tokens_per_microbatch=budget, align=rnd, algorithm="ffd")),
    }
    rows, real = [], int(lens.sum())
    for name, fn in methods.items():
        fn()  # warm-up (numba compiles the packing kernels on first use)
        t0 = time.perf_counter()
        row = fn()
        row.update(method=name, plan_ms=(time.perf_counter() - t0) * 1e3,
                   padding_fraction=1 - real / row["padded_tokens"], real_tokens=real)
        rows.append(row)
    for row in rows:
        row["vs_naive"] = row["padded_tokens"] / rows[0]["padded_tokens"]
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| method | micro-batches / rank | padded tokens | padding | vs naive | fixed-shape "
             "tokens | micro-batch size / budget (min-max) | balance (real) | compute balance | plan ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['num_microbatches']} | {r['padded_tokens']:,} | "
                     f"{r['padding_fraction']:.1%} | {r['vs_naive']:.3f} | {r['fixed_shape_tokens']:,} | "
                     f"{r['min_fill']:.2f}-{r['max_fill']:.2f} | {r['balance']:.4f} | "
                     f"{r['compute_balance']:.4f} | {r['plan_ms']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--dp-size", type=int, default=8)
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--round", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the markdown table here")
    a = ap.parse_args()
    rows = run(a.n, a.max_len, a.dp_size, a.budget, a.round, a.seed)
    text = (f"{a.n} sequences (lognormal, median 2000, max {a.max_len}), dp_size {a.dp_size}, "
            f"budget {a.budget}, round/align {a.round}, real tokens {rows[0]['real_tokens']:,}\n\n"
            + table(rows))
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
