"""Remote shards on object storage (issue 20): fastload's shard cache and plan-aware prefetch
against what a user writes first and against MosaicML Streaming, all three reading the same
samples from the same S3-compatible server with 20 ms added to every request.

The server is moto's (``python -m moto.server``, a subprocess on 127.0.0.1) behind the logging
proxy of the remote tests (``FaultProxy`` with ``latency_s=0.02``); both come from
``tests/remote/_servers.py``, imported by putting ``tests/remote`` on ``sys.path`` (the
benchmarks are not a package). Every byte and every GET counted here is the proxy's: what it
sent in reply bodies, the same measure for all three loaders.

The data: variable-length int32 token sequences (lognormal lengths) written as Arrow IPC shards
with ``fastload index``'s index, uploaded under ``s3://BUCKET/arrow/``; the same samples written
by Streaming's ``MDSWriter`` (``ndarray:int32``, no compression, shards of about the same size)
under ``s3://BUCKET/mds/``. All loaders yield batches of the same size, padded to the batch's
longest sample with a mask, with 2 worker processes (Streaming: see below).

* **fastload**: ``ArrowDataset(url, cache_dir=, cache_limit=)`` and
  ``DataLoader(batch_size=, length_grouped=True, shuffle_shards=K, num_workers=2)``; cache limits
  of 100 %, 25 % and 10 % of the shards' bytes with K = 2, and 10 % with K = 1 (a group of two
  shards fills a cache of 2.4 and leaves no room to fetch ahead), a fresh cache directory for
  epoch 1 (cold), the
  same loader and directory for epoch 2 (warm); and the same loader over the shards on local
  disk, the reference for what the cache can give at best. The first cache limit runs once
  more at each of Streaming's other worker counts (0), beside the local loader at that count.
* **torch, per sample**: torch's DataLoader over a map-style Dataset whose ``__getitem__`` opens
  the sample's shard with ``pyarrow.fs.S3FileSystem`` and reads the record batch holding it (one
  client per worker, nothing cached): a fixed number of shuffled samples, not an epoch (at the
  full size one would take half an hour).
* **Streaming**: ``StreamingDataset(remote="s3://BUCKET/mds/", local=DIR, batch_size=,
  shuffle=True)`` with ``S3_ENDPOINT_URL`` pointing at the proxy, in torch's DataLoader with
  0 and 2 workers (:data:`STREAMING_WORKERS`; with 2, each forked worker drops the S3 client it
  inherited: see :func:`_own_s3_client`); fastload is compared with it at the same count. Its
  ``streaming.vision`` module imports torchvision,
  which the text path never uses: the harness puts an empty module in its place before
  importing ``streaming`` (and says so in its output).
  Not installed (the test suite's run), its rows are skipped with the reason printed; install
  it with :data:`STREAMING_INSTALL` (its own pins would replace this venv's torch and numpy).

Measured per configuration: samples/s of an epoch consumed as fast as it comes (wall time from
``iter()`` to the end, first batch included); the stall at a 10 ms step (a ``time.sleep`` per
batch; the caller's clock around each ``next()``: wait / (wait + step) after the first batch);
time to the first batch; MB and GETs the proxy served. ``--size full`` measures two corpora:
``small`` (issue 31's: 20,000 short samples in 16 shards, batch 32, length-grouped across all
shards) and ``full`` (36,000 longer ones in 24 shards, shard windows). ``--size smoke`` (default) checks what
can fail in seconds: the remote loader yields exactly the local loader's batches, epoch 1
fetches each shard once, and epoch 2 with a full cache sends no request at all.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import sys
import time
import types
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "remote"))
from _servers import Credentials, FaultProxy, Faults, LoggedRequest, MotoServer

import fastload
from fastload.cli import main as fastload_main

# The full size downloads the dataset about thirty times through the proxy: more than the
# suite's default timeout.
pytestmark = pytest.mark.timeout(3600)

#: How to install Streaming beside this venv's torch and numpy: its own pins would replace them
#: (a CUDA torch, numpy < 2.2, torchvision), so it comes without its dependencies, and the extra
#: brings the ones its text path imports.
STREAMING_INSTALL = "pip install -e '.[bench-remote]' && pip install --no-deps mosaicml-streaming==0.13.0"
LATENCY_S = 0.02
#: Streaming's worker counts; fastload runs at each of them too, and "vs Streaming" compares rows
#: of the same count.
STREAMING_WORKERS = (0, 2)
STEP_S = 0.010
WORKERS = 2
BUCKET = "bench"
RECORD_BATCH_ROWS = 256


@dataclass(frozen=True)
class Size:
    shards: int
    samples_per_shard: int
    median_length: int
    max_length: int
    batch_size: int
    # (cache limit as a share of the shards' bytes, shuffle_shards); the first is the baseline
    limits: tuple[tuple[float, int], ...]  # shuffle_shards 0: length-grouped across all shards
    shuffle_shards: int  # of the correctness check and the local reference
    rounds: int  # epoch-1/epoch-2 pairs without a step, per cache limit (median)
    torch_samples: int
    torch_stall: bool  # also time the per-sample loader at the 10 ms step


SIZES = {
    "smoke": Size(4, 300, 64, 256, 32, ((1.0, 2),), 2, 1, 16, False),
    # Issue 31's small corpus: 20,000 short samples in 16 shards (4.3 MB), batch 32, every batch
    # length-grouped across all shards (so it reads from most of them).
    "small": Size(16, 1250, 40, 512, 32, ((1.0, 0),), 0, 3, 64, False),
    # The large corpus. 10 % is 2.4 shards: with K = 2 the group being read fills it, K = 1 leaves room ahead.
    "full": Size(24, 1500, 512, 4096, 64, ((1.0, 2), (0.25, 2), (0.10, 2), (0.10, 1)), 2, 3, 256, True),
}


# -- the server, the data ----------------------------------------------------------------------


@dataclass
class Server:
    moto: MotoServer
    proxy: FaultProxy
    credentials: Credentials

    @property
    def endpoint(self) -> str:
        return self.proxy.endpoint

    def direct(self) -> pafs.S3FileSystem:
        """A client straight to moto: set-up traffic stays out of the proxy's log."""
        return pafs.S3FileSystem(
            endpoint_override=self.moto.endpoint,
            access_key=self.credentials.access_key,
            secret_key=self.credentials.secret_key,
            allow_bucket_creation=True,
        )

    def upload(self, folder: Path, prefix: str) -> str:
        fs = self.direct()
        for path in sorted(folder.iterdir()):
            with fs.open_output_stream(f"{BUCKET}/{prefix}/{path.name}") as out:
                out.write(path.read_bytes())
        return f"s3://{BUCKET}/{prefix}/"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    moto = MotoServer()
    credentials = moto.start()
    proxy = FaultProxy(moto.endpoint, Faults(latency_s=LATENCY_S))
    saved = dict(os.environ)
    try:
        for name in [n for n in os.environ if n.startswith("AWS_")]:
            del os.environ[name]
        os.environ.update(
            AWS_ACCESS_KEY_ID=credentials.access_key,
            AWS_SECRET_ACCESS_KEY=credentials.secret_key,
            AWS_DEFAULT_REGION="us-east-1",
            AWS_EC2_METADATA_DISABLED="true",
            AWS_CONFIG_FILE=os.devnull,
            AWS_SHARED_CREDENTIALS_FILE=os.devnull,
            S3_ENDPOINT_URL=proxy.endpoint,  # Streaming's boto3 client
        )
        served = Server(moto, proxy, credentials)
        served.direct().create_dir(BUCKET)
        yield served
    finally:
        os.environ.clear()
        os.environ.update(saved)
        proxy.close()
        moto.stop()


