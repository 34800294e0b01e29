"""Issue 13, finding 5: a DataError raised in a DataLoader worker reaches the training loop as a
DataError (``except DataError`` / ``except ValueError`` fire, ``reason``/``url``/``key`` survive),
and skip counts from the workers are visible in the main process."""

from __future__ import annotations

import json
import pickle
import sys

import pytest
from helpers_hostile import closing_workers, write_bytes
from torch.utils.data import DataLoader

from streampack.dataset import PackedDataset
from streampack.errors import DataError, ErrorPolicy
from streampack.options import PackOptions, ReadOptions
from streampack.plan.state import dataset_states


def test_data_error_rebuilds_from_its_message_and_pickles() -> None:
    err = DataError("bad_json", "Expecting ',' (shard='fake', key='x')\nsecond line", url="/d/it's.tar",
                    key='k"1', value="v" * 10_000, skipped_bytes=7)
    for back in (DataError(str(err)), pickle.loads(pickle.dumps(err))):
        assert isinstance(back, DataError) and isinstance(back, ValueError)
        assert (back.reason, back.url, back.key) == ("bad_json", "/d/it's.tar", 'k"1')
        assert back.detail == "Expecting ',' (shard ='fake', key='x') second line"
    assert len(err.value) <= 256  # the exception keeps a short value, not the whole line
    assert DataError("no structure here").reason == "unknown"


def test_torch_worker_reraise_keeps_the_type_and_fields() -> None:
    from torch._utils import ExceptionWrapper

    try:
        try:
            raise KeyError("cause")
        except KeyError as cause:
            raise DataError("corrupt_shard", "cut", url="s3://b/x.tar", key="000042", value=9) from cause
    except DataError:
        wrapped = ExceptionWrapper(sys.exc_info(), where="in DataLoader worker process 1")
    with pytest.raises(DataError) as info:
        wrapped.reraise()
    e = info.value
    assert (e.reason, e.url, e.key) == ("corrupt_shard", "s3://b/x.tar", "000042")
    assert "DataLoader worker process 1" in str(e) and "Traceback" in str(e)


def _shards(tmp_path) -> list[str]:
    rows = [{"input_ids": [i + 1, 5]} for i in range(12)]
    rows[7] = {"input_ids": [1, 2 ** 40]}
    good = write_bytes(tmp_path / "a.jsonl", "".join(json.dumps(r) + "\n" for r in rows[:6]).encode())
    bad = write_bytes(tmp_path / "b.jsonl", "".join(json.dumps(r) + "\n" for r in rows[6:]).encode()
                      + b'{"input_ids": ' + b"[" * 500 + b"]" * 500 + b"}\n")
    return [good, bad]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_raise_mode_reaches_the_loop_as_data_error(tmp_path, num_workers: int) -> None:
    # before: with workers, except DataError / except ValueError never fired (RuntimeError)
    urls = _shards(tmp_path)
    ds = PackedDataset(urls, capacity=16, epochs=1, shuffle=False, packing=PackOptions(window=4))
    loader = DataLoader(ds, batch_size=None, num_workers=num_workers)
    with pytest.raises(DataError) as info, closing_workers(iter(loader)) as batches:
        for _ in batches:
            pass
    e = info.value
    assert isinstance(e, ValueError)
    # the bad shard may be split between the workers: either of its bad lines can come first
    assert (e.reason, e.url, e.key) in {("out_of_vocab_id", urls[1], "1"), ("json_too_deep", urls[1], "6")}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_skip_mode_counts_reach_the_main_process(tmp_path, num_workers: int) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    urls = _shards(tmp_path)
    ds = PackedDataset(urls, capacity=16, epochs=1, shuffle=False, read=ReadOptions(on_error="skip"),
                       packing=PackOptions(window=4))
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=num_workers)
    with closing_workers(iter(loader)) as batches:
        docs = sum(b.num_docs for b in batches)
    metrics = [s["metrics"] for s in dataset_states(loader.state_dict())] if num_workers else [ds.metrics()]
    counts: dict[str, int] = {}
    for m in metrics:
        for reason, n in m["errors"]["counts"].items():
            counts[reason] = counts.get(reason, 0) + n
    assert docs == 11 and counts == {"out_of_vocab_id": 1, "json_too_deep": 1}


def test_skips_are_logged_rate_limited_and_raises_are_not(tmp_path, caplog) -> None:
    from streampack.logs import reset_rate_limits
    from streampack.nodes.reader import ShardReader

    urls = _shards(tmp_path)
    reset_rate_limits()
    with caplog.at_level("WARNING", logger="streampack"):
        list(ShardReader(urls, shuffle=False, epochs=1, error_policy=ErrorPolicy("skip")))
        list(ShardReader(urls, shuffle=False, epochs=1,
                         error_policy=ErrorPolicy("skip")))  # the same reasons again: suppressed
    logged = sorted(r.getMessage().split(" (1 ")[1].split()[0] for r in caplog.records)
    assert logged == ["json_too_deep", "out_of_vocab_id"], [r.getMessage() for r in caplog.records]
    caplog.clear()
    reset_rate_limits()
    with caplog.at_level("WARNING", logger="streampack"), pytest.raises(DataError):
        list(ShardReader(urls, shuffle=False, epochs=1))
    assert not caplog.records
