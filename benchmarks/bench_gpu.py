"""On a GPU: packed THD training vs padding, and what streampack's adapters and loss cost per step.

    python benchmarks/bench_gpu.py                   # 300M-parameter Llama-style model, bf16
    python benchmarks/bench_gpu.py --quick           # small model, few steps (a smoke run)
    python benchmarks/bench_gpu.py --out gpu.md      # also write the markdown report

Needs CUDA and torch's ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10; the portable
front :func:`streampack.attention.varlen.varlen_attention` handles 2.11, which has no
``enable_gqa``); on a machine without CUDA it prints why and exits 0. Dependencies: torch and
streampack's layout / attention / packing modules only (no torchdata, no transformers).

What it measures, on the same documents (lognormal and a long-tail mixture of lengths):

1. **Step speed.** A Llama-style decoder (RMSNorm, RoPE at ``position_ids``, grouped-query
   attention, SwiGLU; bf16 weights, AdamW), forward + backward + optimizer step, eager:
   *packed* = ``packs x capacity`` tokens per step, documents back to back, torch's FA2 varlen
   kernel over ``batch.flash_attn_kwargs()``; *padded (fixed)* = ``[packs, capacity]``, one
   document per row (the fixed-shape ceiling of slot throughput); *padded (per batch)* = the same
   number of documents per step padded to the longest of the step. Real tokens/s is what
   training advances by; slots/s is what the GPU computes.
2. **Adapter overhead.** ``flash_attn_kwargs``, ``hf_inputs``, ``te_kwargs`` on the device batch,
   microseconds per call (they run no host sync; see tests/unit/attention/test_sync_free.py).
3. **Feeding the step.** Host-to-device bytes a step (the batch's stored tensors, what ``batch.to(device)``
   sends) against the ``[3, T]`` int64 rows of ids, labels and positions a loader used to write, and the
   derivation of ``labels`` + ``position_ids`` on the device (``streampack.layout.derive``), ms a batch and its
   share of a packed step.
4. **Loss overhead.** Forward + backward of the loss on ``[T, V]`` bf16 logits:
   ``F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum") / n`` against
   ``packed_cross_entropy(logits, batch, num_targets=n)`` and its extras, and the earlier helper
   (boolean gather of the target rows, ``int(keep.sum())``, ``bincount``) for reference.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import emit  # noqa: E402  (benchmarks/report.py; this folder is on sys.path)

from streampack import PackedBatch, pack_batch  # noqa: E402
from streampack.attention import (  # noqa: E402
    packed_cross_entropy,
    te_kwargs,
    varlen_attention_reference,
)
from streampack.attention.varlen import varlen_attention  # noqa: E402
from streampack.layout.derive import derive  # noqa: E402
from streampack.packing import pack  # noqa: E402

DEVICE = torch.device("cuda")
"""``--cpu-check`` runs every code path on the CPU (timings meaningless) so the script cannot rot
between GPU runs; the varlen kernel is then streampack's exact per-span reference."""


def _cpu_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):  # noqa: ANN001, ANN202
    return varlen_attention_reference(q, k, v, cu_q, cu_k, causal=window_size == (-1, 0), scale=scale)


def attention_kernel() -> Callable[..., torch.Tensor] | None:
    return None if DEVICE.type == "cuda" else _cpu_varlen


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    dim: int = 1024
    layers: int = 24
    heads: int = 16
    kv_heads: int = 8
    ffn: int = 2816
    vocab: int = 32000
    capacity: int = 4096
    packs: int = 8
    steps: int = 10
    warmup: int = 3


class Block(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.dim // c.heads
        self.norm1, self.norm2 = nn.RMSNorm(c.dim), nn.RMSNorm(c.dim)
        self.qkv = nn.Linear(c.dim, (c.heads + 2 * c.kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(c.dim, c.dim, bias=False)
        self.up = nn.Linear(c.dim, 2 * c.ffn, bias=False)
        self.down = nn.Linear(c.ffn, c.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attend: Callable[..., torch.Tensor]) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (-1, self.head_dim)).split(
            [self.heads, self.kv_heads, self.kv_heads], dim=-2)
        q, k = rotate(q, *rope), rotate(k, *rope)
        x = x + self.out(attend(q, k, v).flatten(-2))
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


class Decoder(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm, self.head = nn.RMSNorm(c.dim), nn.Linear(c.dim, c.vocab, bias=False)
        half = c.dim // c.heads // 2
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(half) / half), persistent=False)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attend: Callable[..., torch.Tensor]) -> torch.Tensor:
        angles = positions.unsqueeze(-1).float() * self.inv_freq  # [..., D/2]
        rope = (angles.cos().unsqueeze(-2).to(torch.bfloat16), angles.sin().unsqueeze(-2).to(torch.bfloat16))
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, rope, attend)
        return self.head(self.norm(x))


