"""The THD batch layout: PackedBatch, what a document may be, and context-parallel sharding."""
