"""The reader threads' own Python per image, outside the decoder: CPU time per stage, per source.

Usage: ``python -m benchmarks.tools.reader_cost [--count 4096] [--epochs 4] [--repeats 3] [--out FILE]``.

Every row is a ThreadLoader on the CPU over the same small JPEGs, reached three ways: a folder of
files (``ImageFolder``), one tar shard (``key.jpg`` + ``key.cls``) and fsspec ``memory://`` URLs. Its
decoder (passed as ``decoder=``) returns ready tensors at once, so what is left is the readers' own
work: the host Python that holds the GIL a training step waits for. Reported per image, as CPU time
of the reader threads (``time.thread_time``), after a warm-up epoch, the median of ``--repeats``:

- ``fetch``: ``source[i]`` and checking the item;
- ``read``: the rest of reading: the file read, the tar member's read, the URL's, and the loop;
- ``decode``: the call into the (instant) decoder;
- ``split``: splitting into batches, the format, collating targets, the seal;
- ``other``: the rest of a reader thread (the pool taking tasks, the group's set-up).

``fetch`` is timed by wrapping the pipeline's fetch function, whichever of :data:`FETCH_NAMES` the
pipeline calls (per sample or per batch); the timer's own cost per call, measured at start, is taken
out. The other stages are timed once per group, around the pipeline's methods.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import statistics
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from threadloader import ThreadLoader, _pipeline
from threadloader._stats import StatsRecorder
from threadloader.decode.base import DecodedBatch, Encoded, ImageDecoder, RegionOf

SOURCES = ("folder", "tar", "memory")
STAGES = ("fetch", "read", "decode", "split", "other")
#: The pipeline's fetch functions, old and new: whichever it has is timed per call.
FETCH_NAMES = ("fetch", "fetch_batch")
SIDE = 16  # pixels: small files, so the read is the readers' Python, not the page cache


class InstantDecoder(ImageDecoder):
    """Returns rows of one preallocated tensor: a decoder that costs nothing per image."""

    def __init__(self, side: int) -> None:
        self.device = torch.device("cpu")
        self._side = side
        self._stacked = torch.zeros(0, side, side, 3, dtype=torch.uint8)
        self._lock = threading.Lock()

    def decode(
        self,
        encoded: Sequence[Encoded],
        *,
        stream: torch.cuda.Stream | None,
        stats: StatsRecorder | None = None,
        region_of: RegionOf | None = None,
        pad: bool = False,
    ) -> DecodedBatch:
        n = len(encoded)
        with self._lock:
            if n > len(self._stacked):
                self._stacked = torch.full((n, self._side, self._side, 3), 128, dtype=torch.uint8)
            side = (self._side, self._side)
            return DecodedBatch(extents=[side] * n, batch=self._stacked[:n], rows=set(range(n)))


class StageClock:
    """Reader threads' CPU seconds per stage, each thread adding to its own counters."""

    def __init__(self, timer_cost: tuple[float, float]) -> None:
        self._inside, self._outside = timer_cost
        self._lock = threading.Lock()
        self._threads: list[dict[str, float]] = []
        self._local = threading.local()

    def counters(self) -> dict[str, float]:
        """The calling thread's counters (created on first use)."""
        mine: dict[str, float] | None = getattr(self._local, "counters", None)
        if mine is None:
            mine = dict.fromkeys((*STAGES, "produce", "in_read", "fetch_calls", "last_exit"), 0.0)
            self._local.counters = mine
            with self._lock:
                self._threads.append(mine)
        return mine

    def reset(self) -> None:
        with self._lock:
            for counters in self._threads:
                for key in counters:
                    counters[key] = 0.0

    def totals(self) -> dict[str, float]:
        """Seconds per stage over every thread, the timers' own cost taken out."""
        with self._lock:
            summed = {key: sum(c[key] for c in self._threads) for key in self._threads[0]}
        calls = summed["fetch_calls"]
        fetch = summed["fetch"] - calls * self._inside
        return {
            "fetch": fetch,
            "read": summed["in_read"] - summed["fetch"] - calls * self._outside,
            "decode": summed["decode"],
            "split": summed["split"],
            "other": summed["produce"]
            - summed["in_read"]
            - summed["decode"]
            - summed["split"]
            + summed["other"],
        }


def _timed(
    clock: StageClock, key: str, function: Callable[..., Any], *, calls: bool = False
) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        counters = clock.counters()
        started = time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            counters[key] += time.thread_time() - started
            if calls:
                counters["fetch_calls"] += 1

    return wrapper


def _timed_produce(clock: StageClock, function: Callable[..., Any]) -> Callable[..., Any]:
    """Times ``produce``, and the thread's time between two of its calls (the pool's share)."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        counters = clock.counters()
        started = time.thread_time()
        if counters["last_exit"]:
            counters["other"] += started - counters["last_exit"]
        try:
            return function(*args, **kwargs)
        finally:
            counters["last_exit"] = time.thread_time()
            counters["produce"] += counters["last_exit"] - started

    return wrapper


def timer_cost(repeats: int = 200_000) -> tuple[float, float]:
    """Seconds a wrapped call's timers add per call: inside the timed span, and outside it."""
    clock = StageClock((0.0, 0.0))
    function = lambda: None  # noqa: E731
    wrapped = _timed(clock, "fetch", function, calls=True)
    started = time.thread_time()
    for _ in range(repeats):
        function()
    bare = time.thread_time() - started
    started = time.thread_time()
    for _ in range(repeats):
        wrapped()
    whole = time.thread_time() - started - bare
    inside = clock.counters()["fetch"]
    return inside / repeats, max(0.0, whole - inside) / repeats


