"""``FastloadTrainer`` on two real processes, started as torchrun starts them (gloo, CPU): both
ranks take the same number of steps on disjoint batches, and a run resumed from a checkpoint
trains each rank on exactly the batches the uninterrupted run gave it."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from _gloo import run_world

WORLD_SIZE = 2
TIMEOUT_S = 100
STEPS, SAVE_AT = 16, 8

RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    import torch

    torch.set_num_threads(1)  # two ranks and their workers share two cores
    sys.path.insert(0, sys.argv[3])
    from _lm_files import tiny_llama
    from transformers import TrainingArguments

    import fastload
    from fastload.hf import FastloadTrainer


    class Recording(FastloadTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.trained = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.trained.append(inputs["idx"].tolist())
            return super().training_step(model, inputs, num_items_in_batch)

        def _load_optimizer_and_scheduler(self, checkpoint):
            # transformers 4.57.1 loads the optimizer with map_location=args.device, which with
            # several CPU processes is "cpu:<rank>", a location torch.load cannot restore: load
            # both as Trainer does, onto "cpu".
            if checkpoint is None:
                return
            folder = Path(checkpoint)
            self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", map_location="cpu"))
            self.lr_scheduler.load_state_dict(torch.load(folder / "scheduler.pt"))


    def run(out, resume=None):
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=8, max_steps={steps}, save_strategy="steps",
            save_steps={save_at}, logging_steps=4, learning_rate=3e-3, use_cpu=True, ddp_backend="gloo",
            dataloader_num_workers=1, report_to=[], disable_tqdm=True, seed=3,
        )
        trainer = Recording(model=tiny_llama(), args=args, train_dataset=fastload.HDF5Dataset(sys.argv[1]))
        trainer.train(resume_from_checkpoint=resume)
        loader = trainer.train_loader
        return {{
            "trained": trainer.trained,
            "delivered": loader.stats().batches,
            "replicas": [loader.batch_sampler.num_replicas, loader.batch_sampler.rank],
            "global_step": trainer.state.global_step,
        }}


    work = Path(sys.argv[2])
    full = run(str(work / "full"))
    resumed = run(str(work / "resumed"), resume=str(work / "full" / "checkpoint-{save_at}"))
    rank = torch.distributed.get_rank()
    (work / f"rank{{rank}}.json").write_text(json.dumps({{"full": full, "resumed": resumed}}))
    """
).format(steps=STEPS, save_at=SAVE_AT)


def _run_ranks(h5: Path, work: Path) -> list[dict[str, Any]]:
    script = work / "rank.py"
    script.write_text(RANK_SCRIPT)
    here = str(Path(__file__).parent)
    preload = ("torch", "torch.distributed", "fastload", "fastload.hf", "transformers")
    run_world(script, WORLD_SIZE, lambda rank: [str(h5), str(work), here], TIMEOUT_S, local_world=True, preload=preload)
    return [json.loads((work / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S * 2)
def test_two_ranks_train_equal_disjoint_steps_and_resume_exactly(tmp_path: Path) -> None:
    from _lm_files import write_lm_file

    h5 = write_lm_file(tmp_path / "lm.h5", 400)
    reports = _run_ranks(h5, tmp_path)
    for rank, report in enumerate(reports):
        full, resumed = report["full"], report["resumed"]
        assert full["replicas"] == [WORLD_SIZE, rank]
        assert len(full["trained"]) == full["delivered"] == STEPS
        assert resumed["global_step"] == STEPS
        # The resumed run trains on the rest of this rank's uninterrupted batches, no replay.
        assert resumed["trained"] == full["trained"][SAVE_AT:]
        assert resumed["delivered"] == STEPS - SAVE_AT
    for step in range(STEPS):  # at every step the ranks train on different samples
        first, second = (set(r["full"]["trained"][step]) for r in reports)
        assert not first & second
