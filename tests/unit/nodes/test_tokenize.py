"""Tokenize stage: tokenizer kinds, order/determinism under threads, BOS/EOS, exact state."""

from __future__ import annotations

import numpy as np
import pytest
from node_checks import ListSource, check_save_load, drain, make_samples
from tokenizers import Tokenizer, models, pre_tokenizers

from streampack.nodes.tokenize import Tokenize, make_encoder
from streampack.options import TokenizeOptions
from streampack.sample import Sample


def _hf_tokenizer() -> Tokenizer:
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(97)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def _texts(n: int = 300) -> list[Sample]:
    return make_samples(np.random.default_rng(1).integers(1, 40, n), text=True)


def _words(text: str) -> list[int]:
    return [int(w[1:]) + 1 for w in text.split()]


def test_tokenizer_kinds_agree(tmp_path) -> None:
    tok = _hf_tokenizer()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    texts = [s.text for s in _texts(20)]
    want = [_words(t) for t in texts]
    for kind in (tok, str(path), path, _words):
        assert make_encoder(kind)(texts) == want
    with pytest.raises(TypeError, match="tokenizer must be"):
        make_encoder(42)


@pytest.mark.parametrize("num_threads", [1, 3])
def test_threads_keep_order_and_bos_eos(num_threads: int) -> None:
    samples = _texts()
    node = Tokenize(ListSource(samples), _hf_tokenizer(),
                    TokenizeOptions(bos_id=1000, eos_id=1001, block_size=16, num_threads=num_threads))
    out = list(node)
    assert [s.key for s in out] == [s.key for s in samples]
    for s, src in zip(out, samples):
        assert s.text is None and s.tokens.dtype == np.int64
        assert s.tokens.tolist() == [1000, *_words(src.text), 1001]
    assert node.counters == {"tokenized": len(samples), "empty": 0}


def test_pretokenized_pass_through_and_empty_dropped() -> None:
    mixed = [Sample(key="a", text="w1 w2"), Sample(key="b", tokens=np.array([7, 8])),
             Sample(key="c", text="   "), Sample(key="d", text="w3")]
    node = Tokenize(ListSource(mixed), _hf_tokenizer(), TokenizeOptions(block_size=3))
    out = list(node)
    assert [(s.key, s.tokens.tolist()) for s in out] == [("a", [2, 3]), ("b", [7, 8]), ("d", [4])]
    assert node.counters["empty"] == 1


@pytest.mark.parametrize("num_threads", [1, 2])
def test_tokenize_save_load(num_threads: int) -> None:
    samples = _texts(100)
    make = lambda: Tokenize(ListSource(samples), _hf_tokenizer(),  # noqa: E731
                            TokenizeOptions(block_size=7, num_threads=num_threads))
    assert check_save_load(make, offsets=[0, 1, 6, 7, 8, 50, 99, 100]) == 100
    assert drain(make()) == drain(Tokenize(ListSource(samples), _words, TokenizeOptions(block_size=100)))


def test_validation() -> None:
    # the node takes its record, which checked these when it was made
    with pytest.raises(ValueError, match="block_size=0"):
        TokenizeOptions(block_size=0)
    with pytest.raises(ValueError, match="num_threads=0"):
        TokenizeOptions(num_threads=0)
    with pytest.raises(ValueError, match=r"TokenizeOptions\(bos_id=50\) must be None or a token id in \[0, 50\)"):
        Tokenize(ListSource([]), _words, TokenizeOptions(bos_id=50), vocab_size=50)  # spans two records


def test_dataset_with_tokenizer_resumes(tmp_path) -> None:
    from helpers_data import write_jsonl_shards
    from node_checks import canon

    from streampack.dataset import PackedDataset
    from streampack.options import PackOptions

    texts = [s.text for s in _texts(120)]
    urls = write_jsonl_shards(tmp_path, texts, 3)
    path = tmp_path / "tokenizer.json"
    _hf_tokenizer().save(str(path))
    make = lambda: PackedDataset(urls, capacity=64, epochs=1, tokenizer=str(path),
                                 tokenize=TokenizeOptions(eos_id=0, num_threads=2, block_size=5),
                                 packing=PackOptions(window=16))
    ds = make()
    batches = list(ds)
    got = [b.input_ids[s:s + n].tolist() for b in batches for s, n in
           zip(b.cu_seqlens_padded[:-1].tolist(), b.doc_lengths.tolist())]
    assert sorted(got) == sorted([*_words(t), 0] for t in texts)
    assert ds.metrics()["tokenize"]["tokenized"] == len(texts)
    ds, it = make(), None
    it = iter(ds)
    head = [canon(next(it)) for _ in range(7)]
    state = ds.state_dict()
    other = make()
    other.load_state_dict(state)
    assert head + [canon(b) for b in other] == [canon(b) for b in batches]
