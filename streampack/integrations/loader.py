"""The StatefulDataLoader the trainer integrations build, without torchdata's start-up warning.

torchdata 0.11's ``StatefulDataLoader.__init__`` calls ``torch.set_vital``, which torch 2.13
deprecates: every run printed ``UserWarning: 'set_vital' is deprecated`` though nothing is
wrong. The integrations build the loader for the user, so they silence exactly that warning
there (a user who builds the loader themselves can use the same filter).
"""

from __future__ import annotations

import warnings
from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

SET_VITAL_WARNING = "'set_vital' is deprecated"


def stateful_loader(dataset: Any, **kwargs: Any) -> StatefulDataLoader:
    """``StatefulDataLoader(dataset, **kwargs)`` with torchdata's ``set_vital`` warning silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SET_VITAL_WARNING, category=UserWarning)
        return StatefulDataLoader(dataset, **kwargs)
