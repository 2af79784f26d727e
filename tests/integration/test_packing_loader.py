"""``fastload.DataLoader(pack_length=...)`` end to end, on a real HDF5 file and real workers:
every token once per epoch, the same batches in-process, in workers and on the general path,
exact resume, ranks, statistics, and clear errors."""

from __future__ import annotations

import copy
import itertools
from collections import Counter
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from _token_files import write_token_file

import fastload
from fastload.errors import DataFormatError

SEQ_LEN = 64
ROWS = 4


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Lengths 1..149 at seq_len 64: a third of the samples are split into pieces.
    return write_token_file(tmp_path_factory.mktemp("packing") / "tokens.h5", 300, 150, label=True)


def stored_tokens(path: Path) -> list[np.ndarray]:
    with h5py.File(path, "r") as f:
        values, offsets = f["tokens/values"][:], f["tokens/offsets"][:]
    return [values[offsets[i] : offsets[i + 1]].astype(np.int64) for i in range(offsets.size - 1)]


def owned(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def documents_of(batch: dict[str, Any]) -> list[list[int]]:
    """The documents of a packed batch, read back from its tensors alone: runs of positions
    that restart at 0, cut by cu_seqlens, padding (labels all ignored past the first) left out."""
    tokens, labels = batch["tokens"].reshape(-1), batch["labels"].reshape(-1)
    cu = batch["cu_seqlens"].tolist()
    docs = []
    for start, stop in itertools.pairwise(cu):
        if (labels[start + 1 : stop] != -100).any() or (stop - start == 1 and _is_real_single(batch, start)):
            docs.append(tokens[start:stop].tolist())
    return docs


def _is_real_single(batch: dict[str, Any], flat: int) -> bool:
    """A one-token segment is a document when a real token lies there: a row's padding
    segment always runs to the row's end, and its tokens are the pad value 0 (real ids are
    1..29999 in these files)."""
    return int(batch["tokens"].reshape(-1)[flat]) != 0


def expected_documents(path: Path) -> Counter[tuple[int, ...]]:
    pieces = Counter()
    for sample in stored_tokens(path):
        for start in range(0, sample.size, SEQ_LEN):
            pieces[tuple(sample[start : start + SEQ_LEN].tolist())] += 1
    return pieces


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_token_once_per_epoch_in_full_shape_batches(token_file: Path, num_workers: int) -> None:
    loader = fastload.DataLoader(
        fastload.HDF5Dataset(str(token_file)), batch_size=ROWS, pack_length=SEQ_LEN, num_workers=num_workers
    )
    seen: Counter[tuple[int, ...]] = Counter()
    for batch in loader:
        assert batch["tokens"].shape == (ROWS, SEQ_LEN) and batch["tokens"].dtype == torch.int64
        assert batch["label"].shape == (ROWS, SEQ_LEN)  # the per-sample field, per token
        assert int(batch["cu_seqlens"][-1]) == ROWS * SEQ_LEN
        seen.update(tuple(doc) for doc in documents_of(batch))
    assert seen == expected_documents(token_file)
    stats = loader.stats()
    assert stats.padding_efficiency is None
    assert stats.packing_efficiency is not None and stats.packing_efficiency > 0.85


def test_workers_in_process_and_general_path_give_the_same_batches(token_file: Path) -> None:
    dataset = fastload.HDF5Dataset(str(token_file))

    class Samples(torch.utils.data.Dataset):
        """A user's own dataset: sample dicts and a lengths array, no read_batch."""

        def __init__(self) -> None:
            self.tokens = stored_tokens(token_file)
            self.lengths = np.array([t.size for t in self.tokens])
            self.labels = dataset.read_batch(np.arange(len(dataset)))["label"]

        def __len__(self) -> int:
            return len(self.tokens)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"tokens": self.tokens[i].astype(np.uint16), "label": self.labels[i]}

    runs = []
    for source, workers in ((dataset, 0), (dataset, 2), (Samples(), 0), (Samples(), 2)):
        loader = fastload.DataLoader(source, batch_size=ROWS, pack_length=SEQ_LEN, num_workers=workers, seed=7)
        runs.append([owned(b) for b in loader])
    for other in runs[1:]:
        assert len(other) == len(runs[0])
        for a, b in zip(runs[0], other, strict=True):
            assert a.keys() == b.keys()
            for key in a:
                assert torch.equal(a[key], b[key]), key


def test_resume_mid_epoch_gives_the_uninterrupted_batches(token_file: Path) -> None:
    dataset = fastload.HDF5Dataset(str(token_file))

    def make() -> fastload.DataLoader:
        return fastload.DataLoader(dataset, batch_size=ROWS, pack_length=SEQ_LEN, num_workers=2, seed=3)

    full = [owned(b) for b in make()]
    first = make()
    it = iter(first)
    head = [owned(next(it)) for _ in range(5)]
    state = first.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    rest = [owned(b) for b in resumed]
    assert len(head) + len(rest) == len(full)
    for a, b in zip(head + rest, full, strict=True):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["labels"], b["labels"])


