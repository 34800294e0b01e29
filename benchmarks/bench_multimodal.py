"""Image-text packing: fill and samples/s of padding, a fixed-buffer greedy packer and
streampack's window packer on the same generated shards; header-only image length against
decode-then-count.

    PYTHONPATH=. python benchmarks/bench_multimodal.py --samples 4000 --out /tmp/multimodal_results.md

The data: webdataset tar shards written here (fixed seed), one sample = a ``json`` member with
pre-tokenized ``input_ids`` (text ids, and per image ``<|vision_start|> <image> <|vision_end|>``
with one placeholder) and 0-3 image members (``0.jpg``/``1.png``...) whose sizes vary the way web
images do (lognormal side around 640 px, aspect 1:3 to 3:1). Text lengths are long-tailed: 70%
lognormal (median 120 tokens), 30% Pareto (alpha 1.3, scale 300).

A sample's length is its ids with each placeholder replaced by Qwen2-VL's dynamic-resolution
count ``(h/28)·(w/28)`` after ``smart_resize`` (transformers' own function; min 56², max 28²·1280
pixels, so 4-1280 tokens). The image size comes
either from the header alone (``PIL.Image.open(...).size``: PIL reads the header lazily) or after
decoding every pixel (``.convert("RGB")``, what a pipeline that decodes before it packs pays);
the script checks both give the same token counts and times each per image.

Packers, all on those lengths with capacity ``--capacity`` (samples longer are dropped, the
same ones for all):

* **pad**: micro-batches of ``--pad-batch`` samples in arrival order, each padded to its longest;
* **greedy buffer K** (the Energon ``packing_buffer_size`` / NeMo AutoModel kind, written here
  as the peer baseline): collect K samples in arrival order, first-fit each into the bins opened
  for this buffer, emit them all, start over (no carry-over between buffers);
* **streampack**: the real :class:`~streampack.nodes.window_packer.WindowPacker` node (BFD over a
  rolling window, leftovers carried) fed ``Sample``s of those lengths.

Fill = real tokens / slots. "Samples per 1k slots" is what a training step gets at a fixed
token-slot throughput; /work/shared/REFERENCE.md records that packed THD training ran at the
same slot throughput as padded SDPA on an H100 (163k vs 162.6k slots/s), so this ratio is the
training samples/s ratio. "Packer samples/s" is the packing code's own speed in this process.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SEED = 20261125
IMAGE, VISION_START, VISION_END = 90, 92, 93  # Qwen2-VL's layout; text ids are 1..88
TREE = Path(__file__).resolve().parent.parent  # this checkout: the e2e row runs its streampack


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """One packer's result on the common lengths."""

    name: str
    samples: int
    slots: int
    tokens: int
    seconds: float

    @property
    def fill(self) -> float:
        return self.tokens / self.slots

    @property
    def per_kslot(self) -> float:
        return 1000.0 * self.samples / self.slots


# ---------------------------------------------------------------- data

def image_sizes(rng: np.random.Generator, n: int) -> np.ndarray:
    """int ``[n, 2]`` (width, height): lognormal side around 640 px, aspect 1:3 to 3:1."""
    side = np.exp(rng.normal(np.log(640.0), 0.6, n))
    aspect = np.exp(rng.uniform(np.log(1 / 3), np.log(3), n))
    w = np.clip(side * np.sqrt(aspect), 32, 4000)
    h = np.clip(side / np.sqrt(aspect), 32, 4000)
    return np.stack([w, h], 1).round().astype(np.int64)


def text_words(rng: np.random.Generator, n: int) -> np.ndarray:
    short = rng.lognormal(np.log(120.0), 0.8, n)
    long = (rng.pareto(1.3, n) + 1.0) * 300.0
    return np.clip(np.where(rng.random(n) < 0.7, short, long), 1, 20_000).round().astype(np.int64)


def encode_image(rng: np.random.Generator, width: int, height: int, fmt: str) -> bytes:
    """A smooth random picture (upscaled noise, so JPEG/PNG sizes and decode work are realistic
    for photos rather than for flat colour)."""
    from PIL import Image

    small = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8), "RGB")
    buf = io.BytesIO()
    picture = small.resize((int(width), int(height)), Image.BILINEAR)
    if fmt == "png":
        picture.save(buf, format=fmt, compress_level=1)  # level 6 takes ~0.2 s per image here
    else:
        picture.save(buf, format=fmt, quality=85)
    return buf.getvalue()


