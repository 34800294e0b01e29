"""On a GPU: does ``CostModel`` predict the step time of packs with the same tokens but other documents?

    python benchmarks/bench_cost_gpu.py                 # ~1B-parameter Llama-style decoder, 32k-token packs
    python benchmarks/bench_cost_gpu.py --quick         # a smaller model and shorter packs
    python benchmarks/bench_cost_gpu.py --cpu-check     # every code path on CPU, tiny sizes (timings meaningless)
    python benchmarks/bench_cost_gpu.py --out cost.md   # also write the markdown report

Needs CUDA and torch's ``varlen_attn`` (through :func:`streampack.attention.varlen.varlen_attention`);
without CUDA it prints why and exits 0. Depends on torch, numpy and streampack's layout /
attention / packing modules only (the decoder is ``benchmarks/bench_gpu.py``'s).

What it measures: forward + backward (bf16, eager, causal varlen attention) of one pack of
``capacity`` tokens made of different documents — one document filling it; 2, 4, 16, 128
equal ones; a half-pack document plus short ones; lognormal lengths — and of packs of half the
tokens (so the linear term can be told from a fixed per-step cost). Each composition's
measured seconds are fitted by least squares to ``fixed + a · tokens + b · Σ L²`` on the
*fit* compositions, and the fit's error is reported on the *held-out* ones. It also reports
the FLOP model's prediction (``CostModel.from_shape`` of the same decoder, training) against
the measurement: the ratio of the heaviest to the lightest composition at equal tokens,
predicted and measured, and ``b / a`` against the model's ``attention / linear``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import bench_gpu  # noqa: E402  (the decoder, the timer and the CPU stand-in kernel)
from bench_gpu import Config, Decoder, timed  # noqa: E402
from report import emit  # noqa: E402

from streampack import pack_batch  # noqa: E402
from streampack.attention.varlen import varlen_attention  # noqa: E402
from streampack.packing import CostModel  # noqa: E402


@dataclass(frozen=True, slots=True, kw_only=True)
class Composition:
    name: str
    lengths: list[int]
    fit: bool
    """Used to fit the coefficients (else held out to test the fit)."""


def compositions(capacity: int, seed: int = 0) -> list[Composition]:
    """Packs of ``capacity`` tokens (and a few of half as many), from one document to many."""
    c, rng = capacity, np.random.default_rng(seed)
    lognormal = []
    while sum(lognormal) < c:
        lognormal.append(int(min(max(rng.lognormal(np.log(c / 40), 1.0), 16), c - sum(lognormal))))
    out = [Composition(name="1 x C", lengths=[c], fit=True),
           Composition(name="2 x C/2", lengths=[c // 2] * 2, fit=False),
           Composition(name="4 x C/4", lengths=[c // 4] * 4, fit=True),
           Composition(name="16 x C/16", lengths=[c // 16] * 16, fit=False),
           Composition(name="128 x C/128", lengths=[c // 128] * 128, fit=True),
           Composition(name="C/2 + 16 x C/32", lengths=[c // 2] + [c // 32] * 16, fit=False),
           Composition(name="3C/4 + 64 x C/256", lengths=[3 * c // 4] + [c // 256] * 64, fit=False),
           Composition(name="lognormal (mean C/40)", lengths=lognormal, fit=False),
           Composition(name="1 x C/2 (half the tokens)", lengths=[c // 2], fit=True),
           Composition(name="64 x C/128 (half the tokens)", lengths=[c // 128] * 64, fit=True),
           Composition(name="4 x C/8 (half the tokens)", lengths=[c // 8] * 4, fit=False)]
    assert all(sum(x.lengths) in (c, c // 2) for x in out), [sum(x.lengths) for x in out]
    return out


def measure(c: Config, model: Decoder, comp: Composition) -> float:
    """Seconds of forward + backward of one pack holding ``comp``'s documents."""
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, c.vocab, n).tolist() for n in comp.lengths]
    batch = pack_batch([docs], capacity=sum(comp.lengths)).to(bench_gpu.DEVICE)
    kw = batch.flash_attn_kwargs()
    kernel = bench_gpu.attention_kernel()

    def step() -> None:
        logits = model(batch.input_ids, batch.position_ids,
                       lambda q, k, v: varlen_attention(q, k, v, kw, kernel=kernel))
        loss = F.cross_entropy(logits.float(), batch.labels, ignore_index=-100)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return timed(step, c.steps, c.warmup)


def fit(rows: list[dict[str, Any]]) -> np.ndarray:
    """Least squares ``seconds = fixed + a · tokens + b · Σ L²`` on the fit rows: ``[fixed, a, b]``."""
    x = np.array([[1.0, r["tokens"], r["sum_L2"]] for r in rows if r["fit"]])
    y = np.array([r["seconds"] for r in rows if r["fit"]])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return coef


