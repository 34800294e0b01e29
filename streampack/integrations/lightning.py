"""Lightning ``Trainer`` on a :class:`~streampack.dataset.PackedDataset` (docs/integrations.md).

``trainer.fit(model, datamodule=PackedDataModule(ds, num_workers=2), ckpt_path=...)``: the ``training_step`` receives a
:class:`~streampack.layout.batch.PackedBatch` on the model's device. Each part answers a measured failure:

* **The position of the batches trained.** Lightning fetches one batch ahead, so a loader's own
  state at a checkpoint would skip a batch on resume: the module's loader keeps the state after
  each batch, counts the batches handed to ``training_step`` and saves the one at the last trained
  batch; every rank's state is gathered into the checkpoint. On another world size or
  ``num_workers`` the resume is elastic (:mod:`streampack.integrations.resume`).
* **A resume that silently restarts the data.** ``fit(ckpt_path="last")`` without ``save_last=True``
  or a ``dirpath`` finds no checkpoint and only warns. When a fit restores no data position while
  checkpoints exist, the module warns naming both; a checkpoint without its state is a ``ValueError``.
* **Workers that outlive the fit**: ``teardown`` shuts them down (Lightning only does so for the
  DataLoaders it sees). **Stream metrics** go to the loggers every ``log_every_n_steps``.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden

from streampack.integrations.metrics import StreamMetrics
from streampack.integrations.packed_loader import PackedLoader
from streampack.integrations.resume import LoaderResume, plan_resume

STATES_KEY = "loader_states"


class TrainedLoader:
    """Iterates a :class:`~streampack.PackedLoader` and gives its state as of the last batch trained
    (:meth:`trained_state`), which is behind the last one fetched. Not a DataLoader and without ``state_dict``, so
    Lightning neither re-creates it nor saves its own, one-batch-ahead, state for it. With workers the loader asks
    them for the state of that batch when a checkpoint needs it; in-process the state after each batch is kept until
    the batch is trained (the dataset's state is its current one)."""

    def __init__(self, loader: PackedLoader) -> None:
        self.loader = loader
        self._states: dict[int, dict[str, Any]] = {}
        self._trained = self._yielded = 0

    def __iter__(self) -> Iterator[Any]:
        self._states, self._trained = {}, 0
        keep = self.loader.num_workers == 0
        for self._yielded, batch in enumerate(self.loader, 1):
            if keep:
                self._states[self._yielded] = self.loader.state_dict()
            yield batch

    def mark_trained(self) -> None:
        self._trained += 1
        for k in [k for k in self._states if k < self._trained]:
            del self._states[k]

    def trained_state(self) -> dict[str, Any]:
        if self.loader.num_workers:
            return self.loader.state_dict_before(self._yielded - self._trained)
        return self._states.get(self._trained) or self.loader.state_dict()

    def close(self) -> None:
        """Shut the loader's workers down now (Lightning only shuts down the DataLoaders it sees)."""
        self.loader.close()


class PackedDataModule(L.LightningDataModule):
    """Training data from a PackedDataset. ``num_workers``, ``pin_memory`` (default: with CUDA),
    ``persistent_workers``, ``prefetch_factor`` and ``snapshot_every_n_steps`` (set it to the checkpoint interval
    in loader batches: docs/integrations.md) go to the :class:`~streampack.PackedLoader`; ``log_metrics=False`` keeps
    the stream metrics (``dm.stream_metrics``) out of the loggers."""

    def __init__(self, train_dataset: Any, *, num_workers: int = 0, pin_memory: bool | None = None,
                 persistent_workers: bool = False, prefetch_factor: int | None = None,
                 snapshot_every_n_steps: int = 1, log_metrics: bool = True) -> None:
        super().__init__()
        self.train_dataset = train_dataset
        self.loader_kwargs = {"num_workers": num_workers,
                              "pin_memory": torch.cuda.is_available() if pin_memory is None else pin_memory,
                              "persistent_workers": persistent_workers if num_workers else False,
                              "prefetch_factor": prefetch_factor if num_workers else None,
                              "snapshot_every_n_steps": snapshot_every_n_steps}
        self.log_metrics = log_metrics
        self.stream_metrics = StreamMetrics()
        self._loader: TrainedLoader | None = None
        self._resume: LoaderResume | None = None
        self._restored = False  # load_state_dict ran in this fit
        self._check_resume = True  # the first train_dataloader of this fit checks it
        self._logged_step = -1

    def setup(self, stage: str) -> None:
        """Subclasses that override ``setup`` call ``super().setup(stage)``."""
        self._check_resume = True

    def train_dataloader(self) -> TrainedLoader:
        if self._check_resume or self._loader is None:
            self._check_resume = False
            self._check_restored()
        loader = PackedLoader(self.train_dataset, **self.loader_kwargs)
        if self._resume is not None:
            self._resume.apply(self.train_dataset, loader)
            self._resume = None
        self._loader = TrainedLoader(loader)
        return self._loader

    def _check_restored(self) -> None:
        """A fit that restores no data position where the user meant to resume (module docstring)."""
        restored, self._restored = self._restored, False
        trainer = self.trainer
        if restored or trainer is None:
            return
        if trainer.ckpt_path:
            raise ValueError(f"the checkpoint {trainer.ckpt_path} holds no {type(self).__qualname__} state (it "
                             f"was not saved with this datamodule): the data position is unknown and the stream "
                             f"would restart at its first batch")
        if trainer.global_step:
            return
        dirs = [str(cb.dirpath) for cb in trainer.checkpoint_callbacks
                if isinstance(cb, ModelCheckpoint) and cb.dirpath]
        found = [f for d in dirs for f in _checkpoint_files(d)]
        earlier = [f for d in dirs for f in _earlier_runs_checkpoints(trainer, d)]
        if earlier and not found:
            rank_zero_warn(
                f"PackedDataModule: this fit restored no data position, but earlier runs saved {len(earlier)} "
                f"checkpoint(s) (e.g. {earlier[-1]}): the data restarts at batch 1. A ModelCheckpoint without "
                f"dirpath saves under the logger's folder of each run (lightning_logs/version_N/checkpoints), so a "
                f"rerun looks in a new, empty one and ckpt_path='last' finds nothing: give it a fixed "
                f"ModelCheckpoint(dirpath=..., save_last=True)")
        elif found:
            rank_zero_warn(
                f"PackedDataModule: this fit restored no data position, but {len(found)} checkpoint(s) already "
                f"exist (e.g. {found[0]}): the data restarts at batch 1. To resume, pass ckpt_path=<a checkpoint>, "
                f"or ckpt_path='last' with ModelCheckpoint(..., save_last=True): without save_last=True there is "
                f"no last checkpoint and ckpt_path='last' loads nothing")

    def teardown(self, stage: str) -> None:
        """Subclasses that override ``teardown`` call ``super().teardown(stage)``."""
        if self._loader is not None:
            self._loader.close()

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        trainer = self.trainer
        if trainer is not None and trainer.training and self._loader is not None:
            self._loader.mark_trained()
            self.stream_metrics.update(batch)
            self._maybe_log(trainer)
        module = trainer.lightning_module if trainer is not None else None
        if module is not None and is_overridden("on_before_batch_transfer", module):
            batch = module.on_before_batch_transfer(batch, dataloader_idx)
        return batch

    def _maybe_log(self, trainer: Any) -> None:
        step = trainer.global_step
        if not self.log_metrics or step == self._logged_step or step % trainer.log_every_n_steps:
            return
        self._logged_step = step
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        scalars = self.stream_metrics.scalars(group=True if distributed else None)
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step)

    def state_dict(self) -> dict[str, Any]:
        if self._loader is None:
            return {}
        state = self._loader.trained_state()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            states: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(states, state)  # Lightning saves from rank 0
            return {STATES_KEY: states}
        return {STATES_KEY: [state]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = True
        if not state_dict:  # saved before the first batch: the start of the stream is right
            return
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank = torch.distributed.get_rank() if distributed else 0
        self._resume = plan_resume(state_dict[STATES_KEY], rank=rank, dataset=self.train_dataset,
                                   num_workers=self.loader_kwargs["num_workers"])


def _earlier_runs_checkpoints(trainer: Any, dirpath: str) -> list[str]:
    """Checkpoints in the other ``version_*`` folders when ``dirpath`` is Lightning's default, the
    ``checkpoints`` folder inside this run's logger folder (a new one for every process)."""
    log_dir = getattr(trainer.loggers[0], "log_dir", None) if trainer.loggers else None
    if not log_dir:
        return []
    log_dir = posixpath.normpath(str(log_dir))
    if posixpath.normpath(str(dirpath)) != posixpath.join(log_dir, "checkpoints"):
        return []  # a dirpath the user chose: the same folder in every run
    fs, runs, this_run = get_filesystem(log_dir), posixpath.dirname(log_dir), posixpath.basename(log_dir)
    if not fs.isdir(runs):
        return []
    others = sorted(str(d).rstrip("/") for d in fs.ls(runs, detail=False))
    return [f for d in others if posixpath.basename(d) != this_run
            for f in _checkpoint_files(posixpath.join(d, "checkpoints"))]


def _checkpoint_files(dirpath: str) -> list[str]:
    fs = get_filesystem(dirpath)
    if not fs.isdir(dirpath):
        return []
    return sorted(p for p in fs.ls(dirpath, detail=False) if str(p).endswith(ModelCheckpoint.FILE_EXTENSION))
