"""Chat records through the whole chain: read from jsonl, parquet and tar shards, rendered by the Tokenize node's
chat stage, packed; every conversation arrives once with its mask as labels, and a resumed stream is identical."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers_chat import CHATML, chat_tokenizer, conversations, write_jsonl
from helpers_data import write_tar
from node_checks import canon

from streampack import PackedDataset
from streampack.chat import ChatEncoder
from streampack.errors import DataError
from streampack.options import PackOptions, ReadOptions, TokenizeOptions
from streampack.options.tokenize import ChatOptions
from streampack.sample import Sample

pytest.importorskip("transformers", minversion="5.0")
CAPACITY = 64


def _shards(tmp_path, records: list[dict], fmt: str) -> list[str]:
    halves = [records[: len(records) // 2], records[len(records) // 2:]]
    if fmt == "jsonl":
        return [str(write_jsonl(tmp_path / f"chat-{i}.jsonl", h)) for i, h in enumerate(halves)]
    if fmt == "tar":
        return [write_tar(tmp_path / f"chat-{i}.tar", [(f"{j:05d}", {"json": json.dumps(r).encode()})
                                                      for j, r in enumerate(h)]) for i, h in enumerate(halves)]
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = []
    for i, h in enumerate(halves):
        pq.write_table(pa.Table.from_pylist(h), tmp_path / f"chat-{i}.parquet", row_group_size=8)
        paths.append(str(tmp_path / f"chat-{i}.parquet"))
    return paths


def _documents(batches) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(tokens, labels) of every document of the batches."""
    out = []
    for b in batches:
        for s, n in zip(b.cu_seqlens_padded[:-1].tolist(), b.doc_lengths.tolist()):
            out.append((tuple(b.input_ids[s:s + n].tolist()), tuple(b.labels[s:s + n].tolist())))
    return out


def _want(records: list[dict], tok) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    encoded = ChatEncoder(tok, ChatOptions(), max_len=CAPACITY).encode(
        [Sample(key=str(i), chat=r) for i, r in enumerate(records)])
    out = []
    for s in encoded:
        if s is None:
            continue
        t = s.tokens
        labels = np.where(s.loss_mask[1:], t[1:], -100).tolist() + [-100]
        out.append((tuple(t.tolist()), tuple(labels)))
    return out


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "tar"])
def test_every_format_streams_each_conversation_once_with_its_mask(tmp_path, fmt: str) -> None:
    records = conversations(40, seed=11)
    tok = chat_tokenizer(CHATML)
    ds = PackedDataset(_shards(tmp_path, records, fmt), capacity=CAPACITY, epochs=1, tokenizer=tok,
                       tokenize=TokenizeOptions(chat=ChatOptions(), block_size=5), packing=PackOptions(window=8))
    got = _documents(ds)
    want = _want(records, tok)
    assert sorted(got) == sorted(want) and len(want) > 30
    counters = ds.metrics()["tokenize"]
    assert counters["tokenized"] == len(want) and counters["dropped"] == len(records) - len(want)


def test_a_chat_stream_resumes_exactly(tmp_path) -> None:
    records = conversations(48, seed=12)
    urls = _shards(tmp_path, records, "jsonl")
    tok = chat_tokenizer(CHATML)
    make = lambda: PackedDataset(urls, capacity=CAPACITY, epochs=1, tokenizer=tok,  # noqa: E731
                                 tokenize=TokenizeOptions(chat=ChatOptions(), block_size=4),
                                 packing=PackOptions(window=8))
    full = [canon(b) for b in make()]
    ds = make()
    it = iter(ds)
    head = [canon(next(it)) for _ in range(3)]
    other = make()
    other.load_state_dict(ds.state_dict())
    assert head + [canon(b) for b in other] == full and len(full) > 4
    changed = PackedDataset(urls, capacity=CAPACITY, epochs=1, tokenizer=tok, packing=PackOptions(window=8),
                            tokenize=TokenizeOptions(chat=ChatOptions(train_on="last"), block_size=4))
    with pytest.raises(ValueError, match="chat"):
        changed.load_state_dict(ds.state_dict())


