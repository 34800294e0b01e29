"""On a GPU: does one loader worker keep a training GPU fed? Loader tokens/s against the GPU's.

    python benchmarks/bench_gpu_feed.py                     # 349M-parameter model, 32 M-token corpus
    python benchmarks/bench_gpu_feed.py --quick             # small model and corpus (a smoke run)
    python benchmarks/bench_gpu_feed.py --cpu-check         # every code path on CPU, tiny sizes

The question a GPU owner asks of a loader is not its speed on its own but its margin: how many
times the tokens one DataLoader worker delivers exceed what the model consumes, on the machine
that trains. Three numbers from one run, on the same pre-tokenized corpus (the loader benchmark's
corpus, ``benchmarks/peers/corpus.py``: lognormal lengths, mean 600, parquet shards with an
``input_ids: list<int32>`` column), capacity 4096 and 8 packs per batch:

1. **loader alone** -- ``StatefulDataLoader(PackedDataset(...), num_workers=1, pin_memory=True)``,
   every batch copied to the GPU (``batch.to("cuda", non_blocking=True)``), no model: real
   tokens/s over the epoch from ``iter()`` (worker start-up included);
2. **GPU ceiling** -- the Llama-style decoder of ``bench_gpu.py`` (bf16, FA2 ``varlen_attn`` over
   ``flash_attn_kwargs()``) trained on batches already on the device: the real tokens/s the GPU
   can consume;
3. **fed by the loader** -- the same training loop pulling each batch from the loader of (1):
   real tokens/s and the share of wall time the loop waited in ``next()``.

The margin is (1) / (2); the loader keeps up when (3) equals (2) and the wait share is ~0.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import bench_gpu  # noqa: E402  (benchmarks/bench_gpu.py: the model and its timing)
from peers.corpus import Corpus, CorpusSpec, write_parquet  # noqa: E402
from report import emit  # noqa: E402

from streampack.attention.varlen import varlen_attention  # noqa: E402
from streampack.nodes.collate import FILLER_KEY  # noqa: E402

PACKS = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class FeedResult:
    loader_tokens_s: float
    """Real tokens/s one worker delivered to the device, no model."""
    loader_batches: int
    gpu_tokens_s: float
    """Real tokens/s the model trained at on batches already on the device."""
    fed_tokens_s: float
    """Real tokens/s the model trained at pulling batches from the loader."""
    fed_wait_share: float
    """Share of the fed loop's wall time spent waiting in ``next()``."""
    first_batch_s: float


def real_tokens(batch: Any) -> int:
    # a finite epoch's last batch is completed with filler packs (no data in them)
    return batch.num_tokens - batch.doc_keys.count(FILLER_KEY) * batch.capacity


def make_loader(urls: list[str], capacity: int, workers: int) -> Any:
    from streampack import PackedDataset, PackedLoader

    ds = PackedDataset(urls, capacity=capacity, epochs=1, seed=0, packs_per_batch=PACKS)
    return PackedLoader(ds, num_workers=workers, pin_memory=bench_gpu.DEVICE.type == "cuda",
                        prefetch_factor=8 if workers else None)


def loader_alone(urls: list[str], capacity: int, workers: int) -> tuple[float, int, float]:
    """(real tokens/s to the device over one epoch, batches, seconds to the first batch)."""
    tokens, batches, first = 0, 0, None
    start = time.perf_counter()
    for batch in make_loader(urls, capacity, workers):
        batch = batch.to(bench_gpu.DEVICE, non_blocking=True)
        first = first if first is not None else time.perf_counter() - start
        tokens += real_tokens(batch)
        batches += 1
    bench_gpu.sync()
    return tokens / (time.perf_counter() - start), batches, first or 0.0


def trainer(c: bench_gpu.Config) -> Any:
    """One training step over a device batch (the decoder of bench_gpu.py, fused AdamW)."""
    torch.manual_seed(0)
    model = bench_gpu.Decoder(c).to(bench_gpu.DEVICE, torch.bfloat16)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=bench_gpu.DEVICE.type == "cuda")

    def step(b: Any) -> None:
        kw = b.flash_attn_kwargs()
        logits = model(b.input_ids, b.position_ids,
                       lambda q, k, v: varlen_attention(q, k, v, kw, kernel=bench_gpu.attention_kernel()))
        loss = F.cross_entropy(logits.float(), b.labels, ignore_index=-100, reduction="sum") / max(b.num_targets, 1)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    return step


def fed_training(step: Any, urls: list[str], c: bench_gpu.Config, workers: int, steps: int) -> tuple[float, float]:
    """(real tokens/s, share of wall time waiting for the loader) over ``steps`` steps after
    ``c.warmup`` warm-up steps, each batch pulled from a fresh loader."""
    it = iter(make_loader(urls, c.capacity, workers))
    for _ in range(c.warmup):
        step(next(it).to(bench_gpu.DEVICE, non_blocking=True))
    bench_gpu.sync()
    tokens, waited = 0, 0.0
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = next(it)
        waited += time.perf_counter() - t0
        tokens += real_tokens(batch)
        step(batch.to(bench_gpu.DEVICE, non_blocking=True))
    bench_gpu.sync()
    wall = time.perf_counter() - start
    return tokens / wall, waited / wall


