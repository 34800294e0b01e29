"""Bytes and formats: URL expansion, opening with retries, tar / jsonl readers, the sample
index and the offline packed format. Nothing here imports torch."""
