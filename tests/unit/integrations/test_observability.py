"""Logging under ``streampack``, per-worker stats on every batch, and their aggregation into
TensorBoard / W&B / Lightning loggers in the training process."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from helpers_data import make_token_docs, write_tar_shards
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from streampack import PackedDataset, pack_batch
from streampack.integrations.metrics import StreamMetrics
from streampack.layout.stats import WorkerStats
from streampack.logs import event_counts, get_logger, reset_rate_limits, warn_every
from streampack.nodes.collate import FILLER_KEY
from streampack.options import PackOptions, ReadOptions, TopologyOptions
from streampack.plan.state import dataset_states


@pytest.fixture(autouse=True)
def _fresh_log_state():
    reset_rate_limits()
    yield
    reset_rate_limits()


def test_loggers_live_under_streampack_and_warn_every_rate_limits(caplog) -> None:
    log = get_logger("streampack.io.retry")
    assert get_logger("nodes.collate").name == "streampack.nodes.collate" and log.name.startswith("streampack.")
    with caplog.at_level(logging.WARNING, logger="streampack"):
        assert warn_every(log, "retry", "retry %d of %s", 1, "s3://b/k", interval=3600)
        for i in range(5):
            assert not warn_every(log, "retry", "retry %d of %s", i + 2, "s3://b/k", interval=3600)
        assert warn_every(log, "retry", "retry %d", 7, interval=0)
    lines = [r.getMessage() for r in caplog.records if r.name == "streampack.io.retry"]
    assert lines == ["retry 1 of s3://b/k", "retry 7 (5 more retry event(s) suppressed in the last 0 s)"]
    assert event_counts() == {"retry": 7}  # every call counted, suppressed ones included
    logging.getLogger("streampack").setLevel(logging.ERROR)
    try:
        assert not warn_every(log, "retry", "below the level")
    finally:
        logging.getLogger("streampack").setLevel(logging.NOTSET)
    assert event_counts() == {"retry": 8}  # counted even when not logged


def _shards(tmp_path: Path, n: int = 120, num_shards: int = 4) -> list[str]:
    return write_tar_shards(tmp_path, make_token_docs(n, max_len=50, seed=1), num_shards)


def test_every_batch_carries_its_readers_running_totals(tmp_path: Path) -> None:
    ds = PackedDataset(_shards(tmp_path), capacity=64, epochs=1, packs_per_batch=2, packing=PackOptions(window=16))
    batches = list(ds)
    assert batches and all(isinstance(b.stats, WorkerStats) for b in batches)
    last = batches[-1].stats
    assert (last.dp_rank, last.worker_id) == (0, 0)
    assert [b.stats.batches for b in batches] == list(range(1, len(batches) + 1))
    # the last batch is completed with a filler pack (pad tokens, zero targets): not data
    real = [[i for i, k in enumerate(b.doc_keys) if k != FILLER_KEY] for b in batches]
    lengths = [b.doc_lengths.tolist() for b in batches]
    filler_packs = sum(b.doc_keys.count(FILLER_KEY) for b in batches)
    assert filler_packs == 1 and batches[-1].doc_keys[-1] == FILLER_KEY
    assert last.docs == sum(len(r) for r in real) == 120
    assert last.tokens == sum(lengths[j][i] for j, r in enumerate(real) for i in r)
    assert last.packs == sum(b.num_packs for b in batches) - filler_packs
    assert last.slots == last.packs * 64
    assert last.targets == sum(b.num_targets for b in batches)
    assert last.fill == pytest.approx(ds.metrics()["packing"]["fill"])
    assert last.build_seconds > 0 and last.skipped == 0 and last.fillers == 0
    assert pack_batch([[[1, 2]]], capacity=4).stats is None  # only the pipeline attaches stats


def test_totals_continue_across_a_resume(tmp_path: Path) -> None:
    urls = _shards(tmp_path)
    ds = PackedDataset(urls, capacity=64, packing=PackOptions(window=16))
    it = iter(ds)
    first = [next(it) for _ in range(5)]
    state = ds.state_dict()
    after = next(it).stats
    resumed = PackedDataset(urls, capacity=64, packing=PackOptions(window=16))
    resumed.load_state_dict(state)
    again = next(iter(resumed)).stats
    assert again.batches == after.batches == 6
    assert (again.docs, again.tokens, again.slots) == (after.docs, after.tokens, after.slots)
    assert first[-1].stats.docs < again.docs


def test_skips_and_fillers_are_counted(tmp_path: Path) -> None:
    good = [{"input_ids": list(range(1, 9))} for _ in range(6)]
    path = tmp_path / "a.jsonl"
    lines = [json.dumps(d) for d in good]
    lines.insert(3, "{not json")
    path.write_text("\n".join(lines) + "\n")
    skipped = 0
    for rank in (0, 1):  # the bad line lands on one of the two ranks
        ds = PackedDataset([str(path)], capacity=16, epochs=1, read=ReadOptions(on_error="skip"),
                           packing=PackOptions(window=4),
                           topology=TopologyOptions(dp_rank=rank, dp_size=2, batches_per_epoch=8))
        stats = list(ds)[-1].stats
        assert stats.skipped == ds.metrics()["errors"]["total"]
        assert stats.fillers == ds.metrics()["batches"]["fillers"] > 0
        assert stats.batches == 8 and stats.docs <= 6  # fillers add no documents, tokens or slots
        assert stats.tokens == 8 * stats.docs
        skipped += stats.skipped
    assert skipped == 1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stream_metrics_equal_the_loader_state_without_reading_it(tmp_path: Path, num_workers: int) -> None:
    """What used to need every worker's serialised state comes with the batches."""
    urls = _shards(tmp_path, n=160)
    ds = PackedDataset(urls, capacity=64, epochs=1, packing=PackOptions(window=16))
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=num_workers)
    metrics = StreamMetrics()
    batches = []
    for batch in loader:
        metrics.update(batch)
        batches.append(batch)
    totals = metrics.totals()
    assert metrics.readers == max(num_workers, 1)
    assert totals["docs"] == 160 == sum(b.num_docs for b in batches)
    assert totals["tokens"] == sum(b.num_tokens for b in batches)
    per_worker = [s["metrics"]["batches"] for s in dataset_states(loader.state_dict())]
    assert totals["batches"] == sum(w["batches"] for w in per_worker) == len(batches)
    assert totals["fill"] == pytest.approx(sum(w["tokens"] for w in per_worker) / sum(w["slots"] for w in per_worker))


