"""HF transformers ``Trainer`` on a :class:`~streampack.dataset.PackedDataset`.

:class:`PackedTrainer` is ``transformers.Trainer`` with three changes, each for a measured failure:

* **Its own loader.** ``Trainer`` builds ``DataLoader(ds, batch_size=per_device_train_batch_size)``
  (it would batch batches) and hands it to ``accelerator.prepare``. For an ``IterableDataset``
  accelerate either dispatches (rank 0 reads and sends slices to every rank: ``dispatch_batches``
  defaults to True for iterable datasets) or wraps it in ``IterableDatasetShard`` (every rank
  reads the whole stream and keeps 1/N of it). A PackedDataset already shards per rank and
  worker, so either way data is lost or read N times (``tests/test_integration_hf.py`` shows
  both with accelerate's own ``prepare_data_loader``; ``split_batches`` only changes how
  ``IterableDatasetShard`` slices, and ``even_batches`` concerns map-style samplers). :meth:`PackedTrainer.get_train_dataloader`
  returns a ``StatefulDataLoader(ds, batch_size=None)`` (honouring ``dataloader_num_workers``,
  ``dataloader_pin_memory``, ...) that accelerate never sees; each batch becomes ``hf_inputs()``
  in the training process, after its stats are read.
* **An exact data position.** On every checkpoint save the loader's ``state_dict()`` goes into
  the checkpoint folder (``streampack_loader_rank{process_index}.pt``, next to HF's own
  ``rng_state_{process_index}.pth``); ``train(resume_from_checkpoint=...)`` loads it back, and
  HF's own "skip the first N batches" replay is off (``ignore_data_skip=True``), because it
  would re-read the stream from its start and then skip past the right position. The
  ``Trainer`` pulls exactly ``gradient_accumulation_steps`` batches per step, so the saved
  position is the batches trained. Resuming from a checkpoint without the file is a
  ``ValueError``: silently restarting the stream would train on its first batches again.
* **Stream metrics in its logs.** Training log lines get :class:`StreamMetrics` scalars
  (``streampack/tokens``, ``streampack/fill``, ...; summed over ranks when distributed), so the
  ``report_to`` integrations (TensorBoard, W&B, ...) receive them with the loss.

``HFInputs`` (``batch.hf_inputs()``) survives ``Trainer._prepare_input``, which rebuilds every
mapping as ``type(data)({...})`` after moving its tensors.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
import transformers
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from streampack.integrations.metrics import StreamMetrics
from streampack.layout.adapters import HFInputs
from streampack.state import load_loader_state

LOADER_STATE_FILE = "streampack_loader_rank{rank}.pt"


class HFBatches:
    """Iterates a loader of :class:`~streampack.layout.batch.PackedBatch` as ``HFInputs``,
    feeding each batch's stats to ``metrics`` first."""

    def __init__(self, loader: StatefulDataLoader, metrics: StreamMetrics) -> None:
        self.loader, self.metrics = loader, metrics

    def __iter__(self) -> Iterator[HFInputs]:
        for batch in self.loader:
            self.metrics.update(batch)
            yield batch.hf_inputs()

    def set_epoch(self, epoch: int) -> None:
        """Finite streams: the pass the next iteration runs (``PackedDataset.set_epoch``)."""
        set_epoch = getattr(self.loader.dataset, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)


class PackedTrainer(transformers.Trainer):
    """``transformers.Trainer`` for a PackedDataset ``train_dataset`` (module docstring).

    Needs ``TrainingArguments(max_steps=...)`` (an infinite or unsized stream has no length).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stream_metrics = StreamMetrics()
        self._loader: StatefulDataLoader | None = None
        self._loader_state: dict[str, Any] | None = None
        # HF's replay would re-read the stream from the start; the loader state resumes exactly
        self.args.ignore_data_skip = True
        self.add_callback(_SaveLoaderState(self))

    def get_train_dataloader(self) -> HFBatches:  # type: ignore[override]
        if self.train_dataset is None:
            raise ValueError("PackedTrainer needs a train_dataset (a PackedDataset)")
        args = self.args
        workers = args.dataloader_num_workers
        loader = StatefulDataLoader(
            self.train_dataset, batch_size=None, num_workers=workers,
            pin_memory=args.dataloader_pin_memory and torch.cuda.is_available(),
            persistent_workers=args.dataloader_persistent_workers if workers else False,
            prefetch_factor=args.dataloader_prefetch_factor if workers else None,
            multiprocessing_context=args.dataloader_multiprocessing_context if workers else None)
        if self._loader_state is not None:
            load_loader_state(loader, self._loader_state)
            self._loader_state = None
        self._loader = loader
        return HFBatches(loader, self.stream_metrics)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
        if isinstance(checkpoint, (str, os.PathLike)):
            self._loader_state = read_loader_state(checkpoint, self.args.process_index)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if not any(k.startswith(("eval_", "test_")) for k in logs):
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
            reduce = self.args.world_size > 1 and distributed
            logs = {**logs, **self.stream_metrics.scalars(group=True if reduce else None)}
        super().log(logs, *args, **kwargs)


def loader_state_path(checkpoint: str | os.PathLike[str], rank: int) -> str:
    return os.path.join(checkpoint, LOADER_STATE_FILE.format(rank=rank))


def read_loader_state(checkpoint: str | os.PathLike[str], rank: int) -> dict[str, Any]:
    """The loader state :class:`PackedTrainer` saved in ``checkpoint`` for process ``rank``."""
    path = loader_state_path(checkpoint, rank)
    if not os.path.exists(path):
        raise ValueError(f"{checkpoint} has no {os.path.basename(path)}: it was not saved by a "
                         f"PackedTrainer, so the data position is unknown (resuming would train on "
                         f"the stream's first batches again)")
    return torch.load(path, weights_only=True)


class _SaveLoaderState(transformers.TrainerCallback):
    """Writes the loader position into every checkpoint folder the trainer saves."""

    def __init__(self, trainer: PackedTrainer) -> None:
        self.trainer = trainer

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        loader = self.trainer._loader
        if loader is None:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        torch.save(loader.state_dict(), loader_state_path(folder, args.process_index))
