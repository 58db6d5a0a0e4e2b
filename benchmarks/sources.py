"""Throughput of each kind of source on the same images: paths, ImageFolder, a dataset, tar shards, URLs.

Usage: ``python -m benchmarks.sources [--count 2000] [--repeats 3] [--out sources.json] [--quick]``.

Every row is a ThreadLoader with the same options (shuffled, resized to the set's size, float32, on
``--device``) over the same JPEGs (the ``fixed`` benchmark set), reached a different way:

- ``paths``: a list of ``(path, class)``; ``image_folder``: the directory; ``dataset``: a map-style
  dataset returning ``(path, class)``;
- ``tar``: the images packed into WebDataset shards (``{000000..}.tar``, ``key.jpg`` + ``key.cls``);
- ``file_urls`` / ``memory_urls``: ``file://`` and fsspec ``memory://`` URLs, read through fsspec;
- ``tar_file_url`` / ``tar_memory``: the shards through fsspec, as ``file://`` and ``memory://``.

The method is ``benchmarks.run``'s (``startup_s`` runs from construction, which for shards includes
their indexing, to the first batch; then ``--warmup`` batches, then ``--batches`` timed ones). Each
source runs ``--repeats`` times, the sources interleaved, and the JSON holds every run and, per
source, the median with the range.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import sys
import tarfile
from collections.abc import Callable, Generator, Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch

from benchmarks import common, report
from benchmarks.common import Batch
from benchmarks.datasets import OUTPUT_SIZE, ensure_dataset, list_images
from benchmarks.run import Case, measure

SOURCES = (
    "paths",
    "image_folder",
    "dataset",
    "tar",
    "file_urls",
    "memory_urls",
    "tar_file_url",
    "tar_memory",
)

SIZED = {  # option: (full run, --quick, what it is)
    "count": (2000, 64, "images"),
    "batches": (100, 3, "timed batches per run"),
    "warmup": (10, 1, "warm-up batches per run"),
    "batch_size": (64, 16, "images per batch"),
    "repeats": (3, 1, "runs per source, interleaved"),
    "shard_size": (250, 16, "samples per tar shard"),
}


class PathDataset:
    """A user's map-style dataset in its simplest form: ``(path, class)`` by index."""

    def __init__(self, files: Sequence[tuple[Path, int]]) -> None:
        self.files = [(str(path), label) for path, label in files]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[str, int]:
        return self.files[index]


