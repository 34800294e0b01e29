"""Lightning's real ``Trainer`` on a PackedDataset, on CPU: batches through its device and
precision helpers, an exact data position across a checkpoint resume (where Lightning's own
stateful-loader support is one batch ahead), stream metrics in its loggers."""

from __future__ import annotations

import glob
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_data import make_token_docs, write_tar_shards
from node_checks import collect_documents
from topology_sim import SimRank

from streampack import PackedDataset, pack_batch
from streampack.options import PackOptions, TopologyOptions
from tests.integration.test_examples import EXAMPLES, run

L = pytest.importorskip("lightning")
from lightning.pytorch.loggers import Logger  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from streampack.integrations.lightning import STATES_KEY, PackedDataModule  # noqa: E402
from streampack.integrations.resume import every_reader  # noqa: E402


@pytest.fixture(scope="module")
def urls(tmp_path_factory) -> list[str]:
    return write_tar_shards(tmp_path_factory.mktemp("lit"), make_token_docs(300, max_len=60, vocab=128, seed=2), 4)


class TinyLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = torch.nn.Embedding(128, 16), torch.nn.Linear(16, 128)
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        assert batch.input_ids.device == self.device and batch.varlen_cu_seqlens.device == self.device
        self.seen.append(batch.input_ids.clone())
        logits = self.out(self.emb(batch.input_ids)).float()
        loss = torch.nn.functional.cross_entropy(logits, batch.labels, ignore_index=batch.ignore_index)
        self.log("loss", loss, batch_size=batch.num_targets)
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Recorder(Logger):
    name, version = "recorder", 0

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[dict, int]] = []

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.logged.append((dict(metrics), step))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def fit(datamodule: Any, steps: int, out: Path, ckpt: str | None = None, model: TinyLM | None = None,
        **kw: Any) -> TinyLM:
    model = model if model is not None else TinyLM()
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(out), every_n_train_steps=3, save_top_k=-1)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[checkpoints],
                        **{"logger": False, "accumulate_grad_batches": 2, **kw})
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt)
    return model


def _forked_children() -> set[int]:
    """This process's live children running this same program: forked DataLoader workers."""
    import psutil

    me = psutil.Process()
    return {p.pid for p in me.children() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            and p.cmdline() == me.cmdline()}


@pytest.mark.slow
def test_a_fit_leaves_no_worker_processes(urls: list[str], tmp_path: Path) -> None:
    before = _forked_children()
    dm = PackedDataModule(PackedDataset(urls, capacity=64, packing=PackOptions(window=8)), num_workers=2)
    model = fit(dm, steps=3, out=tmp_path)
    try:
        left = _forked_children() - before
        assert not left, f"{len(left)} DataLoader worker process(es) still running after trainer.fit returned"
    finally:
        model.trainer.train_dataloader.close()  # the PackedDataModule's TrainedLoader: not leaked into later tests


@pytest.mark.parametrize("precision", ["bf16-true", "64-true"])
def test_lightning_precision_and_device_helpers_take_packed_batches(precision: str) -> None:
    """Lightning's precision plugins run apply_to_collection on every batch; it raised "A frozen
    dataclass was passed" for PackedBatch and HFInputs."""
    from lightning.fabric.utilities.apply_func import move_data_to_device

    batch = pack_batch([[{"input_ids": [1, 2, 3], "pos3d": [[0.5] * 3] * 3},
                         {"input_ids": [4, 5], "pos3d": [[1.5] * 3] * 2}]], capacity=8, align=2)
    plugin = L.Trainer(accelerator="cpu", precision=precision, logger=False).precision_plugin
    converted = plugin.convert_input(batch)
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float64
    assert converted.extras["pos3d"].dtype == dtype and converted.input_ids.dtype == torch.int32
    assert type(plugin.convert_input(batch.hf_inputs())).__name__ == "HFInputs"
    for record in (batch, batch.hf_inputs()):
        moved = move_data_to_device(record, torch.device("meta"))
        assert type(moved) is type(record)
    # apply_to_collection deep-copies the batch and sets the moved tensors on the copy: the moved batch must not
    # answer with the CPU labels the original derived, but derive its own on its device
    assert batch.labels.device.type == "cpu"
    moved = move_data_to_device(batch, torch.device("meta"))
    assert moved.labels.device.type == "meta" and moved.position_ids.device.type == "meta"


