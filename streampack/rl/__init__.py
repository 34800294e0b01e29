"""Micro-batches for an in-memory RL rollout batch: dynamic batching and balanced packing.

Plan on lengths (:mod:`streampack.rl.plan`), apply the plan to tensors and restore the
original order of per-sequence results (:mod:`streampack.rl.apply`).
"""

from streampack.rl.apply import (
    DynamicMicroBatch,
    apply_dynamic_plan,
    apply_packed_plan,
    restore_order,
)
from streampack.rl.plan import (
    MicroBatchPlan,
    plan_dynamic_batches,
    plan_packed_microbatches,
)

__all__ = [
    "DynamicMicroBatch", "MicroBatchPlan", "apply_dynamic_plan", "apply_packed_plan",
    "plan_dynamic_batches", "plan_packed_microbatches", "restore_order",
]
