"""``fastload doctor`` / ``fastload.doctor(loader)`` and the checks a loader runs as it starts:
each condition made to occur for real (a small tmpfs at ``/dev/shm`` in a private mount
namespace, a lowered ``RLIMIT_NOFILE``, a dataset of a million Python tuples, an unguarded
script, kernels that cannot be imported), and quiet on a healthy setup."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import fastload
from fastload._doctor import _checks, _system
from fastload._doctor._checks import Plan
from fastload._doctor._findings import Severity
from fastload.cli import main
from fastload.errors import PreflightWarning
from tests.integration._token_files import write_token_file

ROOT = Path(__file__).resolve().parents[2]


class Tuples(torch.utils.data.Dataset):
    """A plain dataset holding its samples as a million Python tuples (copy-on-read)."""

    def __init__(self, n: int = 1_000_000) -> None:
        self.rows = [(i, i % 7) for i in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(self.rows[i])


class Shards(torch.utils.data.IterableDataset):
    """Two shards split among workers by worker id: workers past the second get nothing."""

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        wid, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for shard in range(2):
            if shard % workers == wid:
                yield from range(shard * 10, shard * 10 + 10)


def _run(code: str, *, cwd: Path | None = None, prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="default")
    return subprocess.run(
        [*(prefix or []), sys.executable, "-c", code], capture_output=True, text=True, timeout=100, cwd=cwd, env=env
    )


def test_the_doctor_is_quiet_on_a_healthy_setup(tmp_path: Path) -> None:
    path = write_token_file(tmp_path / "d.h5", 200, 64)
    loader = fastload.DataLoader(fastload.HDF5Dataset(str(path)), batch_size=8, num_workers=2, length_grouped=True)
    report = fastload.doctor(loader)
    assert report.ok and report.problems == (), str(report)
    assert sum(1 for _ in loader) == len(loader)  # the start-up checks warn of nothing (warnings are errors)
    assert loader.stats().preflight == ()


def test_the_cli_reports_a_healthy_dataset_and_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_token_file(tmp_path / "d.h5", 200, 64)
    assert main(["doctor", str(path), "--workers", "2", "--batch-size", "8"]) == 0
    assert "no problems found" in capsys.readouterr().out


def test_the_cli_refuses_a_negative_worker_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--workers", "-1"]) == 2
    assert "--workers must be >= 0" in capsys.readouterr().err


def test_a_small_dev_shm_is_reported_for_the_batches_workers_share_there() -> None:
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here: {probe.stderr.decode().strip()}")
    code = textwrap.dedent(
        """
        import torch, fastload
        class Big(torch.utils.data.Dataset):
            def __len__(self): return 64
            def __getitem__(self, i): return torch.zeros(256 * 1024)  # 1 MiB a sample
        loader = fastload.DataLoader(Big(), batch_size=4, num_workers=2)
        print(fastload.doctor(loader))
        """
    )
    script = f"mount -t tmpfs -o size=8m tmpfs /dev/shm && exec {sys.executable} -c '{code}'"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stderr
    assert "[error] shm: 5 batches of 4 MiB in flight need 20 MiB of /dev/shm, which has 8 MiB free" in done.stdout


def test_the_shm_check_measures_the_folder_it_is_given(tmp_path: Path) -> None:
    free = _system.free_bytes(tmp_path)
    assert free is not None
    plan = Plan(num_workers=2, batch_bytes=free // 4)  # 5 in flight: more than the folder holds
    found = _checks.shared_memory(plan, str(tmp_path), str(tmp_path), True, free, free)
    assert [f.severity for f in found] == [Severity.ERROR] and str(tmp_path) in found[0].message
    roomy = Plan(num_workers=2, batch_bytes=free // 10)
    assert _checks.shared_memory(roomy, str(tmp_path), str(tmp_path), True, free, free) == []


def test_a_low_open_file_limit_is_reported_through_the_cli(tmp_path: Path) -> None:
    path = write_token_file(tmp_path / "d.h5", 200, 64)
    code = textwrap.dedent(
        f"""
        import os, resource, sys
        from fastload.cli import main
        opened = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (opened + 24, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        sys.exit(main(["doctor", {str(path)!r}, "--workers", "8"]))
        """
    )
    done = _run(code)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "[error] open-files: RLIMIT_NOFILE is" in done.stdout and "ulimit -n" in done.stdout


def test_a_dataset_of_a_million_tuples_is_reported_and_its_loader_warns_naming_the_doctor() -> None:
    dataset = Tuples()
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=2)
    report = fastload.doctor(loader)
    (finding,) = [f for f in report.problems if f.check == "copy-on-read"]
    assert finding.severity is Severity.WARNING and "million Python objects" in finding.message
    assert "numpy arrays" in finding.remedy
    with pytest.warns(PreflightWarning, match=r"million Python objects.*fastload doctor"):
        it = iter(loader)
    next(it)
    assert any("million Python objects" in line for line in loader.stats().preflight)
    del it


@pytest.mark.filterwarnings("ignore:This DataLoader will create 4 worker processes")
def test_an_iterable_dataset_whose_split_starves_workers_is_reported() -> None:
    report = fastload.doctor(fastload.DataLoader(Shards(), batch_size=2, num_workers=4))
    (finding,) = [f for f in report.problems if f.check == "shares"]
    assert "workers 2, 3 of 4 get no sample" in finding.message
    assert fastload.doctor(fastload.DataLoader(Shards(), batch_size=2, num_workers=2)).ok


def test_a_cgroup_limit_below_the_planned_memory_is_reported(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text(f"{400 << 20}\n")
    (tmp_path / "memory.current").write_text(f"{200 << 20}\n")
    own = tmp_path / "cgroup"
    own.write_text("0::/\n")
    limit = _system.cgroup_memory(tmp_path, str(own))
    assert limit is not None and limit.limit == 400 << 20
    found = _checks.memory(Plan(num_workers=4), limit)
    assert [f.check for f in found] == ["memory"] and "leaving 200 MiB" in found[0].message
    assert _checks.memory(Plan(num_workers=1), limit) == []
    (tmp_path / "memory.max").write_text("max\n")
    assert _system.cgroup_memory(tmp_path, str(own)) is None


UNGUARDED = """
import torch
import fastload

class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([i * i])

{body}
"""
LOOP = """print("script started")
loader = fastload.DataLoader(Squares(), batch_size=2, num_workers=2, multiprocessing_context="forkserver")
print("total", sum(int(b.sum()) for b in loader))"""


def test_an_unguarded_script_is_stopped_before_its_workers_start_and_told_what_to_write(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(UNGUARDED.format(body=LOOP))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, cwd=tmp_path, env=env)
    assert done.returncode == 1
    assert "UnguardedMainError" in done.stderr and f"{script}, line 14" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr
    assert done.stdout.count("script started") == 1 and "errors.WorkerCrashedError:" not in done.stderr


def test_a_guarded_script_starts_its_workers_by_forkserver(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    body = "def main():\n" + textwrap.indent(LOOP, "    ") + '\n\nif __name__ == "__main__":\n    main()\n'
    script.write_text(UNGUARDED.format(body=body))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["script", "started", "total", str(sum(i * i for i in range(8)))]


def test_missing_kernels_are_said_once_at_the_first_loader_in_stats_and_by_the_doctor(tmp_path: Path) -> None:
    path = write_token_file(tmp_path / "d.h5", 100, 32)
    code = textwrap.dedent(
        f"""
        import sys, warnings
        for name in ("fastload._collate._native", "fastload._sampling._binpack"):
            sys.modules[name] = None  # as if the build had no C compiler
        import fastload
        from fastload.cli import main
        from fastload.errors import PreflightWarning
        ds = fastload.HDF5Dataset({str(path)!r})
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            first = fastload.DataLoader(ds, batch_size=8, length_grouped=True)
            for _ in first: pass
            for _ in fastload.DataLoader(ds, batch_size=8): pass
        said = [str(w.message) for w in seen if w.category is PreflightWarning]
        print("WARNINGS", len(said))
        print(said[0])
        print("STATS", first.stats())
        sys.exit(main(["doctor"]))
        """
    )
    done = _run(code)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "WARNINGS 1" in done.stdout
    assert "without the padding kernel (fastload._collate._native), padding a batch takes about 3x" in done.stdout
    assert "fastload doctor" in done.stdout.split("STATS")[0]
    stats = done.stdout.split("STATS")[1]
    assert "preflight: fastload was installed without its C kernels" in stats
    assert "[warning] native-kernels" in stats and "install a C compiler" in stats


def test_a_process_limit_the_workers_would_pass_is_reported() -> None:
    uid = os.getuid() or 1000  # root is not held to RLIMIT_NPROC: check as a user would be
    tasks = _system.user_tasks(os.getuid())
    assert tasks >= 1  # this process, at least
    found = _checks.processes(Plan(num_workers=4), tasks + 3, uid, tasks)
    assert [f.severity for f in found] == [Severity.ERROR] and "RLIMIT_NPROC" in found[0].message
    assert _checks.processes(Plan(num_workers=4), tasks + 100, uid, tasks) == []


def test_a_shard_cache_of_another_user_or_without_room_is_reported(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    folder.mkdir()
    free = _system.free_bytes(folder)
    assert free is not None
    roomy = Plan(num_workers=1, cache=(str(folder), free // 2, free * 2))
    assert _checks.shard_cache(roomy, os.getuid()) == []
    full = _checks.shard_cache(Plan(num_workers=1, cache=(str(folder), None, free * 2)), os.getuid())
    assert [f.severity for f in full] == [Severity.WARNING] and "no cache_limit" in full[0].message
    others = _checks.shard_cache(roomy, os.getuid() + 1)
    assert [f.severity for f in others] == [Severity.ERROR] and "not to you" in others[0].message


def test_a_rank_without_batches_and_workers_without_batches_are_reported() -> None:
    few = [torch.tensor([i]) for i in range(3)]
    none = fastload.doctor(fastload.DataLoader(few, batch_size=4, drop_last=True, num_workers=2))
    assert [f.check for f in none.problems] == ["shares"] and "no batch" in none.problems[0].message
    idle = fastload.doctor(fastload.DataLoader(few, batch_size=2, num_workers=2))
    assert idle.ok
    one = fastload.doctor(fastload.DataLoader(few, batch_size=4, num_workers=2))
    assert [f.check for f in one.problems] == ["shares"] and "1 of them never get one" in one.problems[0].message
