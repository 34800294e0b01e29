"""Micro-batches for an in-memory RL rollout batch: dynamic batching and balanced packing.

Plan on lengths (:mod:`streampack.rl.plan`, numpy only), apply the plan to tensors and restore the original order of
per-sequence results (:mod:`streampack.rl.apply`, torch; loaded on first use so planning alone never imports torch).
"""

from __future__ import annotations

import importlib
from typing import Any

from streampack.rl.plan import MicroBatchPlan, plan_dynamic_batches, plan_packed_microbatches

_LAZY = {name: "streampack.rl.apply" for name in
         ("DynamicMicroBatch", "apply_dynamic_plan", "apply_packed_plan", "restore_order")}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'streampack.rl' has no attribute {name!r}")


__all__ = ["MicroBatchPlan", "plan_dynamic_batches", "plan_packed_microbatches", *_LAZY]
