"""Raw text shards -> HF tokenizer (trained here, nothing downloaded) -> a user stage -> packs.

    python examples/tokenize_chain.py

The chain ``ShardReader -> Tokenize -> user stage -> overlong policy -> WindowPacker -> THD``:

- the text corpus is webdataset tar shards of ``.txt`` members (``streampack.cli.corpus``);
- a byte-level BPE is trained with ``tokenizers`` on the corpus itself and saved as
  ``tokenizer.json``; ``PackedDataset(tokenizer=path, tokenize=TokenizeOptions(eos_id=...))``
  batch-encodes with it on ``num_threads`` threads without changing the order of the stream;
- a per-sample user function sits between tokenization and packing: here it drops documents
  shorter than 16 tokens (returning ``None`` drops a sample; drops are counted).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from streampack import PackedDataset, Sample
from streampack.cli.corpus import train_demo_tokenizer, write_demo_corpus
from streampack.options import PackOptions, TokenizeOptions


def drop_short(sample: Sample) -> Sample | None:
    """A user stage: skip near-empty documents, tag the rest (any per-sample edit works)."""
    if len(sample) < 16:
        return None
    return replace(sample, key=sample.key + ".kept")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--capacity", type=int, default=2048)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        shards = write_demo_corpus(Path(tmp) / "text", num_shards=2, docs_per_shard=200, seed=1)
        tokenizer_json = train_demo_tokenizer(shards, Path(tmp) / "tokenizer.json",
                                              vocab_size=2048, sample_bytes=1_000_000)
        from tokenizers import Tokenizer

        eos = Tokenizer.from_file(tokenizer_json).token_to_id("<|endoftext|>")
        ds = PackedDataset(shards, capacity=args.capacity, tokenizer=tokenizer_json, stages=[drop_short], epochs=1,
                           tokenize=TokenizeOptions(eos_id=eos, num_threads=2), packing=PackOptions(window=128))
        start, tokens, batches = time.perf_counter(), 0, 0
        for batch in ds:
            tokens += batch.num_tokens
            batches += 1
            if batches == 1:
                last = batch.cu_seqlens_padded[:-1].long() + batch.doc_lengths.long() - 1
                with_eos = int((batch.input_ids[last] == eos).sum())
                print(f"first batch: {batch.num_docs} documents ({with_eos} end in EOS; split "
                      f"chunks of overlong ones don't), fill {batch.fill:.1%}, "
                      f"keys {batch.doc_keys[:2]}...")
            if batches >= args.batches:
                break
        secs = time.perf_counter() - start
        m = ds.metrics()
    print(f"{batches} batches, {tokens} tokens in {secs:.2f} s ({tokens / secs:,.0f} tokens/s, "
          f"tokenizing included)")
    print(f"metrics: {m}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
