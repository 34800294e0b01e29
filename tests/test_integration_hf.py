"""HF transformers' real ``Trainer`` (and accelerate) on a PackedDataset, on CPU: packed inputs
through its device helpers, no re-sharding, an exact data position across a checkpoint resume,
stream metrics in its logs. The model is a tiny random Llama built from a config."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers_data import make_token_docs, write_tar_shards
from test_examples import EXAMPLES, run
from torch.utils.data import DataLoader

from streampack import PackedDataset
from streampack.layout.adapters import HFInputs

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from streampack.integrations.hf import PackedTrainer, loader_state_path  # noqa: E402


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def urls(tmp_path_factory) -> list[str]:
    path = tmp_path_factory.mktemp("hf")
    return write_tar_shards(path, make_token_docs(400, max_len=60, vocab=128, seed=2), 4)


def training_args(out: Path, steps: int, **kw) -> transformers.TrainingArguments:
    base = dict(output_dir=str(out), max_steps=steps, per_device_train_batch_size=1,
                gradient_accumulation_steps=2, learning_rate=1e-3, save_steps=3, logging_steps=1,
                report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    return transformers.TrainingArguments(**{**base, **kw})


class StopAt(transformers.TrainerCallback):
    """A preemption: training stops after ``step`` (the schedule still targets ``max_steps``)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        if state.global_step >= self.step:
            control.should_training_stop = True


def train(urls: list[str], out: Path, steps: int, resume: str | None = None, stop_at: int | None = None,
          **kw):  # noqa: ANN201
    model, seen = tiny_llama(), []
    model.register_forward_pre_hook(lambda m, a, k: seen.append(k["input_ids"].clone()), with_kwargs=True)
    trainer = PackedTrainer(model=model, args=training_args(out, steps, **kw),
                            train_dataset=PackedDataset(urls, capacity=128, window=16),
                            callbacks=[StopAt(stop_at)] if stop_at else None)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, model, seen


def test_hf_inputs_survive_the_trainers_own_device_helper(urls: list[str], tmp_path: Path) -> None:
    """``Trainer._prepare_input`` rebuilds mappings as ``type(data)({...})``: the keyword-only
    record raised TypeError there; only ``.as_dict()`` worked."""
    from accelerate.utils import send_to_device

    batch = next(iter(PackedDataset(urls, capacity=128, window=16)))
    trainer = transformers.Trainer(model=tiny_llama(), args=training_args(tmp_path, 1))
    for moved in (trainer._prepare_input(batch.hf_inputs()), send_to_device(batch.hf_inputs(), "cpu")):
        assert type(moved) is HFInputs and moved.max_length_q == batch.varlen_max_seqlen
        assert torch.equal(moved.labels, batch.hf_inputs().labels) and moved.use_cache is False
    assert float(trainer.model(**trainer._prepare_input(batch.hf_inputs())).loss) > 0


def test_accelerate_would_reshard_or_dispatch_a_stream_that_is_already_per_rank(urls: list[str]) -> None:
    """What ``Trainer`` does with an IterableDataset on 2 processes, and why PackedTrainer's
    loader never goes through it: either every rank reads the whole stream and keeps half
    (IterableDatasetShard) or rank 0 reads and sends to all (dispatch, the default)."""
    from accelerate.data_loader import (
        DataLoaderDispatcher,
        IterableDatasetShard,
        prepare_data_loader,
    )

    ds = PackedDataset(urls, capacity=128, window=16, dp_rank=1, dp_size=2)
    sharded = prepare_data_loader(DataLoader(ds, batch_size=1), num_processes=2, process_index=1,
                                  put_on_device=True, dispatch_batches=False)
    assert isinstance(sharded.dataset, IterableDatasetShard)
    dispatched = prepare_data_loader(DataLoader(ds, batch_size=1), num_processes=2, process_index=1,
                                     put_on_device=True)
    assert isinstance(dispatched, DataLoaderDispatcher)  # dispatch_batches=None -> True here
    with pytest.raises(TypeError):  # and the stock Trainer cannot even collate PackedBatches
        next(iter(DataLoader(ds, batch_size=2)))


@pytest.mark.slow  # ~3 s of Trainer start-up and steps; the device-helper test above is the fast smoke
def test_packed_trainer_trains_and_logs_stream_metrics(urls: list[str], tmp_path: Path) -> None:
    trainer, _, seen = train(urls, tmp_path, steps=2, save_steps=100)
    loader = trainer.get_train_dataloader()
    assert type(loader.loader).__name__ == "StatefulDataLoader"  # not accelerate's wrappers
    assert len(seen) == 4 and all(s.shape == (1, 128) for s in seen)  # 2 steps x 2 accumulation
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logged)
    assert logged[-1]["streampack/batches"] == 4 and 0.9 < logged[-1]["streampack/fill"] <= 1


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_from_a_trainer_checkpoint_is_exact(urls: list[str], tmp_path: Path, workers: int) -> None:
    """Stop at the checkpoint of step 3, resume: the same batches as an uninterrupted run, and
    bit-identical weights at the end."""
    _, full_model, full = train(urls, tmp_path / "full", steps=6, dataloader_num_workers=workers)
    train(urls, tmp_path / "cut", steps=6, stop_at=3, dataloader_num_workers=workers)
    checkpoint = tmp_path / "cut" / "checkpoint-3"
    assert Path(loader_state_path(checkpoint, 0)).exists()
    trainer, model, resumed = train(urls, tmp_path / "cut", steps=6, resume=str(checkpoint),
                                    dataloader_num_workers=workers)
    assert len(full) == 12 and len(resumed) == 6
    assert all(torch.equal(a, b) for a, b in zip(full[6:], resumed))
    assert all(torch.equal(p, q) for p, q in zip(full_model.parameters(), model.parameters()))
    assert trainer.state.log_history[-2]["streampack/batches"] == 12


def test_resuming_without_the_data_position_is_refused(urls: list[str], tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint-3"
    checkpoint.mkdir()
    trainer = PackedTrainer(model=tiny_llama(), args=training_args(tmp_path, 6),
                            train_dataset=PackedDataset(urls, capacity=128, window=16))
    with pytest.raises(ValueError, match="streampack_loader_rank0.pt"):
        trainer.train(resume_from_checkpoint=str(checkpoint))


@pytest.mark.slow
def test_example_hf_trainer() -> None:
    out = run([sys.executable, str(EXAMPLES / "hf_trainer.py"), "--workers", "2"])
    assert "identical batches True; identical weights True" in out