def write_shards(root: Path, files: Sequence[tuple[Path, int]], shard_size: int) -> str:
    """Packs the set into WebDataset shards beside it (reused when present); returns the brace pattern."""
    folder = root.parent / f"{root.name}-shards-{shard_size}"
    count = -(-len(files) // shard_size)
    pattern = str(folder / f"{{000000..{count - 1:06d}}}.tar")
    done = folder / "complete"  # holds the set's manifest: shards of another build are rewritten
    built_from = (root / "manifest.json").read_text()
    if done.exists() and done.read_text() == built_from:
        return pattern
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for number in range(count):
        with tarfile.open(folder / f"{number:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as archive:
            for index in range(number * shard_size, min((number + 1) * shard_size, len(files))):
                path, label = files[index]
                for name, data in (
                    (f"{index:06d}.jpg", path.read_bytes()),
                    (f"{index:06d}.cls", b"%d" % label),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    archive.addfile(info, io.BytesIO(data))
    done.write_text(built_from)
    return pattern


def to_memory(files: Sequence[tuple[Path, int]], pattern: str) -> tuple[list[tuple[str, int]], str]:
    """Copies the images and the shards into fsspec's memory file system; returns their URLs."""
    import fsspec

    fs = fsspec.filesystem("memory")
    urls = []
    for path, label in files:
        fs.pipe(f"/bench/images/{path.parent.name}/{path.name}", path.read_bytes())
        urls.append((f"memory://bench/images/{path.parent.name}/{path.name}", label))
    folder = Path(pattern).parent
    for shard in sorted(folder.glob("*.tar")):
        fs.pipe(f"/bench/shards/{shard.name}", shard.read_bytes())
    return urls, f"memory://bench/shards/{Path(pattern).name}"


def source_makers(
    root: Path, files: Sequence[tuple[Path, int]], shard_size: int
) -> dict[str, Callable[[], Any]]:
    """How each row builds its source; called inside the timed start-up (indexing shards counts there)."""
    pattern = write_shards(root, files, shard_size)
    memory_urls, memory_shards = to_memory(files, pattern)
    return {
        "paths": lambda: [(str(path), label) for path, label in files],
        "image_folder": lambda: str(root),
        "dataset": lambda: PathDataset(files),
        "tar": lambda: pattern,
        "file_urls": lambda: [(path.resolve().as_uri(), label) for path, label in files],
        "memory_urls": lambda: memory_urls,
        "tar_file_url": lambda: "file://" + str(Path(pattern).resolve()),
        "tar_memory": lambda: memory_shards,
    }


def threadloader_over(
    make_source: Callable[[], Any],
    *,
    size: tuple[int, int],
    batch_size: int,
    num_threads: int | None,
    device: str,
    index_seconds: dict[str, float],
) -> Generator[Batch, None, None]:
    """A shuffled ThreadLoader over the source, epochs cycled; records a tar source's index time."""
    from threadloader import TarShards

    with common.shuffled_threadloader(
        make_source(), batch_size=batch_size, num_threads=num_threads, size=size, device=device
    ) as loader:
        if isinstance(loader.source, TarShards):
            index_seconds["index_s"] = loader.source.index_seconds
        for images, targets in common.endless(loader):  # with ``size`` set, images come stacked in one tensor
            yield cast(torch.Tensor, images), targets.to(device, non_blocking=True)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per source: the median images/s over the repeats, with the range, and the median start-up."""
    out = []
    for source in dict.fromkeys(row["source"] for row in rows):
        ok = [row for row in rows if row["source"] == source and row["status"] == "ok"]
        summary: dict[str, Any] = {"source": source, "runs": len(ok)}
        rates = report.Spread.of([row["images_per_s"] for row in ok])
        if rates is None:
            failed = [row for row in rows if row["source"] == source]
            summary["status"] = failed[0]["status"] + ": " + failed[0]["reason"] if failed else "not run"
            out.append(summary)
            continue
        summary |= {
            "images_per_s": rates.median,
            "images_per_s_min": rates.low,
            "images_per_s_max": rates.high,
        }
        summary |= {key: statistics.median(row[key] for row in ok) for key in ("startup_s", "cpu_cores")}
        summary["extra_gpu_mb"] = max((row["extra_gpu_mb"] or 0.0) for row in ok)
        index = [row["index_s"] for row in ok if row.get("index_s") is not None]
        out.append(summary | ({"index_s": statistics.median(index)} if index else {}))
    return out


def markdown(summary: list[dict[str, Any]]) -> str:
    """One table row per source."""
    header = [
        "source",
        "img/s (median)",
        "range",
        "startup s",
        "of which indexing s",
        "CPU cores",
        "extra GPU MB",
    ]
    body = []
    for row in summary:
        if "images_per_s" not in row:
            body.append([row["source"], row.get("status", "—"), "", "", "", "", ""])
            continue
        low, high = row["images_per_s_min"], row["images_per_s_max"]
        cells = [
            row["source"],
            f"{row['images_per_s']:,.0f}",
            f"{low:,.0f}-{high:,.0f}",
            f"{row['startup_s']:.2f}",
        ]
        cells += [report.number(row.get("index_s"), ".2f"), f"{row['cpu_cores']:.1f}"]
        body.append([*cells, report.number(row["extra_gpu_mb"] or None, ".0f")])
    return "\n".join(report.table(header, body))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = common.parser("benchmarks.sources", __doc__, SIZED, "the JSON results (a file)")
    p.add_argument("--threads", type=int, help="reader threads (default: the library's)")
    p.add_argument("--only", type=common.names(SOURCES), default=list(SOURCES), help=", ".join(SOURCES))
    p.add_argument("--seed", type=int, default=0)
    return common.parse(p, argv, SIZED)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Builds the data (images, shards, memory copies), measures every source, prints and writes JSON."""
    args = parse_args(argv)
    root = ensure_dataset("fixed", count=args.count, root=args.data_root, seed=args.seed)
    files = list_images(root)
    common.warm_page_cache(files)
    makers = source_makers(root, files, args.shard_size)
    size = OUTPUT_SIZE["fixed"]
    rows: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for source in args.only:
            extra: dict[str, float] = {}
            case = Case(
                name=f"{source} #{repeat + 1}",
                loader="threadloader",
                batch_size=args.batch_size,
                make=partial(
                    threadloader_over,
                    makers[source],
                    size=size,
                    batch_size=args.batch_size,
                    num_threads=args.threads,
                    device=args.device,
                    index_seconds=extra,
                ),
            )
            print(f"[{repeat + 1}/{args.repeats}] {source} ...", file=sys.stderr, flush=True)
            row = measure(case, device=args.device, warmup=args.warmup, batches=args.batches)
            rows.append({"source": source, "repeat": repeat} | asdict(row) | extra)
            done = f"{row.images_per_s:,.0f} img/s" if row.status == "ok" else f"{row.status}: {row.reason}"
            print(f"    {done}", file=sys.stderr, flush=True)
    summary = summarize(rows)
    result = {
        "hardware": common.hardware(args.device),
        "config": {
            "set": "fixed",
            "count": args.count,
            "output_size": "x".join(map(str, size)),
            "batch_size": args.batch_size,
            "warmup": args.warmup,
            "batches": args.batches,
            "repeats": args.repeats,
            "shard_size": args.shard_size,
            "threads": args.threads,
            "shuffle": True,
            "device": args.device,
            "data": str(root),
        },
        "summary": summary,
        "rows": rows,
    }
    print(markdown(summary))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
