"""Several files read as one dataset: lists, globs and directories, with global indices."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from _format_files import (
    Corpus,
    assert_same,
    batch_sample,
    corpus_table,
    fixed,
    h5_sample,
    open_reference,
    random_indices,
    write_arrow_file,
    write_arrow_stream,
    write_fastload,
    write_parquet,
    write_vlen,
)

from fastload import ArrowDataset, HDF5Dataset
from fastload.errors import DataFormatError

BOUNDS = (0, 20, 21, 40, 57)  # shards of 20, 1, 19 and 17 samples


def _h5_shards(folder: Path, corpus: Corpus) -> list[Path]:
    folder.mkdir(exist_ok=True)
    paths = []
    for k, (start, stop) in enumerate(itertools.pairwise(BOUNDS)):
        # Mix storage layouts across shards: the fields, not the storage, must agree.
        write = write_fastload if k % 2 == 0 else write_vlen
        paths.append(write(folder / f"part-{k:03d}.h5", corpus.slice(start, stop)))
    return paths


def _arrow_shards(folder: Path, corpus: Corpus) -> list[Path]:
    folder.mkdir(exist_ok=True)
    writers = [
        lambda p, t: write_arrow_file(p.with_suffix(".arrow"), t, 6),
        lambda p, t: write_parquet(p.with_suffix(".parquet"), t, 4),
        lambda p, t: write_arrow_stream(p.with_suffix(".arrow"), t, 5),
        lambda p, t: write_arrow_file(p.with_suffix(".arrow"), t, 3),
    ]
    return [
        writers[k](folder / f"part-{k:03d}", corpus_table(corpus.slice(start, stop)))
        for k, (start, stop) in enumerate(itertools.pairwise(BOUNDS))
    ]


def _check_global_reads(ds: HDF5Dataset | ArrowDataset, corpus: Corpus, fields: list[str]) -> None:
    indices = random_indices(len(corpus), 60, seed=6)
    batch = ds.read_batch(indices)
    for position, index in enumerate(indices.tolist()):
        i = index % len(corpus)
        expected = {
            "tokens": corpus.tokens[i],
            "label": corpus.label[i],
            "text": corpus.text[i],
            "emb": corpus.emb[i],
        }
        for name in fields:
            assert_same(batch_sample(batch, name, position), expected[name], f"{name}[{index}]")
    assert ds.lengths.tolist() == [len(t) for t in corpus.tokens]


def test_hdf5_shards_by_list_glob_and_directory_are_one_dataset(
    corpus: Corpus, tmp_path: Path
) -> None:
    paths = _h5_shards(tmp_path / "shards", corpus)
    fields = ["tokens", "label", "text"]
    for source in (paths, str(tmp_path / "shards" / "part-*.h5"), tmp_path / "shards"):
        ds = HDF5Dataset(source, fields=fields)
        assert ds.files == [str(p) for p in paths]
        assert len(ds) == len(corpus)
        _check_global_reads(ds, corpus, fields)


def test_arrow_shards_of_mixed_formats_are_one_dataset(corpus: Corpus, tmp_path: Path) -> None:
    paths = _arrow_shards(tmp_path / "shards", corpus)
    fields = ["tokens", "label", "text", "emb"]
    for source in (paths, str(tmp_path / "shards" / "part-*"), tmp_path / "shards"):
        ds = ArrowDataset(source, fields=fields)
        assert ds.files == [str(p) for p in paths]
        _check_global_reads(ds, corpus, fields)


def test_a_list_keeps_its_order_while_globs_sort(corpus: Corpus, tmp_path: Path) -> None:
    paths = _h5_shards(tmp_path / "shards", corpus)
    reversed_ds = HDF5Dataset(paths[::-1], fields=["label"])
    assert fixed(reversed_ds.read_batch([0])["label"]).tolist() == [corpus.label[BOUNDS[3]]]
    globbed = HDF5Dataset(str(tmp_path / "shards" / "*.h5"), fields=["label"])
    assert (
        fixed(globbed.read_batch(np.arange(len(corpus)))["label"]).tolist() == corpus.label.tolist()
    )


def test_hdf5_reference_reads_agree_across_shard_boundaries(corpus: Corpus, tmp_path: Path) -> None:
    paths = _h5_shards(tmp_path / "shards", corpus)
    ds = HDF5Dataset(paths, fields=["tokens"])
    for index in (BOUNDS[1] - 1, BOUNDS[1], BOUNDS[2], BOUNDS[3] - 1, BOUNDS[3]):
        shard = int(np.searchsorted(BOUNDS, index, side="right")) - 1
        with open_reference(paths[shard]) as reference:
            expected = h5_sample(reference, "tokens", index - BOUNDS[shard])
        assert_same(ds[index]["tokens"], expected, f"tokens[{index}]")


def test_shards_with_different_fields_are_rejected_naming_both_files(
    corpus: Corpus, tmp_path: Path
) -> None:
    first = write_fastload(tmp_path / "a.h5", corpus.slice(0, 10))
    second = write_vlen(tmp_path / "b.h5", corpus.slice(10, 20))
    with pytest.raises(DataFormatError, match=r"b\.h5: has fields .* but the first shard .*a\.h5"):
        HDF5Dataset([first, second])
    table = corpus_table(corpus.slice(0, 10))
    other = table.set_column(2, "label", table.column("label").cast("int32"))
    a = write_arrow_file(tmp_path / "a.arrow", table, 4)
    b = write_arrow_file(tmp_path / "b.arrow", other, 4)
    with pytest.raises(
        DataFormatError, match=r"b\.arrow: field 'label' is fixed int32 .* it is fixed int64"
    ):
        ArrowDataset([a, b])


def test_an_empty_shard_between_others_takes_no_indices(corpus: Corpus, tmp_path: Path) -> None:
    h5 = [
        write_fastload(tmp_path / "a.h5", corpus.slice(0, 8)),
        write_fastload(tmp_path / "b.h5", corpus.slice(8, 8)),
        write_fastload(tmp_path / "c.h5", corpus.slice(8, 20)),
    ]
    table = corpus_table(corpus.slice(0, 20))
    arrow = [
        write_arrow_file(tmp_path / "a.arrow", table.slice(0, 8), 3),
        write_arrow_stream(tmp_path / "b.arrow", table.slice(8, 0), 3),
        write_parquet(tmp_path / "c.parquet", table.slice(8), 5),
    ]
    for ds in (
        HDF5Dataset(h5, fields=["label", "tokens"]),
        ArrowDataset(arrow, fields=["label", "tokens"]),
    ):
        assert len(ds) == 20
        assert fixed(ds.read_batch(np.arange(20)[::-1])["label"]).tolist() == list(
            range(19, -1, -1)
        )
        assert ds.lengths.tolist() == [len(t) for t in corpus.tokens[:20]]
