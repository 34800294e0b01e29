"""Trainer integrations: what HF Trainer, Lightning, torchtitan and Megatron need around a
PackedDataset and a PackedBatch (one module per framework, each importing its framework lazily)."""
