"""A synthetic long-tail text corpus: webdataset tar shards of pseudo-English, made offline.

The demo, tests and benchmarks need a skewed length distribution without downloading anything: a Zipfian vocabulary of
syllable pseudo-words (``p_k ~ 1 / k**1.1``, so a BPE trained on it behaves like one trained on natural text), lognormal
document lengths (``sigma=1.05``: mean ~600 tokens with the demo's 8k BPE, ~1% over 4096), sentences and paragraphs.
Shards get fixed tar metadata, so a seed gives byte-identical files; each sample is ``{key}.txt``. The default 8 shards
x 1500 documents are 52.5 MB.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from streampack.io.packed_writer import add_member

_ONSETS = ("", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
           "z", "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "io", "ou", "y")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck")
_MEAN_WORDS = 430.0
_SIGMA = 1.05
_MAX_WORDS = 24_000


def make_vocabulary(vocab_size: int, seed: int) -> np.ndarray:
    """``vocab_size`` distinct pseudo-words (object array), rank 0 most frequent and shortest."""
    rng = np.random.default_rng([seed, 1])
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < vocab_size:
        rank = len(words)
        syllables = 1 + int(rng.integers(0, 2 if rank < 200 else 4))
        word = "".join(_ONSETS[rng.integers(len(_ONSETS))] + _VOWELS[rng.integers(len(_VOWELS))]
                       + _CODAS[rng.integers(len(_CODAS))] for _ in range(syllables))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return np.asarray(words, dtype=object)


def zipf_cdf(vocab_size: int, exponent: float = 1.1) -> np.ndarray:
    weights = 1.0 / np.arange(1, vocab_size + 1, dtype=np.float64) ** exponent
    cdf = np.cumsum(weights)
    return cdf / cdf[-1]


def document_lengths(n: int, rng: np.random.Generator, mean_words: float = _MEAN_WORDS) -> np.ndarray:
    """Lognormal word counts with the given mean (>= 3, capped at ``_MAX_WORDS``)."""
    mu = np.log(mean_words) - _SIGMA**2 / 2
    return np.clip(rng.lognormal(mu, _SIGMA, size=n).astype(np.int64), 3, _MAX_WORDS)


def make_document(num_words: int, vocab: np.ndarray, cdf: np.ndarray, rng: np.random.Generator) -> str:
    """One document of ``num_words`` words with sentence and paragraph structure."""
    words = vocab[np.searchsorted(cdf, rng.random(num_words), side="right").clip(0, len(vocab) - 1)]
    cuts = np.cumsum(rng.integers(4, 25, size=num_words // 4 + 2))
    cuts = cuts[cuts < num_words]
    ends = rng.choice([".", ".", ".", ".", "?", "!"], size=len(cuts) + 1)
    paragraph_breaks = rng.random(len(cuts) + 1) < 0.15
    out: list[str] = []
    start = 0
    for i, stop in enumerate([*cuts.tolist(), num_words]):
        chunk = list(words[start:stop])
        if len(chunk) > 8 and rng.random() < 0.5:
            chunk[len(chunk) // 2] += ","
        out.append(" ".join(chunk).capitalize() + ends[i])
        out.append("\n\n" if paragraph_breaks[i] else " ")
        start = stop
    return "".join(out).rstrip() + "\n"


def write_demo_corpus(directory: str | os.PathLike[str], *, num_shards: int = 8, docs_per_shard: int = 1500,
                      seed: int = 0, vocab_size: int = 20_000, mean_words: float = _MEAN_WORDS,
                      progress: Callable[[int], None] | None = None) -> list[str]:
    """Write ``num_shards`` tar shards of text documents into ``directory`` (same arguments, same bytes);
    return their paths. ``progress(n)`` is called after every shard with its document count."""
    if num_shards < 1 or docs_per_shard < 1:
        raise ValueError(f"{num_shards=} and {docs_per_shard=} must be >= 1")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    vocab = make_vocabulary(vocab_size, seed)
    cdf = zipf_cdf(vocab_size)
    paths: list[str] = []
    for shard in range(num_shards):
        rng = np.random.default_rng([seed, 2, shard])
        lengths = document_lengths(docs_per_shard, rng, mean_words)
        path = out / f"corpus-{shard:06d}.tar"
        tmp = path.with_suffix(".tar.tmp")
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i, n in enumerate(lengths.tolist()):
                text = make_document(n, vocab, cdf, rng)
                add_member(tar, f"s{shard:04d}-{i:06d}.txt", text.encode("utf-8"))
        os.replace(tmp, path)  # a crash never leaves a half shard that looks complete
        paths.append(str(path))
        if progress is not None:
            progress(docs_per_shard)
    return paths


def iter_corpus_text(paths: list[str], limit_bytes: int | None = None):
    """Yield the text of every document in ``paths`` (shard order), up to ``limit_bytes``."""
    seen = 0
    for path in paths:
        with tarfile.open(path, "r") as tar:
            for member in tar:
                f = tar.extractfile(member)
                if f is None:
                    continue
                data = f.read()
                yield data.decode("utf-8")
                seen += len(data)
                if limit_bytes is not None and seen >= limit_bytes:
                    return


def train_demo_tokenizer(paths: list[str], out_path: str | os.PathLike[str], *,
                         vocab_size: int = 8192, sample_bytes: int = 4_000_000) -> str:
    """Train a byte-level BPE on the first ``sample_bytes`` of the corpus and save it as a
    ``tokenizer.json``; return its path. No download: ``tokenizers`` trains it in ~1-2 s."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(iter_corpus_text(paths, sample_bytes), trainer=trainer)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tok.save(str(tmp))
    os.replace(tmp, out)
    return str(out)


__all__ = ["document_lengths", "make_document", "make_vocabulary", "train_demo_tokenizer",
           "write_demo_corpus", "zipf_cdf"]