def test_a_new_pass_never_makes_totals_go_backwards(tmp_path: Path) -> None:
    ds = PackedDataset(_shards(tmp_path, n=40, num_shards=2), capacity=64, epochs=1, packing=PackOptions(window=8))
    metrics = StreamMetrics()
    seen = []
    for _ in range(2):  # two passes: each reader's totals restart at 0
        for batch in DataLoader(ds, batch_size=None):
            metrics.update(batch)
            seen.append(metrics.totals()["docs"])
    assert seen == sorted(seen) and seen[-1] == 80


def test_slow_batches_are_logged_and_counted(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("STREAMPACK_SLOW_BATCH_SECONDS", "0")
    ds = PackedDataset(_shards(tmp_path, n=30), capacity=64, epochs=1, packing=PackOptions(window=8))
    with caplog.at_level(logging.INFO, logger="streampack"):
        batches = list(ds)
    messages = [r.getMessage() for r in caplog.records if r.name == "streampack.nodes.collate"]
    assert messages[0].startswith("rank 0 worker 0: first batch after")
    assert any("took" in m and "STREAMPACK_SLOW_BATCH_SECONDS" in m for m in messages[1:])
    assert batches[-1].stats.events["slow_batch"] == len(batches) - 1  # all but the first


class FakeRun:
    """A W&B run's ``log(dict, step=)``."""

    def __init__(self) -> None:
        self.logged: list[tuple[dict, int]] = []

    def log(self, values: dict, step: int) -> None:
        self.logged.append((values, step))


class FakeLightningLogger:
    def __init__(self) -> None:
        self.logged: list[tuple[dict, int]] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.logged.append((metrics, step))


def test_log_to_tensorboard_wandb_and_lightning_loggers(tmp_path: Path) -> None:
    ds = PackedDataset(_shards(tmp_path, n=40), capacity=64, epochs=1, packing=PackOptions(window=8))
    metrics = StreamMetrics()
    for batch in ds:
        metrics.update(batch)
    scalars = metrics.scalars()
    assert scalars["streampack/docs"] == 40 and 0 < scalars["streampack/fill"] <= 1
    run, lightning_logger = FakeRun(), FakeLightningLogger()
    metrics.log_to(run, step=7)
    metrics.log_to(lightning_logger, step=7)
    assert run.logged == [(scalars, 7)] and lightning_logger.logged == [(scalars, 7)]
    with pytest.raises(TypeError, match="add_scalar"):
        metrics.log_to(object(), step=0)
    tensorboard = pytest.importorskip("torch.utils.tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = tensorboard.SummaryWriter(str(tmp_path / "tb"))
    metrics.log_to(writer, step=7)
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(scalars)
    (point,) = events.Scalars("streampack/tokens")
    assert point.step == 7 and point.value == pytest.approx(scalars["streampack/tokens"])


def _reduce_worker(rank: int, world: int, init_file: str, results: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        metrics = StreamMetrics()
        metrics.update(WorkerStats(dp_rank=rank, worker_id=0, batches=1, docs=3 + rank, tokens=10,
                                   slots=20, packs=1, events={f"kind{rank}": 1}))
        results[rank] = metrics.scalars(group=True)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_scalars_sum_over_ranks(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_reduce_worker, args=(2, str(tmp_path / "init"), results), nprocs=2)
        got = dict(results)
    for rank in (0, 1):
        assert got[rank]["streampack/docs"] == 7 and got[rank]["streampack/fill"] == 0.5
        assert got[rank]["streampack/events/kind0"] == got[rank]["streampack/events/kind1"] == 1


def test_batches_with_stats_still_move_and_pin(tmp_path: Path) -> None:
    batch = next(iter(PackedDataset(_shards(tmp_path, n=20), capacity=64, epochs=1, packing=PackOptions(window=8))))
    moved = batch.to("meta")
    assert moved.stats is batch.stats and moved.input_ids.device.type == "meta"
    assert torch.equal(batch.to("cpu").input_ids, batch.input_ids)