def doc_lengths(kind: str, n: int, capacity: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "lognormal":  # mean ~600 tokens
        lengths = rng.lognormal(math.log(600) - 0.5, 1.0, n)
    else:  # long tail: mostly short chat/web turns, a fifth long documents
        short, long = rng.lognormal(math.log(150), 0.8, n), rng.uniform(capacity / 4, capacity, n)
        lengths = np.where(rng.random(n) < 0.8, short, long)
    return np.clip(lengths, 2, capacity).astype(np.int64)


def make_batches(c: Config, kind: str, count: int, seed: int = 0) -> list[PackedBatch]:
    """``count`` full packed batches of random documents (bfd packs; each keeps its documents)."""
    rng = np.random.default_rng(seed)
    lengths = doc_lengths(kind, c.packs * count * c.capacity // 300, c.capacity, rng)
    bins = sorted(pack(lengths, c.capacity, algorithm="bfd"), key=lambda b: -int(lengths[b].sum()))
    docs = [[rng.integers(0, c.vocab, int(lengths[i])).tolist() for i in b] for b in bins]
    return [pack_batch(docs[i * c.packs:(i + 1) * c.packs], capacity=c.capacity)
            for i in range(min(count, len(docs) // c.packs))]


def padded(batch: PackedBatch, width: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The batch's documents as right-padded rows ``[n, width or longest]``: ids, positions, labels."""
    starts, lengths = batch.cu_seqlens_padded[:-1].tolist(), batch.doc_lengths.tolist()
    width = width or max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.int64)
    labels = torch.full_like(ids, -100)
    for row, (s, n) in enumerate(zip(starts, lengths)):
        ids[row, :n] = batch.input_ids[s:s + n]
        labels[row, :n] = batch.labels[s:s + n]
    return ids, torch.arange(width).expand_as(ids), labels, sum(lengths)


def timed(fn: Callable[[], object], steps: int, warmup: int) -> float:
    """Seconds per call of ``fn`` (CUDA events, after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    if DEVICE.type != "cuda":
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - start) / steps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / steps


def train_speed(c: Config, batches: list[PackedBatch]) -> dict[str, tuple[float, float]]:
    """(real tokens/s, slots/s) of packed and padded training on the same documents."""
    torch.manual_seed(0)
    model = Decoder(c).to(DEVICE, torch.bfloat16)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=DEVICE.type == "cuda")
    dev = [b.to(DEVICE) for b in batches]

    def step(ids: torch.Tensor, pos: torch.Tensor, labels: torch.Tensor, attend: Callable, n: int) -> None:
        logits = model(ids, pos, attend).flatten(0, -2)
        loss = F.cross_entropy(logits.float(), labels.flatten(), ignore_index=-100, reduction="sum") / n
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # [B, S, H, D]
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True, enable_gqa=True).transpose(1, 2)

    out, turn = {}, iter(range(10**9))

    def packed_step() -> None:
        b = dev[next(turn) % len(dev)]
        kw = b.flash_attn_kwargs()
        step(b.input_ids, b.position_ids, b.labels,
             lambda q, k, v: varlen_attention(q, k, v, kw, kernel=attention_kernel()), b.num_targets)

    real = sum(b.num_tokens for b in dev) / len(dev)
    seconds = timed(packed_step, c.steps, c.warmup)
    out["packed THD (varlen_attn)"] = (real / seconds, c.packs * c.capacity / seconds)
    for name, width in (("padded, fixed [packs, capacity]", c.capacity), ("padded per step to the longest", None)):
        groups = []  # `packs` documents per step, like a packed batch's rows
        for b in batches:
            ids, pos, labels, _ = padded(b, width)
            for j in range(0, ids.shape[0], c.packs):
                rows = tuple(t[j:j + c.packs].to(DEVICE) for t in (ids, pos, labels))
                groups.append((*rows, int((rows[2] != -100).sum()), int((rows[0] != 0).sum())))

        def padded_step() -> None:
            ids, pos, labels, targets, _ = groups[next(turn) % len(groups)]
            step(ids, pos, labels, sdpa, targets)

        seconds = timed(padded_step, c.steps, c.warmup)
        lengths = torch.cat([b.doc_lengths for b in batches]).double()
        real_per_step = float(lengths.mean()) * c.packs
        slots = sum(g[0].numel() for g in groups) / len(groups)
        out[name] = (real_per_step / seconds, slots / seconds)
    return out


def adapter_overhead(batch: PackedBatch, calls: int = 200) -> dict[str, float]:
    """Microseconds per adapter call on a device batch (host time, no sync inside)."""
    out = {}
    for name, fn in (("flash_attn_kwargs()", batch.flash_attn_kwargs), ("hf_inputs()", batch.hf_inputs),
                     ("te_kwargs()", lambda: te_kwargs(batch))):
        fn()
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        out[name] = (time.perf_counter() - start) / calls * 1e6
    return out


def feed_cost(batch: PackedBatch, steps: int, warmup: int) -> dict[str, float]:
    """Bytes ``to(device)`` sends for the host ``batch`` against the retired int64 rows, and the on-device
    derivation's milliseconds per batch."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (getattr(batch, f) for f in batch.__dataclass_fields__) if isinstance(t, torch.Tensor)}
    stored = sum(storages.values())
    offsets = stored - batch.input_ids.untyped_storage().nbytes()
    dev = batch.to(DEVICE)
    args = (dev.input_ids, dev.cu_seqlens, dev.cu_seqlens_padded, dev.loss_mask, dev.target_ids, dev.ignore_index)
    return {"bytes": stored, "bytes_rows": 24 * batch.total_tokens + offsets,
            "derive_ms": timed(lambda: derive(*args), max(steps * 10, 1), warmup) * 1e3}


def old_helper(logits: torch.Tensor, batch: PackedBatch, n: int) -> torch.Tensor:
    """The baseline loss: gather target rows, read counts on the host, bincount."""
    keep = batch.labels != batch.ignore_index
    token_loss = F.cross_entropy(logits[keep].float(), batch.labels[keep], reduction="none")
    int(keep.sum())
    torch.bincount(batch.seq_idx.long()[keep], minlength=batch.num_docs)
    return token_loss.sum() / n


def loss_overhead(batch: PackedBatch, vocab: int, steps: int, warmup: int) -> dict[str, float]:
    """Milliseconds for forward + backward of each loss on bf16 ``[T, V]`` logits."""
    logits = torch.randn(batch.total_tokens, vocab, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    labels, n = batch.labels, batch.num_targets
    cases = {
        "F.cross_entropy(logits.float(), ...) / n": lambda: F.cross_entropy(
            logits.float(), labels, ignore_index=-100, reduction="sum") / n,
        "packed_cross_entropy(num_targets=n)": lambda: packed_cross_entropy(logits, batch, num_targets=n).loss,
        "F.cross_entropy(bf16 logits) / n": lambda: F.cross_entropy(
            logits, labels, ignore_index=-100, reduction="sum") / n,
        "packed_cross_entropy(upcast=False)": lambda: packed_cross_entropy(
            logits, batch, num_targets=n, upcast=False).loss,
        "packed_cross_entropy(per_token=True)": lambda: packed_cross_entropy(
            logits, batch, num_targets=n, per_token=True).loss,
        "packed_cross_entropy(reduction='sequence')": lambda: packed_cross_entropy(
            logits, batch, reduction="sequence").loss,
        "packed_cross_entropy(mask_ignored=True)": lambda: packed_cross_entropy(
            logits, batch, num_targets=n, mask_ignored=True).loss,
        "earlier helper (gather, int(), bincount)": lambda: old_helper(logits, batch, n),
    }
    out = {}
    for name, loss in cases.items():
        out[name] = timed(lambda loss=loss: loss().backward(), steps, warmup) * 1e3
    return out


def report(c: Config, speeds: dict[str, dict[str, tuple[float, float]]], adapters: dict[str, float],
           losses: dict[str, float], seconds_per_step: float, feed: dict[str, float]) -> str:
    device = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "CPU check (timings meaningless)"
    head = (f"torch {torch.__version__} · {device} · bf16 · decoder dim {c.dim}, "
            f"{c.layers} layers, {c.heads}/{c.kv_heads} heads, vocab {c.vocab} "
            f"({sum_params(c) / 1e6:.0f}M parameters) · {c.packs} x {c.capacity} tokens per step")
    lines = [head, "", "| lengths | method | real tokens/s | slots/s | packed speedup (real tokens) |",
             "|---|---|---:|---:|---:|"]
    for kind, rows in speeds.items():
        packed = rows["packed THD (varlen_attn)"][0]
        for name, (real, slots) in rows.items():
            lines.append(f"| {kind} | {name} | {real:,.0f} | {slots:,.0f} | {packed / real:.2f}x |")
    lines += ["", "| adapter (device batch) | us per call | share of a packed step |", "|---|---:|---:|"]
    lines += [f"| {k} | {v:.1f} | {v / 1e6 / seconds_per_step:.3%} |" for k, v in adapters.items()]
    lines += ["", "| feeding a step | value |", "|---|---:|",
              f"| host-to-device bytes a step (stored fields) | {feed['bytes']:,.0f} |",
              f"| the same with `[3, T]` int64 rows (ids, labels, positions) | {feed['bytes_rows']:,.0f} |",
              f"| derive labels + position_ids on the device, ms a batch | {feed['derive_ms']:.3f} |",
              f"| its share of a packed step | {feed['derive_ms'] / 1e3 / seconds_per_step:.3%} |"]
    base = losses["F.cross_entropy(logits.float(), ...) / n"]
    lines += ["", "| loss, forward + backward | ms | vs plain F.cross_entropy (float32) |", "|---|---:|---:|"]
    lines += [f"| {k} | {v:.2f} | {v / base - 1:+.1%} |" for k, v in losses.items()]
    return "\n".join(lines)


def sum_params(c: Config) -> int:
    per_layer = c.dim * (c.heads + 2 * c.kv_heads) * (c.dim // c.heads) + c.dim * c.dim + 3 * c.dim * c.ffn
    return c.layers * per_layer + 2 * c.vocab * c.dim


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Rows for ``benchmarks/run_all.py``: packed vs padded tokens/s (one row saying why when
    there is no CUDA)."""
    global DEVICE
    if not torch.cuda.is_available():
        return [{"skipped": f"no CUDA device (torch {torch.__version__})"}]
    DEVICE = torch.device("cuda")
    c = Config(dim=256, layers=4, heads=8, kv_heads=4, ffn=704, vocab=8192, packs=4, steps=5,
               warmup=2) if quick else Config()
    rows = []
    for kind in ("lognormal", "long tail"):
        for method, (real_s, slots_s) in train_speed(c, make_batches(c, kind.replace(" ", ""), count=4)).items():
            rows.append({"lengths": kind, "method": method, "slots_per_s": slots_s, "real_tokens_per_s": real_s})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small model and few steps")
    p.add_argument("--out", help="also write the markdown report here")
    p.add_argument("--cpu-check", action="store_true", help="run the code paths on CPU, tiny sizes")
    args = p.parse_args(argv)
    global DEVICE
    if args.cpu_check:
        DEVICE = torch.device("cpu")
        c = Config(dim=64, layers=1, heads=4, kv_heads=2, ffn=128, vocab=256, capacity=256, packs=2,
                   steps=1, warmup=0)
    elif not torch.cuda.is_available():
        print(f"bench_gpu: skipped, no CUDA device (torch {torch.__version__}); --cpu-check runs "
              f"the code paths on CPU")
        return 0
    else:
        c = Config(dim=256, layers=4, heads=8, kv_heads=4, ffn=704, vocab=8192, packs=4, steps=5,
                   warmup=2) if args.quick else Config()
    speeds, probe = {}, None
    for kind in ("lognormal", "long tail"):
        batches = make_batches(c, kind.replace(" ", ""), count=4)
        speeds[kind] = train_speed(c, batches)
        probe = probe or batches[0]
    device_batch = probe.to(DEVICE)
    packed_tokens_s = speeds["lognormal"]["packed THD (varlen_attn)"][1]
    text = report(c, speeds, adapter_overhead(device_batch),
                  loss_overhead(device_batch, c.vocab, max(c.steps * 2, 1), c.warmup),
                  c.packs * c.capacity / packed_tokens_s, feed_cost(probe, c.steps, c.warmup))
    return emit(text, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
