"""HF transformers' real ``Trainer`` (and accelerate) on a PackedDataset, on CPU: packed inputs
through its device helpers, no re-sharding, an exact data position across a checkpoint resume,
stream metrics in its logs. The model is a tiny random Llama built from a config."""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers_data import make_token_docs, write_tar_shards
from node_checks import collect_documents
from topology_sim import SimRank
from torch.utils.data import DataLoader

from streampack import PackedDataset
from streampack.layout.adapters import HFInputs
from streampack.options import PackOptions, TopologyOptions
from tests.integration.test_examples import EXAMPLES, run

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from streampack.integrations.hf import (  # noqa: E402
    PackedTrainer,
    last_resumable_checkpoint,
    loader_state_path,
    read_loader_states,
    write_loader_state,
)
from streampack.integrations.resume import every_reader  # noqa: E402


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
                            train_dataset=PackedDataset(urls, capacity=128, packing=PackOptions(window=16)),
                            callbacks=[StopAt(stop_at)] if stop_at else None)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, model, seen


def test_hf_inputs_survive_the_trainers_own_device_helper(urls: list[str], tmp_path: Path) -> None:
    """``Trainer._prepare_input`` rebuilds mappings as ``type(data)({...})``: the keyword-only
    record raised TypeError there; only ``.as_dict()`` worked."""
    from accelerate.utils import send_to_device

    batch = next(iter(PackedDataset(urls, capacity=128, packing=PackOptions(window=16))))
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

    ds = PackedDataset(urls, capacity=128, packing=PackOptions(window=16),
                       topology=TopologyOptions(dp_rank=1, dp_size=2))
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
    assert type(loader.loader).__name__ == "PackedLoader"  # not accelerate's wrappers
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
                            train_dataset=PackedDataset(urls, capacity=128, packing=PackOptions(window=16)))
    with pytest.raises(ValueError, match="streampack_loader_rank0.pt"):
        trainer.train(resume_from_checkpoint=str(checkpoint))


@pytest.mark.slow
def test_example_hf_trainer() -> None:
    out = run([sys.executable, str(EXAMPLES / "hf_trainer.py"), "--workers", "2"])
    assert "identical batches True; identical weights True" in out


def _folder(out: Path, step: int, ranks: list[int], world_size: int, trainer_state: bool = True) -> Path:
    folder = out / f"checkpoint-{step}"
    for rank in ranks:
        write_loader_state(folder, rank, world_size, {"step": step})
    folder.mkdir(parents=True, exist_ok=True)
    if trainer_state:
        (folder / "trainer_state.json").write_text("{}")
    return folder


def test_resume_true_takes_the_newest_folder_with_every_ranks_loader_state(tmp_path: Path, caplog) -> None:
    """HF's own choice (get_last_checkpoint) is the newest checkpoint-N folder, with or without
    the loader state: PackedTrainer then refused it, and a 2-rank run whose rank 1 died before
    its file was written resumed rank 0 from one folder and rank 1 from none."""
    good = _folder(tmp_path, 3, [0, 1], 2)
    _folder(tmp_path, 6, [], 2)  # HF's files, no loader state (a user on_save hook raised, a kill)
    _folder(tmp_path, 9, [0], 2)  # rank 1 never wrote its file
    _folder(tmp_path, 12, [0, 1], 2, trainer_state=False)  # HF's own save did not finish
    (tmp_path / "checkpoint-15.tmp").mkdir()  # not a checkpoint-N name at all
    with caplog.at_level(logging.WARNING, logger="streampack.integrations.hf"):
        assert last_resumable_checkpoint(tmp_path) == str(good)
    said = caplog.text
    assert "checkpoint-6: no streampack_loader_rank0.pt" in said
    assert "checkpoint-9: missing streampack_loader_rank1.pt of the world_size=2 run" in said
    assert "checkpoint-12: no trainer_state.json" in said
    assert read_loader_states(good, rank=2) == [{"step": 3}, {"step": 3}, None]  # a 3rd rank: elastic
    with pytest.raises(ValueError, match="checkpoint-9: missing streampack_loader_rank1.pt"):
        read_loader_states(tmp_path / "checkpoint-9", 0)  # an explicit folder: refused, not guessed
    shutil.rmtree(good)
    with pytest.raises(ValueError, match="found no checkpoint to resume from"):
        last_resumable_checkpoint(tmp_path)


