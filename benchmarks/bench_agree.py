"""Time one round of ``streampack.plan.agree.agree_counts`` for G readers against a loopback TCPStore.

Readers are threads, spread over ``procs`` spawned processes (0: threads of this process, which
also hosts the store's libuv server). Every reader connects first (10 ms apart: this sandbox's
loopback stalls 5 s on bursts of concurrent connects), then all start a round together; a round
takes from the first reader's start to the last reader's return. Rows: ``round_s`` (median of
``rounds``; ``round_max_s`` the slowest), ``reader_p50_s`` / ``reader_max_s`` (one reader's call), ``connect_s`` (all readers).

    python benchmarks/bench_agree.py                  (G = 64, 512, 2048)
    python benchmarks/bench_agree.py --quick
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import threading
import time
from datetime import timedelta
from typing import Any

from streampack.plan.agree import Agreement, _connect, _connection, agree_counts

_GAP_S = 0.01


def _readers(a: Agreement, first: int, n: int, workers: int, rounds: int) -> list[list[tuple[float, float]]]:
    """Run global readers ``first..first+n-1`` as threads; per round, each reader's (start, end)."""
    times = [[(0.0, 0.0)] * n for _ in range(rounds)]

    def one(i: int) -> None:
        g = first + i
        time.sleep(g * _GAP_S)
        store = _connect(a)  # the benchmark's own control client
        with _connection(a):  # the round's client, connected now and left in the process's pool
            pass
        store.add("bench/ready", 1)
        for k in range(rounds):
            store.wait([f"bench/go{k}"], timedelta(seconds=600))
            start = time.time()
            agree_counts(a, key=f"r{k}", dp_rank=g // workers, worker_id=g % workers, num_workers=workers,
                         count=g % 7 + k)
            times[k][i] = (start, time.time())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return times


def _proc(a: Agreement, first: int, n: int, workers: int, rounds: int, queue: Any) -> None:
    queue.put(_readers(a, first, n, workers, rounds))


def measure(readers: int, workers: int = 8, procs: int = 0, rounds: int = 3) -> dict[str, Any]:
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=600), wait_for_workers=False)
    a = Agreement(host="127.0.0.1", port=server.port, prefix=f"bench{time.time_ns()}", dp_size=readers // workers,
                  timeout_s=600)
    ctx, queue, parts = mp.get_context("spawn"), None, []
    out: list[list[list[tuple[float, float]]]] = []
    if procs:
        queue = ctx.Queue()
        share = readers // procs
        parts = [ctx.Process(target=_proc, args=(a, p * share, share, workers, rounds, queue)) for p in range(procs)]
        for p in parts:
            p.start()
    else:
        local = threading.Thread(target=lambda: out.append(_readers(a, 0, readers, workers, rounds)))
        local.start()
    start = time.time()
    while int(server.add("bench/ready", 0)) < readers:
        time.sleep(0.05)
    connect = time.time() - start
    for k in range(rounds):
        server.set(f"bench/go{k}", "1")
        time.sleep(0.5)
        server.wait([f"{a.prefix}/r{k}/done"], timedelta(seconds=600))
    if procs:
        out = [queue.get(timeout=600) for _ in parts]
        for p in parts:
            p.join()
    else:
        local.join()
    per_round = [[t for part in out for t in part[k]] for k in range(rounds)]
    spans = [max(e for _, e in r) - min(s for s, _ in r) for r in per_round]
    calls = sorted(e - s for r in per_round for s, e in r)
    return {"readers": readers, "ranks": readers // workers, "workers": workers, "procs": procs,
            "round_s": statistics.median(spans), "round_max_s": max(spans), "reader_p50_s": calls[len(calls) // 2], "reader_max_s": calls[-1],
            "connect_s": connect}


def run(quick: bool = False) -> list[dict[str, Any]]:
    cases = [(64, 0), (64, 4)] if quick else [(64, 0), (512, 0), (2048, 0), (512, 8), (2048, 8)]
    return [measure(g, procs=p) for g, p in cases]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--readers", type=int, nargs="*", help="only these G (threads of this process)")
    parser.add_argument("--procs", type=int, default=0)
    args = parser.parse_args()
    rows = [measure(g, procs=args.procs) for g in args.readers] if args.readers else run(quick=args.quick)
    for row in rows:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()
