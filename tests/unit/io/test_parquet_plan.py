"""Pre-tokenized parquet plans like tar and jsonl (issue 17): its index records each row's token
count (the token list column's lengths), so a finite run over several ranks yields equal batch
counts with every row once; a data set that cannot be planned is refused naming its shards."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers_data import make_token_docs
from helpers_formats import write_parquet, write_parquet_shards

from streampack.dataset import PackedDataset
from streampack.io.decode import BAD_LENGTH, DecodeOptions
from streampack.io.index import build_index, index_decode
from streampack.io.limits import Limits
from streampack.options import PackOptions, ReadOptions, TopologyOptions


@pytest.mark.slow  # ~6 s on the shared box (three ranks' graphs and the packer's first compile)
def test_pre_tokenized_parquet_is_planned_over_ranks(tmp_path):
    """Finding: a finite run over dp_size > 1 on pre-tokenized parquet was refused ("parquet,
    whose index reads only the footer: no token counts") though every length is in the file."""
    docs = make_token_docs(90, seed=4, max_len=60)
    urls = write_parquet_shards(tmp_path / "d", docs, 4, row_group_size=7)
    ranks = [list(PackedDataset(urls, capacity=64, packing=PackOptions(window=8), epochs=1,
                                topology=TopologyOptions(dp_rank=r, dp_size=3, equal_batches="count"), seed=2,
                                read=ReadOptions(cache_dir=str(tmp_path / "cache")))) for r in range(3)]
    assert len({len(r) for r in ranks}) == 1 and len(ranks[0]) > 3, [len(r) for r in ranks]
    got: dict[str, list[int]] = {}
    for b in (b for r in ranks for b in r):
        cu, starts = b.cu_seqlens.tolist(), b.cu_seqlens_padded.tolist()
        for i, key in enumerate(b.doc_keys):
            if key != "<filler>":
                assert key not in got, f"{key} read twice"
                got[key] = b.input_ids[starts[i]:starts[i] + cu[i + 1] - cu[i]].tolist()
    assert len(got) == len(docs) and sorted(map(tuple, got.values())) == sorted(map(tuple, docs))


def test_parquet_index_lengths_match_what_the_reader_sees(tmp_path):
    """Lengths per row: the list lengths; a null list is -1 with a text column (tokenized later)
    and refused without one; a row over max_sample_bytes is refused, as the reader refuses it."""
    table = pa.table({"input_ids": pa.array([[1, 2, 3], None, [], list(range(50)), [7]], pa.list_(pa.int64()))})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=2)
    index = build_index(str(tmp_path / "a.parquet"), decode=index_decode(DecodeOptions(limits=Limits(max_sample_bytes=300))))
    assert index.lengths.tolist() == [3, BAD_LENGTH, 0, BAD_LENGTH, 1]
    with_text = pa.table({"input_ids": pa.array([[1, 2], None], pa.list_(pa.int32())), "text": ["a", "b"]})
    pq.write_table(with_text, tmp_path / "b.parquet")
    assert build_index(str(tmp_path / "b.parquet")).lengths.tolist() == [2, -1]


def test_text_parquet_is_refused_naming_the_shards(tmp_path):
    urls = [write_parquet(tmp_path / f"t{i}.parquet", ["some text", "more"]) for i in range(2)]
    with pytest.raises(ValueError, match=r"2 of 2 shards.*parquet.*text to tokenize.*t0\.parquet"):
        PackedDataset(urls, capacity=64, epochs=1,
                      topology=TopologyOptions(dp_rank=0, dp_size=2), tokenizer=lambda t: [ord(c) for c in t],
                      read=ReadOptions(cache_dir=str(tmp_path / "cache")))
