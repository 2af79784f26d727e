"""Input discovery, the progress bar, option validation and the command-line help."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from fastload._apps._convert._cli import convert_main
from fastload._apps._convert._convert_options import Compression, ConvertOptions
from fastload._apps._convert._discover import discover
from fastload._apps._convert._progress import Progress
from fastload.errors import UsageError


def test_a_dataset_dict_folder_asks_for_one_split(tmp_path: Path) -> None:
    (tmp_path / "dd" / "train").mkdir(parents=True)
    (tmp_path / "dd" / "test").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(
        UsageError, match=r"DatasetDict folder \(splits: test, train\); pass one split's folder"
    ):
        discover((str(tmp_path / "dd"),), None)


def test_format_hf_requires_a_save_to_disk_folder(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "x.arrow").write_bytes(b"")
    with pytest.raises(UsageError, match="not a Hugging Face save_to_disk folder"):
        discover((str(tmp_path / "plain"),), "hf")


def test_compressed_binary_formats_and_mixed_kinds_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a.parquet.gz").write_bytes(b"x")
    with pytest.raises(UsageError, match="gzip-compressed parquet files are not supported"):
        discover((str(tmp_path / "a.parquet.gz"),), None)
    (tmp_path / "a.npy").write_bytes(b"x")
    (tmp_path / "b.txt").write_text("x\n")
    with pytest.raises(UsageError, match="cannot be mixed"):
        discover((str(tmp_path / "a.npy"), str(tmp_path / "b.txt")), None)


def test_format_override_reads_files_of_any_extension_in_a_folder(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    for name in ("b.py", "a.c", "README"):
        (tmp_path / "src" / name).write_text("x\n")
    found = discover((str(tmp_path / "src"),), "txt")
    assert [f.path.name for f in found.files] == ["README", "a.c", "b.py"] and found.ignored == 0
    assert discover((str(tmp_path / "src" / "README"),), "txt").files[0].format == "txt"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_counts_bytes_per_second_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", Terminal())
    with Progress(description="converting", total_bytes=2000, enabled=True) as bar:
        bar.advance(input_bytes=1000, records=10)
    err = sys.stderr.getvalue()
    assert "converting" in err and "B/s" in err and "2.00k" in err


@pytest.mark.parametrize("terminal", [False, True])
def test_progress_without_a_bar_is_a_plain_line_every_few_seconds(
    monkeypatch: pytest.MonkeyPatch, terminal: bool
) -> None:
    """Not a terminal (a log), or a terminal without tqdm: lines, the first after the interval."""
    monkeypatch.setattr(sys, "stderr", Terminal() if terminal else io.StringIO())
    if terminal:
        monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `import tqdm` fail
    with Progress(description="converting", total_bytes=2_000_000, enabled=True) as bar:
        bar.advance(input_bytes=500_000, records=10)
    assert sys.stderr.getvalue() == ""  # within the first LINE_EVERY_S
    monkeypatch.setenv("_FASTLOAD_PROGRESS_EVERY_S", "0")
    with Progress(description="converting", total_bytes=2_000_000, enabled=True) as bar:
        bar.advance(input_bytes=500_000, records=10)
    (line,) = sys.stderr.getvalue().splitlines()
    assert line.startswith("converting: 0.5 MB of 2.0 MB (25 %), 10 records, ")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"workers": -1}, "--workers must be >= 0, got -1"),
        ({"min_length": 5, "max_length": 4}, "--min-length (5) must not exceed --max-length (4)"),
        ({"fields": ("lengths",)}, "field name 'lengths' is not allowed"),
        ({"fields": ("a",), "label_fields": ("a",)}, "field 'a' is named twice"),
        ({"dtype": "float32"}, "--dtype must be one of"),
        ({"shard_size": 0}, "--shard-size must be >= 1 sample, got 0"),
    ],
)
def test_bad_option_values_name_the_option_and_the_bound(
    tmp_path: Path, options: dict[str, object], message: str
) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ConvertOptions(inputs=("x",), output=tmp_path / "o.h5", **options)  # type: ignore[arg-type]


def test_compression_parses_levels_and_rejects_others() -> None:
    assert (
        str(Compression.parse("gzip")) == "gzip:4" and str(Compression.parse("gzip:9")) == "gzip:9"
    )
    assert Compression.parse("lzf").kind == "lzf" and Compression.parse("none").level is None
    for bad in ("gzip:10", "lzf:1", "zstd"):
        with pytest.raises(UsageError, match="--compression"):
            Compression.parse(bad)


def test_help_documents_the_compression_trade_off(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        convert_main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert (
        "memory-maps" in out
        and "--shard-size" in out
        and "--workers" in out
        and "--on-error" in out
    )