def test_the_loader_state_is_written_atomically(tmp_path: Path, monkeypatch) -> None:
    """A kill during torch.save leaves no half-written rank file where a resume would read it."""
    def killed(obj, path):  # noqa: ANN001, ANN202
        Path(path).write_bytes(b"half a pickle")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        write_loader_state(tmp_path / "checkpoint-3", 0, 1, {"step": 3})
    assert not Path(loader_state_path(tmp_path / "checkpoint-3", 0)).exists()


class RaiseOnSave(transformers.TrainerCallback):
    """A user ``on_save`` hook that fails (or a kill right after HF's save)."""

    def on_save(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        raise RuntimeError("user on_save hook failed")


@pytest.mark.slow
def test_the_loader_state_is_part_of_the_checkpoint_and_resume_true_skips_folders_without_it(
        urls: list[str], tmp_path: Path, caplog) -> None:
    """The loader state was written by a callback after HF's save and after user callbacks: a
    raising user ``on_save`` left checkpoint-3 without it. Now it is there, and a newer folder
    without it is skipped (logged) by ``resume_from_checkpoint=True``, which resumes exactly."""
    _, _, full = train(urls, tmp_path / "full", steps=6)
    with pytest.raises(RuntimeError, match="user on_save hook failed"):
        model = tiny_llama()
        PackedTrainer(model=model, args=training_args(tmp_path / "cut", 6),
                      train_dataset=PackedDataset(urls, capacity=128, packing=PackOptions(window=16)),
                      callbacks=[RaiseOnSave()]).train()
    checkpoint = tmp_path / "cut" / "checkpoint-3"
    assert Path(loader_state_path(checkpoint, 0)).exists()
    stale = tmp_path / "cut" / "checkpoint-6"  # the old failure: HF's files without the data position
    shutil.copytree(checkpoint, stale)
    Path(loader_state_path(stale, 0)).unlink()
    with caplog.at_level(logging.WARNING, logger="streampack.integrations.hf"):
        _, _, resumed = train(urls, tmp_path / "cut", steps=6, resume=True)
    assert f"skipping {stale}: no streampack_loader_rank0.pt" in caplog.text
    assert len(resumed) == 6 and all(torch.equal(a, b) for a, b in zip(full[6:], resumed))


class SimRankTrainer(PackedTrainer):
    """One rank of a simulated multi-process run: its loader-state file is rank ``sim_rank``'s."""

    sim_rank, sim_world = 0, 1

    def process(self) -> tuple[int, int]:
        return self.sim_rank, self.sim_world


@pytest.mark.slow
def test_elastic_resume_through_the_trainer_trains_every_sample_once(tmp_path: Path) -> None:
    """2 ranks x 0 workers train 3 steps and checkpoint; 1 rank x 2 workers resumes from the
    folder (all rank files into ``load_state_dict([...])``): every sample of the epoch once.
    Before, rank 0's file alone went into the new loader and the fingerprint refused it."""
    docs = make_token_docs(120, max_len=60, vocab=128, seed=5)
    shards = write_tar_shards(tmp_path / "data", docs, 3)
    make = lambda rank, size: PackedDataset(shards, capacity=128, epochs=1, packing=PackOptions(window=8),
                                            topology=TopologyOptions(dp_rank=rank, dp_size=size, equal_batches="count"))
    trained = []

    def run(trainer_cls: type, ds: PackedDataset, steps: int, resume: bool | None = None, **kw) -> None:  # noqa: ANN003
        trainer = trainer_cls(model=tiny_llama(), args=training_args(tmp_path / "out", steps, **kw),
                              train_dataset=ds)
        update = trainer.stream_metrics.update
        trainer.stream_metrics.update = lambda batch: (trained.append(batch), update(batch))
        trainer.train(resume_from_checkpoint=resume)

    for rank in range(2):
        SimRankTrainer.sim_rank, SimRankTrainer.sim_world = rank, 2
        run(SimRankTrainer, make(rank, 2), steps=3, gradient_accumulation_steps=1)
    assert len(trained) == 6
    # how many batches the resumed rank (2 workers, simulated in-process) has left in the epoch
    old = every_reader(read_loader_states(tmp_path / "out" / "checkpoint-3", 0))
    left = len(list(SimRank(lambda: make(0, 1), 2, load=old)))
    run(PackedTrainer, make(0, 1), steps=3 + left, resume=True, gradient_accumulation_steps=1,
        dataloader_num_workers=2)
    assert len(trained) == 6 + left
    assert collect_documents(trained) == {f"{i:08d}": doc for i, doc in enumerate(docs)}
