"""The pipeline's ``torchdata.nodes.BaseNode`` stages, one per file, in the order data flows."""
