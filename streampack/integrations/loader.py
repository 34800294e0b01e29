"""The StatefulDataLoader the trainer integrations build, and torchdata's start-up warning.

torchdata 0.11's ``StatefulDataLoader.__init__`` calls ``torch.set_vital``, which torch 2.13
deprecates; the integrations silence exactly that warning, and importing :mod:`streampack.dataset`
installs that one narrow filter (:func:`quiet_set_vital`). Building the loader is also the first
moment the worker count is known, so ``batches_per_epoch`` is checked against it here.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where a loader is built: PackedDataset imports this module for the filter
    from torchdata.stateful_dataloader import StatefulDataLoader

SET_VITAL_WARNING = "'set_vital' is deprecated"
_SET_VITAL_CALLER = r"torchdata\.stateful_dataloader\.stateful_dataloader\Z"


def quiet_set_vital() -> None:
    """Ignore torch's ``set_vital`` deprecation from torchdata's ``StatefulDataLoader.__init__`` only, so a
    loader a user builds is quiet too (importing :mod:`streampack.dataset` calls it)."""
    warnings.filterwarnings("ignore", message=SET_VITAL_WARNING, category=UserWarning, module=_SET_VITAL_CALLER)


def stateful_loader(dataset: Any, **kwargs: Any) -> StatefulDataLoader:
    """``StatefulDataLoader(dataset, **kwargs)`` with torchdata's ``set_vital`` warning silenced,
    refusing here, in the main process, a ``batches_per_epoch`` its workers cannot share evenly
    (each worker would only find out inside its process, behind torch's worker traceback)."""
    topology = getattr(getattr(dataset, "config", None), "topology", None)  # a PackedDataset's, or none
    per_rank = getattr(topology, "batches_per_epoch", None)
    workers = kwargs.get("num_workers") or 0
    if per_rank is not None and workers and per_rank % workers:
        raise ValueError(f"batches_per_epoch={per_rank} must be a multiple of num_workers={workers} "
                         f"(each DataLoader worker yields an equal share of the rank's batches)")
    from torchdata.stateful_dataloader import StatefulDataLoader

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SET_VITAL_WARNING, category=UserWarning)
        return StatefulDataLoader(dataset, **kwargs)