def test_ranks_share_an_epoch_with_padding_batches_only(token_file: Path) -> None:
    dataset = fastload.HDF5Dataset(str(token_file))
    seen: Counter[tuple[int, ...]] = Counter()
    counts = []
    for rank in range(3):
        sampler = fastload.PackedBatchSampler(
            dataset.lengths, seq_len=SEQ_LEN, rows=ROWS, num_replicas=3, rank=rank
        )
        loader = fastload.DataLoader(dataset, batch_sampler=sampler, num_workers=1)
        batches = [owned(b) for b in loader]
        counts.append(len(batches))
        for batch in batches:
            docs = documents_of(batch)
            if not docs:  # a batch of padding only: nothing for the loss
                assert (batch["labels"] == -100).all()
            seen.update(tuple(doc) for doc in docs)
    assert len(set(counts)) == 1
    assert seen == expected_documents(token_file)


def test_options_that_cannot_go_together_are_refused(token_file: Path) -> None:
    dataset = fastload.HDF5Dataset(str(token_file))
    with pytest.raises(ValueError, match=r"length_grouped=True and pack_length= .*choose one"):
        fastload.DataLoader(dataset, batch_size=2, pack_length=SEQ_LEN, length_grouped=True)
    with pytest.raises(ValueError, match=r"pack_length= builds its own batch sampler"):
        fastload.DataLoader(dataset, sampler=range(10), pack_length=SEQ_LEN)
    with pytest.raises(ValueError, match=r"pack_length must be a positive integer"):
        fastload.DataLoader(dataset, batch_size=2, pack_length=0)
    with pytest.raises(ValueError, match=r"needs the dataset's per-sample lengths"):
        fastload.DataLoader([{"tokens": [1, 2]}], batch_size=1, pack_length=SEQ_LEN)


def test_a_length_that_disagrees_with_the_data_names_the_sample(token_file: Path) -> None:
    class Lying(torch.utils.data.Dataset):
        lengths = np.array([3, 5, 4])

        def __len__(self) -> int:
            return 3

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"tokens": np.arange(1, 4 if i != 1 else 3)}  # sample 1 holds 2, not 5

    loader = fastload.DataLoader(Lying(), batch_size=1, pack_length=16, shuffle=False)
    with pytest.raises(DataFormatError, match=r"field 'tokens' of sample 1 has 2 elements, but the dataset's lengths say 5"):
        list(loader)


def test_shuffle_shards_shapes_only_a_planned_loader(token_file: Path) -> None:
    dataset = fastload.HDF5Dataset([str(token_file)] * 3)  # three shards of the same file
    loader = fastload.DataLoader(dataset, batch_size=ROWS, pack_length=SEQ_LEN, shuffle_shards=1)
    sampler = copy.deepcopy(loader.batch_sampler)  # a copy: the loader's own is for its engine
    assert sampler is not None and sampler.num_replicas == 1
    per_shard = len(dataset) // 3
    for batch in sampler:  # K=1: every batch reads one shard
        assert len({int(s) // per_shard for s in batch.samples}) <= 1
    with pytest.raises(ValueError, match=r"shuffle_shards= shapes a length-grouped or packed plan"):
        fastload.DataLoader(dataset, batch_size=2, shuffle_shards=1)
    with pytest.raises(ValueError, match=r"shuffle_shards must be a positive integer"):
        fastload.DataLoader(dataset, max_tokens=512, shuffle_shards=0)


# -- narrow outputs ---------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("fields", [None, ["tokens"]])  # the general path; the one-call build
def test_narrow_outputs_equal_the_wide_ones_batch_for_batch(token_file: Path, workers: int, fields: Any) -> None:
    def loader(**narrow: Any) -> fastload.DataLoader[Any]:
        collate = fastload.PackCollate(SEQ_LEN, rows=ROWS, **narrow)
        dataset = fastload.HDF5Dataset(token_file, fields=fields)
        return fastload.DataLoader(dataset, pack_length=SEQ_LEN, batch_size=ROWS, num_workers=workers, collate_fn=collate)

    wide = [owned(b) for b in loader()]
    narrow = [owned(b) for b in loader(position_dtype=torch.int32, device_labels=True)]
    assert len(narrow) == len(wide) > 5
    for mine, theirs in zip(narrow, wide, strict=True):
        assert list(mine) == list(theirs)  # labels built on the host here, in their place
        assert mine["position_ids"].dtype == torch.int32
        for name, value in theirs.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(mine[name].long(), value.long()), name
                assert name == "position_ids" or mine[name].dtype == value.dtype, name
            else:
                assert mine[name] == value, name


@pytest.mark.gpu
@pytest.mark.parametrize("workers", [0, 2])
def test_on_a_gpu_the_labels_built_there_equal_the_host_ones(token_file: Path, workers: int) -> None:
    def loader(**options: Any) -> fastload.DataLoader[Any]:
        dataset = fastload.HDF5Dataset(token_file, fields=["tokens"])
        return fastload.DataLoader(dataset, pack_length=SEQ_LEN, batch_size=ROWS, num_workers=workers, **options)

    host = [owned(b) for b in loader()]
    on_gpu = loader(device="cuda")
    assert on_gpu.collate_fn.device_labels  # type: ignore[attr-defined]
    got = [{k: v.cpu() for k, v in b.items()} for b in on_gpu]
    assert len(got) == len(host)
    for mine, theirs in zip(got, host, strict=True):
        assert list(mine) == list(theirs)
        for name, value in theirs.items():
            assert mine[name].dtype == value.dtype and torch.equal(mine[name], value), name
