"""torchdata's start-up warning.

torchdata 0.11's ``StatefulDataLoader.__init__`` calls ``torch.set_vital``, which torch 2.13
deprecates; :class:`~streampack.PackedLoader` silences exactly that warning, and importing
:mod:`streampack.dataset` installs that one narrow filter (:func:`quiet_set_vital`).
"""

from __future__ import annotations

import warnings

SET_VITAL_WARNING = "'set_vital' is deprecated"
_SET_VITAL_CALLER = r"torchdata\.stateful_dataloader\.stateful_dataloader\Z"


def quiet_set_vital() -> None:
    """Ignore torch's ``set_vital`` deprecation from torchdata's ``StatefulDataLoader.__init__`` only, so a
    loader a user builds is quiet too (importing :mod:`streampack.dataset` calls it)."""
    warnings.filterwarnings("ignore", message=SET_VITAL_WARNING, category=UserWarning, module=_SET_VITAL_CALLER)
