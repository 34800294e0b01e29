"""Fine-tune a Hugging Face ``transformers`` model on packed batches with ``hf_inputs()``.

    python examples/hf_finetune.py          # ~30 s on 2 CPU cores, nothing downloaded

A tiny ``LlamaForCausalLM`` is built from a config (random weights) and a BPE tokenizer is
trained on the synthetic corpus, so the example runs offline. Each ``PackedBatch`` becomes
``model(**batch.hf_inputs())``: ``[1, T]`` ids, per-document ``position_ids``, unshifted labels
with -100 at each document start, ``cu_seq_lens_q/k`` and ``use_cache=False`` — with sdpa or
eager attention, transformers detects the packing from ``position_ids`` only when no KV cache
exists; with ``attn_implementation="flash_attention_2"`` on a GPU it uses ``cu_seq_lens_*``.

Before training, the script checks the packed forward against each document run alone.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import transformers

from streampack import PackedDataset
from streampack.attention import unpack_per_document
from streampack.cli.corpus import train_demo_tokenizer, write_demo_corpus
from streampack.options import PackOptions


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"])
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        shards = write_demo_corpus(Path(tmp) / "text", num_shards=2, docs_per_shard=150, seed=3,
                                   mean_words=60)
        tok = train_demo_tokenizer(shards, Path(tmp) / "tokenizer.json", vocab_size=1024,
                                   sample_bytes=500_000)
        ds = PackedDataset(shards, capacity=512, packs_per_batch=2, tokenizer=tok,
                           packing=PackOptions(window=64, overlong="truncate"))
        config = transformers.LlamaConfig(
            vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            attn_implementation=args.attn)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        optim = torch.optim.AdamW(model.parameters(), lr=2e-3)
        stream = iter(ds)

        batch = next(stream)
        with torch.no_grad():
            packed = unpack_per_document(model(**batch.hf_inputs()).logits, batch)
            worst = 0.0
            for doc, got in zip(range(batch.num_docs), packed):
                s = int(batch.cu_seqlens_padded[doc])
                ids = batch.input_ids[s:s + got.shape[0]][None]
                alone = model(input_ids=ids, use_cache=False).logits[0]
                worst = max(worst, float((got - alone).abs().max()))
        print(f"packed vs per-document logits over {batch.num_docs} documents: max |diff| = {worst:.2e}")
        if worst > 1e-4:
            return 1

        for step in range(args.steps):
            out = model(**batch.hf_inputs())  # HF shifts labels and takes the token mean
            optim.zero_grad()
            out.loss.backward()
            optim.step()
            print(f"step {step:2d}  docs {batch.num_docs:3d}  fill {batch.fill:.1%}  loss {float(out.loss):.3f}")
            batch = next(stream)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
