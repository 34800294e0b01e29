"""Training a tiny vision-language model on packed image-text batches, with a preemption and an exact resume.

    python examples/vlm_pretrain.py                   # ~1 min on 2 CPU cores
    python examples/vlm_pretrain.py --steps 12 --preempt-at 5 --workers 2

What it shows:

1. Webdataset tar shards of image-text samples (written here: 0-3 PNG/JPEG/WebP images of random
   sizes per sample, a long-tail text, one placeholder token per image in the ids).
2. ``PackedDataset(media=MediaOptions(rule=DynamicResolution(...)))``: each image's token count
   comes from its header (Qwen2-VL's ``smart_resize`` rule), so the packer packs true lengths
   without decoding a pixel; only packs that leave the packer are decoded, in the loader worker.
3. A transformers Qwen2-VL built from a tiny config (random weights, no download) trained on
   ``model(**batch.hf_inputs())``: flattened patches, ``image_grid_thw`` and per-document mRoPE
   ``position_ids [4, 1, T]``; documents of a pack never attend to each other.
4. A checkpoint at ``--preempt-at`` (model, optimizer, loader state — references, no pixels),
   then a restart that continues with exactly the batches and losses of an uninterrupted run;
   the script checks it and exits 1 if not.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from streampack import PackedDataset, PackedLoader
from streampack.media import DynamicResolution, MediaOptions
from streampack.options import PackOptions
from streampack.plan.state import load_loader_state

VOCAB, IMAGE = 96, 90  # ids 1..88 are text; 90 is the image placeholder
RULE = DynamicResolution(patch_size=2, merge_size=2, min_pixels=8 * 8, max_pixels=32 * 32)


def write_shards(root: Path, shards: int = 3, per_shard: int = 48, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    fmts = {"png": "PNG", "jpg": "JPEG", "webp": "WEBP"}
    urls = []
    for s in range(shards):
        path = root / f"vlm-{s:04d}.tar"
        with tarfile.open(path, "w") as tf:
            for i in range(per_shard):
                members: dict[str, bytes] = {}
                k = int(rng.integers(0, 4))
                ids = rng.integers(1, 89, size=int(rng.lognormal(3.0, 0.8)) + 2).tolist()
                for j in range(k):
                    ids.insert(int(rng.integers(0, len(ids))), IMAGE)
                    w, h = (int(v) for v in rng.integers(8, 48, size=2))
                    ext = list(fmts)[int(rng.integers(0, 3))]
                    buf = io.BytesIO()
                    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, fmts[ext])
                    members[f"{j}.{ext}"] = buf.getvalue()
                members["json"] = json.dumps({"input_ids": ids[:200]}).encode()
                for field, data in members.items():
                    info = tarfile.TarInfo(f"s{s}i{i}.{field}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
        urls.append(str(path))
    return urls


def tiny_qwen2_vl(seed: int) -> torch.nn.Module:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        # bos/eos inside this tiny vocabulary (the defaults are Qwen's 151643/151645, which
        # transformers warns about for a 96-token model)
        text_config={"vocab_size": VOCAB, "bos_token_id": 94, "eos_token_id": 95,
                     "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "in_channels": 3,
                       "patch_size": RULE.patch_size, "temporal_patch_size": RULE.temporal_patch_size,
                       "spatial_merge_size": RULE.merge_size},
        image_token_id=IMAGE, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93)
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(config)


def make_job(shards: list[str], workers: int, seed: int):
    model = tiny_qwen2_vl(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=2e-3)
    ds = PackedDataset(shards, capacity=256, packing=PackOptions(window=32), packs_per_batch=2, seed=seed,
                       media=MediaOptions(rule=RULE, image_token_id=IMAGE))
    return model, optim, PackedLoader(ds, num_workers=workers)


def train(model, optim, loader, steps: int, log: list[tuple[str, float, int]]) -> None:
    """``steps`` optimizer steps from wherever ``loader`` stands; log (batch digest, loss, images)."""
    it = iter(loader)
    for _ in range(steps):
        batch = next(it)
        loss = model(**batch.hf_inputs()).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
        pixels = batch.vision.pixel_values.numpy().tobytes() if batch.vision is not None else b""
        digest = hashlib.sha1(batch.input_ids.numpy().tobytes() + pixels).hexdigest()[:12]
        log.append((digest, loss.item(), batch.vision.num_images if batch.vision is not None else 0))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--preempt-at", type=int, default=4)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0 < args.preempt_at < args.steps:
        p.error(f"--preempt-at={args.preempt_at} must be between 1 and --steps - 1 ({args.steps - 1})")
    with tempfile.TemporaryDirectory() as tmp:
        shards = write_shards(Path(tmp))
        ckpt = Path(tmp) / "ckpt.pt"
        reference: list[tuple[str, float, int]] = []
        train(*make_job(shards, args.workers, args.seed), args.steps, reference)

        resumed: list[tuple[str, float, int]] = []
        model, optim, loader = make_job(shards, args.workers, args.seed)
        train(model, optim, loader, args.preempt_at, resumed)
        torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "loader": loader.state_dict()}, ckpt)
        loader_bytes = len(torch.save(loader.state_dict(), buf := io.BytesIO()) or buf.getvalue())
        del model, optim, loader  # preemption: everything in memory is gone

        state = torch.load(ckpt, weights_only=True)
        model, optim, loader = make_job(shards, args.workers, args.seed)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        load_loader_state(loader, state["loader"])
        train(model, optim, loader, args.steps - args.preempt_at, resumed)

    for step, ((d0, l0, n), (d1, l1, _)) in enumerate(zip(reference, resumed)):
        mark = "  <- resumed here" if step == args.preempt_at else ""
        print(f"step {step:3d}  images {n:2d}  batch {d0}  loss {l0:.4f}  resumed {d1} {l1:.4f}{mark}")
    same_data = [d for d, _, _ in reference] == [d for d, _, _ in resumed]
    same_loss = all(abs(a - b) <= 1e-5 * max(1.0, abs(a)) for (_, a, _), (_, b, _) in zip(reference, resumed))
    images = sum(n for _, _, n in reference)
    print(f"loader state {loader_bytes} bytes; {images} images trained")
    print(f"identical batch stream after resume: {same_data}; identical losses: {same_loss}; "
          f"loss {reference[0][1]:.3f} -> {reference[-1][1]:.3f}")
    return 0 if same_data and same_loss and images > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
