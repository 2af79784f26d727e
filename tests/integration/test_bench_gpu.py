"""``benchmarks/bench_gpu.py --size smoke``, as the suite runs it so that it never rots: on a
machine without CUDA every GPU-only figure reads "no CUDA" (none is made up), the loaders still
run, and every batch they delivered equals the reference; with CUDA the GPU figures are there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu.py"


def loaders(cuda: bool) -> tuple[str, ...]:
    """How each of the four loaders' configurations begins."""
    return (
        "torch, per-sample h5py",
        "torch, `__getitems__` from a memory map",
        'fastload, 2 workers, `device="cuda"`' if cuda else "fastload, 2 workers, host (no CUDA)",
        "fastload, 2 workers, `pin_memory=True` + own `non_blocking` copy",
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_smoke_run_is_complete_and_every_batch_equals_the_reference(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--size", "smoke", "--json", str(out), "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    saved = json.loads(out.read_text())
    cuda = torch.cuda.is_available()
    assert saved["cuda"] is cuda and saved["mismatches"] == {}
    figures = saved["figures"]
    measures = [f["measure"] for f in figures]
    # Copies (pinned, pageable), the GPU-idle matrix (one host run per loader without CUDA),
    # the training ceiling and the four loaders.
    idle_runs = 4 * (4 if cuda else 1)
    assert len(figures) == 2 + idle_runs + 5
    assert sum(m.startswith("host-to-device copy") for m in measures) == 2
    assert sum(m.startswith("GPU idle") for m in measures) == idle_runs
    assert sum(m.startswith("training tokens/s") for m in measures) == 5
    for name in loaders(cuda):
        assert sum(f["configuration"].startswith(name) for f in figures) == idle_runs // 4 + 1, name
    # Every loader run compared all its batches with the reference, and all were equal.
    checked = [f for f in figures if not f["measure"].startswith("host-to-device")]
    assert all(f["batches"] > 0 and f["mismatches"] == [] for f in checked)
    assert saved["batches_checked"] == sum(f["batches"] for f in checked)
    table = done.stdout[done.stdout.index("| measure |") :].strip().splitlines()
    assert len(table) == 2 + len(figures)  # one markdown table: header, rule, a row each
    assert all(line.startswith("| ") and line.endswith(" |") and line.count(" | ") == 5 for line in table[2:])
    for row, figure in zip(table[2:], figures, strict=True):
        cells = [c.strip() for c in row.strip("|").split("|")]
        gpu_only = figure["measure"].startswith(("host-to-device", "training"))
        if not cuda:  # no number where only a GPU could give one
            assert (cells[3] == "no CUDA") is gpu_only, row
            if figure["measure"].startswith("GPU idle"):
                assert cells[4] == "no CUDA" and cells[2] == "no CUDA", row
        else:
            assert "no CUDA" not in row, row
        if not figure["measure"].startswith("host-to-device"):
            assert cells[5] == f"{figure['batches']}/{figure['batches']}", row


def test_the_comparison_finds_a_batch_overwritten_or_reordered(tmp_path: Path) -> None:
    """What a slot reused under a pending copy does to a batch (another batch's bytes in it, or
    some of them), and elements moved within a batch, each make that batch differ."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_gpu
    finally:
        sys.path.remove(str(SCRIPT.parent))
    path = tmp_path / "corpus.h5"
    bench_gpu.write_corpus(path, 300)
    reference = bench_gpu.Reference(path)
    plan = bench_gpu.make_plan(300, 6, 8, seed=3)
    checker = bench_gpu.Checker(torch.device("cpu"), len(plan), 8)
    for i, rows in enumerate(plan[:5]):
        batch = reference.batch(rows)
        tokens = batch["tokens"].clone()
        if i == 1:  # the next batch's tokens written over this one's, where they fit
            other = reference.batch(plan[2])["tokens"]
            width = min(tokens.shape[1], other.shape[1])
            tokens[:, :width] = other[:, :width]
        if i == 3:  # two different tokens of a row swapped
            assert tokens[0, 0] != tokens[0, 1]
            tokens[0, [0, 1]] = tokens[0, [1, 0]]
        checker.add(tokens, batch["lengths"])
    assert checker.mismatches(reference, plan) == [1, 3, 5]  # batch 5 never arrived