#: The corpora each ``--size`` runs: the full run measures the small corpus and the large one.
CORPORA = {"smoke": ["smoke"], "full": ["small", "full"]}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "corpus_name" in metafunc.fixturenames:
        metafunc.parametrize("corpus_name", CORPORA[str(metafunc.config.getoption("--size"))], scope="module")


@dataclass
class Corpus:
    name: str
    folder: Path  # the Arrow shards and their index, on local disk
    samples: list[np.ndarray]
    shard_bytes: int  # the shards' bytes, index excluded
    url: str
    mds_url: str | None

    @property
    def token_sum(self) -> int:
        return int(sum(int(s.sum(dtype=np.int64)) for s in self.samples))


def make_samples(size: Size, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    total = size.shards * size.samples_per_shard
    lengths = np.clip(rng.lognormal(np.log(size.median_length), 0.75, total), 8, size.max_length).astype(np.int64)
    values = rng.integers(1, 50_000, int(lengths.sum()), dtype=np.int32)
    return np.split(values, np.cumsum(lengths)[:-1])


def write_arrow_shards(samples: list[np.ndarray], size: Size, folder: Path) -> None:
    folder.mkdir(parents=True)
    for shard in range(size.shards):
        rows = samples[shard * size.samples_per_shard : (shard + 1) * size.samples_per_shard]
        offsets = np.concatenate([[0], np.cumsum([r.size for r in rows])]).astype(np.int32)
        column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(rows)))
        shard_table = pa.table({"tokens": column})
        path = folder / f"part-{shard:05d}.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, shard_table.schema) as out:
            out.write_table(shard_table, max_chunksize=RECORD_BATCH_ROWS)
    assert fastload_main(["index", "--quiet", str(folder)]) == 0