def test_fit_with_the_datamodule_logs_stream_metrics(urls: list[str], tmp_path: Path) -> None:
    logger = Recorder()
    dm = PackedDataModule(PackedDataset(urls, capacity=64, packing=PackOptions(window=8)))
    model = fit(dm, steps=2, out=tmp_path, logger=logger, log_every_n_steps=1, precision="bf16-true")
    assert len(model.seen) == 4
    streamed = [m for m, _ in logger.logged if "streampack/tokens" in m]
    last = streamed[-1]
    assert streamed and last["streampack/batches"] >= 3 and 0.5 < last["streampack/fill"] <= 1
    assert last["streampack/fill"] == pytest.approx(last["streampack/tokens"] / last["streampack/slots"])
    assert dm.stream_metrics.totals()["batches"] >= 4


def _resumed(urls: list[str], tmp_path: Path, make_dm: Any) -> tuple[TinyLM, TinyLM]:
    full = fit(make_dm(), steps=6, out=tmp_path / "full")
    fit(make_dm(), steps=3, out=tmp_path / "cut")
    (checkpoint,) = glob.glob(str(tmp_path / "cut" / "*step=3*"))
    return full, fit(make_dm(), steps=6, out=tmp_path / "cut", ckpt=checkpoint)


@pytest.mark.slow
@pytest.mark.parametrize(("workers", "snapshot"), [(0, 1), (2, 1), (2, 2)])
def test_resume_from_a_lightning_checkpoint_is_exact(urls: list[str], tmp_path: Path, workers: int,
                                                     snapshot: int) -> None:
    """SGD without a schedule: the step-3 checkpoint of a 3-step run is the 6-step run's (with workers snapshotting
    every 2 steps, step 3 is off the interval: the restored loader replays one batch)."""
    full, resumed = _resumed(urls, tmp_path, lambda: PackedDataModule(
        PackedDataset(urls, capacity=64, packing=PackOptions(window=8)), num_workers=workers,
        snapshot_every_n_steps=snapshot))
    assert len(full.seen) == 12 and len(resumed.seen) == 6
    assert all(torch.equal(a, b) for a, b in zip(full.seen[6:], resumed.seen))
    assert all(torch.equal(p, q) for p, q in zip(full.parameters(), resumed.parameters()))


@pytest.mark.slow
def test_lightnings_own_stateful_loader_support_skips_the_prefetched_batch(urls: list[str], tmp_path: Path) -> None:
    """Why the module tracks trained batches: a plain StatefulDataLoader's state, saved by
    Lightning, is one batch ahead (Lightning fetches ahead), so the resume skips a batch."""

    class Native(L.LightningDataModule):
        def train_dataloader(self) -> StatefulDataLoader:
            return StatefulDataLoader(PackedDataset(urls, capacity=64, packing=PackOptions(window=8)), batch_size=None)

    full, resumed = _resumed(urls, tmp_path, Native)
    assert torch.equal(full.seen[7], resumed.seen[0])  # batch 6 was never trained


def _trace(out: Path) -> list[list[tuple[int, str]]]:
    """``trained.txt`` of the example, one list of (batch number, digest) per run of the script."""
    runs: list[list[tuple[int, str]]] = []
    for line in (out / "trained.txt").read_text().splitlines():
        if line.startswith("# run"):
            runs.append([])
        else:
            n, digest = line.split()
            runs[-1].append((int(n), digest))
    return runs