def run_config(c: Config) -> tuple[list[dict[str, Any]], dict[str, float]]:
    torch.manual_seed(0)
    model = Decoder(c).to(bench_gpu.DEVICE, torch.bfloat16)
    flops = CostModel.from_shape(hidden=c.dim, layers=c.layers, heads=c.heads, kv_heads=c.kv_heads, ffn=c.ffn,
                                 vocab=c.vocab)
    rows = []
    for comp in compositions(c.capacity):
        lengths = np.asarray(comp.lengths, dtype=np.int64)
        rows.append({"composition": comp.name, "fit": comp.fit, "docs": len(comp.lengths),
                     "tokens": int(lengths.sum()), "sum_L2": float((lengths.astype(np.float64) ** 2).sum()),
                     "predicted_TFLOP": flops.pack_cost(lengths) / 1e12, "seconds": measure(c, model, comp)})
    fixed, a, b = fit(rows)
    for r in rows:
        r["fitted_seconds"] = fixed + a * r["tokens"] + b * r["sum_L2"]
        r["fit_error_%"] = 100 * (r["fitted_seconds"] / r["seconds"] - 1)
    full = [r for r in rows if r["tokens"] == c.capacity]
    heavy, light = max(full, key=lambda r: r["sum_L2"]), min(full, key=lambda r: r["sum_L2"])
    summary = {
        "held-out fit error, mean |%|": float(np.mean([abs(r["fit_error_%"]) for r in rows if not r["fit"]])),
        "held-out fit error, max |%|": float(np.max([abs(r["fit_error_%"]) for r in rows if not r["fit"]])),
        "heaviest / lightest at equal tokens, measured": heavy["seconds"] / light["seconds"],
        "heaviest / lightest at equal tokens, FLOP model": heavy["predicted_TFLOP"] / light["predicted_TFLOP"],
        "fitted b / a (attention per L² / linear per token)": b / a if a > 0 else float("nan"),
        "FLOP model attention / linear": flops.attention / flops.linear,
        "fixed seconds per step (fit)": fixed,
    }
    return rows, summary


def report(c: Config, rows: list[dict[str, Any]], summary: dict[str, float]) -> str:
    device = torch.cuda.get_device_name() if bench_gpu.DEVICE.type == "cuda" else "CPU check (timings meaningless)"
    head = (f"torch {torch.__version__} · {device} · bf16 · decoder dim {c.dim}, {c.layers} layers, "
            f"{c.heads}/{c.kv_heads} heads, FFN {c.ffn}, vocab {c.vocab} · packs of {c.capacity} tokens · "
            f"forward + backward, mean of {c.steps} after {c.warmup} warm-up")
    lines = [head, "", "| composition | fit / held out | docs | tokens | FLOP model (TFLOP) | measured ms | "
             "fitted ms | fit error |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['composition']} | {'fit' if r['fit'] else 'held out'} | {r['docs']} | {r['tokens']} | "
                     f"{r['predicted_TFLOP']:.4g} | {r['seconds'] * 1e3:.2f} | {r['fitted_seconds'] * 1e3:.2f} | "
                     f"{r['fit_error_%']:+.1f}% |")
    lines += ["", "| summary | value |", "|---|---:|"]
    lines += [f"| {k} | {v:.4g} |" for k, v in summary.items()]
    return "\n".join(lines)


def configs(quick: bool, cpu: bool) -> Config:
    if cpu:
        return Config(dim=64, layers=1, heads=4, kv_heads=2, ffn=128, vocab=256, capacity=512, packs=1,
                      steps=1, warmup=0)
    if quick:
        return Config(dim=1024, layers=4, heads=16, kv_heads=8, ffn=2816, vocab=32000, capacity=8192, packs=1,
                      steps=5, warmup=2)
    return Config(dim=2048, layers=12, heads=16, kv_heads=8, ffn=5632, vocab=32000, capacity=32768, packs=1,
                  steps=10, warmup=3)


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Rows for ``benchmarks/run_all.py`` (one row saying why when there is no CUDA)."""
    if not torch.cuda.is_available():
        return [{"skipped": f"no CUDA device (torch {torch.__version__})"}]
    bench_gpu.DEVICE = torch.device("cuda")
    rows, summary = run_config(configs(quick, cpu=False))
    return rows + [{"composition": k, "seconds": v} for k, v in summary.items()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smaller model and 8k-token packs")
    p.add_argument("--cpu-check", action="store_true", help="run the code paths on CPU, tiny sizes")
    p.add_argument("--out", help="also write the markdown report here")
    args = p.parse_args(argv)
    if args.cpu_check:
        bench_gpu.DEVICE = torch.device("cpu")
    elif not torch.cuda.is_available():
        print(f"bench_cost_gpu: skipped, no CUDA device (torch {torch.__version__}); --cpu-check runs the "
              f"code paths on CPU")
        return 0
    else:
        bench_gpu.DEVICE = torch.device("cuda")
    c = configs(args.quick, args.cpu_check)
    text = report(c, *run_config(c))
    return emit(text, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
