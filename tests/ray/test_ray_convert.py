"""``--engine ray`` against ``--engine local``: the same inputs give the same files, byte for byte
(shards, index, vocabulary), for every input kind and tokenizer, over several Ray Data
executions; a Ray worker killed mid-task loses and duplicates nothing; bad records are reported
as the local converter reports them. All on the session's local Ray instance (2 CPUs)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fastload._apps._convert import _ray
from fastload._apps._convert._convert import ConvertReport, convert
from fastload._apps._convert._convert_options import ConvertOptions
from fastload.errors import DataFormatError, UsageError

pytest.importorskip("ray.data")

#: Ray's own deprecation notices about its internal settings are not ours to act on.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")

#: Small chunks, tasks and windows, so that a few hundred kB of input make dozens of Ray tasks of
#: a few chunks each, over several Ray Data executions.
BLOCK_BYTES = 8 << 10


@pytest.fixture(autouse=True)
def _small_tasks(ray_cluster: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_ray, "TASK_BYTES", 3 * BLOCK_BYTES)
    monkeypatch.setattr(_ray, "WINDOW_TASKS", 4)


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def convert_both(
    tmp_path: Path, inputs: list[Path], **options: object
) -> tuple[ConvertReport, ConvertReport]:
    """Convert ``inputs`` into ``tmp_path/local`` and ``tmp_path/ray``; both reports."""
    reports = []
    for engine in ("local", "ray"):
        (tmp_path / engine).mkdir()
        reports.append(
            convert(
                ConvertOptions(
                    inputs=tuple(map(str, inputs)),
                    output=tmp_path / engine / "out.h5",
                    block_bytes=BLOCK_BYTES,
                    engine=engine,  # type: ignore[arg-type]
                    **options,  # type: ignore[arg-type]
                )
            )
        )
    return reports[0], reports[1]


def text_lines(count: int, seed: int = 0) -> list[str]:
    words = ["the", "cat", "hello", "world", "sat", "on", "a", "mat", "naïve", "日本"]
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(words, size=int(rng.integers(0, 30)))) for _ in range(count)]


def _text(folder: Path) -> tuple[list[Path], dict[str, object]]:
    plain = folder / "a.txt"
    plain.write_text("\n".join(text_lines(3000)) + "\n")
    packed = folder / "b.txt.gz"
    packed.write_bytes(gzip.compress(("\n".join(text_lines(2000, seed=1)) + "\n").encode()))
    return [plain, packed], {"shard_size": 700, "max_length": 40}


def _jsonl_whitespace(folder: Path) -> tuple[list[Path], dict[str, object]]:
    path = folder / "rows.jsonl"
    rows = [{"text": t, "label": i % 7} for i, t in enumerate(text_lines(2500, seed=2))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    options = {"shard_size": 600, "tokenizer": "whitespace", "label_fields": ("label",)}
    return [path], options | {"max_length": 12, "overlong": "drop"}


def _csv_hf(folder: Path) -> tuple[list[Path], dict[str, object]]:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "the": 3, "cat": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    path = folder / "rows.csv"
    lines = ["text,label"] + [f'"{t}, ""quoted""\nsecond line",{i}' for i, t in enumerate(text_lines(1500, 3))]
    path.write_text("\n".join(lines) + "\n")
    return [path], {"shard_size": 500, "tokenizer": str(folder / "tokenizer.json"), "label_fields": ("label",)}


def _columnar(folder: Path) -> tuple[list[Path], dict[str, object]]:
    table = pa.table({"text": text_lines(2000, 4), "label": np.arange(2000) % 3})
    pq.write_table(table, folder / "a.parquet", row_group_size=300)
    with pa.ipc.new_file(folder / "b.arrow", table.schema) as writer:
        writer.write_table(table.slice(0, 900))
    return [folder / "a.parquet", folder / "b.arrow"], {"shard_size": 1000, "label_fields": ("label",)}


def _numpy(folder: Path) -> tuple[list[Path], dict[str, object]]:
    lengths = np.random.default_rng(5).integers(1, 50, size=4000)
    np.save(folder / "tokens.npy", np.arange(lengths.sum(), dtype=np.int32) % 1000)
    np.save(folder / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]))
    paths = [folder / "tokens.npy", folder / "offsets.npy"]
    return paths, {"shard_size": 900, "offsets": (("tokens", "offsets"),), "max_length": 30}


INPUTS: dict[str, Callable[[Path], tuple[list[Path], dict[str, object]]]] = {
    "text and gzip text, byte tokens": _text,
    "JSON Lines, whitespace vocabulary, labels, overlong dropped": _jsonl_whitespace,
    "CSV with quoted newlines, tokenizer.json": _csv_hf,
    "Parquet and Arrow": _columnar,
    "numpy with offsets": _numpy,
}


@pytest.mark.parametrize("kind", list(INPUTS))
def test_ray_writes_the_local_converters_files_byte_for_byte(tmp_path: Path, kind: str) -> None:
    (tmp_path / "in").mkdir()
    inputs, options = INPUTS[kind](tmp_path / "in")
    local, ray = convert_both(tmp_path, inputs, **options)
    assert len(local.outputs) >= 2  # several shards, each from several chunks
    assert files(tmp_path / "ray") == files(tmp_path / "local")
    assert (ray.samples, ray.tokens, ray.stats) == (local.samples, local.tokens, local.stats)
    assert ray.notes() == [n.replace("/local/", "/ray/") for n in local.notes()]


def test_a_ray_worker_killed_mid_task_is_retried_and_nothing_is_lost_or_duplicated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "in").mkdir()
    inputs, options = _text(tmp_path / "in")
    marker = tmp_path / "killed"
    monkeypatch.setenv(_ray.KILL_ONCE_ENV, str(marker))
    local, ray = convert_both(tmp_path, inputs, **options)
    # Both a tokenizing task and a shard-writing task killed their own worker process once.
    assert Path(f"{marker}.map").exists() and Path(f"{marker}.shard").exists()
    assert files(tmp_path / "ray") == files(tmp_path / "local")
    assert ray.samples == local.samples > 4500  # minus the empty lines, as --min-length 1 says
    assert not [p for p in (tmp_path / "ray").iterdir() if p.name.startswith(".")]


def _bad_jsonl(folder: Path) -> Path:
    rows = [json.dumps({"text": t}) for t in text_lines(900, 6)]
    rows[400] = '{"text": broken'
    rows[700] = json.dumps({"text": 7})
    path = folder / "bad.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_a_bad_record_is_reported_with_its_file_and_line_as_locally(tmp_path: Path) -> None:
    path = _bad_jsonl(tmp_path)
    messages = []
    for engine in ("local", "ray"):
        with pytest.raises(DataFormatError, match=r"bad\.jsonl:401: malformed JSON") as caught:
            convert(
                ConvertOptions(
                    inputs=(str(path),),
                    output=tmp_path / f"{engine}.h5",
                    block_bytes=BLOCK_BYTES,
                    engine=engine,  # type: ignore[arg-type]
                )
            )
        messages.append(str(caught.value))
        assert not (tmp_path / f"{engine}.h5").exists()
    assert messages[0] == messages[1]


def test_on_error_skip_counts_what_the_local_converter_counts(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    path = _bad_jsonl(tmp_path / "in")
    local, ray = convert_both(tmp_path, [path], on_error="skip", shard_size=300)
    assert ray.stats.skipped == local.stats.skipped == {"malformed JSON": 1, "wrong type": 1}
    assert ray.stats.first_skip == local.stats.first_skip
    assert files(tmp_path / "ray") == files(tmp_path / "local")


def test_ray_options_are_checked_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--ray-address applies to --engine ray"):
        ConvertOptions(inputs=("a",), output=tmp_path / "o.h5", ray_address="auto")
    with pytest.raises(UsageError, match="--workers applies to --engine local"):
        ConvertOptions(inputs=("a",), output=tmp_path / "o.h5", engine="ray", workers=2)
    with pytest.raises(UsageError, match="--ray-address must be auto"):
        ConvertOptions(inputs=("a",), output=tmp_path / "o.h5", engine="ray", ray_address="x")
    recorded = ConvertOptions(inputs=("a",), output=tmp_path / "o.h5", engine="ray").recorded()
    assert "engine" not in recorded and "ray_address" not in recorded  # same attributes as local