def _trained_lines(out: Path) -> int:
    try:
        return sum(1 for line in (out / "trained.txt").read_text().splitlines() if not line.startswith("#"))
    except FileNotFoundError:
        return 0


@pytest.mark.slow
def test_example_lightning_train_resumes_after_sigkill_and_a_rerun(tmp_path: Path) -> None:
    """The README's recipe as a real process: SIGKILLed mid-run, the same command again trains
    exactly the batches an uninterrupted run trains, from the last checkpoint, to the same weights."""
    script = [sys.executable, str(EXAMPLES / "lightning_train.py"), "--steps", "8", "--every", "2", "--workers", "2"]
    run([*script, "--out", str(tmp_path / "full")])
    cut = tmp_path / "cut"
    with open(tmp_path / "cut.log", "wb") as log:
        proc = subprocess.Popen([*script, "--out", str(cut)], cwd=EXAMPLES.parent, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 400
        # past the step-4 checkpoint (batch 8), mid-step: the kill loses trained batches 8 and 9
        while _trained_lines(cut) < 10 and proc.poll() is None:
            assert time.monotonic() < deadline, (tmp_path / "cut.log").read_text()[-3000:]
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it was killed"
    out = run([*script, "--out", str(cut)])
    full, (killed, rerun) = _trace(tmp_path / "full"), _trace(cut)
    assert rerun[0][0] >= 4 and rerun[0][0] <= len(killed), f"the rerun started at batch {rerun[0][0]}: {out}"
    assert dict(killed[:rerun[0][0]] + rerun) == dict(full[0]) and len(full[0]) == 16
    assert (cut / "weights.txt").read_text() == (tmp_path / "full" / "weights.txt").read_text()
    (metrics,) = (tmp_path / "full").rglob("metrics.csv")
    assert "streampack/fill" in metrics.read_text().splitlines()[0]


def test_a_rerun_without_a_checkpoint_dirpath_warns_that_the_data_restarts(urls: list[str], tmp_path: Path) -> None:
    """Lightning's default ModelCheckpoint saves under lightning_logs/version_0/checkpoints; a
    second run of the same script gets version_1, ckpt_path="last" finds nothing there and the
    data restarts at batch 1 (before: no warning, the module looked in the new, empty folder)."""
    def one_run() -> None:
        trainer = L.Trainer(max_steps=1, accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=str(tmp_path), logger=L.pytorch.loggers.CSVLogger(str(tmp_path)))
        trainer.fit(TinyLM(), datamodule=PackedDataModule(PackedDataset(urls, capacity=64)), ckpt_path="last")

    one_run()
    assert glob.glob(str(tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "*.ckpt"))
    with pytest.warns(UserWarning, match=r"restored no data position.*version_0.*ModelCheckpoint\(dirpath="):
        one_run()


class Keeper(TinyLM):
    """Keeps every trained batch (their doc_keys show which samples were trained)."""

    def __init__(self, trained: list[Any]) -> None:
        super().__init__()
        self.trained = trained

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        self.trained.append(batch)
        return super().training_step(batch, batch_idx)


def readme_fit(model: Any, dm: PackedDataModule, out: Path, steps: int, **checkpoint: Any) -> None:
    """The README's Lightning snippet, at test scale (every 3 steps instead of 500)."""
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                        logger=False, callbacks=[L.pytorch.callbacks.ModelCheckpoint(
                            dirpath=str(out), every_n_train_steps=3, **checkpoint)])
    trainer.fit(model, datamodule=dm, ckpt_path="last")


