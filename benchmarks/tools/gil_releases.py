"""GIL releases per loaded image, stage by stage in a reader thread: the hand-offs a training loop pays.

Usage: ``python -m benchmarks.tools.gil_releases [--pipelines fixed,varied,augment] [--device cpu]
[--out DIR]``

Each time a reader thread releases the GIL (around a torch op, an nvImageCodec call, a file read), a
training loop waiting for it takes it, and the reader must later win it back: each release is a
possible hand-off, and a hand-off costs the loop a thread wake-up, whatever little work follows it
(``python -m benchmarks.gil`` measures that cost; docs/benchmarks.md). So the count of releases per
image is what a change to the readers should bring down.

Python keeps no such count. An LD_AUDIT library (``benchmarks/tools/_gilaudit.c``, built with the system's C
compiler on first use into the data cache) re-binds the calls extension modules make to
``PyEval_SaveThread`` to a counting wrapper. It sees torch's, nvImageCodec's, numpy's and Pillow's
releases, not the interpreter's own (``os.read``, ``os.open``, lock waits): a file read adds about
four per file to what is reported.

The loader runs with one reader thread, so the process-wide count over a stage is that stage's; the
stages are the reader's methods, wrapped (nested rows are indented), counted per image the reader made
(it works ahead of the consumer); the whole process's count is per image consumed. Pipelines:
``fixed`` (256x256 JPEGs), ``varied`` (photos resized to 224, normalized), ``augment`` (varied with
RandomResizedCrop and flip).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import mmap
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

PIPELINES = ("fixed", "varied", "augment")
_SOURCE = Path(__file__).with_name("_gilaudit.c")
_CHILD = "_THREADLOADER_GIL_RELEASES_CHILD"
_PRODUCED = "images produced"  # the reader works ahead of the consumer: its stages are per image it made

#: (owner module, attribute path, label, depth): the reader's stages, in the order they run.
_STAGES = (
    ("threadloader._pipeline", "BatchProducer.produce", "reader, in all", 0),
    ("threadloader._pipeline", "BatchProducer._read", "fetch + read", 1),
    ("threadloader._pipeline", "BatchProducer._decode", "decode, in all", 1),
    ("threadloader.decode.nvimgcodec", "NvImageCodecDecoder._parse", "parse headers", 2),
    ("threadloader.decode.nvimgcodec", "NvImageCodecDecoder._allocate", "allocate outputs", 2),
    ("threadloader.decode.nvimgcodec", "NvImageCodecDecoder._decode_leased", "nvImageCodec decode", 2),
    ("threadloader._pipeline", "BatchProducer._split", "split into batches, in all", 1),
    ("threadloader._pipeline", "BatchProducer._format", "transform + format", 2),
    ("threadloader._output", "OutputFormat.apply", "output format", 3),
    ("threadloader._pipeline", "collate_targets", "targets", 2),
    ("threadloader._handoff", "ReaderStream.seal", "seal (event)", 2),
)


def build_audit_library(cache: Path) -> Path:
    """Compiles ``_gilaudit.c`` into ``cache`` once per source version; raises without a C compiler."""
    source = _SOURCE.read_bytes()
    library = cache / f"libgilaudit-{hashlib.sha256(source).hexdigest()[:12]}.so"
    if library.exists():
        return library
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError(
            "benchmarks.tools.gil_releases builds its LD_AUDIT library with a C compiler and found none "
            "(no $CC, cc or gcc on PATH): install one, or build benchmarks/tools/_gilaudit.c elsewhere with "
            "`cc -O2 -shared -fPIC` and pass it with --library"
        )
    cache.mkdir(parents=True, exist_ok=True)
    partial = library.with_suffix(f".{os.getpid()}.tmp")
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(partial), str(_SOURCE)], check=True)
    partial.replace(library)
    return library


class ReleaseCounter:
    """Reads the count the audit library keeps in ``path``."""

    def __init__(self, path: Path) -> None:
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), 4096)

    def __call__(self) -> int:
        return struct.unpack_from("q", self._map, 0)[0]


def _counted(original: Callable[..., Any], label: str, count: Callable[[], int], totals: Counter[str]) -> Any:
    """``original``, adding the releases during each call to ``totals[label]``."""

    @functools.wraps(original)
    def counted(*args: Any, **kwargs: Any) -> Any:
        before = count()
        try:
            return original(*args, **kwargs)
        finally:
            totals[label] += count() - before

    return counted


def _wrap_stages(count: Callable[[], int], totals: Counter[str]) -> None:
    """Wraps each stage so that the releases during its calls add up under its label."""
    import importlib

    for module_name, path, label, _ in _STAGES:
        owner: Any = importlib.import_module(module_name)
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        setattr(owner, name, _counted(getattr(owner, name), label, count, totals))
    from threadloader._pipeline import Batch, BatchProducer

    produce = BatchProducer.produce

    @functools.wraps(produce)
    def producing(*args: Any, **kwargs: Any) -> Any:
        outcomes = produce(*args, **kwargs)
        totals[_PRODUCED] += sum(len(o.indices) for o in outcomes if isinstance(o, Batch))
        return outcomes

    BatchProducer.produce = producing  # type: ignore[method-assign]


def _loader_kwargs(pipeline: str, device: str, batch_size: int) -> dict[str, Any]:
    import torch

    from benchmarks.datasets import OUTPUT_SIZE
    from threadloader.transforms import RandomHorizontalFlip, RandomResizedCrop

    size = OUTPUT_SIZE["fixed" if pipeline == "fixed" else "varied"]
    kwargs: dict[str, Any] = {
        "batch_size": batch_size,
        "shuffle": True,
        "seed": 0,
        "drop_last": True,
        "device": device,
        "num_threads": 1,
        "dtype": torch.float32,
        "mean": (0.485, 0.456, 0.406),
        "std": (0.229, 0.224, 0.225),
    }
    if pipeline == "augment":
        kwargs["transform"] = [RandomResizedCrop(size), RandomHorizontalFlip()]
    else:
        kwargs["size"] = size
    return kwargs


def _batches(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def measure(args: argparse.Namespace, count: Callable[[], int]) -> list[dict[str, Any]]:
    """One row per pipeline: releases per image in all, and per stage."""
    import torch

    from benchmarks.datasets import ensure_dataset
    from threadloader import ThreadLoader

    before = count()
    torch.ones(1).add_(1)  # a dispatched op releases the GIL: the count must move
    if count() == before:
        raise RuntimeError("the audit library counted no GIL release: LD_AUDIT is not honoured here")
    totals: Counter[str] = Counter()
    _wrap_stages(count, totals)
    from benchmarks.loaders import with_engine

    rows = []
    engines = args.engines if args.device == "cuda" else [None]
    for pipeline, engine in ((p, e) for p in args.pipelines for e in engines):
        root = ensure_dataset("fixed" if pipeline == "fixed" else "varied", count=args.count)
        with with_engine(engine):
            loader = ThreadLoader(root, **_loader_kwargs(pipeline, args.device, args.batch_size))
        with loader:
            batches = _batches(loader)
            for _ in range(args.warmup):
                next(batches)
            if args.device == "cuda":
                torch.cuda.synchronize()
            totals.clear()
            start, images = count(), 0
            for _ in range(args.batches):
                images += len(next(batches)[1])
            total = count() - start
        rows.append(
            {
                "pipeline": pipeline if engine is None else f"{pipeline}[{engine}]",
                "engine": engine,
                "device": args.device,
                "images": images,
                "per_image": total / images,
                "stages": {label: totals[label] / max(1, totals[_PRODUCED]) for _, _, label, _ in _STAGES},
            }
        )
    return rows


def report(rows: list[dict[str, Any]]) -> str:
    """A markdown table: stages down, pipelines across."""
    lines = [
        "| GIL releases per image | " + " | ".join(row["pipeline"] for row in rows) + " |",
        "|---|" + "---|" * len(rows),
        "| **whole process** | " + " | ".join(f"**{row['per_image']:.1f}**" for row in rows) + " |",
    ]
    for _, _, label, depth in _STAGES:
        name = "&nbsp;&nbsp;" * 2 * depth + label
        lines.append(f"| {name} | " + " | ".join(f"{row['stages'][label]:.2f}" for row in rows) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from benchmarks.run import _names

    assert __doc__ is not None
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.tools.gil_releases", description=__doc__.splitlines()[0]
    )
    p.add_argument("--pipelines", type=_names(PIPELINES), default=list(PIPELINES))
    p.add_argument(
        "--engines", type=_names(("capi", "python")), default=["capi", "python"],
        help="on a GPU, nvImageCodec's C API and its Python API: a column each (default both)",
    )  # fmt: skip
    p.add_argument("--count", type=int, help="images in each set (default 2000; --quick 32)")
    p.add_argument("--batch-size", type=int, help="default 64; --quick 8")
    p.add_argument("--warmup", type=int, default=5, help="batches before counting (default 5)")
    p.add_argument("--batches", type=int, help="batches counted (default 20; --quick 3)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--library", type=Path, help="a built _gilaudit.c (default: build it into the cache)")
    p.add_argument("--out", type=Path, help="write gil_releases.md and gil_releases.json here")
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    args = p.parse_args(argv)
    args.count = args.count or (32 if args.quick else 2000)
    args.batch_size = args.batch_size or (8 if args.quick else 64)
    args.batches = args.batches or (3 if args.quick else 20)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]] | None:
    """In the first process: builds the library and runs this module again under LD_AUDIT."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if os.environ.get(_CHILD) is None:
        from benchmarks.datasets import default_root

        library = args.library or build_audit_library(default_root() / "gil-audit")
        with tempfile.TemporaryDirectory() as scratch:
            counter = Path(scratch) / "releases"
            env = os.environ | {"LD_AUDIT": str(library), "GILC_FILE": str(counter), _CHILD: "1"}
            child = subprocess.run([sys.executable, "-m", "benchmarks.tools.gil_releases", *argv], env=env)
        if child.returncode:
            raise SystemExit(child.returncode)
        return None
    rows = measure(args, ReleaseCounter(Path(os.environ["GILC_FILE"])))
    text = report(rows)
    print(text, end="")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gil_releases.md").write_text(text)
        from benchmarks.run import command_line

        dump = {"command": command_line("benchmarks.tools.gil_releases", argv), "rows": rows}
        (args.out / "gil_releases.json").write_text(json.dumps(dump, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
