"""``fastload.hf.FastloadTrainer``: a real ``transformers.Trainer`` training a tiny random-weight
Llama on CPU from an ``HDF5Dataset``, with fastload's engine (a worker process) loading. One
worker: on a 2-core machine two workers next to torch's two compute threads slow every step."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import TrainingArguments

import fastload
from fastload.hf import LOADER_STATE_NAME, FastloadTrainer

sys.path.insert(0, str(Path(__file__).parent))
from _lm_files import tiny_llama, write_lm_file

SAMPLES = 400  # 50 batches of 8 per epoch


@pytest.fixture(autouse=True, scope="module")
def _one_compute_thread() -> Any:
    """torch's compute threads spin while they wait for each other: on a 2-core machine shared
    with a worker process (and other jobs) two of them make a step of this tiny model many
    times slower than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dataset_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_lm_file(tmp_path_factory.mktemp("lm") / "lm.h5", SAMPLES)


class RecordingTrainer(FastloadTrainer):
    """Records the sample indices (the ``idx`` field) of every batch it trains on, in order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trained: list[list[int]] = []

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        self.trained.append(inputs["idx"].flatten().tolist())
        return super().training_step(model, inputs, num_items_in_batch)


def _trainer(path: Path, out: Path, **options: Any) -> RecordingTrainer:
    trainer_options = {
        k: options.pop(k) for k in ("pack_length", "length_grouped", "eval_dataset") if k in options
    }
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        logging_steps=10,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=3,
        **{"max_steps": 40, "save_strategy": "no", "dataloader_num_workers": 1, **options},
    )
    return RecordingTrainer(
        model=tiny_llama(), args=args, train_dataset=fastload.HDF5Dataset(path), **trainer_options
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["length_grouped", "packed"])
def test_trains_on_fastload_batches_the_loss_drops_and_the_logs_carry_the_stall(
    dataset_path: Path, tmp_path: Path, mode: str
) -> None:
    options: dict[str, Any] = {"pack_length": 128} if mode == "packed" else {}
    evaluation = {"eval_dataset": fastload.HDF5Dataset(dataset_path), "eval_strategy": "steps", "eval_steps": 20}
    trainer = _trainer(dataset_path, tmp_path, **options, **evaluation)
    trainer.train()

    loader = trainer.train_loader
    assert isinstance(loader, fastload.DataLoader)
    stats = loader.stats()
    # Every batch trained on went through fastload's iterator, from its worker engine.
    assert stats.batches == len(trainer.trained) == 40
    assert stats.num_workers == 1
    if mode == "packed":
        assert stats.packing_efficiency is not None and stats.packing_efficiency > 0.9
    else:
        assert stats.padding_efficiency is not None and stats.padding_efficiency > 0.8

    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 4
    assert logs[-1]["loss"] < 0.85 * logs[0]["loss"]
    for entry in logs:
        assert 0.0 <= entry["fastload_stall_fraction"] < 1.0
        assert entry["fastload_samples_per_s"] > 0
    summary = trainer.state.log_history[-1]
    assert "train_loss" in summary and "fastload_stall_fraction" in summary
    # Evaluation runs on a fastload loader too, in order, and its loss drops with training.
    evaluations = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
    assert len(evaluations) == 2 and evaluations[1] < evaluations[0]


def test_batches_hold_what_a_causal_lm_takes(dataset_path: Path, tmp_path: Path) -> None:
    trainer = _trainer(dataset_path, tmp_path, dataloader_num_workers=0)
    batch = next(iter(trainer.get_train_dataloader()))
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    assert ids.dtype == labels.dtype == torch.int64
    assert torch.equal(labels[mask == 1], ids[mask == 1])
    assert bool((labels[mask == 0] == -100).all()) and bool((mask == 0).any())
    # The model is given only what its forward takes.
    assert set(trainer._prepare_inputs(dict(batch))) == {"input_ids", "attention_mask", "labels"}

    packed = _trainer(dataset_path, tmp_path, dataloader_num_workers=0, pack_length=128)
    batch = next(iter(packed.get_train_dataloader()))
    assert batch["input_ids"].shape == (8, 128)
    assert set(packed._prepare_inputs(dict(batch))) == {"input_ids", "position_ids", "labels"}


STEPS = 40


@pytest.fixture(scope="module")
def full_runs(dataset_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[RecordingTrainer, Path]]:
    """Uninterrupted runs, by gradient accumulation steps, made when first asked for: the
    trainer (what it trained on) and its output folder (a checkpoint every 10 steps)."""
    return {}


def _full_run(
    runs: dict[int, tuple[RecordingTrainer, Path]], path: Path, out: Path, accumulation: int
) -> tuple[RecordingTrainer, Path]:
    if accumulation not in runs:
        trainer = _trainer(
            path,
            out,
            max_steps=STEPS,
            gradient_accumulation_steps=accumulation,
            save_strategy="steps",
            save_steps=10,
        )
        trainer.train()
        runs[accumulation] = (trainer, out)
    return runs[accumulation]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("accumulation", "resume_at"),
    [(1, 20), (2, 10), (2, 30)],  # batches consumed before the resume: 20, 20 and 60 (epoch 1)
)
def test_resume_trains_on_exactly_the_uninterrupted_batches(
    dataset_path: Path,
    tmp_path: Path,
    full_runs: dict[int, tuple[RecordingTrainer, Path]],
    accumulation: int,
    resume_at: int,
) -> None:
    steps = STEPS
    full, out = _full_run(full_runs, dataset_path, tmp_path / "full", accumulation)
    checkpoint = out / f"checkpoint-{resume_at}"
    saved = json.loads((checkpoint / LOADER_STATE_NAME).read_text())
    assert saved["sampler"]  # the loader's own state_dict, beside the checkpoint

    resumed = _trainer(
        dataset_path,
        tmp_path / "resumed",
        max_steps=steps,
        gradient_accumulation_steps=accumulation,
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    before = resume_at * accumulation
    assert len(full.trained) == steps * accumulation
    assert resumed.trained == full.trained[before:]
    # No replay: the resumed loader delivered only the batches that were trained on.
    assert resumed.train_loader is not None
    assert resumed.train_loader.stats().batches == len(resumed.trained)
    assert resumed.state.global_step == steps