@pytest.mark.slow
def test_the_readme_snippet_with_save_last_resumes_exactly(urls: list[str], tmp_path: Path) -> None:
    """``ModelCheckpoint(every_n_train_steps=..., save_last=True)`` + ``ckpt_path="last"``, run
    once, stopped at step 3 (a preemption), run again: the batches of an uninterrupted run."""
    make_dm = lambda: PackedDataModule(PackedDataset(urls, capacity=64, packing=PackOptions(window=8)))  # noqa: E731
    full = TinyLM()
    readme_fit(full, make_dm(), tmp_path / "full", steps=6, save_last=True)
    readme_fit(TinyLM(), make_dm(), tmp_path / "cut", steps=3, save_last=True)
    resumed = TinyLM()
    readme_fit(resumed, make_dm(), tmp_path / "cut", steps=6, save_last=True)
    assert len(full.seen) == 6 and len(resumed.seen) == 3
    assert all(torch.equal(a, b) for a, b in zip(full.seen[3:], resumed.seen))
    assert all(torch.equal(p, q) for p, q in zip(full.parameters(), resumed.parameters()))


@pytest.mark.slow
def test_a_resume_that_restores_no_data_position_says_so(urls: list[str], tmp_path: Path) -> None:
    """The README's old snippet (no ``save_last=True``): ``ckpt_path="last"`` loaded nothing,
    Lightning only hinted at it, and the data restarted at batch 1 with no word from
    streampack. A checkpoint without the datamodule's state is refused."""
    make_dm = lambda: PackedDataModule(PackedDataset(urls, capacity=64, packing=PackOptions(window=8)))  # noqa: E731
    first = TinyLM()
    readme_fit(first, make_dm(), tmp_path, steps=3)
    again = TinyLM()
    with pytest.warns(UserWarning, match=r"restored no data position.*save_last=True"):
        readme_fit(again, make_dm(), tmp_path, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(first.seen, again.seen))  # batch 1 again: why it warns
    (saved,) = glob.glob(str(tmp_path / "*step=3.ckpt"))
    checkpoint = torch.load(saved, weights_only=False)
    del checkpoint["PackedDataModule"]  # e.g. saved with another datamodule
    torch.save(checkpoint, tmp_path / "foreign.ckpt")
    with pytest.raises(ValueError, match="holds no PackedDataModule state"):
        fit(make_dm(), steps=6, out=tmp_path / "x", ckpt=str(tmp_path / "foreign.ckpt"))


@pytest.mark.slow
def test_elastic_resume_through_lightning_trains_every_sample_once(tmp_path: Path) -> None:
    """2 ranks x 0 workers train 3 steps, their states gathered into the checkpoint (what
    ``state_dict`` does under torch.distributed, simulated here); 1 rank x 2 workers resumes:
    every sample of the epoch once. Before, a changed world size was refused."""
    docs = make_token_docs(120, max_len=60, vocab=128, seed=5)
    shards = write_tar_shards(tmp_path / "data", docs, 3)
    make = lambda rank, size: PackedDataset(shards, capacity=64, epochs=1, packing=PackOptions(window=8),
                                            topology=TopologyOptions(dp_rank=rank, dp_size=size, equal_batches="count"))
    trained: list[Any] = []
    states = []
    for rank in range(2):
        fit(PackedDataModule(make(rank, 2)), steps=3, out=tmp_path / f"rank{rank}", accumulate_grad_batches=1,
            model=Keeper(trained))
        (saved,) = glob.glob(str(tmp_path / f"rank{rank}" / "*step=3.ckpt"))
        checkpoint = torch.load(saved, weights_only=False)
        states += checkpoint["PackedDataModule"][STATES_KEY]
    assert len(trained) == 6 and len(states) == 2
    checkpoint["PackedDataModule"][STATES_KEY] = states  # one state per rank, as all_gather_object gives
    torch.save(checkpoint, tmp_path / "gathered.ckpt")
    left = len(list(SimRank(lambda: make(0, 1), 2, load=every_reader(states))))
    fit(PackedDataModule(make(0, 1), num_workers=2), steps=3 + left, out=tmp_path / "resumed",
        ckpt=str(tmp_path / "gathered.ckpt"), accumulate_grad_batches=1, model=Keeper(trained))
    assert len(trained) == 6 + left
    assert collect_documents(trained) == {f"{i:08d}": doc for i, doc in enumerate(docs)}
