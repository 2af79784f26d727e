"""``FastloadTrainer``: Hugging Face's ``transformers.Trainer`` with fastload doing the loading.

``Trainer`` builds a ``torch.utils.data.DataLoader`` of its own in ``get_train_dataloader`` (and
``get_eval_dataloader``), passes it through ``accelerator.prepare``, and on resume replays the
epoch's first batches through ``skip_first_batches``, which rebuilds the loader once more. This
subclass keeps fastload's engine throughout:

* the loaders are ``fastload.DataLoader`` over a planned batch sampler that shards by rank
  itself (``per_device_train_batch_size``, ``dataloader_num_workers``, ``dataloader_drop_last``,
  ``seed``/``data_seed`` and ``dataloader_persistent_workers`` are honoured; every rank gets the
  same number of steps), never passed through ``accelerator.prepare``;
* batches are what a causal LM's forward takes: ``input_ids``, ``attention_mask`` and
  ``labels`` (-100 on padding), length-grouped by default; or with ``pack_length=`` packed
  rows: ``input_ids``, ``position_ids`` and ``labels`` (transformers keeps the packed documents
  apart in attention from the ``position_ids``);
* every checkpoint (``save_steps``) holds the loader's ``state_dict()`` as
  ``fastload_loader.json``, and ``train(resume_from_checkpoint=...)`` loads it instead of
  skipping batches: the resumed run trains on exactly the batches the uninterrupted run would
  have, with no replay;
* each training log gets ``fastload_stall_fraction`` and ``fastload_samples_per_s`` over the
  steps since the previous log (the final summary: over the whole run).

:class:`CausalLMCollate` (padded ids, mask and labels) is here for loops of your own, on
accelerate for example.

Importing this module imports ``transformers`` (the ``hf`` extra: ``pip install 'torch-fastload[hf]'``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from fastload._integrations._deps import require

require("transformers", "fastload.hf")

from transformers import Trainer, TrainerCallback  # noqa: E402
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint  # noqa: E402

from fastload._capabilities import reads_batches  # noqa: E402
from fastload._collate import PackCollate  # noqa: E402
from fastload._integrations._causal import CausalLMCollate  # noqa: E402
from fastload._loader._dataloader import DataLoader  # noqa: E402
from fastload._sampling import LengthGroupedBatchSampler, PackedBatchSampler  # noqa: E402

#: The file, in each checkpoint folder, that holds the training loader's ``state_dict()``.
LOADER_STATE_NAME = "fastload_loader.json"

# Random batches (``length_grouped=False``) are length-grouped windows of one batch: every
# batch a random draw, sorted inside, which changes nothing that trains.
_RANDOM_WINDOW = 1
_GROUPED_WINDOW = 100


class FastloadTrainer(Trainer):
    """``transformers.Trainer`` on fastload's loader (see the module text).

    Takes ``Trainer``'s arguments and, keyword-only:

    * ``length_grouped`` (default ``True``): batches of similar-length samples; ``False``:
      random batches. Either way through a :class:`~fastload.LengthGroupedBatchSampler`.
    * ``max_tokens``: length-grouped batches under a budget of padded tokens
      (``per_device_train_batch_size`` then caps the rows).
    * ``pack_length``: packed rows of this many tokens, ``per_device_train_batch_size`` rows
      per batch (:class:`~fastload.PackedBatchSampler`).
    * ``pad_token_id``: the id written on padding (its labels are -100 whatever it is);
      default the ``processing_class``'s ``pad_token_id``, else 0.
    * ``token_field``: the dataset's ragged field of token ids (default ``input_ids``, what
      ``fastload convert`` writes); the batch carries it as that name.

    The datasets must be fastload readers (``HDF5Dataset``, ``ArrowDataset``) or any dataset
    with ``read_batch`` and per-sample ``lengths``. Fields the model's forward does not take
    (``lengths``, ``document_ids``, ``cu_seqlens``, ``max_seqlen``, an ``idx``) are dropped
    before the forward, as ``remove_unused_columns`` does for a ``datasets.Dataset``.
    """

    def __init__(
        self,
        *args: Any,
        length_grouped: bool = True,
        max_tokens: int | None = None,
        pack_length: int | None = None,
        pad_token_id: int | None = None,
        token_field: str = "input_ids",
        **kwargs: Any,
    ) -> None:
        if not isinstance(length_grouped, bool):
            raise TypeError(f"length_grouped must be True or False; got {length_grouped!r}")
        for name, value in (("max_tokens", max_tokens), ("pack_length", pack_length)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None; got {value!r}")
        if pack_length is not None and max_tokens is not None:
            raise ValueError(
                "pack_length= packs per_device_train_batch_size rows per batch; max_tokens= is "
                "for padded batches: give one of them"
            )
        super().__init__(*args, **kwargs)
        self._length_grouped = length_grouped
        self._max_tokens = max_tokens
        self._pack_length = pack_length
        if pad_token_id is None:
            pad_token_id = getattr(self.processing_class, "pad_token_id", None) or 0
        self._pad_token_id = int(pad_token_id)
        self._token_field = token_field
        self._train_loader: DataLoader[Any] | None = None
        self._pending_loader_state: dict[str, Any] | None = None
        self._logged_meter: tuple[float, float, int] = (0.0, 0.0, 0)
        self.add_callback(_LoadLoaderState(self))

    # -- loaders --------------------------------------------------------------------------------

    @property
    def train_loader(self) -> DataLoader[Any] | None:
        """The fastload loader the current (or last) ``train()`` draws from."""
        return self._train_loader

    def get_train_dataloader(self) -> DataLoader[Any]:
        if self.train_dataset is None:
            raise ValueError("FastloadTrainer: training requires a train_dataset")
        args = self.args
        seed = args.data_seed if args.data_seed is not None else args.seed
        self._train_loader = self._loader(
            self.train_dataset, self._train_batch_size, shuffle=True, drop_last=args.dataloader_drop_last, seed=seed
        )
        self._logged_meter = (0.0, 0.0, 0)
        return self._train_loader

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader[Any]:
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("FastloadTrainer: evaluation requires an eval_dataset")
        if isinstance(eval_dataset, str):
            named: Any = self.eval_dataset
            eval_dataset = named[eval_dataset]
        elif eval_dataset is None:
            eval_dataset = self.eval_dataset
        return self._loader(eval_dataset, self.args.eval_batch_size, shuffle=False, drop_last=False, seed=0)

    def _loader(self, dataset: Any, batch_size: int, *, shuffle: bool, drop_last: bool, seed: int) -> DataLoader[Any]:
        if not reads_batches(dataset):
            raise TypeError(
                f"FastloadTrainer needs a dataset fastload reads by batch (read_batch and "
                f"per-sample lengths), such as fastload.HDF5Dataset; got {type(dataset).__name__}"
            )
        lengths = dataset.lengths
        args = self.args
        world = {"num_replicas": max(1, args.world_size), "rank": args.process_index}
        sampler: LengthGroupedBatchSampler | PackedBatchSampler
        collate: CausalLMCollate | PackCollate
        if self._pack_length is not None:
            sampler = PackedBatchSampler(
                lengths, seq_len=self._pack_length, rows=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last, **world
            )
            collate = PackCollate(
                self._pack_length, rows=batch_size, primary=self._token_field, pad_value=self._pad_token_id
            )
        else:
            sampler = LengthGroupedBatchSampler(
                lengths,
                batch_size=batch_size,
                max_tokens=self._max_tokens,
                shuffle=shuffle,
                seed=seed,
                drop_last=drop_last,
                window=_GROUPED_WINDOW if self._length_grouped else _RANDOM_WINDOW,
                **world,
            )
            collate = CausalLMCollate(field=self._token_field, pad_token_id=self._pad_token_id)
        workers = args.dataloader_num_workers
        device = args.device if args.device.type == "cuda" else None
        return DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=collate,
            num_workers=workers,
            prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
            persistent_workers=args.dataloader_persistent_workers and workers > 0,
            device=device,  # pinned slots and a side-stream copy: dataloader_pin_memory's job
        )

    # -- inputs ---------------------------------------------------------------------------------

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        if self.args.remove_unused_columns:
            self._set_signature_columns_if_needed()
            accepted = set(self._signature_columns or ()) | set(self.label_names or ())
            inputs = {name: value for name, value in inputs.items() if name in accepted}
        if self._token_field != "input_ids" and self._token_field in inputs:
            inputs["input_ids"] = inputs.pop(self._token_field)
        return super()._prepare_inputs(inputs)

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        columns: list[str] = self._signature_columns or []
        if self._token_field not in columns:
            self._signature_columns = [*columns, self._token_field]  # type: ignore[assignment]

    # -- checkpoints ----------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; resuming from a checkpoint that holds ``fastload_loader.json``
        loads the loader's position from it instead of replaying the epoch's first batches
        (unless ``ignore_data_skip``, which starts the epoch afresh, as with ``Trainer``)."""
        if isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        if resume_from_checkpoint is False:
            resume_from_checkpoint = None
        state_path = (
            None if resume_from_checkpoint is None else os.path.join(str(resume_from_checkpoint), LOADER_STATE_NAME)
        )
        if state_path is None or self.args.ignore_data_skip or not os.path.isfile(state_path):
            return super().train(resume_from_checkpoint, *args, **kwargs)
        with open(state_path) as f:
            self._pending_loader_state = json.load(f)
        # Trainer skips the resumed epoch's first batches unless ignore_data_skip; the loaded
        # state already starts where the checkpoint stopped, so it must not skip them again.
        self.args.ignore_data_skip = True
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.args.ignore_data_skip = False
            self._pending_loader_state = None

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self._train_loader is None or not self.args.should_save:
            return
        folder = os.path.join(
            self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        if os.path.isdir(folder):  # every rank's loader is at the same position: one file
            with open(os.path.join(folder, LOADER_STATE_NAME), "w") as f:
                json.dump(self._train_loader.state_dict(), f)

    # -- logging --------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """``Trainer.log`` with fastload's stall fraction and samples/s added to training logs.
        Added here rather than by a callback's ``on_log``: ``Trainer`` writes ``log_history``
        before the callbacks see the logs."""
        loader = self._train_loader
        if loader is not None and ("loss" in logs or "train_loss" in logs):
            snap = loader.stats()
            if "loss" in logs:  # the steps since the previous training log
                wait0, step0, samples0 = self._logged_meter
                wait, step, samples = snap.wait_s - wait0, snap.step_s - step0, snap.samples - samples0
                self._logged_meter = (snap.wait_s, snap.step_s, snap.samples)
            else:  # the end of training: the whole run
                wait, step, samples = snap.wait_s, snap.step_s, snap.samples
            total = wait + step
            logs["fastload_stall_fraction"] = round(wait / total, 6) if total > 0 else 0.0
            logs["fastload_samples_per_s"] = round(samples / total, 3) if total > 0 else 0.0
        super().log(logs, start_time)


class _LoadLoaderState(TrainerCallback):
    """Loads the checkpoint's loader position when training begins: after ``Trainer`` has
    sized the epochs from the loader's full length (a loaded loader counts only the batches
    left) and before the first epoch's ``set_epoch``, which keeps a position loaded for the
    same epoch."""

    def __init__(self, trainer: FastloadTrainer) -> None:
        self._trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer
        if trainer._pending_loader_state is not None and trainer._train_loader is not None:
            trainer._train_loader.load_state_dict(trainer._pending_loader_state)
            trainer._pending_loader_state = None


__all__ = ["LOADER_STATE_NAME", "CausalLMCollate", "FastloadTrainer"]
