"""Trainer integrations, one module per framework, each importing its framework lazily: ``hf`` (``PackedTrainer``),
``lightning`` (``PackedDataModule``), ``torchtitan``, ``megatron`` (``megatron_batch``), ``metrics`` (``StreamMetrics``)
and ``resume`` (``plan_resume``)."""
