"""CostOptions: estimated compute per batch (``PackedBatch.est_cost``), and cost-balanced emission
(:mod:`streampack.packing.schedule`) (``PackedDataset(cost=...)``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from streampack.packing.cost import CostModel
from streampack.packing.schedule import Balance

SHAPE_EXAMPLE = "{'hidden': 4096, 'layers': 32, 'heads': 32, 'kv_heads': 8, 'ffn': 14336}"


@dataclass(frozen=True, slots=True, kw_only=True)
class CostOptions:
    """A cost model, and whether packs leave in cost-balanced order."""

    model: CostModel | Mapping[str, Any] | None = None
    """A :class:`~streampack.packing.CostModel`, or a model shape (the keyword arguments of
    ``CostModel.from_shape``, e.g. ``{"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8,
    "ffn": 14336, "vocab": 128256}``; held as the ``CostModel`` it makes), or None (no estimate)."""
    balance: Balance | str | None = None
    """``"cost"`` (default :class:`~streampack.packing.Balance` options) or a ``Balance``: order the packs so that every
    rank's step costs about the same (needs ``model``); held as a ``Balance``. None: packs leave in shuffled order."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", _model(self.model))
        object.__setattr__(self, "balance", _balance(self.balance, self.model))


def _model(value: Any) -> CostModel | None:
    if value is None or isinstance(value, CostModel):
        return value
    if isinstance(value, Mapping):
        try:
            return CostModel.from_shape(**value)
        except TypeError as e:
            raise ValueError(f"CostOptions(model={dict(value)!r}): not a model shape for CostModel.from_shape: "
                             f"{e}") from None
    raise TypeError(f"CostOptions(model=...): must be a CostModel, a mapping of CostModel.from_shape "
                    f"arguments or None, got {type(value).__name__}")


def _balance(value: Any, model: CostModel | None) -> Balance | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value != "cost":
            raise ValueError(f"CostOptions(balance={value!r}): must be None, 'cost' or a streampack.packing.Balance")
        value = Balance()
    if not isinstance(value, Balance):
        raise TypeError(f"CostOptions(balance=...): must be None, 'cost' or a Balance, got {type(value).__name__}")
    if model is None:
        raise ValueError(f"CostOptions(balance='cost') needs model= (a CostModel, or a model shape such as "
                         f"{SHAPE_EXAMPLE})")
    return value