def streaming_module() -> tuple[Any, str | None]:
    """``streaming`` (with the empty ``streaming.vision`` stand-in), or None and why not."""
    if importlib.util.find_spec("streaming") is None:
        return None, f"mosaicml-streaming is not installed ({STREAMING_INSTALL})"
    # streaming/__init__ imports streaming.vision, which imports torchvision; text never uses it.
    sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    try:
        import streaming
    except ImportError as exc:
        return None, f"import streaming failed: {type(exc).__name__}: {exc}"
    return streaming, None


def write_mds(streaming: Any, samples: list[np.ndarray], shard_bytes: int, folder: Path) -> None:
    with streaming.MDSWriter(
        out=str(folder), columns={"tokens": "ndarray:int32"}, compression=None, size_limit=shard_bytes
    ) as out:
        for sample in samples:
            out.write({"tokens": sample})


@pytest.fixture(scope="module")
def corpus(server: Server, corpus_name: str, tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    size = SIZES[corpus_name]
    root = tmp_path_factory.mktemp("remote-corpus")
    samples = make_samples(size)
    write_arrow_shards(samples, size, root / "arrow")
    shard_bytes = sum(p.stat().st_size for p in (root / "arrow").glob("*.arrow"))
    url = server.upload(root / "arrow", f"{corpus_name}/arrow")
    streaming, _ = streaming_module()
    mds_url = None
    if streaming is not None:
        write_mds(streaming, samples, shard_bytes // size.shards, root / "mds")
        mds_url = server.upload(root / "mds", f"{corpus_name}/mds")
    return Corpus(corpus_name, root / "arrow", samples, shard_bytes, url, mds_url)


# -- measuring one epoch --------------------------------------------------------------------------


@dataclass
class Epoch:
    samples: int
    seconds: float
    first_batch_s: float
    wait_s: float  # in next() after the first batch
    token_sum: int
    mb: float = 0.0
    gets: int = 0
    shard_gets: int = 0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds

    @property
    def stall(self) -> float:
        after = self.seconds - self.first_batch_s
        return self.wait_s / after if after > 0 else 0.0


def consume(batches: Iterable[dict[str, torch.Tensor]], step_s: float, limit: int | None = None) -> Epoch:
    """Iterate ``batches`` (up to ``limit`` samples), sleeping ``step_s`` per batch; time each
    ``next()`` with the caller's clock. Sums the tokens (padding is 0) to check them."""
    samples = tokens = 0
    wait = 0.0
    first: float | None = None
    start = time.perf_counter()
    iterator = iter(batches)
    while limit is None or samples < limit:
        before = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            if first is not None:
                wait += time.perf_counter() - before
            break
        got = time.perf_counter()
        if first is None:
            first = got - start
        else:
            wait += got - before
        samples += int(batch["lengths"].numel())
        tokens += int(batch["tokens"].sum(dtype=torch.int64))
        if step_s:
            time.sleep(step_s)
    seconds = time.perf_counter() - start
    return Epoch(samples, seconds, first or seconds, wait, tokens)


def pad_collate(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same output as fastload's: int32 ids padded with 0, an int64 mask, the lengths."""
    lengths = torch.tensor([s.numel() for s in samples], dtype=torch.int64)
    tokens = torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)
    mask = (torch.arange(tokens.shape[1])[None, :] < lengths[:, None]).to(torch.int64)
    return {"tokens": tokens, "attention_mask": mask, "lengths": lengths}


# -- the three loaders ------------------------------------------------------------------------------


def fastload_loader(
    corpus: Corpus, server: Server, size: Size, cache: Path, limit: float, shuffle_shards: int, workers: int = WORKERS
) -> fastload.DataLoader:
    dataset = fastload.ArrowDataset(
        corpus.url,
        storage_options={"endpoint_override": server.endpoint},
        cache_dir=cache,
        cache_limit=None if limit >= 1 else int(corpus.shard_bytes * limit),
    )
    with warnings.catch_warnings():
        # A 10 % cache cannot hold two windows of shuffle_shards=2: the loader says so, and the
        # table measures what that costs.
        warnings.filterwarnings("ignore", message="shuffle_shards=.* with cache_limit")
        return fastload.DataLoader(
            dataset, batch_size=size.batch_size, length_grouped=True, shuffle_shards=shuffle_shards or None,
            num_workers=workers, seed=0,
        )  # fmt: skip


def local_loader(corpus: Corpus, size: Size, workers: int = WORKERS) -> fastload.DataLoader:
    """The same loader over the same shards on local disk: what the cache can at best give."""
    return fastload.DataLoader(
        fastload.ArrowDataset(sorted(corpus.folder.glob("*.arrow"))), batch_size=size.batch_size,
        length_grouped=True, shuffle_shards=size.shuffle_shards or None, num_workers=workers, seed=0,
    )  # fmt: skip


def run_local(corpus: Corpus, size: Size, step_s: float, workers: int = WORKERS) -> list[Epoch]:
    loader = local_loader(corpus, size, workers)
    return [consume(loader, step_s) for _ in range(2)]


def run_fastload(
    corpus: Corpus, server: Server, size: Size, cache: Path, config: tuple[float, int, int], step_s: float
) -> list[Epoch]:
    """Epoch 1 on an empty cache, epoch 2 on the same loader and cache."""
    shutil.rmtree(cache, ignore_errors=True)
    epochs: list[Epoch] = []
    loader = fastload_loader(corpus, server, size, cache, *config)
    for _ in range(2):
        mark = len(server.proxy.requests())
        epochs.append(consume(loader, step_s))
        _recount(server.proxy, epochs[-1], mark, ".arrow")
    return epochs


def _recount(proxy: FaultProxy, epoch: Epoch, mark: int, suffix: str) -> None:
    """What the proxy served since request ``mark``: MB of reply bodies and GETs (of shards)."""
    gets: list[LoggedRequest] = [r for r in proxy.requests()[mark:] if r.method == "GET"]
    epoch.mb = sum(r.body_bytes for r in gets) / 1e6
    epoch.gets = len(gets)
    epoch.shard_gets = sum(1 for r in gets if r.path.endswith(suffix))


class PerSampleS3(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """What a user writes first: each ``__getitem__`` opens the sample's Arrow shard on S3 and
    reads the record batch that holds it (one pyarrow client per worker process)."""

    def __init__(self, corpus: Corpus, server: Server, size: Size) -> None:
        self._paths = [f"{BUCKET}/{corpus.name}/arrow/part-{s:05d}.arrow" for s in range(size.shards)]
        self._per_shard = size.samples_per_shard
        self._endpoint = server.endpoint
        self._keys = server.credentials
        self._fs: pafs.S3FileSystem | None = None
        self._len = size.shards * size.samples_per_shard

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> torch.Tensor:
        if self._fs is None:
            self._fs = pafs.S3FileSystem(
                endpoint_override=self._endpoint, access_key=self._keys.access_key, secret_key=self._keys.secret_key
            )
        shard, row = divmod(index, self._per_shard)
        with self._fs.open_input_file(self._paths[shard]) as source:
            record_batch = pa.ipc.open_file(source).get_batch(row // RECORD_BATCH_ROWS)
            values = record_batch.column(0)[row % RECORD_BATCH_ROWS].values
        return torch.from_numpy(values.to_numpy(zero_copy_only=False).copy())


def run_torch(corpus: Corpus, server: Server, size: Size, step_s: float) -> Epoch:
    order = np.random.default_rng(1).permutation(size.shards * size.samples_per_shard)[: size.torch_samples]
    loader = torch.utils.data.DataLoader(
        PerSampleS3(corpus, server, size), batch_size=size.batch_size, sampler=order.tolist(),
        num_workers=WORKERS, collate_fn=pad_collate, multiprocessing_context="fork", timeout=300,
    )  # fmt: skip
    mark = len(server.proxy.requests())
    epoch = consume(loader, step_s)
    _recount(server.proxy, epoch, mark, ".arrow")
    expected = sum(int(corpus.samples[i].sum(dtype=np.int64)) for i in order)
    assert (epoch.samples, epoch.token_sum) == (len(order), expected)
    return epoch


def _streaming_collate(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    return pad_collate([torch.from_numpy(np.array(s["tokens"])) for s in samples])


def _own_s3_client(_: int) -> None:
    """torch's ``worker_init_fn`` for Streaming: drop the S3 client the worker inherited.

    ``StreamingDataset`` downloads its index in the main process, so its boto3 client holds a
    kept-alive connection when torch forks the workers; both workers then send their GETs down
    that one socket and each may read the other's reply. Here that wrote one shard's bytes under
    another's name in every 2-worker epoch tried (``IndexError: Relative sample index ... is not
    present``, ``buffer size must be a multiple of element size``). Streaming's maintainers
    advise spawn; here a spawned worker imports ``streaming`` afresh, without the harness's
    stand-in for ``streaming.vision``, and fails on torchvision (not installable against this
    torch build). Fork it stays, with a client of each worker's own, as boto3 asks of
    processes, and with fork's cheaper worker start."""
    info = torch.utils.data.get_worker_info()
    for stream in info.dataset.streams:
        stream._downloader.clean_up()  # the next download creates the worker's own client


def run_streaming(
    streaming: Any, corpus: Corpus, size: Size, server: Server, local: Path, step_s: float, workers: int
) -> list[Epoch]:
    """Epoch 1 into an empty ``local``, epoch 2 from it (no cache limit)."""
    shutil.rmtree(local, ignore_errors=True)
    streaming.base.util.clean_stale_shared_memory()
    dataset = streaming.StreamingDataset(
        remote=corpus.mds_url, local=str(local), batch_size=size.batch_size, shuffle=True, shuffle_seed=0
    )
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=size.batch_size,
        num_workers=workers,
        collate_fn=_streaming_collate,
        worker_init_fn=_own_s3_client if workers else None,
    )
    epochs: list[Epoch] = []
    for _ in range(2):
        mark = len(server.proxy.requests())
        epochs.append(consume(loader, step_s))
        _recount(server.proxy, epochs[-1], mark, ".mds")
    del loader, dataset
    return epochs


# -- the benchmark ---------------------------------------------------------------------------------


def test_remote_batches_equal_local_and_a_full_cache_downloads_nothing_in_epoch_2(
    server: Server, corpus: Corpus, corpus_name: str, tmp_path: Path
) -> None:
    """Correctness of what the table times: both epochs give exactly the batches of the same
    loader over the shards on local disk; epoch 2 with a full cache sends no GET."""
    size = SIZES[corpus_name]
    remote = fastload_loader(corpus, server, size, tmp_path / "cache", 1.0, size.shuffle_shards)
    local = local_loader(corpus, size, workers=0)
    for epoch in range(2):
        mark = len(server.proxy.requests())
        batches = 0
        for got, expected in zip(remote, local, strict=True):
            assert all(torch.equal(got[k], expected[k]) for k in expected), f"epoch {epoch + 1}, batch {batches}"
            batches += 1
        served = server.proxy.requests()[mark:]
        gets = [r for r in served if r.method == "GET" and r.path.endswith(".arrow")]
        if epoch == 0:
            assert sorted(r.path for r in gets if (r.range or "bytes=0-").startswith("bytes=0-")) == sorted(
                f"/{BUCKET}/{corpus_name}/arrow/part-{s:05d}.arrow" for s in range(size.shards)
            )  # each shard downloaded once
        else:
            assert served == []  # no GET, and no HEAD or listing either
    assert batches == len(local)


def _progress(what: str, epochs: list[Epoch]) -> None:
    print(f"  {what}: " + ", ".join(f"{e.samples_per_s:,.0f} samples/s in {e.seconds:.1f} s" for e in epochs), flush=True)


def _row(loader: str, limit: str, epoch: int, runs: list[Epoch], stepped: Epoch | None, workers: int) -> dict[str, Any]:
    return {
        "loader": loader,
        "workers": workers,
        "cache_limit": limit,
        "epoch": epoch,
        "samples": runs[0].samples,
        "samples_per_s": statistics.median(r.samples_per_s for r in runs),
        "first_batch_s": statistics.median(r.first_batch_s for r in runs),
        "stall": None if stepped is None else stepped.stall,
        "stepped_first_batch_s": None if stepped is None else stepped.first_batch_s,
        "mb": runs[0].mb,
        "gets": runs[0].gets,
        "shard_gets": runs[0].shard_gets,
        "rounds": len(runs),
    }


def _median_of(rows: list[dict[str, Any]], loader: str, limit: str, epoch: int, workers: int) -> float | None:
    key = (loader, limit, epoch, workers)
    found = [r["samples_per_s"] for r in rows if (r["loader"], r["cache_limit"], r["epoch"], r["workers"]) == key]
    return found[0] if found else None


def test_remote_table(server: Server, corpus: Corpus, corpus_name: str, tmp_path: Path) -> None:
    size = SIZES[corpus_name]
    streaming, why_not = streaming_module()
    if streaming is not None and corpus.mds_url is None:
        streaming, why_not = None, "streaming imported after the corpus was written"
    token_sum, total = corpus.token_sum, size.shards * size.samples_per_shard
    # (cache limit share, shuffle_shards, workers): every limit at WORKERS, and the first at
    # Streaming's worker counts too.
    configs = [(limit, shuffle, WORKERS) for limit, shuffle in size.limits]
    configs += [(*size.limits[0], w) for w in STREAMING_WORKERS if w != WORKERS]
    label = {
        c: f"{c[0] * 100:.0f} %" + ("" if c[1] == size.limits[0][1] else f", shuffle_shards={c[1]}")
        for c in configs
    }
    counts = (WORKERS, *(w for w in STREAMING_WORKERS if w != WORKERS))

    fast: dict[tuple[float, int, int], list[list[Epoch]]] = {c: [] for c in configs}
    ours: dict[int, list[list[Epoch]]] = {w: [] for w in STREAMING_WORKERS}
    near: dict[int, list[list[Epoch]]] = {w: [] for w in counts}
    for _ in range(size.rounds):  # interleaved: each round runs every configuration once
        for w in counts:
            near[w].append(run_local(corpus, size, 0.0, w))
            _progress(f"fastload, local disk, {w} workers", near[w][-1])
        for config in configs:
            fast[config].append(run_fastload(corpus, server, size, tmp_path / "cache", config, 0.0))
            _progress(f"fastload {label[config]}, {config[2]} workers", fast[config][-1])
        for w in STREAMING_WORKERS if streaming is not None else ():
            ours[w].append(run_streaming(streaming, corpus, size, server, tmp_path / "mds-cache", 0.0, w))
            _progress(f"Streaming, {w} workers", ours[w][-1])
    near_stepped = {w: run_local(corpus, size, STEP_S, w) for w in counts}
    fast_stepped = {c: run_fastload(corpus, server, size, tmp_path / "cache", c, STEP_S) for c in configs}
    ours_stepped = {
        w: run_streaming(streaming, corpus, size, server, tmp_path / "mds-cache", STEP_S, w)
        for w in (STREAMING_WORKERS if streaming is not None else ())
    }
    torch_runs = [run_torch(corpus, server, size, 0.0)]
    torch_stepped = run_torch(corpus, server, size, STEP_S) if size.torch_stall else None

    # Every epoch timed read every sample exactly once (by count and by the sum of its tokens).
    timed = [*(e for runs in fast.values() for e in runs), *fast_stepped.values()]
    timed += [*(e for runs in ours.values() for e in runs), *ours_stepped.values()]
    timed += [*(e for runs in near.values() for e in runs), *near_stepped.values()]
    for epochs in timed:
        for epoch in epochs:
            assert (epoch.samples, epoch.token_sum) == (total, token_sum)
    # Epoch 2 with a full cache downloads nothing: no GET at all.
    for config in (c for c in configs if c[0] >= 1):
        for epochs in [*fast[config], fast_stepped[config]]:
            assert (epochs[1].gets, epochs[1].mb) == (0, 0.0)

    local_name = "fastload, shards on local disk (reference)"
    rows: list[dict[str, Any]] = []
    for w in counts:
        for e in range(2):
            rows.append(_row(local_name, "-", e + 1, [r[e] for r in near[w]], near_stepped[w][e], w))
    for config in configs:
        for e in range(2):
            rows.append(_row("fastload", label[config], e + 1, [r[e] for r in fast[config]], fast_stepped[config][e], config[2]))
    for w in ours_stepped:
        for e in range(2):
            rows.append(_row("Streaming", "none", e + 1, [r[e] for r in ours[w]], ours_stepped[w][e], w))
    rows.append(_row("torch, per sample", "-", 1, torch_runs, torch_stepped, WORKERS))
    for row in rows:
        at = (row["epoch"], row["workers"])
        reference = _median_of(rows, "Streaming", "none", *at) if row["loader"] != "torch, per sample" else None
        local = _median_of(rows, local_name, "-", *at)
        full = _median_of(rows, "fastload", label[configs[0]], *at) if row["loader"] == "fastload" else None
        row["vs_streaming"] = None if reference is None else row["samples_per_s"] / reference
        row["vs_local"] = None if local is None or row["loader"] != "fastload" else row["samples_per_s"] / local
        row["vs_fastload_100"] = None if full is None else row["samples_per_s"] / full

    print(f"\nbench_remote ({corpus_name}): {total:,} samples, {size.shards} Arrow shards, {corpus.shard_bytes / 1e6:.1f} MB;"
          f" batch {size.batch_size}, {LATENCY_S * 1e3:.0f} ms per request at the proxy;"
          f" fastload shuffle_shards={size.limits[0][1] or None} unless said; medians of {size.rounds} round(s) without a step")
    if streaming is None:
        print(f"Streaming: skipped: {why_not}")
    else:
        print("Streaming: streaming.vision replaced by an empty module (it imports torchvision; text never uses it)")
    print(table(rows))
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(exist_ok=True)
    (results / f"bench_remote_{corpus_name}.json").write_text(json.dumps({"size": asdict(size), "rows": rows}, indent=1))


def _fmt(value: float | None, pattern: str) -> str:
    return "—" if value is None else format(value, pattern)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| loader | workers | cache limit | epoch | samples/s | vs Streaming | vs local disk | vs fastload 100 %"
        " | stall @ 10 ms | first batch | MB downloaded | GETs (of shards) | samples |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['loader']} | {r['workers']} | {r['cache_limit']} | {r['epoch']} | {r['samples_per_s']:,.0f}"
            f" | {_fmt(r['vs_streaming'], '.2f')}× | {_fmt(r['vs_local'], '.2f')}× | {_fmt(r['vs_fastload_100'], '.2f')}×"
            f" | {_fmt(None if r['stall'] is None else r['stall'] * 100, '.2f')} %"
            f" | {r['first_batch_s']:.2f} s | {r['mb']:,.1f} | {r['gets']:,} ({r['shard_gets']:,}) | {r['samples']:,} |"
        )
    return "\n".join(lines).replace("—×", "—").replace("— %", "—")
