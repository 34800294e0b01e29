"""streampack: stream sharded data into packed THD batches for LLM training, resumably.

Every name below loads on first use, so ``import streampack.packing`` (pure numpy) or the RL
planner never pays for torch or torchdata.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "PackedDataset": "streampack.dataset",
    "PackedLoader": "streampack.integrations.packed_loader",
    "ReadOptions": "streampack.options",
    "TokenizeOptions": "streampack.options",
    "PackOptions": "streampack.options",
    "TopologyOptions": "streampack.options",
    "CostOptions": "streampack.options",
    "sync_batches": "streampack.plan.sync",
    "PackedBatch": "streampack.layout.batch",
    "alignment": "streampack.layout.batch",
    "check_invariants": "streampack.layout.batch",
    "pack_batch": "streampack.layout.batch",
    "CPShard": "streampack.layout.cp",
    "cp_partition_indices": "streampack.layout.cp",
    "cp_shard": "streampack.layout.cp",
    "cp_unshard": "streampack.layout.cp",
    "OverlongCounters": "streampack.nodes.overlong",
    "apply_overlong": "streampack.nodes.overlong",
    "Sample": "streampack.sample",
    "DataError": "streampack.errors",
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


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [*_LAZY]
