"""A new user's first hour: each mistake fails at once, with a message naming the cause.

Every test pins the exact message of one mistake measured on the tree before these fixes
(where the error came late, or named the wrong cause).
"""

from __future__ import annotations

import json
import logging
import re
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers_data import make_text_docs, make_token_docs, write_jsonl_shards
from helpers_hostile import closing_workers

from streampack import DataError, PackedDataset
from streampack.errors import NOT_TOKENIZED, log_worker_error
from streampack.logs import reset_rate_limits
from streampack.options import ReadOptions, TopologyOptions


def test_missing_directory_says_it_does_not_exist(tmp_path):
    # before: "cannot tell the format of shard '.../nodir': want one of [...]"
    missing = str(tmp_path / "nodir")
    with pytest.raises(ValueError, match=rf"^{re.escape(repr(missing))} does not exist \(not a shard file, "):
        PackedDataset(missing, capacity=64)


def test_brace_typo_names_missing_shards_at_construction(tmp_path):
    # before: built fine and failed only when a reader reached shard-000008
    write_jsonl_shards(tmp_path, make_token_docs(16), 8)
    with pytest.raises(ValueError) as info:
        PackedDataset(str(tmp_path / "shard-{000000..000009}.jsonl"), capacity=64, epochs=1)
    names = ", ".join(repr(str(tmp_path / f"shard-{i:06d}.jsonl")) for i in (8, 9))
    assert str(info.value) == (f"2 of 10 shards do not exist: {names} "
                               "(check the brace range / glob; on_error='skip' reads the others)")


def test_many_missing_shards_are_shown_first_few_and_counted(tmp_path):
    write_jsonl_shards(tmp_path, make_token_docs(4), 2)
    with pytest.raises(ValueError, match=r"^8 of 10 shards do not exist: '.*shard-000002.jsonl', .*"
                                         r"'.*shard-000006.jsonl', \.\.\. \(check"):
        PackedDataset(str(tmp_path / "shard-{000000..000009}.jsonl"), capacity=64)


def test_missing_shards_under_skip_are_logged_not_raised(tmp_path, caplog):
    write_jsonl_shards(tmp_path, make_token_docs(4), 2)
    with caplog.at_level(logging.WARNING, logger="streampack"):
        PackedDataset(str(tmp_path / "shard-{000000..000002}.jsonl"), capacity=64, read=ReadOptions(on_error="skip"))
    assert "1 of 3 shards do not exist" in caplog.text and "skipped as missing_shard" in caplog.text


def test_jsonl_missing_field_names_keys_and_fields_present(tmp_path):
    # before: "missing_field: sample has neither tokens nor text (shard=..., key='0')"
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"id": "doc-7", "content": "hello"}) + "\n")
    with pytest.raises(DataError) as info:
        next(iter(PackedDataset(str(path), capacity=64)))
    assert str(info.value) == (f"missing_field: no 'input_ids' (token ids) or 'text' (text) field "
                               f"(fields: ['id', 'content']); set tokens_key= / text_key= "
                               f"(shard={str(path)!r}, key='0')")
    assert info.value.reason == "missing_field" and info.value.key == "0"


def test_text_without_tokenizer_says_pass_tokenizer(tmp_path):
    # before: "sample '...#0' is not tokenized yet"
    (url,) = write_jsonl_shards(tmp_path, make_text_docs(3), 1)
    with pytest.raises(ValueError) as info:
        next(iter(PackedDataset(url, capacity=64)))
    assert str(info.value) == f"sample '{url}#0' {NOT_TOKENIZED}"
    assert "pass tokenizer=" in NOT_TOKENIZED and "tokens_key=" in NOT_TOKENIZED


