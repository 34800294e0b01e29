"""Reading stages: shard URLs -> Samples (``source.ShardReader``), sharding, errors."""
