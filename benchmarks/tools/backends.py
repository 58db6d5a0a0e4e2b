"""Each decoding configuration alone: images/s, CPU cores, the stage budget, and what the start leaves.

Usage: ``python -m benchmarks.tools.backends [--sets fixed,varied] [--configs 'NAME=JSON;...']
[--count 1000] [--warm 40] [--batches 300] [--out FILE]``.

Each row runs in a fresh process (nvImageCodec's start and its Decoder pools are process-wide): build a
ThreadLoader with the row's keyword arguments (``--configs``: ``auto={}``, ``all={"backend": "all"}``,
...), take ``--warm`` batches and then batches until those the readers decoded with Pillow while
nvImageCodec started are consumed, let the consumer idle for a second (the process's CPU seconds
then: nothing should run), then time ``--batches`` batches, the consumer synchronizing its stream after
each. Per row: images/s, the process's CPU cores while timed, the CPU seconds of the threads that used
most (by name: the readers', nvImageCodec's ``[NVIMGCODEC][TP`` pool threads), and the loader's host
milliseconds per batch in each stage (summed over the readers: the stage budget). The decisions it
informed are in docs/design.md ("Decoder engines").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    endless,
    shuffled_threadloader,
    thread_cpu,
    thread_names,
)
from benchmarks.datasets import OUTPUT_SIZE, SETS, ensure_dataset, list_images

DEFAULT_CONFIGS = 'auto={};all={"backend": "all"};cuda={"backend": "cuda"}'


def busiest(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> list[tuple[str, float]]:
    """The threads that used the most CPU between two readings, as ``(name, seconds)``.

    Python's name where a thread has one, else the OS's (nvImageCodec's pool threads are
    ``[NVIMGCODEC][TP``).
    """
    names = thread_names(after)
    used = [
        (names[tid], round(cpu - before.get(tid, (name, 0.0))[1], 2)) for tid, (name, cpu) in after.items()
    ]
    return sorted((entry for entry in used if entry[1] >= 0.02), key=lambda entry: -entry[1])[:8]


def row(
    set_name: str, options: dict[str, Any], *, count: int, warm: int, batches: int, batch_size: int
) -> dict[str, Any]:
    """One configuration, measured in this process."""
    cuda = torch.cuda.is_available()
    sync = torch.cuda.current_stream().synchronize if cuda else (lambda: None)
    if cuda:
        torch.zeros(1, device="cuda")
    free = torch.cuda.mem_get_info()[0] if cuda else 0
    size = OUTPUT_SIZE[set_name]
    normalize: dict[str, Any] = {"mean": IMAGENET_MEAN, "std": IMAGENET_STD} if set_name == "varied" else {}
    loader = shuffled_threadloader(
        list_images(ensure_dataset(set_name, count=count)),
        batch_size=batch_size,
        size=size,
        **normalize,
        **options,
    )
    stream = endless(loader)
    for _ in range(warm):
        next(stream)
    last, unchanged = loader.stats().started_on_cpu, 0
    while unchanged < 8:  # past the start: the batches Pillow decoded meanwhile consumed
        next(stream)
        now = loader.stats().started_on_cpu
        unchanged, last = (unchanged + 1 if now == last else 0), now
    sync()
    time.sleep(0.3)  # the readers fill their window, then wait
    idle_from = time.process_time()
    time.sleep(1.0)
    idle = time.process_time() - idle_from
    first, threads_from, cpu_from, wall_from = (
        loader.stats(),
        thread_cpu(),
        time.process_time(),
        time.perf_counter(),
    )
    images = 0
    for _ in range(batches):
        batch, _targets = next(stream)
        sync()
        images += len(batch)
    wall = time.perf_counter() - wall_from
    cpu, threads, last_stats = time.process_time() - cpu_from, thread_cpu(), loader.stats()
    result = {
        "set": set_name,
        "options": options,
        "images_per_s": round(images / wall),
        "cpu_cores": round(cpu / wall, 2),
        "idle_cpu_s": round(idle, 2),
        "busiest_threads": busiest(threads_from, threads),
        "stage_ms_per_batch": {
            stage: round(1000 * (last_stats.stage_seconds[stage] - first.stage_seconds[stage]) / batches, 2)
            for stage in last_stats.stage_seconds
            if stage != "ahead"  # the idle second is in it
        },
        "device_mb": round((free - torch.cuda.mem_get_info()[0]) / 2**20) if cuda else 0,
    }
    loader.close()
    return result


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sets", default="fixed,varied")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="NAME=JSON keyword arguments, ';'-separated")
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--warm", type=int, default=40)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--out", type=Path)
    p.add_argument("--row", help=argparse.SUPPRESS)  # internal: SET NAME JSON, run in this process
    args = p.parse_args(argv)
    if args.row:
        set_name, options = args.row.split(" ", 1)
        measured = row(
            set_name, json.loads(options), count=args.count, warm=args.warm, batches=args.batches,
            batch_size=args.batch_size,
        )  # fmt: skip
        print("ROW " + json.dumps(measured), flush=True)
        return
    rows = []
    for set_name in args.sets.split(","):
        if set_name not in SETS:
            raise SystemExit(f"--sets takes {', '.join(SETS)}, got {set_name!r}")
        for config in args.configs.split(";"):
            name, _, options = config.partition("=")
            command = [
                sys.executable, "-m", "benchmarks.tools.backends", "--row", f"{set_name} {options or '{}'}",
                "--count", str(args.count), "--warm", str(args.warm), "--batches", str(args.batches),
                "--batch-size", str(args.batch_size),
            ]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
            found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
            result = json.loads(found[-1]) if found else {"set": set_name, "failed": done.stderr[-2000:]}
            result["name"] = name
            rows.append(result)
            print(json.dumps(result), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