def test_a_bad_record_names_shard_and_key_and_skip_drops_only_it(tmp_path) -> None:
    records = conversations(10, seed=13)
    records[4] = {"conversations": [{"from": "narrator", "value": "w1 w2"}]}
    urls = [str(write_jsonl(tmp_path / "chat.jsonl", records))]
    tok = chat_tokenizer(CHATML)
    opts = TokenizeOptions(chat=ChatOptions())
    with pytest.raises(DataError, match=r"chat_unknown_role.*chat\.jsonl.*key='4'.*narrator"):
        list(PackedDataset(urls, capacity=CAPACITY, epochs=1, tokenizer=tok, tokenize=opts))
    ds = PackedDataset(urls, capacity=CAPACITY, epochs=1, tokenizer=tok, tokenize=opts,
                       read=ReadOptions(on_error="skip"))
    assert len(_documents(ds)) == 9 and ds.metrics()["errors"]["counts"] == {"chat_unknown_role": 1}



def _tag_epoch(sample: Sample) -> Sample:
    from dataclasses import replace

    return replace(sample, key=f"{sample.key}@{sample.origin.epoch}")


def test_an_elastic_resume_trains_every_conversation_once(tmp_path) -> None:
    """An infinite chat stream on 2 ranks x 1 worker saves after 7 batches each; 3 ranks x 1 worker resume from all
    their states (carried conversations re-read and rendered again): every (conversation, epoch) up to the resumed
    epoch exactly once, as the text stage's elastic test checks."""
    from collections import Counter

    from topology_sim import SimRank

    from streampack.nodes.collate import FILLER_KEY
    from streampack.options import TopologyOptions
    from streampack.plan import elastic

    records = conversations(40, seed=14)
    urls = _shards(tmp_path, records, "jsonl")
    tok = chat_tokenizer(CHATML)

    def make(rank: int, size: int) -> PackedDataset:
        return PackedDataset(urls, capacity=CAPACITY, epochs=None, seed=3, tokenizer=tok, stages=[_tag_epoch],
                             tokenize=TokenizeOptions(chat=ChatOptions(), block_size=5),
                             packing=PackOptions(window=6, max_wait=3),
                             topology=TopologyOptions(dp_rank=rank, dp_size=size))

    old = [SimRank(lambda r=r: make(r, 2), 1) for r in range(2)]
    consumed = [next(rk) for rk in old for _ in range(7)]
    states = [s for rk in old for s in rk.states()]
    probe = make(0, 3)
    last = elastic.remaining(states, probe.config, probe.sources, probe.stages).epoch
    for rank in range(3):
        new = SimRank(lambda r=rank: make(r, 3), 1, load=states)
        consumed += [next(new) for _ in range(40)]
    seen = Counter(k for b in consumed for k in b.doc_keys if k != FILLER_KEY)  # shard#key@epoch
    assert max(seen.values()) == 1
    kept = len(_want(records, tok))
    for epoch in range(last + 1):
        assert sum(1 for k in seen if k.endswith(f"@{epoch}")) == kept, epoch


def test_a_resume_with_another_chat_template_on_the_tokenizer_is_refused(tmp_path) -> None:
    from helpers_chat import LLAMA3

    urls = _shards(tmp_path, conversations(20, seed=15), "jsonl")
    make = lambda template: PackedDataset(urls, capacity=CAPACITY, epochs=1, tokenizer=chat_tokenizer(template),  # noqa: E731
                                          tokenize=TokenizeOptions(chat=ChatOptions()))
    ds = make(CHATML)
    next(iter(ds))
    with pytest.raises(ValueError, match="tokenizer"):
        make(LLAMA3).load_state_dict(ds.state_dict())
    make(CHATML).load_state_dict(ds.state_dict())  # the same tokenizer, built again: accepted


def test_dataloader_workers_render_and_resume_exactly(tmp_path) -> None:
    """Two StatefulDataLoader workers, each with the HF tokenizer: a resume mid-epoch continues batch for batch."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    urls = [str(write_jsonl(tmp_path / f"chat-{i}.jsonl", conversations(30, seed=20 + i))) for i in range(4)]
    tok = chat_tokenizer(CHATML)
    make = lambda: StatefulDataLoader(PackedDataset(urls, capacity=CAPACITY, epochs=1, tokenizer=tok,  # noqa: E731
                                                    tokenize=TokenizeOptions(chat=ChatOptions()),
                                                    packing=PackOptions(window=8)), batch_size=None, num_workers=2)
    full = [canon(b) for b in make()]
    loader = make()
    it = iter(loader)
    head = [canon(next(it)) for _ in range(5)]
    resumed = make()
    resumed.load_state_dict(loader.state_dict())
    assert head + [canon(b) for b in resumed] == full and len(full) > 20