def gpu_ceiling(step: Any, urls: list[str], c: bench_gpu.Config, steps: int) -> float:
    """Real tokens/s of the same steps on batches staged on the device first."""
    it = iter(make_loader(urls, c.capacity, 0))
    staged = [next(it).to(bench_gpu.DEVICE) for _ in range(min(steps, 8))]
    tokens = sum(real_tokens(b) for b in staged) / len(staged)
    turn = iter(range(10**9))
    seconds = bench_gpu.timed(lambda: step(staged[next(turn) % len(staged)]), steps, c.warmup)
    return tokens / seconds


def measure(c: bench_gpu.Config, corpus_tokens: float, workers: int, steps: int, root: str) -> FeedResult:
    corpus = Corpus(CorpusSpec(tokens=int(corpus_tokens), capacity=c.capacity, vocab=c.vocab), root)
    urls = write_parquet(corpus)
    loader_s, batches, first = loader_alone(urls, c.capacity, workers)
    step = trainer(c)
    gpu_s = gpu_ceiling(step, urls, c, steps)
    fed_s, wait = fed_training(step, urls, c, workers, steps)
    return FeedResult(loader_tokens_s=loader_s, loader_batches=batches, gpu_tokens_s=gpu_s, fed_tokens_s=fed_s,
                      fed_wait_share=wait, first_batch_s=first)


def report(c: bench_gpu.Config, r: FeedResult, workers: int, corpus_tokens: float) -> str:
    device = torch.cuda.get_device_name() if bench_gpu.DEVICE.type == "cuda" else "CPU (code-path check)"
    return "\n".join([
        f"torch {torch.__version__} · {device} · {os.cpu_count()} CPUs · decoder dim {c.dim}, {c.layers} layers, "
        f"{bench_gpu.sum_params(c) / 1e6:.0f}M parameters, bf16 · {PACKS} x {c.capacity} tokens per step · "
        f"{corpus_tokens / 1e6:g} M-token parquet corpus · {workers} loader worker(s)",
        "",
        "| measure | real tokens/s | note |",
        "|---|---:|---|",
        f"| loader alone, to the device | {r.loader_tokens_s:,.0f} | {r.loader_batches} batches, first after "
        f"{r.first_batch_s:.2f} s |",
        f"| GPU ceiling (batches on the device) | {r.gpu_tokens_s:,.0f} | what the model consumes |",
        f"| training fed by the loader | {r.fed_tokens_s:,.0f} | {100 * r.fed_wait_share:.2f}% of wall time "
        f"waiting for data |",
        "",
        f"Margin: one worker delivers **{r.loader_tokens_s / r.gpu_tokens_s:.1f}x** the tokens the GPU consumes; "
        f"fed training runs at {r.fed_tokens_s / r.gpu_tokens_s:.3f}x the ceiling.",
    ])


def config(quick: bool, cpu: bool) -> tuple[bench_gpu.Config, float, int]:
    """(model, corpus tokens, training steps)."""
    if cpu:
        return bench_gpu.Config(dim=64, layers=1, heads=4, kv_heads=2, ffn=128, vocab=256, capacity=256,
                                steps=2, warmup=1), 2e5, 2
    if quick:
        return bench_gpu.Config(dim=256, layers=4, heads=8, kv_heads=4, ffn=704, vocab=8192, steps=10,
                                warmup=3), 8e6, 10
    return bench_gpu.Config(steps=30, warmup=5), 32e6, 30


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Rows for ``benchmarks/run_all.py`` (one row saying why when there is no CUDA)."""
    if not torch.cuda.is_available():
        return [{"skipped": f"no CUDA device (torch {torch.__version__})"}]
    bench_gpu.DEVICE = torch.device("cuda")
    c, corpus_tokens, steps = config(quick, cpu=False)
    with tempfile.TemporaryDirectory() as root:
        r = measure(c, corpus_tokens, 1, steps, root)
    return [{"loader_tokens_per_s": r.loader_tokens_s, "gpu_tokens_per_s": r.gpu_tokens_s,
             "fed_tokens_per_s": r.fed_tokens_s, "margin": r.loader_tokens_s / r.gpu_tokens_s,
             "wait_share": r.fed_wait_share}]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small model and corpus")
    p.add_argument("--cpu-check", action="store_true", help="run the code paths on CPU, tiny sizes")
    p.add_argument("--workers", type=int, default=1, help="loader workers (default 1)")
    p.add_argument("--dir", help="where the corpus is written (default: a temporary directory)")
    p.add_argument("--out", help="also write the markdown report here")
    args = p.parse_args(argv)
    if args.cpu_check:
        bench_gpu.DEVICE = torch.device("cpu")
    elif not torch.cuda.is_available():
        print(f"bench_gpu_feed: skipped, no CUDA device (torch {torch.__version__}); --cpu-check runs "
              f"the code paths on CPU")
        return 0
    else:
        bench_gpu.DEVICE = torch.device("cuda")
    c, corpus_tokens, steps = config(args.quick, args.cpu_check)
    with tempfile.TemporaryDirectory() as tmp:
        r = measure(c, corpus_tokens, args.workers, steps, args.dir or tmp)
    return emit(report(c, r, args.workers, corpus_tokens), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
