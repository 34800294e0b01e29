"""HF transformers ``Trainer`` on a :class:`~streampack.dataset.PackedDataset` (docs/integrations.md).

:class:`PackedTrainer` is ``transformers.Trainer`` with these changes, each for a measured failure:

* **Its own loader.** accelerate either dispatches an ``IterableDataset``'s batches from rank 0 or
  wraps it in ``IterableDatasetShard``; a PackedDataset already shards, so either way data is lost
  or read N times. :meth:`PackedTrainer.get_train_dataloader` returns a :class:`~streampack.PackedLoader` that
  accelerate never sees; each batch becomes ``hf_inputs()`` after its stats are read.
* **An exact data position.** ``_save_checkpoint`` writes the loader state atomically into the
  folder before HF writes the model, and ``train(resume_from_checkpoint=...)`` loads it with HF's
  batch-skipping replay off; ``True`` takes the newest folder holding every rank's state (logging
  the newer ones skipped), an explicit folder without them is a ``ValueError``. On another world
  size or worker count the resume is elastic (:mod:`streampack.integrations.resume`).
* **Stream metrics in its logs** (``streampack/tokens``, ...; summed over ranks).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
import transformers
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from streampack.integrations.metrics import StreamMetrics
from streampack.integrations.packed_loader import PackedLoader
from streampack.integrations.resume import LoaderResume, plan_resume
from streampack.layout.adapters import HFInputs

LOADER_STATE_FILE = "streampack_loader_rank{rank}.pt"
LOADER_KEY, WORLD_SIZE_KEY = "loader", "world_size"
"""A rank's file is ``{"loader": loader.state_dict(), "world_size": W}``: ``W`` tells a resume
how many rank files make the folder complete (a plain loader state, as older versions wrote,
is read as the loader state of an unknown world size)."""
_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_log = logging.getLogger(__name__)


class HFBatches:
    """Iterates a loader of :class:`~streampack.layout.batch.PackedBatch` as ``HFInputs``,
    feeding each batch's stats to ``metrics`` first."""

    def __init__(self, loader: PackedLoader, metrics: StreamMetrics) -> None:
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
    """``transformers.Trainer`` for a PackedDataset ``train_dataset``; needs ``TrainingArguments(max_steps=...)``.
    ``snapshot_every_n_steps`` goes to the :class:`~streampack.PackedLoader` (set it to ``save_steps`` times the gradient
    accumulation: docs/integrations.md)."""

    def __init__(self, *args: Any, snapshot_every_n_steps: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self.stream_metrics = StreamMetrics()
        self._loader: PackedLoader | None = None
        self._resume: LoaderResume | None = None
        # HF's replay would re-read the stream from the start; the loader state resumes exactly
        self.args.ignore_data_skip = True

    def process(self) -> tuple[int, int]:
        """``(rank, world_size)`` naming this process's loader-state file (HF's process index)."""
        return self.args.process_index, self.args.world_size

    def get_train_dataloader(self) -> HFBatches:  # type: ignore[override]
        if self.train_dataset is None:
            raise ValueError("PackedTrainer needs a train_dataset (a PackedDataset)")
        args = self.args
        workers = args.dataloader_num_workers
        loader = PackedLoader(self.train_dataset, num_workers=workers,
                              pin_memory=args.dataloader_pin_memory and torch.cuda.is_available(),
                              persistent_workers=args.dataloader_persistent_workers if workers else False,
                              prefetch_factor=args.dataloader_prefetch_factor if workers else None,
                              multiprocessing_context=args.dataloader_multiprocessing_context if workers else None,
                              snapshot_every_n_steps=self.snapshot_every_n_steps)
        if self._resume is not None:
            self._resume.apply(self.train_dataset, loader)
            self._resume = None
        self._loader = loader
        return HFBatches(loader, self.stream_metrics)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = last_resumable_checkpoint(self.args.output_dir)
        if isinstance(checkpoint, (str, os.PathLike)):
            rank, _ = self.process()
            states = read_loader_states(checkpoint, rank)
            self._resume = plan_resume(states, rank=rank, dataset=self.train_dataset,
                                       num_workers=self.args.dataloader_num_workers)
            resume_from_checkpoint = str(checkpoint)  # HF must not pick another folder itself
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        # The data position goes in first, so no folder HF finishes lacks it (module docstring)
        if self._loader is not None:
            folder = os.path.join(self._get_output_dir(trial=trial),
                                  f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            rank, world_size = self.process()
            write_loader_state(folder, rank, world_size, self._loader.state_dict())
        super()._save_checkpoint(model, trial)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if not any(k.startswith(("eval_", "test_")) for k in logs):
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
            reduce = self.args.world_size > 1 and distributed
            logs = {**logs, **self.stream_metrics.scalars(group=True if reduce else None)}
        super().log(logs, *args, **kwargs)


def loader_state_path(checkpoint: str | os.PathLike[str], rank: int) -> str:
    return os.path.join(checkpoint, LOADER_STATE_FILE.format(rank=rank))


def write_loader_state(checkpoint: str | os.PathLike[str], rank: int, world_size: int,
                       loader_state: dict[str, Any]) -> None:
    """Atomically: a reader sees the whole file or none (a kill mid-write leaves only the
    temporary file, which no reader looks at)."""
    os.makedirs(checkpoint, exist_ok=True)
    path = loader_state_path(checkpoint, rank)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save({LOADER_KEY: loader_state, WORLD_SIZE_KEY: world_size}, tmp)
    os.replace(tmp, path)


def _read(path: str) -> tuple[dict[str, Any], int]:
    """(loader state, world size of the run that wrote it)."""
    saved = torch.load(path, weights_only=True)
    return saved[LOADER_KEY], int(saved[WORLD_SIZE_KEY])


def read_loader_states(checkpoint: str | os.PathLike[str], rank: int) -> list[dict[str, Any] | None]:
    """Every rank's loader state in ``checkpoint`` (None for a rank without a file, which only
    an elastic resume from the others can survive), after :func:`checkpoint_problem`."""
    problem = checkpoint_problem(checkpoint)
    if problem is not None:
        raise ValueError(f"cannot resume from {checkpoint}: {problem} (resuming would lose the data "
                         f"position and train on the stream's first batches again)")
    world_size = _saved_world_size(checkpoint)
    ranks = _rank_files(checkpoint)
    return [_read(loader_state_path(checkpoint, r))[0] if r in ranks else None
            for r in range(max(world_size, max(ranks) + 1, rank + 1))]


def _rank_files(checkpoint: str | os.PathLike[str]) -> set[int]:
    names = os.listdir(checkpoint) if os.path.isdir(checkpoint) else []
    pattern = re.compile("^" + re.escape(LOADER_STATE_FILE).replace(r"\{rank\}", r"(\d+)") + "$")
    return {int(m.group(1)) for m in map(pattern.match, names) if m}


def _saved_world_size(checkpoint: str | os.PathLike[str]) -> int:
    return _read(loader_state_path(checkpoint, 0))[1]


def checkpoint_problem(checkpoint: str | os.PathLike[str]) -> str | None:
    """Why ``checkpoint`` cannot be resumed from (None: it can): it must hold ``streampack_loader_rank{i}.pt`` of every
    rank of the run that saved it and HF's ``trainer_state.json`` (which HF writes after them)."""
    ranks = _rank_files(checkpoint)
    if 0 not in ranks:
        return (f"no {LOADER_STATE_FILE.format(rank=0)} (not saved by a PackedTrainer, or the save was interrupted)")
    world_size = _saved_world_size(checkpoint)
    missing = [r for r in range(world_size) if r not in ranks]
    if missing:
        names = ", ".join(LOADER_STATE_FILE.format(rank=r) for r in missing)
        return f"missing {names} of the {world_size=} run that saved it"
    if not os.path.exists(os.path.join(checkpoint, TRAINER_STATE_NAME)):
        return f"no {TRAINER_STATE_NAME} (HF's save was interrupted)"
    return None


def last_resumable_checkpoint(output_dir: str | os.PathLike[str]) -> str:
    """The newest ``checkpoint-N`` folder of ``output_dir`` that :func:`checkpoint_problem`
    accepts; every newer folder is logged as skipped, with why. ``ValueError`` when none."""
    found = sorted(((int(m.group(1)), name) for name in (os.listdir(output_dir) if os.path.isdir(output_dir) else [])
                    if (m := _CHECKPOINT_RE.match(name)) and os.path.isdir(os.path.join(output_dir, name))),
                   reverse=True)
    skipped = []
    for _, name in found:
        folder = os.path.join(output_dir, name)
        problem = checkpoint_problem(folder)
        if problem is None:
            return folder
        _log.warning("resume_from_checkpoint=True: skipping %s: %s", folder, problem)
        skipped.append(f"{name}: {problem}")
    raise ValueError(f"resume_from_checkpoint=True found no checkpoint to resume from in {output_dir} "
                     f"(skipped: {'; '.join(skipped) or 'no checkpoint-N folders'})")
