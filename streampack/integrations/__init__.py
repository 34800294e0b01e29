"""Trainer integrations: what HF Trainer, Lightning, torchtitan and Megatron need around a
PackedDataset and a PackedBatch (one module per framework, each importing its framework lazily).

* :mod:`streampack.integrations.hf` -- ``PackedTrainer`` (``transformers.Trainer``)
* :mod:`streampack.integrations.lightning` -- ``PackedDataModule``
* :mod:`streampack.integrations.torchtitan` -- ``titan_collate``, ``post_dataloading_process``,
  ``titan_dataloader``
* :mod:`streampack.integrations.megatron` -- ``megatron_batch``
* :mod:`streampack.integrations.metrics` -- ``StreamMetrics`` (per-worker stats, any trainer)
* :mod:`streampack.integrations.resume` -- ``plan_resume``: a rank's own loader state (same
  topology) or every old reader's state (elastic), for HF and Lightning
"""
