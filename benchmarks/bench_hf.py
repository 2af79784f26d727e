"""transformers ``Trainer``: steps/s and trained tokens/s of the same tiny-model run with the
Trainer's own loader and with ``fastload.hf.FastloadTrainer``.

What it isolates: the loader under a real ``Trainer`` loop. The model is a 2-layer Llama of
hidden size 32 with random weights on CPU (one compute thread), small enough that loading is a
visible share of a step. The data is 4,000 sequences of lognormal length (median 64, 8..256
tokens) over a vocabulary of 64.

Runs, batches of 16, one loader worker each:

* ``trainer``: ``Trainer`` with its defaults — a torch ``DataLoader`` over a map-style dataset
  of token lists, padded by ``DataCollatorForLanguageModeling(mlm=False)`` (a
  ``PreTrainedTokenizerFast``), random batches;
* ``trainer-grouped``: the same with ``group_by_length=True`` (transformers'
  ``LengthGroupedSampler``);
* ``fastload-random``, ``fastload-grouped``: ``FastloadTrainer`` on an ``HDF5Dataset`` of the
  same sequences, random or length-grouped batches;
* ``fastload-packed``: ``FastloadTrainer(pack_length=256)``, 16 rows of 256 tokens per step.

Figures: steps/s (``train_steps_per_second``: the whole ``train()``, worker start included) and
trained tokens/s (labels other than -100, per second of ``train()``), each the median of
interleaved rounds; ratios against ``trainer`` of the same process.

Reproduce: ``.venv/bin/python -m pytest benchmarks/bench_hf.py -s -p no:cacheprovider --size
full`` (``--size smoke``, the default, runs in well under a minute).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

import fastload
from fastload.hf import FastloadTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
from _lm_files import VOCAB, tiny_llama

pytestmark = pytest.mark.timeout(900)

SAMPLES, BATCH, PACK_LENGTH = 4_000, 16, 256
SIZES = {"smoke": (30, 1), "full": (300, 3)}  # steps per run, repeats


def _sequences() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(np.log(64), 0.75, SAMPLES)), 8, 256).astype(np.int64)
    return [((rng.integers(1, VOCAB) + np.arange(n) * rng.integers(1, 4)) % (VOCAB - 1) + 1) for n in lengths]


def _write_h5(path: Path, sequences: list[np.ndarray]) -> Path:
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    with h5py.File(path, "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = len(sequences)
        f.create_dataset("input_ids/values", data=np.concatenate(sequences).astype(np.uint16))
        f.create_dataset("input_ids/offsets", data=np.concatenate([[0], np.cumsum(lengths)]))
        f.create_dataset("lengths", data=lengths)
    return path


class _TokenLists(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """What a Trainer user has after tokenizing: one list of ids per sample."""

    def __init__(self, sequences: list[np.ndarray]) -> None:
        self._rows = [{"input_ids": s.tolist()} for s in sequences]

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self._rows[i]


def _tokenizer() -> Any:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, **{f"t{i}": i for i in range(1, VOCAB)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[PAD]")), pad_token="[PAD]")


class _CountsTokens:
    """Counts the tokens each step trains on (labels other than -100)."""

    trained_tokens = 0

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
        self.trained_tokens += int((inputs["labels"] != -100).sum())
        return super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]


class _Trainer(_CountsTokens, Trainer):
    pass


class _FastloadTrainer(_CountsTokens, FastloadTrainer):
    pass


def _run(name: str, steps: int, out: Path, h5: Path, lists: _TokenLists) -> tuple[float, float]:
    args = TrainingArguments(
        output_dir=str(out / name),
        per_device_train_batch_size=BATCH,
        max_steps=steps,
        learning_rate=3e-3,
        logging_steps=steps,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=1,
        dataloader_pin_memory=False,
        group_by_length=name == "trainer-grouped",
        disable_tqdm=True,
        seed=3,
    )
    trainer: Any
    if name.startswith("trainer"):
        collator = DataCollatorForLanguageModeling(_tokenizer(), mlm=False)
        trainer = _Trainer(model=tiny_llama(), args=args, train_dataset=lists, data_collator=collator)
    else:
        options = {
            "fastload-random": {"length_grouped": False},
            "fastload-grouped": {},
            "fastload-packed": {"pack_length": PACK_LENGTH},
        }[name]
        trainer = _FastloadTrainer(model=tiny_llama(), args=args, train_dataset=fastload.HDF5Dataset(h5), **options)
    metrics = trainer.train().metrics
    return metrics["train_steps_per_second"], trainer.trained_tokens / metrics["train_runtime"]


def test_trainer_steps_per_second(bench_size: str) -> None:
    steps, repeats = SIZES[bench_size]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            sequences = _sequences()
            h5 = _write_h5(out / "lm.h5", sequences)
            lists = _TokenLists(sequences)
            names = ["trainer", "trainer-grouped", "fastload-random", "fastload-grouped", "fastload-packed"]
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
            for _ in range(repeats):  # interleaved rounds: a drift of the machine hits every run
                for name in names:
                    runs[name].append(_run(name, steps, out, h5, lists))
            results = {
                name: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
                for name, rs in runs.items()
            }
    finally:
        torch.set_num_threads(threads)
    base_steps, base_tokens = results["trainer"]
    print(f"\n{steps} steps of {BATCH}, median of {repeats}")
    print(f"{'run':<18}{'steps/s':>9}{'x':>7}{'tokens/s':>11}{'x':>7}")
    for name, (steps_s, tokens_s) in results.items():
        print(f"{name:<18}{steps_s:>9.1f}{steps_s / base_steps:>7.2f}{tokens_s:>11,.0f}{tokens_s / base_tokens:>7.2f}")
    assert all(s > 0 and t > 0 for s, t in results.values())