def instrument(clock: StageClock) -> Callable[[], None]:
    """Wraps the pipeline's stages with the clock; returns what undoes it."""
    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, replacement: Any) -> None:
        patches.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, replacement)

    producer = _pipeline.BatchProducer
    patch(producer, "produce", _timed_produce(clock, producer.produce))
    patch(producer, "_read", _timed(clock, "in_read", producer._read))
    patch(producer, "_decode", _timed(clock, "decode", producer._decode))
    patch(producer, "_split", _timed(clock, "split", producer._split))
    for name in FETCH_NAMES:
        if name in vars(_pipeline):
            patch(_pipeline, name, _timed(clock, "fetch", getattr(_pipeline, name), calls=True))

    def undo() -> None:
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)

    return undo


def make_sources(root: Path, count: int) -> dict[str, Any]:
    """The same JPEGs as a class folder, one tar shard and memory:// URLs (with targets)."""
    pixels = torch.randint(
        0, 256, (SIDE, SIDE, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    out = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(out, "JPEG", quality=90)
    data = out.getvalue()
    classes = 8
    for c in range(classes):
        (root / "folder" / f"c{c}").mkdir(parents=True)
    shard = root / "000000.tar"
    memory = f"/reader-cost-{uuid.uuid4().hex}"
    import fsspec

    fs = fsspec.filesystem("memory")
    urls = []
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as archive:
        for i in range(count):
            (root / "folder" / f"c{i % classes}" / f"{i:06d}.jpg").write_bytes(data)
            for name, member in ((f"{i:06d}.jpg", data), (f"{i:06d}.cls", b"%d" % (i % classes))):
                info = tarfile.TarInfo(name)
                info.size = len(member)
                archive.addfile(info, io.BytesIO(member))
            fs.pipe(f"{memory}/{i:06d}.jpg", data)
            urls.append((f"memory://{memory}/{i:06d}.jpg", i % classes))
    return {"folder": str(root / "folder"), "tar": str(shard), "memory": urls}


def measure(
    source: Any, *, epochs: int, batch_size: int, threads: int, cost: tuple[float, float]
) -> dict[str, float]:
    """µs of reader-thread CPU per image, per stage, over ``epochs`` after a warm-up epoch."""
    clock = StageClock(cost)
    undo = instrument(clock)
    try:
        with ThreadLoader(
            source,
            batch_size=batch_size,
            num_threads=threads,
            decoder=InstantDecoder(SIDE),
            size=(SIDE, SIDE),
        ) as loader:
            for _ in loader:  # warm-up: page cache, fsspec's caches, first calls
                pass
            clock.reset()
            images = 0
            for _ in range(epochs):
                for batch, _targets in loader:
                    images += len(batch)
    finally:
        undo()
    seconds = clock.totals()
    row = {stage: seconds[stage] / images * 1e6 for stage in STAGES}
    row["total"] = sum(row[stage] for stage in STAGES)
    return row


def _median_rows(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def table(rows: dict[str, dict[str, float]]) -> str:
    header = "| source | " + " | ".join(STAGES) + " | total |"
    lines = [header, "|" + " --- |" * (len(STAGES) + 2)]
    for name, row in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[key]:.1f}" for key in (*STAGES, "total")) + " |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=4096, help="images per source")
    parser.add_argument("--epochs", type=int, default=4, help="measured epochs, after one warm-up")
    parser.add_argument("--repeats", type=int, default=3, help="runs per source, sources interleaved")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="reader threads")
    parser.add_argument("--sources", default=",".join(SOURCES), help=f"comma-separated, of {SOURCES}")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch's intra-op threads: more make a reader spin at their barrier on tiny CPU ops",
    )
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    args = parse_args(argv)
    names = [name for name in args.sources.split(",") if name]
    unknown = sorted(set(names) - set(SOURCES))
    if unknown:
        raise SystemExit(f"unknown --sources {unknown}; choose from {SOURCES}")
    torch.set_num_threads(args.torch_threads)
    cost = timer_cost()
    with tempfile.TemporaryDirectory(prefix="reader-cost-") as tmp:
        sources = make_sources(Path(tmp), args.count)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        for _ in range(args.repeats):
            for name in names:
                runs[name].append(
                    measure(
                        sources[name],
                        epochs=args.epochs,
                        batch_size=args.batch_size,
                        threads=args.threads,
                        cost=cost,
                    )
                )
    rows = {name: _median_rows(found) for name, found in runs.items()}
    print(
        f"reader-thread CPU, µs per image (median of {args.repeats}; "
        f"fetch timers' cost taken out: {cost[0] * 1e6:.2f} + {cost[1] * 1e6:.2f} µs per call)"
    )
    print(table(rows))
    if args.out is not None:
        config = {key: value for key, value in vars(args).items() if key != "out"}
        report = {"config": config, "python": sys.version.split()[0], "rows": rows, "runs": runs}
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
