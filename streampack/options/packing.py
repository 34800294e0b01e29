"""PackOptions: how samples become packs, and the batch they are laid out in (``PackedDataset(packing=...)``)."""

from __future__ import annotations

from dataclasses import dataclass

from streampack.options._check import need_choice, need_int, need_type
from streampack.packing import get_algorithm

OVERLONG_POLICIES: tuple[str, ...] = ("split", "truncate", "drop", "error")
"""What a sample longer than ``capacity`` becomes (:mod:`streampack.nodes.overlong` applies them)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PackOptions:
    """The packer's window and algorithm, the overlong policy, and the padding values."""

    window: int = 1024
    """Samples in the rolling packing window (state and memory are bounded by it)."""
    algorithm: str = "bfd"
    """A name in ``streampack.packing.ALGORITHMS``: ``bfd``, ``ffd``, ``mffd``, ``ffs``, ``kk``,
    ``histogram``, ``greedy``, ``shuffle_pack``."""
    max_wait: int | None = None
    """A sample is emitted at most ``max_wait`` windows after it arrives; None =
    ``max(8, 8192 // window)`` (``packing.window_rounds.default_max_wait``: about 8,192 later
    samples at most, which keeps window 256 within 0.1 point of offline fill)."""
    slack: int | None = None
    """Free tokens that still count a pack as full; None = ``capacity // 256``."""
    overlong: str = "split"
    """A sample longer than ``capacity``: ``split`` (capacity-sized chunks, keys ``/0``, ``/1``, ...),
    ``truncate``, ``drop`` or ``error``."""
    pad_id: int = 0
    """Padding token id."""
    ignore_index: int = -100
    """Label of positions that train nothing."""
    pin_memory: bool = False
    """Pin each batch in the main process (``num_workers=0``) when CUDA is available."""

    def __post_init__(self) -> None:
        need_int("PackOptions", "window", self.window, 1)
        need_int("PackOptions", "max_wait", self.max_wait, 1, optional=True)
        need_int("PackOptions", "slack", self.slack, 0, optional=True)
        need_int("PackOptions", "pad_id", self.pad_id, 0)
        need_type("PackOptions", "ignore_index", self.ignore_index, int)
        need_type("PackOptions", "pin_memory", self.pin_memory, bool)
        need_choice("PackOptions", "overlong", self.overlong, OVERLONG_POLICIES)
        try:
            get_algorithm(self.algorithm)
        except ValueError as e:
            raise ValueError(f"PackOptions(algorithm={self.algorithm!r}): {e}") from None
