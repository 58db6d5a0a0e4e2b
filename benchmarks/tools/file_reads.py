"""What a main thread loses per file the readers read: Python's reads against the batch's reads in C.

Usage: ``python -m benchmarks.tools.file_reads [--files 1024] [--rate 5000] [--rounds 3] [--seconds 2]
[--tar]``.

Two reader threads call the read stage (``threadloader._sources.read_batch``) on groups of 64 files
from the page cache, paced to ``--rate`` files a second together, as a loader feeding a step would; the
main thread meanwhile runs small torch ops on the CPU, each letting go of the GIL, as an eager training
step does. Per round, the main thread's ops a second alone, beside Python's reads (the C library
switched off) and beside the C reads, each for ``--seconds``; the loss per file is the share of the
main thread's rate lost, over the files read a second. Rounds alternate the two, so that a machine
whose speed drifts favours neither. ``--tar`` writes the files as the members of 4 tar shards and reads
those (one ``os.pread`` each in Python, 16 to a call in C). The figures are in docs/design.md ("GIL
releases per image").
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable

import torch

from threadloader import SampleError, TarShards, _filereads
from threadloader._encoded import Deferred
from threadloader._sources import Fetched, read_batch

GROUP = 64
READERS = 2


def main_thread_rate(seconds: float) -> float:
    """Small torch ops a second on this thread, each letting go of the GIL."""
    x = torch.ones(16)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(100):
            x.add_(1)
        done += 100
    return done / (time.perf_counter() - start)


def beside_readers(paths: list[str] | list[Deferred], rate: float, seconds: float) -> tuple[float, float]:
    """The main thread's ops a second beside paced readers, and the files they read a second."""
    stop = threading.Event()
    counts = [0] * READERS

    def read(reader: int) -> None:
        at, due = reader * GROUP, time.perf_counter()
        while not stop.is_set():
            group: list[Fetched | SampleError] = [
                (i, paths[(at + i) % len(paths)], None) for i in range(GROUP)
            ]
            read_batch(group)
            counts[reader] += GROUP
            at += GROUP * READERS
            due += GROUP * READERS / rate
            time.sleep(max(0.0, due - time.perf_counter()))

    threads = [threading.Thread(target=read, args=(reader,), daemon=True) for reader in range(READERS)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    before, start = sum(counts), time.perf_counter()
    ops = main_thread_rate(seconds)
    files = (sum(counts) - before) / (time.perf_counter() - start)
    stop.set()
    for thread in threads:
        thread.join()
    return ops, files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=1024)
    parser.add_argument("--rate", type=float, default=5000.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--tar", action="store_true", help="the files as members of 4 tar shards")
    args = parser.parse_args()
    if not _filereads.available():
        raise SystemExit("the C library (threadloader/_reads.c) is not built: bash .ci/build-alloc")
    torch.set_num_threads(1)
    library = _filereads._loaded[0]
    losses: dict[str, list[float]] = {"python": [], "c": []}
    with tempfile.TemporaryDirectory() as root:
        blobs = [
            os.urandom(40_000 + (i * 7919) % 160_000) for i in range(args.files)
        ]  # 40-200 kB, like photos
        paths: list[str] | list[Deferred] = []
        if args.tar:
            shards = [os.path.join(root, f"{s:06d}.tar") for s in range(4)]
            for s, shard in enumerate(shards):
                with tarfile.open(shard, "w") as archive:
                    for i in range(s, args.files, len(shards)):
                        info = tarfile.TarInfo(f"{i:06d}.jpg")
                        info.size = len(blobs[i])
                        archive.addfile(info, io.BytesIO(blobs[i]))
            source = TarShards(shards)
            paths = [source[i] for i in range(len(source))]  # type: ignore[misc,assignment]
        else:
            for i, blob in enumerate(blobs):
                paths.append(os.path.join(root, f"{i}.jpg"))  # type: ignore[arg-type]
                with open(paths[-1], "wb") as file:  # type: ignore[arg-type]
                    file.write(blob)
        everything: list[Fetched | SampleError] = [(i, path, None) for i, path in enumerate(paths)]  # type: ignore[misc]
        failed = [blob for blob in read_batch(everything) if isinstance(blob, SampleError)]
        if failed:
            raise SystemExit(f"the files written do not read back: {failed[0]}")
        switch: dict[str, Callable[[], None]] = {
            "python": lambda: _filereads._loaded.__setitem__(0, None),
            "c": lambda: _filereads._loaded.__setitem__(0, library),
        }
        for round_ in range(args.rounds):
            alone = main_thread_rate(args.seconds)
            row = []
            for name in ("python", "c") if round_ % 2 == 0 else ("c", "python"):
                switch[name]()
                ops, files = beside_readers(paths, args.rate, args.seconds)
                losses[name].append((1 - ops / alone) / files * 1e6)
                lost = losses[name][-1]
                row.append(f"{name}: {ops:,.0f} ops/s beside {files:,.0f} files/s, {lost:.1f} us/file")
            print(f"round {round_ + 1}: alone {alone:,.0f} ops/s; " + "; ".join(row))
        switch["c"]()
    medians = {name: statistics.median(values) for name, values in losses.items()}
    print(
        f"main thread lost per {'tar member' if args.tar else 'file'}, median of {args.rounds} rounds on "
        f"{os.cpu_count()} cores: "
        f"Python's reads {medians['python']:.1f} us, the C reads {medians['c']:.1f} us"
    )


if __name__ == "__main__":
    main()