def test_parquet_text_column_type_checked_at_construction(tmp_path):
    # before: built fine; the first batch raised bad_dtype on row 0
    path = str(tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": pa.array([1, 2, 3], pa.int64())}), path)
    with pytest.raises(DataError) as info:
        PackedDataset(path, capacity=64)
    assert str(info.value) == ("bad_dtype: text column 'text' has type int64, want string (or UTF-8 binary); "
                               f"set text_key= / tokens_key= to the right column (shard={path!r}, value='int64')")


def test_parquet_token_column_type_checked_at_construction(tmp_path):
    path = str(tmp_path / "a.parquet")
    pq.write_table(pa.table({"input_ids": pa.array([[1.5], [2.0]], pa.list_(pa.float64()))}), path)
    with pytest.raises(DataError, match=r"^bad_dtype: token column 'input_ids' has type list<element: double>, "
                                         r"want a list of integers"):
        PackedDataset(path, capacity=64)


def test_parquet_good_schema_passes(tmp_path):
    path = str(tmp_path / "a.parquet")
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2], [3]], pa.list_(pa.int32())),
                             "text": pa.array([1, 2], pa.int64())}), path)  # ids win: text never read
    assert next(iter(PackedDataset(path, capacity=64, epochs=1))).num_tokens == 3


def test_worker_error_line_names_type_shard_key_reason_and_worker():
    err = DataError("missing_field", "no 'input_ids' field", url="/d/a.jsonl", key="4")
    assert log_worker_error(err, worker_id=1, num_workers=2, dp_rank=3) == (
        "DataLoader worker 1 of 2 (dp_rank 3): DataError missing_field in shard='/d/a.jsonl' key='4': "
        "no 'input_ids' field")
    assert log_worker_error(KeyError("x"), worker_id=0, num_workers=1, dp_rank=0) == (
        "DataLoader worker 0 of 1 (dp_rank 0): KeyError: 'x'")


def test_worker_logs_one_line_before_torch_traceback(tmp_path):
    from torch.utils.data import DataLoader

    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"id": 1}) + "\n" + json.dumps({"input_ids": [1, 2]}) + "\n")
    log_file = tmp_path / "log.txt"
    handler = logging.FileHandler(log_file)  # the worker is another process: caplog cannot see it
    logger = logging.getLogger("streampack")
    logger.addHandler(handler)
    reset_rate_limits()
    try:
        loader = DataLoader(PackedDataset(str(path), capacity=64), batch_size=None, num_workers=1)
        with pytest.raises(DataError) as info, closing_workers(iter(loader)) as batches:
            for _ in batches:
                pass
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert len(str(info.value).splitlines()) > 10  # what torch shows: the worker's whole traceback
    lines = log_file.read_text().splitlines()
    assert lines == [f"DataLoader worker 0 of 1 (dp_rank 0): DataError missing_field in shard={str(path)!r} "
                     "key='0': no 'input_ids' (token ids) or 'text' (text) field (fields: ['id']); "
                     "set tokens_key= / text_key="]


def test_streampack_itself_emits_no_set_vital_warning(tmp_path):
    # torchdata 0.11's StatefulDataLoader.__init__ calls torch.set_vital, deprecated in torch 2.13;
    # streampack's own reading path must not be where a user sees it (pytest's config ignores
    # it globally, hence "always" here)
    from torch.utils.data import DataLoader

    urls = write_jsonl_shards(tmp_path, make_token_docs(20), 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(DataLoader(PackedDataset(urls, capacity=64, epochs=1), batch_size=None))
    assert batches and not [w for w in caught if "set_vital" in str(w.message)]


def test_the_trainer_integrations_build_their_loader_without_the_set_vital_warning(tmp_path):
    from torch.utils.data import IterableDataset

    from streampack import PackedLoader

    class Four(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = PackedLoader(Four())
    assert list(loader) == [0, 1, 2, 3]
    assert not [w for w in caught if "set_vital" in str(w.message)]


def test_batches_per_epoch_not_shared_by_the_workers_is_refused_when_the_loader_is_built(tmp_path):
    # before: each DataLoader worker raised it inside its own process, behind torch's traceback
    from streampack import PackedLoader

    write_jsonl_shards(tmp_path, make_token_docs(16), 2)
    ds = PackedDataset(str(tmp_path / "shard-{000000..000001}.jsonl"), capacity=64, epochs=1,
                       topology=TopologyOptions(batches_per_epoch=3))
    with pytest.raises(ValueError, match=r"batches_per_epoch=3 must be a multiple of num_workers=2"):
        PackedLoader(ds, num_workers=2)
    assert PackedLoader(ds, num_workers=3) is not None
