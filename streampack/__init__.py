"""streampack: stream sharded data into packed THD batches for LLM training, resumably."""

from __future__ import annotations

import importlib
from typing import Any

from streampack.batch import PackedBatch, alignment, check_invariants, pack_batch
from streampack.cp import CPShard, cp_partition_indices, cp_shard, cp_unshard
from streampack.overlong import OverlongCounters, apply_overlong
from streampack.sample import Sample

__version__ = "0.1.0"

# Heavier parts load on first use, so `import streampack` stays cheap for RL-only users.
_LAZY = {
    "PackedDataset": "streampack.dataset",
    "plan_dynamic_batches": "streampack.rl",
    "plan_packed_microbatches": "streampack.rl",
    "MicroBatchPlan": "streampack.rl",
    "restore_order": "streampack.rl",
    "apply_dynamic_plan": "streampack.rl",
    "apply_packed_plan": "streampack.rl",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'streampack' has no attribute {name!r}")


__all__ = [
    "CPShard", "OverlongCounters", "PackedBatch", "Sample", "alignment", "apply_overlong",
    "check_invariants", "cp_partition_indices", "cp_shard", "cp_unshard", "pack_batch",
    *_LAZY,
]