def write_shards(root: Path, samples: int, shards: int, seed: int) -> list[str]:
    import webdataset as wds

    rng = np.random.default_rng(seed)
    words = text_words(rng, samples)
    n_images = rng.choice(4, samples, p=[0.15, 0.6, 0.15, 0.1])
    sizes = image_sizes(rng, int(n_images.sum()))
    urls, k = [], 0
    per_shard = -(-samples // shards)
    for s in range(shards):
        url = str(root / f"mm-{s:06d}.tar")
        with wds.TarWriter(url) as sink:
            for i in range(s * per_shard, min(samples, (s + 1) * per_shard)):
                ids = rng.integers(1, 89, int(words[i])).tolist()
                for j in range(int(n_images[i])):
                    at = int(rng.integers(0, len(ids) + 1))
                    ids[at:at] = [VISION_START, IMAGE, VISION_END]
                sample = {"__key__": f"s{i:08d}", "json": json.dumps({"input_ids": ids}).encode()}
                for j in range(int(n_images[i])):
                    fmt = "png" if rng.random() < 0.2 else "jpeg"
                    sample[f"{j}.{'png' if fmt == 'png' else 'jpg'}"] = encode_image(rng, *sizes[k], fmt)
                    k += 1
                sink.write(sample)
        urls.append(url)
    return urls


def read_samples(urls: list[str]) -> Iterator[dict]:
    import webdataset as wds

    yield from wds.WebDataset(urls, shardshuffle=False, empty_check=False)


# ---------------------------------------------------------------- lengths

def qwen2_vl_tokens(width: int, height: int) -> int:
    # the PIL backend's module: the same function, without torchvision
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    h, w = smart_resize(height, width, factor=28, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    return (h // 28) * (w // 28)


def header_size(data: bytes) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:  # reads the header only
        return im.size


def decoded_size(data: bytes) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        rgb = im.convert("RGB")  # decodes every pixel
        return rgb.size


@dataclass(frozen=True, slots=True, kw_only=True)
class Lengths:
    lengths: np.ndarray
    """int64 ``[n]`` sample lengths in tokens (text + image tokens + frame tokens)."""
    image_tokens: np.ndarray
    """int64 ``[n_images]``."""
    header_us: float
    decode_us: float
    read_s: float


def measure_lengths(urls: list[str]) -> Lengths:
    t0 = time.perf_counter()
    samples = list(read_samples(urls))
    read_s = time.perf_counter() - t0
    images = [v for s in samples for k, v in sorted(s.items()) if k.endswith((".jpg", ".png"))]
    timed = {}
    for name, fn in (("header", header_size), ("decode", decoded_size), ("header2", header_size)):
        t = time.perf_counter()
        timed[name] = [fn(b) for b in images]
        timed[name + "_s"] = time.perf_counter() - t
    if timed["header"] != timed["decode"]:
        raise AssertionError("header and decoded sizes differ")
    tokens = np.array([qwen2_vl_tokens(w, h) for w, h in timed["header"]], dtype=np.int64)
    lengths, k = [], 0
    for s in samples:
        n = sum(1 for key in s if key.endswith((".jpg", ".png")))
        ids = json.loads(s["json"])["input_ids"]
        assert ids.count(IMAGE) == n
        lengths.append(len(ids) - n + int(tokens[k:k + n].sum()))
        k += n
    header_s = min(timed["header_s"], timed["header2_s"])  # best of two passes, as a warm cache
    return Lengths(lengths=np.array(lengths, dtype=np.int64), image_tokens=tokens,
                   header_us=1e6 * header_s / len(images), decode_us=1e6 * timed["decode_s"] / len(images),
                   read_s=read_s)


# ---------------------------------------------------------------- packers

def pad_to_longest(lengths: np.ndarray, batch: int) -> list[list[int]]:
    """Micro-batches of ``batch`` samples in arrival order; slots = batch x its longest."""
    return [lengths[i:i + batch].tolist() for i in range(0, len(lengths), batch)]


def greedy_buffer(lengths: np.ndarray, capacity: int, buffer: int) -> list[list[int]]:
    """Fixed-buffer greedy packer (Energon ``packing_buffer_size`` / NeMo AutoModel style):
    K samples in arrival order, first fit into this buffer's bins, all bins emitted."""
    packs: list[list[int]] = []
    for start in range(0, len(lengths), buffer):
        bins: list[list[int]] = []
        room: list[int] = []
        for n in lengths[start:start + buffer].tolist():
            for b, free in enumerate(room):
                if n <= free:
                    bins[b].append(n)
                    room[b] -= n
                    break
            else:
                bins.append([n])
                room.append(capacity - n)
        packs += bins
    return packs


def streampack_window(lengths: np.ndarray, capacity: int, window: int) -> list[list[int]]:
    from torchdata.nodes import IterableWrapper

    from streampack.nodes.window_packer import WindowPacker
    from streampack.packing.window_rounds import PackerRules
    from streampack.sample import Sample

    docs = (Sample(key=f"d{i}", tokens=np.zeros(n, dtype=np.int64)) for i, n in enumerate(lengths.tolist()))
    packer = WindowPacker(IterableWrapper(docs), rules=PackerRules(capacity=capacity, window=window))
    packer.reset()
    return [[len(s) for s in pack] for pack in packer]


def measure(name: str, fn: Callable[[], list[list[int]]], capacity: int | None, repeats: int = 3) -> Row:
    """Best wall time of ``repeats`` calls (the first also pays imports and compiling)."""
    seconds = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        packs = fn()
        seconds = min(seconds, time.perf_counter() - t)
    samples = sum(len(p) for p in packs)
    slots = sum(len(p) * max(p) for p in packs) if capacity is None else len(packs) * capacity
    return Row(name=name, samples=samples, slots=slots, tokens=sum(sum(p) for p in packs), seconds=seconds)


# ---------------------------------------------------------------- end to end

E2E_CHILD = r"""
import json, sys, time
from streampack import PackedDataset
from streampack.media import DynamicResolution, MediaOptions
from streampack.options import PackOptions
urls, capacity, window, image = json.loads(sys.argv[1])
ds = PackedDataset(urls, capacity=capacity, packs_per_batch=1, shuffle=False, epochs=1,
                   packing=PackOptions(window=window, overlong="drop"),
                   media=MediaOptions(rule=DynamicResolution(), image_token_id=image))
t = time.perf_counter()
samples = tokens = slots = images = patches = 0
for batch in ds:
    samples += len(batch.cu_seqlens) - 1
    tokens += batch.num_tokens
    slots += batch.total_tokens
    if batch.vision is not None:
        images += batch.vision.num_images
        patches += int(batch.vision.pixel_values.shape[0])
print(json.dumps({"samples": samples, "tokens": tokens, "slots": slots, "images": images,
                  "patches": patches, "seconds": time.perf_counter() - t}))
"""


def end_to_end(urls: list[str], capacity: int, window: int) -> tuple[Row | None, str]:
    """streampack's whole media pipeline (read, header-only count, pack, decode and patchify only
    emitted packs), in a child process; (None, why) when it fails."""
    env = {**os.environ, "PYTHONPATH": str(TREE)}
    arg = json.dumps([urls, capacity, window, IMAGE])
    done = subprocess.run([sys.executable, "-c", E2E_CHILD, arg], env=env, capture_output=True, text=True,
                          cwd=TREE)
    if done.returncode:
        return None, "the media pipeline failed: " + done.stderr.strip().splitlines()[-1][:200]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    row = Row(name="streampack end to end: PackedDataset(media=...), decode included",
              samples=r["samples"], slots=r["slots"], tokens=r["tokens"], seconds=r["seconds"])
    return row, f"{r['images']} images decoded to {r['patches']} patches"


# ---------------------------------------------------------------- report

def report(args: argparse.Namespace, lens: Lengths, kept: np.ndarray, dropped: int, rows: list[Row],
           e2e: tuple[Row | None, str]) -> str:
    pad = rows[0]
    out = [
        "# Multimodal packing: fill, samples/s, header-only lengths",
        "",
        f"Generated by `PYTHONPATH=. python benchmarks/bench_multimodal.py --samples {args.samples} "
        f"--shards {args.shards} --capacity {args.capacity}` on {platform.machine()} "
        f"({os.cpu_count()} CPUs, shared and loaded), Python {platform.python_version()}; all rows from one run.",
        "",
        f"Data: {args.samples} image-text samples in {args.shards} webdataset tar shards, "
        f"{len(lens.image_tokens)} images (JPEG 80%, PNG 20%); read back in {lens.read_s:.2f} s.",
        f"Sample length (ids, each image placeholder expanded to its Qwen2-VL token count): mean {kept.mean():.0f}, "
        f"median {np.median(kept):.0f}, p99 {np.percentile(kept, 99):.0f}, max {kept.max()}; "
        f"image tokens per image: mean {lens.image_tokens.mean():.0f}, min {lens.image_tokens.min()}, "
        f"max {lens.image_tokens.max()}; {dropped} samples over capacity {args.capacity} dropped (for every packer).",
        "",
        "## Image length: header only vs decode-then-count (per image, PIL)",
        "",
        "| method | µs per image | speedup |",
        "|---|---:|---:|",
        f"| decode every pixel, then size | {lens.decode_us:.0f} | 1.0x |",
        f"| header only (`Image.open(...).size`) | {lens.header_us:.1f} | {lens.decode_us / lens.header_us:.0f}x |",
        "",
        "Token counts from the two agree on every image (the script checks).",
        "",
        f"## Packing the same {len(kept)} lengths, capacity {args.capacity}",
        "",
        "| packer | packs / batches | fill | samples per 1k slots | vs padding | packer samples/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        units = r.slots // args.capacity if r is not pad else -(-r.samples // args.pad_batch)
        out.append(f"| {r.name} | {units} | {r.fill:.1%} | {r.per_kslot:.3f} | {r.per_kslot / pad.per_kslot:.2f}x | "
                   f"{r.samples / r.seconds:,.0f} |")
    out += ["", "\"vs padding\" is the training samples/s ratio at equal slot throughput (see the script's docstring).",
            ""]
    row, note = e2e
    out += ["## End to end", ""]
    if row is None:
        out += [f"Not measured: {note}.", ""]
    else:
        out += ["| pipeline | samples | fill | samples per 1k slots | samples/s (1 process) |",
                "|---|---:|---:|---:|---:|",
                f"| {row.name} | {row.samples} | {row.fill:.1%} | {row.per_kslot:.3f} | "
                f"{row.samples / row.seconds:,.1f} |",
                "", f"The first shard's {row.samples} samples read from tar ({note}), every sample's length from "
                "image headers, over-capacity samples dropped as in the rows above (`overlong=\"drop\"`: the "
                "default `split` refuses a cut through an image). Its samples/s is bounded by decoding, resizing "
                "and patchifying pixels, done only for the packs the packer emitted.", ""]
    return "\n".join(out)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=4000)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--capacity", type=int, default=8192)
    p.add_argument("--pad-batch", type=int, default=8)
    p.add_argument("--buffers", type=int, nargs="+", default=[32, 128])
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--no-end-to-end", dest="end_to_end", action="store_false",
                   help="skip the row that runs the media pipeline from the media branch")
    return p.parse_args(argv)


def bench(args: argparse.Namespace) -> tuple[str, list[Row]]:
    """The whole run: (markdown report, packer rows)."""
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        urls = write_shards(Path(tmp), args.samples, args.shards, args.seed)
        print(f"wrote {len(urls)} shards in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        lens = measure_lengths(urls)
        # the first shard only: decoding every pixel is ~100x the rest of the run on this box
        e2e = end_to_end(urls[:1], args.capacity, args.window) if args.end_to_end else (None, "--no-end-to-end")
    over = lens.lengths > args.capacity
    kept = lens.lengths[~over]
    rows = [measure(f"pad to longest, {args.pad_batch} per batch", lambda: pad_to_longest(kept, args.pad_batch), None)]
    rows += [measure(f"greedy buffer K={k} (Energon/AutoModel kind)",
                     lambda k=k: greedy_buffer(kept, args.capacity, k), args.capacity) for k in args.buffers]
    rows.append(measure(f"streampack WindowPacker (bfd, window {args.window})",
                        lambda: streampack_window(kept, args.capacity, args.window), args.capacity))
    for r in rows:
        assert r.samples == len(kept) and r.tokens == int(kept.sum()), f"{r.name} lost samples"
    return report(args, lens, kept, int(over.sum()), rows, e2e), rows


def run(quick: bool = False) -> list[dict]:
    """Rows for ``benchmarks/run_all.py`` (no end-to-end row there: it imports another branch)."""
    sizes = ["--samples", "200", "--shards", "2"] if quick else ["--samples", "2000", "--shards", "4"]
    _, rows = bench(parse([*sizes, "--no-end-to-end"]))
    return [{"packer": r.name, "fill": round(r.fill, 4), "samples_per_kslot": round(r.per_kslot, 4),
             "packer_samples_per_s": round(r.samples / r.seconds)} for r in rows]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    text, _ = bench(args)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
